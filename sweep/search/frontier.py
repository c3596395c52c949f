"""Frontier search: the largest stable lr of every combination of the categorical axes, by bisection.

For each combination (precision x attention x ...), probe the top of the lr interval; if it diverges,
probe the bottom; then bisect in log-lr between the largest stable and the smallest diverged lr until
they are within `factor` (default 2x). Each combination's bracket is rebuilt from the ledger every
round, so combinations share nothing but the ledger, a resumed search reuses every finished run, and
the number of runs is logarithmic in the interval: 1e-5..1e-1 at 2x takes 2 + 4 runs per combination
where a 2x grid takes 15.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass
class Bracket:
    """What the ledger says about one combination's lr frontier."""

    lo: float
    hi: float
    stable: Optional[float] = None
    """Largest lr seen stable."""
    diverged: Optional[float] = None
    """Smallest lr seen diverged."""
    undecided: Optional[str] = None
    """Why this combination cannot be bisected (a run was skipped or crashed)."""
    runs: int = 0

    def observe(self, lr: float, status: str) -> None:
        self.runs += 1
        if status == "stable":
            self.stable = lr if self.stable is None else max(self.stable, lr)
        elif status == "diverged":
            self.diverged = lr if self.diverged is None else min(self.diverged, lr)
        else:
            self.undecided = f"a run at lr={lr:g} was {status}"

    def next_lr(self, factor: float) -> Optional[float]:
        """The next lr to try, or None when the frontier is known within `factor` (or cannot be)."""
        if self.undecided:
            return None
        if self.stable is None and self.diverged is None:
            return self.hi
        if self.stable is None:  # only divergence seen so far
            return self.lo if self.diverged > self.lo else None
        if self.diverged is None:  # stable up to the top of the interval
            return None if self.stable >= self.hi else self.hi
        if self.stable >= self.diverged:  # non-monotonic: stable above a diverged lr; report as is
            return None
        if self.diverged / self.stable <= factor * (1 + 1e-9):
            return None
        return math.sqrt(self.stable * self.diverged)

    def verdict(self) -> str:
        if self.undecided:
            return f"undecided: {self.undecided}"
        if self.stable is None:
            return f"diverges at the bottom of the interval ({self.lo:g})"
        if self.diverged is None:
            return f"stable up to the top of the interval ({self.hi:g})"
        return f"max stable lr in [{self.stable:.3g}, {self.diverged:.3g})"


def grid_runs(lo: float, hi: float, factor: float) -> int:
    """Runs per combination of a log grid over [lo, hi] at the same resolution."""
    return math.ceil(math.log(hi / lo) / math.log(factor) - 1e-9) + 1


BRACKET_COLUMNS = ("max_stable", "min_diverged", "runs", "verdict", "marginal")
"""frontier.csv's columns after the combination's own (its categorical params)."""


def marginal_edges(sweep_dir: Path, table, param: str) -> list[bool]:
    """Per row of the frontier table (a combination's params and its `max_stable`): whether a run at that lr is
    marginal (sweep/report/marginal.py: stable, but above its combination's best lr and its eval loss over 3x the
    best's). The bisection brackets where runs diverge; the summary's Stability frontier also skips a marginal lr."""
    import pandas as pd

    from sweep.report.runs import PARAM, runs_from_dirs  # pandas: at the search's end only
    from sweep.report.tables import marginal_runs

    runs = runs_from_dirs(sweep_dir, starting_s=0)
    if "superseded_by" in runs:
        runs = runs[runs.superseded_by.isna()].reset_index(drop=True)
    if runs.empty or PARAM + param not in runs:
        return [False] * len(table)
    marginal = runs[marginal_runs(runs).to_numpy()]
    lrs = pd.to_numeric(marginal[PARAM + param], errors="coerce")  # the trials' own values: equal, not close
    combination = [c for c in table.columns if c not in BRACKET_COLUMNS]
    edges = []
    for _, row in table.iterrows():  # a bracket with no stable lr (NaN) matches no run
        hit = marginal[(lrs == row.max_stable).to_numpy()]
        for key in combination:
            hit = hit[[str(v) == str(row[key]) for v in hit.get(PARAM + key, [None] * len(hit))]]
        edges.append(not hit.empty)
    return edges
