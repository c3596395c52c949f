"""What a diagnosis reads from a run directory: result.json (or a confirmation run's trial.json), metrics.csv and the
config it ran with."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from sweep.config import ConfigError, Verdict
from sweep.config.recorded import UnresolvedReference, load_recorded
from sweep.diagnose.signals import RunRecord, as_number
from sweep.run.results import RESULT_FILE, record_problem, run_record, write_record

CONFIG_FILE = Path(".hydra") / "config.yaml"
METRICS_FILE = "metrics.csv"
NEEDED = ("status", "verdict", "first_bad_step", "cause", "params", "steps_run")
"""result.json keys a diagnosis reads; a run written before them cannot be diagnosed."""


class DiagnoseError(ValueError):
    """Input a diagnosis cannot take: one line for the user, exit status 2."""


def load(run_dir: Path, diverged_only: bool = True) -> RunRecord:
    """The run in `run_dir`; DiagnoseError (one line) for anything that is not a diverged run we can read."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DiagnoseError(f"{run_dir}: no such directory")
    path = run_record(run_dir)  # result.json; trial.json for a confirmation's own run
    if path is None or not (run_dir / CONFIG_FILE).is_file():
        raise DiagnoseError(f"{run_dir} is not a run directory (needs {RESULT_FILE} and {CONFIG_FILE})")
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DiagnoseError(f"{path}: unreadable ({type(e).__name__})") from e
    problem = record_problem(result)  # valid JSON of the wrong shape: one line, not a traceback in a reader
    if problem is not None:
        raise DiagnoseError(f"{path}: {problem}: it was not written by a run (or was changed since)")
    missing = [k for k in NEEDED if k not in result]
    if missing:
        raise DiagnoseError(
            f"{run_dir} was written by an older version: result.json has no {', '.join(missing)}; run it again"
        )
    if diverged_only and result["status"] != "diverged":
        what = result["status"] + (f" ({result.get('reason')})" if result.get("reason") else "")
        raise DiagnoseError(f"{run_dir}: the run is {what}, not diverged: there is nothing to diagnose")
    rows = read_metrics(run_dir / METRICS_FILE)
    if result["status"] == "diverged" and not rows and result.get("verdict") != Verdict.corrupt_checkpoint:
        raise DiagnoseError(f"{run_dir}: no {METRICS_FILE}, which every run that trained writes; run it again")
    try:
        config, run = load_recorded(run_dir)
    except UnresolvedReference as e:
        raise DiagnoseError(str(e)) from e
    except ConfigError as e:
        raise DiagnoseError(f"{run_dir}: its config no longer composes: {e}") from e
    except Exception as e:
        raise DiagnoseError(f"{run_dir}: its config cannot be read ({type(e).__name__}: {e})") from e
    step, start = result["first_bad_step"], result.get("start_step") or 0
    if result["status"] == "diverged" and not (isinstance(step, int) and start <= step < run.steps):
        raise DiagnoseError(
            f"{path}: first_bad_step {step!r} is not a step of the run (steps {start} to {run.steps - 1}): "
            "it was not written by this run (or was changed since)"
        )
    return RunRecord(run_dir, result, rows, config, run)


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [{k: as_number(v) for k, v in row.items()} for row in csv.DictReader(f)]


def write_mechanism(record: RunRecord, name: str, summary: str) -> dict:
    """A diagnosis's mechanism written back into the run's record (result.json), the one its own signals named
    kept beside it: `mechanism` = {name, summary, source: "diagnosis", recorded: {name, summary} or null}.
    Written whole or not at all (write_record); a second diagnosis keeps the first's `recorded`. Returns it."""
    old = record.result.get("mechanism")
    recorded = old.get("recorded") if isinstance(old, dict) and old.get("source") == "diagnosis" else old
    mechanism = {"name": name, "summary": summary, "source": "diagnosis", "recorded": recorded}
    path = run_record(record.run_dir) or Path(record.run_dir) / RESULT_FILE
    write_record(path, {**record.result, "mechanism": mechanism})
    record.result["mechanism"] = mechanism
    return mechanism


def sweep_dir_of(run_dir: Path) -> Path:
    """The directory of the sweep a run belongs to, as its ledger names it (sweep.job: `hydra.sweep.dir` of a
    multirun job, the run dir of a single run), from the run's .hydra/hydra.yaml; a relative one is made
    absolute against the directory the run was started in. Without hydra.yaml: the folder above the run."""
    from omegaconf import OmegaConf

    run_dir = Path(run_dir)
    try:
        hydra = OmegaConf.load(run_dir / ".hydra" / "hydra.yaml").hydra
        multirun = str(OmegaConf.select(hydra, "mode", default="")) == "MULTIRUN"
        given = OmegaConf.select(hydra, "sweep.dir", default=None, throw_on_resolution_failure=False)
        cwd = OmegaConf.select(hydra, "runtime.cwd", default=None, throw_on_resolution_failure=False)
    except Exception:  # noqa: BLE001  (missing or unreadable: a job dir sits in its sweep dir)
        return run_dir.resolve().parent
    if not multirun:
        return run_dir
    if given is None or "${" in str(given):  # saved unresolved (outputs/sweeps/${now:...})
        return run_dir.resolve().parent
    return Path(str(cwd or ".")) / str(given)
