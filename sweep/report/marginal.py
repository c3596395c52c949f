"""Marginal runs: stable by every verdict of their own, but far worse than the best lr of their combination.

A run's verdict comes from its own curve; across the sweep the grid says more. A run is **marginal** when
1. it is `stable`;
2. its lr is above its combination's best lr (the lr stable in every replicate with the lowest mean quality,
   tables.frontier_records `best_lr`). An lr *below* the best is under-trained at this horizon, not unstable:
   it may be the right lr for a longer run, so it is never marginal;
3. its quality (noise.quality_column: the eval loss, else the final training loss) is more than FACTOR[quality]
   x the best lr's mean: 3x for the eval loss, 4x for the final training loss (one minibatch at one random
   timestep: it spreads more between seeds and lrs);
4. where the best lr has replicates, its excess over that mean is beyond their noise: more than Z standard
   deviations of one more replicate, Z * sd * sqrt(1 + 1/n) (noise.py's Z). Without replicates rule 3 alone
   decides.
An lr with a marginal run is `marginal` in the frontier's stability per lr (`by_lr`), like an lr with a diverged
replicate is `diverged`: the frontier's largest stable lr and the recommendation skip it, and the divergence map
shows the cell as `marginal` (`m k/n` with replicates).

The factors are measured (docs/design.md, "How the marginal factors were chosen"): on the tiny video DiT, the
stable lrs above the best that still trained reached at most 1.69x the best eval loss (2.84x the final loss);
the runs that a longer horizon or a twin seed showed failing reached 7.5x-16x (final loss: 6.6x and up). Each
factor sits near the geometric middle of its gap.
"""

from __future__ import annotations

import math

import pandas as pd

from sweep.report.noise import EVAL, FINAL, Spread, Z

FACTOR = {EVAL: 3.0, FINAL: 4.0}
"""Per quality column: a stable run above its combination's best lr is marginal when its quality exceeds this
many times the best lr's mean."""


def factor(quality: str) -> float:
    """FACTOR of a quality column (noise.quality_column)."""
    return FACTOR.get(quality, FACTOR[FINAL])


def threshold(best: Spread, quality: str) -> float:
    """The quality above which a run at an lr above the best one is marginal (NaN when the best has none)."""
    if best.n == 0:
        return math.nan
    noise = Z * best.sd * math.sqrt(1 + 1 / best.n) if best.measured else 0.0
    return max(factor(quality) * best.mean, best.mean + noise)


def is_marginal(status: str, lr: float, value: float, best_lr: float | None, best: Spread | None, quality: str) -> bool:
    """Rules 1-4 of the module docstring for one run; `value` is its `quality` column's."""
    if status != "stable" or best_lr is None or best is None or pd.isna(lr) or pd.isna(value):
        return False
    return float(lr) > best_lr and float(value) > threshold(best, quality)
