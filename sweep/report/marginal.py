"""Marginal runs: stable by every verdict of their own, but far worse than the best lr of their combination.

A run's verdict comes from its own curve; across the sweep the grid says more. A run is **marginal** when
1. it is `stable`;
2. its lr is above its combination's best lr (the lr stable in every replicate with the lowest mean quality,
   tables.frontier_records `best_lr`). An lr *below* the best is under-trained at this horizon, not unstable:
   it may be the right lr for a longer run, so it is never marginal;
3. its quality (noise.quality_column: the eval loss, else the final training loss) is more than FACTOR x the
   best lr's mean;
4. where the best lr has replicates, its excess over that mean is beyond their noise: more than Z standard
   deviations of one more replicate, Z * sd * sqrt(1 + 1/n) (noise.py's Z). Without replicates rule 3 alone
   decides.
An lr with a marginal run is `marginal` in the frontier's stability per lr (`by_lr`), like an lr with a diverged
replicate is `diverged`: the frontier's largest stable lr and the recommendation skip it, and the divergence map
shows the cell as `marginal` (`m k/n` with replicates).

FACTOR is measured (docs/design.md, "The tables' columns"): a stable lr above the best reached at most 1.6x the
best eval loss in the grids measured there, and the cases that a longer horizon showed unstable 6.6x-16x.
"""

from __future__ import annotations

import math

import pandas as pd

from sweep.report.noise import Spread, Z

FACTOR = 2.0
"""A stable run above its combination's best lr is marginal when its quality exceeds FACTOR x the best's mean."""


def threshold(best: Spread) -> float:
    """The quality above which a run at an lr above the best one is marginal (NaN when the best has none)."""
    if best.n == 0:
        return math.nan
    noise = Z * best.sd * math.sqrt(1 + 1 / best.n) if best.measured else 0.0
    return max(FACTOR * best.mean, best.mean + noise)


def is_marginal(status: str, lr: float, quality: float, best_lr: float | None, best: Spread | None) -> bool:
    """Rules 1-4 of the module docstring for one run."""
    if status != "stable" or best_lr is None or best is None or pd.isna(lr) or pd.isna(quality):
        return False
    return float(lr) > best_lr and float(quality) > threshold(best)


def ratio_text(quality: float, best: Spread) -> str:
    """How far a quality is from the best's mean: "6.6x the best"."""
    return f"{quality / best.mean:.2g}x the best" if best.n and best.mean > 0 else "far above the best"
