"""`replicates=N`: every combination of a sweep runs with N seeds, `seed`, `seed + 1`, ... `seed + N - 1`.

A sweeper turns it into one more swept axis, `seed=s,s+1,...` (the summary tables read `seed` as
replicates of a cell, never as an axis: sweep/report/noise.py). Sweeping `seed` yourself does the same
with the seeds you choose; giving both is a config error, as the two would disagree on the seeds.
"""

from __future__ import annotations

from hydra.core.override_parser.overrides_parser import OverridesParser

from sweep.config import MAX_REPLICATES, ConfigError

SEED = "seed"


def replicate_overrides(arguments: list[str], replicates: int, seed: int) -> list[str]:
    """The override that adds the replicate seeds to a sweep of `arguments` ([] for replicates=1, and for
    a value out of range, which the config check then names)."""
    if not 1 < replicates <= MAX_REPLICATES:
        return []
    keys = {o.key_or_group for o in OverridesParser.create().parse_overrides(list(arguments))}
    if SEED in keys:
        # Before, "use replicates=N (seeds 5...6)": replicates alone starts at the config's seed, not the override's.
        raise ConfigError(
            f"replicates={replicates} and a seed override both given: give one, e.g. {seeds(seed, replicates)} for"
            f" the {replicates} seeds from {seed}"
        )
    return [seeds(seed, replicates)]


def seeds(first: int, replicates: int) -> str:
    """The override of `replicates` seeds from `first`: seed=first,first+1,..."""
    return f"{SEED}={','.join(str(first + i) for i in range(replicates))}"
