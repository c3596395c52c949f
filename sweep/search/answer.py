"""The sweep's answer on its Optuna study: what no finished trial can carry.

A trial is written when its run ends, but some answers come later: the recommendation and the marginal runs
are decided across the sweep once every run is in, and a diagnosis names a run's mechanism after its trial
was recorded. Optuna's API lets no finished trial change (RDBStorage `check_trial_is_updatable` raises
`UpdateFinishedTrialError`; JournalStorage raises it for the writer and drops the update when any reader
replays the log), while a study's user attrs may be written at any time, and optuna-dashboard shows them on
the study's page, in its "Study User Attributes" table (strings as they are, anything else as JSON). So the
sweep's answer lives there (docs/design.md, section 5):

- `recommendation`: the summary's recommendation line, word for word.
- `recommended`: the settings it recommends, e.g. {"precision": "bf16_amp", "attention": "flash",
  "optim.lr": 0.001}; {} when it recommends nothing.
- `recommended_trials`: the trial numbers of the stable runs of that setting (its replicates), ascending.
- `marginal_trials`: the trial numbers of the runs the report marks marginal (the runs table's `marginal`
  column: stable, but far above their combination's best), ascending; [] when none or not decided.
- `quality`: what the recommendation compared runs by, `eval_loss` or `final_loss`: the number each stable
  trial's value is (sweep.run.results.quality_key).
- `diagnosed`: {trial number, as a string: mechanism} of each run a diagnosis named after its trial was
  recorded (sweep/diagnose/diagnosis.py); `python -m sweep.report STORAGE` applies it (sweep/report/study.py).
  In an RDB storage the trial's own `mechanism` attr is rewritten too, the recorded one kept as
  `mechanism_recorded` (`set_finished_trial_attrs`); a journal file cannot, and keeps the recorded one there.
- `confirmation`: {"sweep_dir", "record": confirmation.json's content} (sweep/confirm/), or None before one;
  `python -m sweep.report STORAGE` reads it as the directory's report reads the file (sweep/report/confirmation.py).

Written at the end of every multirun (sweep/callbacks.py `SweepSummary`), by `python -m sweep.report DIR
--write`, by `python -m sweep.confirm` and by every diagnosis. A ledger that is off has nothing to carry it; one
that is down, locked or damaged costs one warning line, never the summary.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Optional

import optuna

from sweep.config import LedgerConfig
from sweep.run.urls import scrub
from sweep.search.ledger import (
    DIAGNOSED,
    LEDGER_FILE,
    counted_trials,
    diagnosed_mechanisms,
    load_study,
    mask_url,
    open_storage,
    set_finished_trial_attrs,
    storage_error_line,
    storage_url,
    study_name,
    with_retries,
)

PARAM = "param:"  # the runs table's prefix of a swept value (sweep/report/runs.py)


def answer_attrs(summary, trial_of: dict[str, int]) -> dict:
    """The study attrs of a sweep's answer, from its Summary (sweep/report/registry.py) and the trial number of
    each run directory."""
    from sweep.report.noise import quality_column

    runs = summary.runs
    if "superseded_by" in runs:
        runs = runs[runs.superseded_by.isna()]
    rec = summary.recommendation
    settings = dict(rec.settings)
    stable = runs[runs.status == "stable"]
    ofsetting = [
        r["run_dir"]
        for r in stable.to_dict("records")
        if settings and all(_same(r[PARAM + k], v) for k, v in settings.items() if PARAM + k in r)
    ]
    marginal = []
    if "marginal" in runs:
        marginal = [r["run_dir"] for r in runs.to_dict("records") if _truthy(r["marginal"])]
    return {
        "recommendation": rec.line,
        "recommended": settings,
        "recommended_trials": sorted(trial_of[d] for d in ofsetting if d in trial_of),
        "marginal_trials": sorted(trial_of[d] for d in marginal if d in trial_of),
        "quality": quality_column(runs),
    }


def _same(a, b) -> bool:
    """A runs-table value equals a recommended setting's: numbers within rounding, anything else by its text."""
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
    return math.isclose(a, b, rel_tol=1e-9) if numbers else str(a) == str(b)


def _truthy(v) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v)) and str(v) not in ("<NA>", "False")


def record_answer(
    study: optuna.Study, summary, deadline: Optional[float] = None, sweep_dir: Optional[Path] = None
) -> dict:
    """Write the sweep's answer into the study's user attrs, retried until `deadline` (time.monotonic()) at most;
    returns what was written. `sweep_dir`: the sweep's directory, whose confirmation.json is copied too."""
    trials = with_retries(lambda: study.get_trials(deepcopy=False), "get_trials", deadline=deadline)
    trial_of = {t.user_attrs["run_dir"]: t.number for t in counted_trials(trials) if "run_dir" in t.user_attrs}
    attrs = answer_attrs(summary, trial_of)
    if sweep_dir is not None:
        from sweep.report.confirmation import CONFIRMATION_ATTR

        attrs[CONFIRMATION_ATTR] = confirmation_copy(sweep_dir)
    for key, value in attrs.items():
        with_retries(lambda: study.set_user_attr(key, value), "set_user_attr", deadline=deadline)  # noqa: B023
    return attrs


def record_sweep_answer(cfg: Optional[LedgerConfig], sweep_dir: Path, summary) -> Optional[str]:
    """record_answer on the sweep's own study; None when written or when there is none to write into (ledger
    off, nothing recorded), else one line saying why not (a ledger down, locked or damaged) for the caller."""
    if cfg is None or not cfg.enabled:
        return None
    deadline = time.monotonic() + cfg.lock_timeout_s
    try:
        study = existing_study(cfg, sweep_dir, deadline)
        if study is not None:
            record_answer(study, summary, deadline, sweep_dir)
    except Exception as e:  # noqa: BLE001  (the summary stands; the study misses the answer, said in one line)
        return _not_recorded("the sweep's answer", cfg, sweep_dir, e)
    return None


def confirmation_copy(sweep_dir: Path) -> Optional[dict]:
    """The study's copy of the sweep's confirmation.json (CONFIRMATION_ATTR); None when there is none, or it cannot
    be read (the directory's report says why)."""
    from sweep.report.confirmation import CONFIRMATION_FILE

    try:
        record = json.loads((Path(sweep_dir) / CONFIRMATION_FILE).read_text())
    except (OSError, ValueError):
        return None
    return {"sweep_dir": str(Path(sweep_dir).resolve()), "record": record}


def record_multirun_answer(config, sweep_dir: Path, summary) -> Optional[str]:
    """record_sweep_answer with the `ledger` of a multirun's config (sweep/callbacks.py SweepSummary); nothing
    for a config without one (not our app)."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(config, "ledger", default=None)
    try:
        cfg = ledger_config(node) if node is not None else None
    except Exception as e:  # noqa: BLE001  (an ${oc.env:...} URL whose variable is not set, ...)
        return f"ledger: the sweep's answer is not recorded: ledger: {storage_error_line(e)}"
    return record_sweep_answer(cfg, sweep_dir, summary)


def record_report_answer(source: str, name: Optional[str], summary) -> Optional[str]:
    """`python -m sweep.report SOURCE --write`: record_answer on the study SOURCE stands for: a sweep directory's
    own (its multirun.yaml's `ledger`, else its ledger.db), or the study the report read from a storage."""
    path = Path(source)
    if "://" not in source and path.is_dir():
        if name is None:
            try:
                cfg = sweep_ledger(path)
            except Exception as e:  # noqa: BLE001  (an ${oc.env:...} URL whose variable is not set here, ...)
                return (
                    f"ledger: the sweep's answer is not recorded: its multirun.yaml's ledger: {storage_error_line(e)}"
                )
            return record_sweep_answer(cfg, path, summary)
        source = str(path / LEDGER_FILE)  # --study NAME: a study of the sweep's own ledger file
    from sweep.report.study import open_storage as open_existing
    from sweep.report.study import pick_study
    from sweep.report.study import storage_url as report_url

    url = report_url(source)
    try:
        storage = open_existing(url)
        record_answer(optuna.load_study(study_name=pick_study(storage, url, name), storage=storage), summary)
    except Exception as e:  # noqa: BLE001
        return f"ledger: the sweep's answer is not in {mask_url(url)}: {scrub(storage_error_line(e), url)}"
    return None


def sweep_ledger(sweep_dir: Path) -> LedgerConfig:
    """The `ledger` settings a sweep ran with, from its multirun.yaml (interpolations resolved); the defaults
    when it has none."""
    from omegaconf import OmegaConf

    saved = Path(sweep_dir) / "multirun.yaml"
    node = OmegaConf.select(OmegaConf.load(saved), "ledger", default=None) if saved.is_file() else None
    return ledger_config(node) if node is not None else LedgerConfig()


def ledger_config(node) -> LedgerConfig:
    """A config's `ledger` node as the LedgerConfig that names its study (interpolations resolved)."""
    from omegaconf import OmegaConf

    known = {f.name for f in dataclasses.fields(LedgerConfig)} - {"pruner"}
    values = OmegaConf.to_container(node, resolve=True)
    return LedgerConfig(**{k: v for k, v in values.items() if k in known})


def existing_study(cfg: LedgerConfig, sweep_dir: Path, deadline: Optional[float] = None) -> Optional[optuna.Study]:
    """The sweep's study where it exists; None when its storage or the study is not there (nothing recorded), so
    that nothing creates an empty ledger."""
    url = storage_url(cfg, sweep_dir)
    file = url.split(":///", 1)[1] if url.startswith("sqlite:///") else url if "://" not in url else None
    if file is not None and not Path(file).is_file():
        return None
    storage = open_storage(url, lock_timeout_s=cfg.lock_timeout_s)
    name = study_name(cfg, sweep_dir, storage, deadline=deadline)
    if name not in with_retries(lambda: optuna.get_all_study_names(storage), "get_all_study_names", deadline=deadline):
        return None
    return load_study(url, name, cfg.lock_timeout_s)


def record_diagnosed(cfg: LedgerConfig, sweep_dir: Path, run_dir: Path, mechanism: str, recorded) -> Optional[str]:
    """A diagnosis's mechanism on the study of the run's sweep: `diagnosed`[its trial number] and, in an RDB
    storage, the trial's `mechanism` (the recorded one kept as `mechanism_recorded`). None when written or when
    there is nothing to write into (ledger off, no study, no trial of that run), else one line saying why not."""
    if not cfg.enabled:
        return None
    deadline = time.monotonic() + cfg.lock_timeout_s
    try:
        study = existing_study(cfg, sweep_dir, deadline)
        run = str(Path(run_dir).resolve())
        trials = counted_trials(study.get_trials(deepcopy=False)) if study is not None else []
        numbers = [t.number for t in trials if t.user_attrs.get("run_dir") == run]
        if not numbers:
            return None  # never recorded (ledger off then, or still pending): nothing to correct
        diagnosed = {**diagnosed_mechanisms(study), str(numbers[0]): mechanism}
        with_retries(lambda: study.set_user_attr(DIAGNOSED, diagnosed), "set_user_attr", deadline=deadline)
        set_finished_trial_attrs(study, numbers[0], {"mechanism": mechanism, "mechanism_recorded": recorded})
    except Exception as e:  # noqa: BLE001  (result.json and diagnosis.json hold it; the study misses it)
        return _not_recorded(f"the diagnosis of {run_dir}", cfg, sweep_dir, e)
    return None


def _not_recorded(what: str, cfg: LedgerConfig, sweep_dir: Path, e: BaseException) -> str:
    url = storage_url(cfg, sweep_dir)
    return f"ledger: {what} is not in {mask_url(url)}: {scrub(storage_error_line(e), url)}"
