"""What a diagnosis reads from a run directory: result.json (or a confirmation run's trial.json), metrics.csv and the
config it ran with."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from sweep.config import ConfigError, Verdict
from sweep.config.recorded import UnresolvedReference, load_recorded
from sweep.diagnose.signals import RunRecord, as_number
from sweep.run.results import RESULT_FILE, run_record

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
    return RunRecord(run_dir, result, rows, config, run)


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [{k: as_number(v) for k, v in row.items()} for row in csv.DictReader(f)]
