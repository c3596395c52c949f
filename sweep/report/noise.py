"""Signal or noise: the quality number the tables compare runs by, its spread over replicates, and ties.

The quality of a stable run is its held-out **eval loss** (sweep/run/evaluate.py): a fixed set of clips,
timesteps and noise, the same for every run of a sweep (folder data: its held-out files, data.eval_files).
A sweep whose runs have none (eval off, a folder too small to hold files out) falls back to the final
training loss, one minibatch, and every table that uses it says so.

Two runs that differ only in their seed (`seed=0,1,2` or `replicates=3`) are replicates: their spread is
the noise of a training run, and a difference between two settings counts as a difference only when it
is larger than that noise. The rule, used everywhere:

    tie  <=>  |mean_a - mean_b| <= 2 * sqrt(sd_a^2 / n_a + sd_b^2 / n_b)

(two standard errors of the difference of the means; sd with ddof=1). With a single replicate on either
side the noise is not measured, and `within_noise` says so (None) instead of guessing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from sweep.run.results import QUALITY_KEYS, quality_key

EVAL, FINAL = QUALITY_KEYS
Z = 2.0
"""Standard errors of a difference that still count as noise (~95% for normal noise)."""
FLOOR = 1e-3
"""A relative difference below 0.1% is a tie whatever the measured noise: replicates that agree to the
last bit (a toggle that does not change the math) must not make a rounding difference look real."""


def quality_column(runs: pd.DataFrame) -> str:
    """`eval_loss` when any stable run has one, else `final_loss`: the rule of a run's trial value in the ledger
    (sweep.run.results.quality_key), applied to the sweep's stable runs."""
    stable = runs[runs.status == "stable"] if "status" in runs else runs
    return quality_key(lambda key: key in stable and bool(stable[key].notna().any()))


def quality_name(column: str) -> str:
    return "eval loss" if column == EVAL else "final training loss (no eval loss recorded)"


@dataclass(frozen=True)
class Spread:
    """Replicates of one setting: mean, sample standard deviation (NaN with one), count."""

    mean: float
    sd: float
    n: int

    @classmethod
    def of(cls, values) -> Spread:
        v = [float(x) for x in values if x is not None and not pd.isna(x) and math.isfinite(float(x))]
        if not v:
            return cls(np.nan, np.nan, 0)
        return cls(float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else np.nan, len(v))

    @property
    def measured(self) -> bool:
        return self.n > 1

    def text(self) -> str:
        if self.n == 0:
            return "n/a"
        if not self.measured:
            return f"{self.mean:.4g} (1 replicate)"
        return f"{self.mean:.4g} ± {self.sd:.2g} ({self.n} replicates)"


def noise_of_difference(a: Spread, b: Spread) -> float:
    """Z standard errors of mean_a - mean_b; NaN when either side has fewer than two replicates."""
    if not (a.measured and b.measured):
        return np.nan
    return Z * math.sqrt(a.sd**2 / a.n + b.sd**2 / b.n)


def within_noise(a: Spread, b: Spread) -> bool | None:
    """True: a tie; False: a real difference; None: noise not measured (a single replicate)."""
    if abs(a.mean - b.mean) <= FLOOR * min(abs(a.mean), abs(b.mean)):
        return True
    noise = noise_of_difference(a, b)
    return None if pd.isna(noise) else bool(abs(a.mean - b.mean) <= noise)


def paired_change(pairs: list[tuple[float, float]]) -> tuple[float, float, int]:
    """(mean relative change b/a - 1, Z standard errors of that mean, n) over matched (a, b) pairs.

    Pairs are runs equal in everything but one axis (same lr, seed, other axes), so the spread of their
    relative changes is the noise of the comparison itself; with one pair it is not measured (NaN).
    """
    changes = [b / a - 1.0 for a, b in pairs if a > 0 and math.isfinite(a) and math.isfinite(b)]
    if not changes:
        return np.nan, np.nan, 0
    mean = float(np.mean(changes))
    if len(changes) < 2:
        return mean, np.nan, 1
    return mean, Z * float(np.std(changes, ddof=1)) / math.sqrt(len(changes)), len(changes)


def effect_label(change: float, noise: float, a, b) -> str:
    """`tie`, `<value> better` or `unmeasured` for a paired change (lower loss is better)."""
    if pd.isna(change):
        return ""
    if abs(change) <= FLOOR:
        return "tie"
    if pd.isna(noise):
        return "unmeasured (1 pair)"
    if abs(change) <= noise:
        return "tie"
    return f"{b if change < 0 else a} better"
