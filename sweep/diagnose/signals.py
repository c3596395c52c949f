"""A finished run as a diagnosis reads it: result.json, metrics.csv rows and its RunConfig (no file access here,
so the run's own loop can name its mechanism from what it holds: sweep/run/execute.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sweep.config import RunConfig


@dataclass
class RunRecord:
    """One finished run as its directory holds it."""

    run_dir: Path
    result: dict
    rows: list[dict]
    """metrics.csv, one dict per step, numbers as floats (an empty cell is NaN)."""
    config: Any
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
        """The first step a replay of its config trains: where it resumed from a checkpoint, else 0. A confirmation's
        continued run (sweep/confirm/trial.py) recorded the step it continued from, but its config is, step for step,
        the same run from step 0, with the grid run's rows as its first."""
        resumed = self.run is None or self.run.checkpoint.resume_from  # (a record made without its config: as said)
        return int(self.result.get("start_step") or 0) if resumed else 0

    def column(self, name: str, before: int | None = None) -> list[tuple[int, float]]:
        """(step, value) of a metrics column where it is a finite number, steps < `before` only if given."""
        out = []
        for r in self.rows:
            v = r.get(name, math.nan)
            if math.isfinite(v) and (before is None or r["step"] < before):
                out.append((int(r["step"]), v))
        return out


def as_number(v) -> float:
    """A metrics cell as a float: an empty cell (a step without that statistic) is NaN."""
    try:
        return float(v) if v not in (None, "") else math.nan
    except (TypeError, ValueError):
        return math.nan


def computes_in_fp32(run: RunConfig) -> bool:
    """fp32 weights, no autocast, no fp8 matmuls: the run has no lower precision to take away (no fp32 row, no
    bisection)."""
    p = run.precision
    return p.param_dtype.value == "float32" and p.autocast_dtype is None and p.fp8 is None
