"""Hydra callback: print and save the summary tables when a multirun ends.

Wired in conf/config.yaml (`hydra.callbacks.summary`). It reads the run directories of the sweep, so
it sees every run whatever launcher ran it, and stays fast (no plotting): report.html is one command
away, `python -m sweep.report <sweep dir>`.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import textwrap
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from sweep.config import (
    RETIRED_KEYS,
    ConfigError,
    RunConfig,
    check_launcher,
    check_no_chdir,
    check_output_dir,
    make_output_dir,
    to_run_config,
)
from sweep.config.secrets import check_no_literal_secrets
from sweep.errors import exiting_on_config_error
from sweep.run.once import forget, per_sweep
from sweep.run.results import lock_held
from sweep.run.urls import install_secret_filter
from sweep.search.space import parse

log = logging.getLogger("sweep")


class OutputDirCheck(Callback):
    """Before anything is written: the run or sweep directory must be creatable (sweep.config.check_output_dir) and
    free (check_run_dir, claim_sweep_dir), hydra.job.chdir false (sweep.config.check_no_chdir), a sweep's launcher
    able to run a job (sweep.config.check_launcher), the composed config must spell out no secret
    (sweep.config.secrets), and
    every log record is scrubbed of secrets from here on (scrub_logs).

    Hydra creates the job directory before the task function runs, so this cannot wait for sweep.job.
    Listed first in conf/config.yaml: start hooks run in order, so it comes before a scenario's pretraining
    writes into the sweep directory. The grid sweeper checks each cell's own subdirectory.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        scrub_logs(config)
        self._check(str(config.hydra.run.dir), "hydra.run.dir")
        with exiting_on_config_error():
            check_no_literal_secrets(config)  # Hydra copies the composed config into .hydra/config.yaml
            check_no_chdir(config)
            check_run_dir(config)
            make_output_dir(str(config.hydra.run.dir), "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        scrub_logs(config)
        self._check(str(config.hydra.sweep.dir), "hydra.sweep.dir")
        with exiting_on_config_error():
            check_no_literal_secrets(config)  # ... and the sweep's into multirun.yaml
            check_no_chdir(config)
            check_launcher(config)
            claim_sweep_dir(config)
        forget(config.hydra.sweep.dir)  # a new sweep says its once-per-sweep lines again (sweep/run/once.py)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        release_sweep_dir(Path(config.hydra.sweep.dir))

    @staticmethod
    def _check(path: str, key: str) -> None:
        with exiting_on_config_error():  # raised, Hydra would only warn and go on to fail on mkdir
            check_output_dir(path, key)


def scrub_logs(config: DictConfig) -> None:
    """Every log record of this process scrubbed of secrets from here on (sweep.run.urls.install_secret_filter): the
    secrets of the config's URLs, resolved (an ${oc.env:...} that does not resolve is the config check's to report)."""
    urls = [
        OmegaConf.select(config, key, default=None, throw_on_resolution_failure=False)
        for key in ("ledger.storage", "logger.mlflow.tracking_uri")
    ]
    install_secret_filter(*(str(u) for u in urls if u))


NOT_WHAT_RUNS = ("threads", "progress", "log_every", "logger", "confirm", "report")
"""Overrides that say how a grid's runs go or where they are logged, not which runs it makes: the same sweep
may change them."""
SWEEP_FILE = "multirun.yaml"  # Hydra's (and our Optuna sweeper's) saved config of the sweep owning the directory
_ALIVE = ".sweep.alive"
_CLAIM = ".sweep.claim"
_ALIVE_HELD: dict[str, int] = {}


def task_overrides(config: DictConfig) -> list[str]:
    """The command's overrides as typed, unresolved: iterating Hydra's list resolves an override such as
    ledger.storage=${oc.env:SWEEP_LEDGER_URL} into the URL it names, secrets included."""
    node = OmegaConf.select(config, "hydra.overrides.task", default=None)
    return [str(o) for o in OmegaConf.to_container(node, resolve=False)] if node is not None else []


def sweep_identity(config: DictConfig) -> list[str]:
    """What makes two sweeps the same sweep, as a list of strings (the sweeper first, then overrides).

    Grid (Hydra's basic sweeper, ours): the command's overrides in order (it numbers its job directories
    in that order, from 0), less NOT_WHAT_RUNS. Optuna sweeper: its cells, i.e. the swept axes (a resume
    may change a fixed value such as steps, or n_trials, as README "Resume" says), in any order; job
    directories are numbered by trial of the study, which the same sweep shares.
    """
    overrides = task_overrides(config)
    target = str(OmegaConf.select(config, "hydra.sweeper._target_", default="") or "")
    if "optuna" not in target:
        return [target, *(o for o in overrides if not o.split("=", 1)[0].lstrip("+~").startswith(NOT_WHAT_RUNS))]
    params = OmegaConf.select(config, "hydra.sweeper.params", default=None)
    args = [f"{k}={v}" for k, v in (OmegaConf.to_container(params) if params is not None else {}).items()] + overrides
    try:
        _, fixed = parse(args)
    except Exception:  # noqa: BLE001  (the sweeper reports a bad search space itself)
        return [target, *args]
    return [target, *sorted(a for a in args if a not in fixed)]


def claim_sweep_dir(config: DictConfig) -> None:
    """Refuse a hydra.sweep.dir that belongs to another sweep, or lies inside one's tree (enclosing_sweep), before
    any run (raises ConfigError).

    Both sweepers number job directories from what they know of their own sweep only (the grid from 0,
    the Optuna sweeper by trial number of its study), so two sweeps in one directory overwrite each
    other's <n>/result.json and mix their summaries. The directory belongs to the sweep whose
    multirun.yaml it holds, once that sweep has started a job there or while it is still live (it holds
    .sweep.alive); the same command again, the only way to resume (README, "Resume"), is the same sweep.

    The decision and the claim are one step under an exclusive flock of .sweep.lock, and the claim names
    its sweep in .sweep.claim before the lock is let go: a sweep started at the same moment sees a live
    claim even though no multirun.yaml is written yet (before, both saw an empty directory and both ran).
    While a sweep is live, a grid sweep is refused whatever its overrides (two grids number their job
    directories alike); an Optuna sweep only joins the same sweep (several workers share one study). A
    dead sweep's claim is free: the kernel drops its lock with the process.
    """
    sweep_dir = Path(str(config.hydra.sweep.dir))
    outer = enclosing_sweep(sweep_dir)
    if outer is not None:
        raise ConfigError(
            f"hydra.sweep.dir: {sweep_dir} is inside the sweep {outer[0]} (it holds {outer[1]}), whose summary and "
            "report would count this sweep's runs as its own; give this one a directory outside it"
        )
    make_output_dir(str(sweep_dir), "hydra.sweep.dir")
    release_sweep_dir(sweep_dir)  # this process ran a sweep here before (in-process tests): that one is over
    ours = sweep_identity(config)
    with open(sweep_dir / ".sweep.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two sweeps starting at once decide one after the other
        saved = sweep_dir / SWEEP_FILE
        found = next(sweep_dir.rglob(".hydra/overrides.yaml"), None)
        started = found is not None
        if _sweep_alive(sweep_dir):
            claim = _read_claim(sweep_dir)
            if "optuna" not in ours[0] or claim.get("identity") != ours:
                who = f" (pid {claim['pid']})" if isinstance(claim.get("pid"), int) else ""
                raise ConfigError(
                    f"hydra.sweep.dir: {sweep_dir} is in use by a sweep still running or starting{who}; wait for it"
                    " to end (the same command then resumes it), or give this one its own hydra.sweep.dir"
                )
        if saved.is_file() or started:
            theirs, why = saved_identity(saved)
            if started and theirs != ours:
                other = not_this_sweeps(sweep_dir, found.parent.parent)
                if other is not None:
                    raise ConfigError(f"hydra.sweep.dir: {sweep_dir} {other}; give this sweep its own hydra.sweep.dir")
                if theirs is None:  # runs of a sweep no one can name: this one could be any other
                    raise ConfigError(
                        f"hydra.sweep.dir: {sweep_dir} holds runs of a sweep whose {SWEEP_FILE} {why}; restore it"
                        " to resume that sweep, or give this one its own hydra.sweep.dir"
                    )
                raise ConfigError(
                    f"hydra.sweep.dir: {sweep_dir} holds another sweep ({' '.join(theirs[1:]) or 'no overrides'}); "
                    "give this one its own hydra.sweep.dir, or resume that one with its own command"
                )
        fd = os.open(sweep_dir / _ALIVE, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)  # dropped at the end of the sweep, or when this process dies
        _ALIVE_HELD[str(sweep_dir)] = fd
        tmp = sweep_dir / f"{_CLAIM}.{os.getpid()}"
        try:
            tmp.write_text(json.dumps({"pid": os.getpid(), "identity": ours}))
            os.replace(tmp, sweep_dir / _CLAIM)  # still under the lock: the next sweep reads whole claims only
        except OSError:  # a full disk: the live lock still refuses other sweeps (and Optuna workers that would join)
            tmp.unlink(missing_ok=True)


def _read_claim(sweep_dir: Path) -> dict:
    """The live sweep's .sweep.claim ({pid, identity}); {} when missing or unreadable (a sweep of an older
    version, which is then refused as any other)."""
    try:
        claim = json.loads((sweep_dir / _CLAIM).read_text())
        return claim if isinstance(claim, dict) else {}
    except (OSError, ValueError):
        return {}


SWEEP_MARKS = (SWEEP_FILE, ".sweep.lock", ".sweep.alive", ".sweep.claim")
"""Files only a sweep writes in its own directory: a run directory holding one is a sweep's root."""


def sweep_mark(directory: Path) -> str | None:
    """The first of SWEEP_MARKS the directory holds (it is a sweep's root), or None."""
    return next((m for m in SWEEP_MARKS if (directory / m).exists()), None)


def enclosing_sweep(path: Path) -> tuple[Path, str] | None:
    """(the sweep's root, its mark) of the nearest directory strictly above `path` that is a sweep's root, or None.

    A run or a sweep placed there would be counted by that sweep's summary and report (they read every
    result.json below the root), resumed or not. Runs a sweep makes in its own tree do not come through here:
    its job directories are Hydra's, and a diagnosis's or a confirmation's runs call sweep.run.execute directly.
    """
    for parent in Path(os.path.abspath(path)).parents:
        mark = sweep_mark(parent)
        if mark is not None:
            return parent, mark
    return None


def not_this_sweeps(sweep_dir: Path, job_dir: Path) -> str | None:
    """What a run directory found below `sweep_dir` belongs to, when it is not a job of a sweep rooted there: "holds
    the sweep X" (a sweep rooted between them) or "holds a single run (X)" (Hydra's mode RUN); None otherwise."""
    for parent in [job_dir, *job_dir.parents]:
        if parent == sweep_dir or sweep_dir not in parent.parents:
            break
        if sweep_mark(parent) is not None:
            return f"holds the sweep {parent}"
    try:
        mode = OmegaConf.select(OmegaConf.load(job_dir / ".hydra" / "hydra.yaml"), "hydra.mode", default=None)
    except Exception:  # noqa: BLE001  (unreadable or missing: no one can say what ran there)
        return None
    return f"holds a single run ({job_dir}: python -m sweep without -m)" if str(mode) == "RUN" else None


def run_identity(config: DictConfig) -> dict:
    """What makes two single runs the same run: the composed config less `hydra` and NOT_WHAT_RUNS, flat,
    unresolved (an ${oc.env:...} stays itself), as Hydra saves it in .hydra/config.yaml; less RETIRED_KEYS
    too, which a run recorded before they were dropped still has."""
    flat: dict = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            flat[prefix[:-1]] = node

    tree = OmegaConf.to_container(config, resolve=False, enum_to_str=True)
    walk({k: v for k, v in tree.items() if k != "hydra" and k not in NOT_WHAT_RUNS}, "")
    for key in (*RESUME_OF_THE_SAME_RUN, *RETIRED_KEYS):
        flat.pop(key, None)
    return flat


RESUME_OF_THE_SAME_RUN = ("checkpoint.resume_from", "checkpoint.resume_optimizer")
"""Keys that resume a run from its checkpoint rather than make another run: the same run dir takes them."""


def check_run_dir(config: DictConfig) -> None:
    """Refuse a hydra.run.dir (a single run, no -m) that lies inside a sweep's tree (enclosing_sweep), or holds a
    sweep or a run of another config, before anything is written (raises ConfigError).

    A run directory holds one run: the same config again reruns it as before (its checkpoints resume it),
    but a run of other settings would overwrite its result.json, and a sweep's root would get a result.json
    and a trial in that sweep's study.
    """
    run_dir = Path(str(config.hydra.run.dir))
    outer = enclosing_sweep(run_dir)
    if outer is not None:
        raise ConfigError(
            f"hydra.run.dir: {run_dir} is inside the sweep {outer[0]} (it holds {outer[1]}), whose summary and report "
            "would count this run as one of its own; give this run a directory outside it"
        )
    if not run_dir.is_dir():
        return
    marks = [m for m in SWEEP_MARKS if (run_dir / m).exists()]
    if marks or any(run_dir.glob("*/.hydra/overrides.yaml")):
        why = marks[0] if marks else "job directories"
        raise ConfigError(
            f"hydra.run.dir: {run_dir} is the directory of a sweep (it holds {why}); give this run its own"
            " hydra.run.dir"
        )
    saved = run_dir / ".hydra" / "config.yaml"
    if not saved.is_file():
        return
    if not any((run_dir / name).exists() for name in ("result.json", "metrics.csv", "checkpoints")):
        return  # Hydra wrote .hydra/ for a run refused at composition (a config error): nothing of it to overwrite
    try:
        loaded = OmegaConf.load(saved)
        theirs = run_identity(loaded) if isinstance(loaded, DictConfig) else None
    except Exception:  # noqa: BLE001  (damaged YAML: no one can say which run it was)
        theirs = None
    if theirs is None:
        raise ConfigError(
            f"hydra.run.dir: {run_dir} holds a run whose .hydra/config.yaml cannot be read; give this run its"
            " own hydra.run.dir"
        )
    ours = run_identity(config)
    # A key the schema gained after that run was recorded (finetune.base_dtype, precision.fp8) ran at its default:
    # every new key's default is what runs did before it existed.
    defaults = run_identity(OmegaConf.structured(RunConfig))
    theirs = {**{k: defaults[k] for k in ours if k not in theirs and k in defaults}, **theirs}
    differ = [k for k in sorted(set(theirs) | set(ours)) if theirs.get(k, "<unset>") != ours.get(k, "<unset>")]
    if differ:
        shown = ", ".join(f"{k}={theirs.get(k, '<unset>')} there, {ours.get(k, '<unset>')} here" for k in differ[:3])
        more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
        raise ConfigError(
            f"hydra.run.dir: {run_dir} holds a run of another config ({shown}{more}); give this run its own"
            " hydra.run.dir (the same config again reruns that one)"
        )


def saved_identity(saved: Path) -> tuple[list[str] | None, str]:
    """(sweep_identity of the sweep a multirun.yaml saved, "") or (None, why it cannot be read)."""
    try:
        config = OmegaConf.load(saved)
        if not isinstance(config, DictConfig):
            return None, "is not a saved Hydra config (a YAML list)"
        return sweep_identity(config), ""
    except FileNotFoundError:
        return None, "is missing"
    except Exception as e:  # noqa: BLE001  (damaged YAML, unreadable file, a foreign config)
        return None, f"cannot be read ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})"


def _sweep_alive(sweep_dir: Path) -> bool:
    """Whether a live sweep holds the directory (a shared lock on .sweep.alive)."""
    return lock_held(sweep_dir / _ALIVE, fcntl.LOCK_EX)


def release_sweep_dir(sweep_dir: Path) -> None:
    fd = _ALIVE_HELD.pop(str(sweep_dir), None)
    if fd is not None:
        os.close(fd)


class TrackerSweep(Callback):
    """logger=mlflow: the sweep's parent MLflow run, made before the first job and ended after the summary
    (sweep/run/mlflow_sink.py). Jobs find it through <sweep dir>/mlflow_parent.json, whatever launcher runs
    them. A tracker that fails is a warning here: the sweep goes on, and each run says so in result.json."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        cfg = self._mlflow(config)
        if cfg is None:
            return
        from sweep.run.mlflow_sink import start_sweep_run

        try:
            start_sweep_run(cfg, Path(config.hydra.sweep.dir), " ".join(task_overrides(config)))
        except Exception as e:  # noqa: BLE001  (the runs log without a parent, or say why they could not)
            log.warning("logger mlflow: no parent run for this sweep: %s", e)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        cfg = self._mlflow(config)
        if cfg is None:
            return
        from sweep.run.mlflow_sink import end_sweep_run

        try:
            end_sweep_run(cfg, Path(config.hydra.sweep.dir))
        except Exception as e:  # noqa: BLE001
            log.warning("logger mlflow: could not end the sweep's parent run: %s", e)

    @staticmethod
    def _mlflow(config: DictConfig):
        node = OmegaConf.select(config, "logger.mlflow", default=None)
        return OmegaConf.to_object(node) if node is not None and node.enabled else None


class PendingTrials(Callback):
    """Record the trials the ledger could not take when their runs ended (sweep/search/pending.py): at the
    start of a sweep (what a killed or interrupted one left) and at its end."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        record_pending_trials(config)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        record_pending_trials(config)


def record_pending_trials(config: DictConfig) -> None:
    from sweep.search.pending import pending_runs, record_pending

    sweep_dir = Path(str(config.hydra.sweep.dir))
    if "ledger" not in config or not sweep_dir.is_dir() or not pending_runs(sweep_dir):
        return
    from sweep.job import group_or_enum_choices  # the same param choices the jobs record with

    done, problems = record_pending(
        sweep_dir,
        OmegaConf.select(config, "ledger.storage", default=None),  # resolved: a URL from the environment too
        group_or_enum_choices,
        float(OmegaConf.select(config, "ledger.lock_timeout_s", default=30.0)),
    )
    if done:
        log.info("ledger: recorded %d trial(s) left pending: %s", len(done), ", ".join(str(d) for d in done))
    for line in problems:
        log.warning("ledger: still not recorded: %s (later: python -m sweep.sync_ledger %s)", line, sweep_dir)


class SweepSummary(Callback):
    """At the end of every multirun: the tables on the terminal, summary.md/.csv/.parquet and report.html (unless
    report.html=false) in the sweep dir."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from sweep.report.confirmation import read_confirmation
        from sweep.report.runs import runs_from_dirs  # pandas: imported once a sweep has runs to summarize
        from sweep.report.summary import summarize
        from sweep.report.text import WIDTH, render_text, write_summary

        sweep_dir = Path(config.hydra.sweep.dir)
        with per_sweep(sweep_dir):  # the diagnosis's and the confirmation's runs say the sweep's data lines once too
            diagnose_failures(config, sweep_dir)
            confirm_answer(config, sweep_dir)
            diagnose_failures(config, sweep_dir, confirmation=True)
        runs = runs_from_dirs(sweep_dir, starting_s=0)  # every job of this sweep has returned
        for line in runs.attrs.get("skipped", []):
            log.warning("summary: skipped %s", line)
        if runs.empty:
            log.warning("no run of this sweep wrote a result.json (%s)", sweep_dir)
            return
        confirmation, problem = read_confirmation(sweep_dir)
        if problem:
            log.warning("summary: %s", problem)
        try:
            target = OmegaConf.select(config, "ladder.target", default=None)
            summary = summarize(
                runs,
                target,
                OmegaConf.select(config, "ladder.confidence", default=0.9),
                OmegaConf.select(config, "report.target", default=None),
                confirmation,
            )
            text = render_text(summary)
            written = write_summary(sweep_dir, summary)
        except Exception:
            log.exception(
                "could not summarize %s; the runs are recorded, try: python -m sweep.report %s", sweep_dir, sweep_dir
            )
            return
        from sweep.search.answer import record_multirun_answer  # the answer on the study, for optuna-dashboard

        if (problem := record_multirun_answer(config, sweep_dir, summary)) is not None:
            log.warning("%s", problem)
        page = sweep_html(config, sweep_dir, summary)
        saved = textwrap.fill(
            f"Saved in {sweep_dir}: {', '.join(p.name for p in written)}", WIDTH, subsequent_indent="  "
        )
        print(f"\n{text}\n\n{saved}\nHTML report: {page or f'python -m sweep.report {sweep_dir}'}", flush=True)


def sweep_html(config: DictConfig, sweep_dir: Path, summary) -> Path | None:
    """report.html in the sweep dir unless report.html=false (sweep/report/html.py): its path, or None when off
    or not written (one warning line; the summary files are written already)."""
    if not OmegaConf.select(config, "report.html", default=True):
        return None
    from sweep.report.html import write_sweep_report  # plotly: only when the page is written

    try:
        files, problem = write_sweep_report(sweep_dir, summary)
    except Exception as e:  # noqa: BLE001  (a figure that fails to build costs the page, never the summary)
        files, problem = [], f"could not write report.html ({type(e).__name__}: {e})"
    if problem:
        log.warning("%s; python -m sweep.report %s writes it", problem, sweep_dir)
    return files[0] if files else None


def diagnose_failures(config: DictConfig, sweep_dir: Path, confirmation: bool = False) -> None:
    """monitor.diagnose=auto: diagnose one run of each distinct failure (sweep/diagnose/multirun.py) of the grid, or
    (`confirmation`) of the confirmation at the longer horizon, before the summary reads them; a failure is logged,
    never raised."""
    if OmegaConf.select(config, "monitor.diagnose", default="off") != "auto":
        return
    from sweep.diagnose.multirun import diagnose_confirmation, diagnose_sweep  # torch: only for sweeps that diagnose

    try:
        (diagnose_confirmation if confirmation else diagnose_sweep)(
            sweep_dir,
            float(OmegaConf.select(config, "monitor.diagnose_budget", default=1.0)),
            progress=lambda line: print(line, flush=True),
        )
    except Exception:
        log.exception("diagnosing the diverged runs of %s failed; python -m sweep.diagnose RUN_DIR", sweep_dir)


def confirm_answer(config: DictConfig, sweep_dir: Path) -> None:
    """confirm.mode=auto: rerun the sweep's answer at a longer horizon (sweep/confirm/multirun.py) before the
    summary reads it; a failure is logged, never raised. The runs' kept final states are dropped after."""
    if OmegaConf.select(config, "confirm.mode", default="off") != "auto":
        return
    from sweep.confirm import state
    from sweep.confirm.multirun import confirm_sweep  # torch: only for sweeps that confirm

    try:
        confirm_sweep(
            sweep_dir,
            OmegaConf.select(config, "confirm.steps", default=None),
            float(OmegaConf.select(config, "confirm.factor", default=4.0)),
            float(OmegaConf.select(config, "confirm.budget", default=1.0)),
            progress=lambda line: print(line, flush=True),
            target=OmegaConf.select(config, "report.target", default=None),
        )
    except ConfigError as e:
        log.warning("confirm: %s; not confirmed", e)
    except Exception:
        log.exception("confirming the answer of %s failed; python -m sweep.confirm %s", sweep_dir, sweep_dir)
    finally:
        state.clear()


class ScenarioCheck(Callback):
    """For `+scenario=NAME` sweeps: pretrain before the runs if asked, and say after them whether the
    scenario reproduced (sweep/scenario.py). Does nothing for other sweeps."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.get("scenario") is None or not config.scenario.get("name"):
            return
        from sweep.scenario import pretrain, pretrain_config  # torch: only for +scenario sweeps

        HydraConfig.instance().set_config(config)  # so ${hydra:sweep.dir} in the scenario resolves
        name = config.scenario.name
        try:
            run = pretrain_config(config)
            if run.scenario.pretrain_steps:
                print(f"Scenario {name}: pretraining {run.scenario.pretrain_steps} steps first", flush=True)
                pretrain(run, Path(config.hydra.sweep.dir))
        except (ValueError, RuntimeError) as e:  # Hydra would only warn and run every cell without its weights
            raise SystemExit(f"Scenario {name}: {e}") from None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.get("scenario") is None or not config.scenario.get("name"):
            return
        from sweep.scenario import check, render, write

        sweep_dir = Path(config.hydra.sweep.dir)
        scenario = to_run_config(config).scenario
        results = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/result.json"))]
        outcomes = check(scenario.expect, results)
        write(sweep_dir, scenario, outcomes)
        changed = [o for o in config.hydra.overrides.task if not o.lstrip("+~").startswith(("scenario=", "hydra"))]
        print(f"\n{render(scenario, outcomes, changed)}", flush=True)
