"""What a diagnosis reads from a run directory: result.json, metrics.csv and the config it ran with."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from sweep.config import ConfigError, RunConfig, Verdict, to_run_config, without_retired
from sweep.diagnose.signals import RunRecord, as_number
from sweep.run.results import RESULT_FILE

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
    if not (run_dir / RESULT_FILE).is_file() or not (run_dir / CONFIG_FILE).is_file():
        raise DiagnoseError(f"{run_dir} is not a run directory (needs {RESULT_FILE} and {CONFIG_FILE})")
    try:
        result = json.loads((run_dir / RESULT_FILE).read_text())
    except (OSError, ValueError) as e:
        raise DiagnoseError(f"{run_dir / RESULT_FILE}: unreadable ({type(e).__name__})") from e
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
        config = without_retired(resolve_hydra(OmegaConf.load(run_dir / CONFIG_FILE), run_dir))
        run = to_run_config(OmegaConf.merge(OmegaConf.structured(RunConfig), config))
    except ConfigError as e:
        raise DiagnoseError(f"{run_dir}: its config no longer composes: {e}") from e
    except Exception as e:
        raise DiagnoseError(f"{run_dir}: its config cannot be read ({type(e).__name__}: {e})") from e
    return RunRecord(run_dir, result, rows, config, run)


_HYDRA_REF = re.compile(r"\$\{hydra:([^}]+)\}")


def resolve_hydra(config: DictConfig, run_dir: Path) -> DictConfig:
    """The saved config with its `${hydra:...}` references (a scenario's `${hydra:sweep.dir}/pretrained/...`)
    replaced by what they were for this run: outside Hydra nothing resolves them. Keys come from the run's
    .hydra/hydra.yaml (a relative folder made absolute against the directory the run was started in); the
    run's own folder is where the run dir is, and its sweep's the folder above it when hydra.yaml has it
    unresolved (`outputs/sweeps/${now:...}`)."""
    hydra_file = run_dir / ".hydra" / "hydra.yaml"
    node = OmegaConf.load(hydra_file).hydra if hydra_file.is_file() else OmegaConf.create({})
    started_in = Path(str(OmegaConf.select(node, "runtime.cwd", default=None) or "."))
    known = {"runtime.output_dir": run_dir, "run.dir": run_dir}

    def value(key: str) -> str:
        if key in known:
            return str(Path(known[key]).resolve())
        found = OmegaConf.select(node, key, default=None, throw_on_resolution_failure=False)
        if key == "sweep.dir" and (found is None or "${" in str(found)):  # a job dir sits in its sweep dir
            return str(run_dir.resolve().parent)
        if found is None or "${" in str(found):
            raise DiagnoseError(
                f"{run_dir}: its config refers to ${{hydra:{key}}}, which its .hydra/hydra.yaml does not say"
            )
        return str(found) if not key.endswith("dir") or Path(str(found)).is_absolute() else str(started_in / str(found))

    def fix(v):
        if isinstance(v, str):
            return _HYDRA_REF.sub(lambda m: value(m.group(1)), v)
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, list):
            return [fix(x) for x in v]
        return v

    return OmegaConf.create(fix(OmegaConf.to_container(config, resolve=False)))


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [{k: as_number(v) for k, v in row.items()} for row in csv.DictReader(f)]
