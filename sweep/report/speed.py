"""Speeds compared like with like: what the frontier's steps_per_s and the recommendation's tie-break read.

A packed run's steps/s is its share of a pack's wall time (hydra/launcher=packed, docs/packing.md), not comparable
with a lone run's; a sweep may hold both (a pack's leftover runs alone). So every speed the report shows comes from
runs of one packing, the same for every combination.
"""

from __future__ import annotations

import pandas as pd


def like_with_like_speed(stable: pd.DataFrame, combos: pd.Series) -> tuple[pd.Series, str]:
    """Mean steps/s per combination over the stable runs of one packing, and which packing:
    "lone runs" or "runs packed k at a time".

    The packing chosen is the one that covers the most combinations (lone runs on a tie), so every
    combination's speed is measured the same way; a combination with no run of that packing gets none.
    """
    if "packed" in stable:
        pack = stable.packed.map(lambda k: 1 if k is None or pd.isna(k) else int(k))
    else:
        pack = pd.Series(1, index=stable.index)
    cover = combos.groupby(pack).nunique()
    k = min(cover.index[cover == cover.max()]) if len(cover) else 1
    speed = stable[pack == k].steps_per_second.groupby(combos[pack == k]).mean()
    return speed, "lone runs" if k == 1 else f"runs packed {k} at a time"
