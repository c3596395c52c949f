"""What a diagnosis reads from a run directory: result.json, metrics.csv and the config it ran with."""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from sweep.config import ConfigError, RunConfig, to_run_config
from sweep.run.results import RESULT_FILE

CONFIG_FILE = Path(".hydra") / "config.yaml"
METRICS_FILE = "metrics.csv"
NEEDED = ("status", "verdict", "first_bad_step", "cause", "params", "steps_run")
"""result.json keys a diagnosis reads; a run written before them cannot be diagnosed."""


class DiagnoseError(ValueError):
    """Input a diagnosis cannot take: one line for the user, exit status 2."""


@dataclass
class RunRecord:
    """One finished run as its directory holds it."""

    run_dir: Path
    result: dict
    rows: list[dict]
    """metrics.csv, one dict per step, numbers as floats (an empty cell is NaN)."""
    config: DictConfig
    """The composed config the run was made with (.hydra/config.yaml), for counterfactual overrides."""
    run: RunConfig

    @property
    def first_bad(self) -> int:
        return int(self.result["first_bad_step"])

    @property
    def last_step(self) -> int:
        """The step whose numbers tripped the verdict (a spike's first bad step can be earlier; a bad batch
        stops its step before the forward, so metrics.csv ends a step before it)."""
        return max(int(self.rows[-1]["step"]), self.first_bad) if self.rows else self.first_bad

    @property
    def start(self) -> int:
        return int(self.result.get("start_step") or 0)

    def column(self, name: str, before: int | None = None) -> list[tuple[int, float]]:
        """(step, value) of a metrics column where it is a finite number, steps < `before` only if given."""
        out = []
        for r in self.rows:
            v = r.get(name, math.nan)
            if math.isfinite(v) and (before is None or r["step"] < before):
                out.append((int(r["step"]), v))
        return out


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
    if result["status"] == "diverged" and not rows and result.get("verdict") != "corrupt_checkpoint":
        raise DiagnoseError(f"{run_dir}: no {METRICS_FILE}, which every run that trained writes; run it again")
    try:
        config = resolve_hydra(OmegaConf.load(run_dir / CONFIG_FILE), run_dir)
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


def as_number(v) -> float:
    """A metrics cell as a float: an empty cell (a step without that statistic) is NaN."""
    try:
        return float(v) if v not in (None, "") else math.nan
    except (TypeError, ValueError):
        return math.nan
