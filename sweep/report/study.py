"""The runs table read from the ledger: the sweep's Optuna study (docs/design.md, "The ledger").

A trial's `user_attrs` carry the run's outcome under the names of result.json, so a study and the run
directories it points at give the same runs table. Where an attribute is missing (a study written by
another tool), the trial state says what it can: COMPLETE is stable unless its constraint is
infeasible, PRUNED is skipped (pruned at its last reported step), FAIL is error, RUNNING and WAITING
are running. A running trial whose job directory (its `run_dir`, or `<study name>/<trial number>`, as
our sweeper names them) exists but is held by no live job (`results.is_being_written`) is
`interrupted`: its job was killed, and the trial stays RUNNING until a sweeper fails it as stale. A trial the Optuna
sweeper failed as stale (its job died unrecorded) is left out, and of several trials naming one run
directory the latest finished one counts. A mechanism a diagnosis named after the trial was recorded comes from
the study's `diagnosed` attr (sweep/search/answer.py), as result.json has it after the write-back.

Opening never creates anything: a SQLite file or journal that does not exist is an error, not a new,
empty ledger. Every message names the storage through `mask_url`, never with its password.
"""

from __future__ import annotations

import math
from pathlib import Path

import optuna
import pandas as pd
from optuna.trial import TrialState

from sweep.report.confirmation import CONFIRMATION_ATTR
from sweep.report.runs import RESULT_KEYS, STARTING_S, outcome_row, runs_frame, younger_than
from sweep.run.results import is_being_written
from sweep.search.ledger import CONSTRAINTS_KEY, counted_trials, diagnosed_mechanisms, driver_url, mask_url

JOURNAL_SUFFIXES = (".log", ".jsonl", ".journal")
SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")


class SourceError(Exception):
    """A report source that cannot be read (no such file, no such study): shown as one line."""


def is_storage(target: str) -> bool:
    """A storage URL, or a path to a SQLite ledger or an Optuna journal file."""
    return "://" in target or target.endswith(SQLITE_SUFFIXES + JOURNAL_SUFFIXES)


def storage_url(target: str) -> str:
    """The Optuna storage URL of a URL, a SQLite file path or a journal file path."""
    if "://" in target:
        return target
    path = Path(target)
    if not path.is_file():
        raise SourceError(f"no such ledger file: {target}")
    return str(path.resolve()) if target.endswith(JOURNAL_SUFFIXES) else f"sqlite:///{path.resolve()}"


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """A read-only-minded opening: a missing SQLite file or journal is an error, not a new ledger."""
    if "://" not in url:
        from optuna.storages.journal import JournalFileBackend

        if not Path(url).is_file():
            raise SourceError(f"no such journal file: {url}")
        return optuna.storages.JournalStorage(JournalFileBackend(url))
    if url.startswith("sqlite:///") and not Path(url.split(":///", 1)[1]).is_file():
        raise SourceError(f"no such SQLite ledger: {url.split(':///', 1)[1]}")
    try:
        return optuna.storages.RDBStorage(driver_url(url), heartbeat_interval=None)
    except Exception as e:  # noqa: BLE001  (driver missing, host unreachable, bad credentials, ...)
        raise SourceError(f"cannot open {mask_url(url)}: {_clean(e, url)}") from None


def pick_study(storage: optuna.storages.BaseStorage, url: str, name: str | None) -> str:
    """The study to read: `name` if the storage has it, else the only one there."""
    names = optuna.get_all_study_names(storage)
    where = mask_url(url)
    if name is not None:
        if name not in names:
            listed = ", ".join(repr(n) for n in names) or "none"
            raise SourceError(f"no study named {name!r} in {where} (studies there: {listed})")
        return name
    if not names:
        raise SourceError(f"no study in {where}")
    if len(names) > 1:
        raise SourceError(
            f"{len(names)} studies in {where}: pass --study NAME, one of " + ", ".join(repr(n) for n in names)
        )
    return names[0]


def runs_from_study(url: str, study_name: str | None = None) -> tuple[pd.DataFrame, str]:
    """(runs table, study name) of a study in an Optuna storage."""
    storage = open_storage(url)
    name = pick_study(storage, url, study_name)
    study = optuna.load_study(study_name=name, storage=storage)
    diagnosed = diagnosed_mechanisms(study)
    rows = []
    for trial in counted_trials(study.get_trials(deepcopy=False)):
        row = trial_row(trial, name)
        if str(trial.number) in diagnosed:  # a diagnosis made after the trial was recorded (sweep/search/answer.py)
            row["mechanism"] = diagnosed[str(trial.number)]
        rows.append(row)
    runs = runs_frame(rows)
    runs.attrs.update(study=name, **{CONFIRMATION_ATTR: study.user_attrs.get(CONFIRMATION_ATTR)})  # its copy of it
    return runs, name


def trial_row(trial: optuna.trial.FrozenTrial, study_name: str | None = None) -> dict:
    """One row of the runs table from one trial."""
    attrs = trial.user_attrs
    run_dir = attrs.get("run_dir")
    status = attrs.get("status") or _status_from_state(trial)
    if status == "running":
        run_dir = run_dir or job_dir(trial, study_name)
        status = _liveness(Path(run_dir)) if run_dir else status
    outcome = {k: attrs.get(k) for k in RESULT_KEYS if k in attrs}
    if trial.state is TrialState.PRUNED and "status" not in attrs and trial.last_step is not None:
        outcome["pruned_at_step"] = trial.last_step
    outcome.update(
        cause_where=attrs.get("cause_where"), cause_module=attrs.get("cause_module"), mechanism=attrs.get("mechanism")
    )
    if (
        outcome.get("final_loss") is None
        and outcome.get("eval_loss") is None
        and status == "stable"
        and trial.value is not None
    ):
        # A trial some other app completed: its value is the best we know (ours record final_loss, and a value
        # that is the eval loss when they have one).
        outcome["final_loss"] = trial.value
    recorded = attrs.get("params") or {}  # every param, in the order the run named them
    params = {**recorded, **{k: v for k, v in trial.params.items() if k not in recorded}}
    return outcome_row(status, run_dir, params, **outcome)


def job_dir(trial: optuna.trial.FrozenTrial, study_name: str | None) -> str | None:
    """The job directory of a trial that recorded none yet: our Optuna sweeper names it by trial number
    in the sweep directory, the default study name. None when that is not a directory here."""
    if not study_name:
        return None
    path = Path(study_name) / str(trial.number)
    return str(path.resolve()) if path.is_dir() else None


def _liveness(run_dir: Path) -> str:
    """A RUNNING trial is `running` while a live job holds its directory's lock (or Hydra made the
    directory just now), else `interrupted`: its job was killed, and the trial waits to go stale."""
    young = younger_than(run_dir / ".hydra" / "overrides.yaml", STARTING_S)
    return "running" if is_being_written(run_dir) or young else "interrupted"


def _status_from_state(trial: optuna.trial.FrozenTrial) -> str:
    if trial.state is TrialState.COMPLETE:
        constraints = trial.system_attrs.get(CONSTRAINTS_KEY) or ()
        infeasible = any(c > 0 for c in constraints) or not math.isfinite(trial.value or 0.0)
        return "diverged" if infeasible else "stable"
    # PRUNED is a pruner's stop (ours record skipped runs so too): skipped, with pruned_at_step.
    return {TrialState.PRUNED: "skipped", TrialState.FAIL: "error"}.get(trial.state, "running")


def _clean(exc: Exception, url: str) -> str:
    """An exception's first line, with the raw URL (and so its password) masked."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0].replace(url, mask_url(url))
    try:
        from sqlalchemy.engine import make_url

        password = make_url(url).password
    except Exception:  # noqa: BLE001  (not an SQLAlchemy URL)
        password = None
    return line.replace(str(password), "***") if password else line
