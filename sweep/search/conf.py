"""The Optuna sweeper's settings and the pruner's, as typed schemas: dataclasses and enums only.

Imported by the Hydra plugin module (hydra_plugins/dit_sweep/optuna_sweep.py), which Hydra's plugin
discovery imports in every Hydra app installed beside ours: so nothing here imports optuna, torch or
the implementation (sweep/search/sweeper.py). The run's own schema (sweep/config.py) takes
PrunerConfig from here for `ledger.pruner`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional


class PrunerName(str, Enum):
    none = "none"
    median = "median"
    percentile = "percentile"
    threshold = "threshold"
    successive_halving = "successive_halving"
    hyperband = "hyperband"


class SamplerName(str, Enum):
    tpe = "tpe"
    random = "random"
    grid = "grid"  # every cell of the swept choices, each once (enqueued, not sampled)
    cmaes = "cmaes"
    qmc = "qmc"


class SweepMode(str, Enum):
    search = "search"  # sample n_trials
    frontier = "frontier"  # bisect the largest stable `frontier_param` per combination


PRUNERS = tuple(p.value for p in PrunerName)


@dataclass
class PrunerConfig:
    """Stops unpromising runs of an Optuna search early (sweep/search/pruning.py). Optuna does not keep the
    pruner in the storage, so our sweeper passes its `hydra.sweeper.pruner` to every job as this node."""

    name: PrunerName = PrunerName.none
    report_every: int = 5
    """Report the loss to the trial every this many steps (a storage round-trip each); the pruner decides on
    those steps only."""
    n_startup_trials: int = 5
    """median, percentile: prune nothing until this many trials have completed."""
    n_warmup_steps: int = 0
    """median, percentile, threshold: prune no run before this step."""
    n_min_trials: int = 1
    """median, percentile: trials that must have reported at a step before it is compared."""
    percentile: float = 25.0
    """percentile: prune a run whose best loss so far is worse than this percentile of the others' (median = 50)."""
    lower: Optional[float] = None
    """threshold: prune a run whose loss falls below this."""
    upper: Optional[float] = None
    """threshold: prune a run whose loss rises above this (e.g. 2x the initial loss: going nowhere good)."""
    min_resource: Optional[int] = None
    """successive_halving, hyperband: steps before the first rung; null = Optuna's default (auto, 1)."""
    reduction_factor: Optional[int] = None
    """successive_halving, hyperband: keep 1/this of the runs per rung; null = Optuna's default (4, 3)."""
    min_early_stopping_rate: int = 0
    """successive_halving: the first rung is min_resource x reduction_factor^this steps."""
    max_resource: Optional[int] = None
    """hyperband: steps of a full run; null = auto (the longest finished trial)."""


@dataclass
class SamplerConf:
    name: SamplerName = SamplerName.tpe
    seed: Optional[int] = None
    n_startup_trials: int = 5
    """TPE: random trials before the model takes over."""


@dataclass
class OptunaSweepConf:
    _target_: str = "hydra_plugins.dit_sweep.optuna_sweep.OptunaSweeper"
    sampler: SamplerConf = field(default_factory=SamplerConf)
    n_trials: int = 20
    """Finished trials to reach (grid: ignored, the grid's size)."""
    n_jobs: int = 1
    """Trials launched per batch (the launcher decides where they run)."""
    heartbeat_s: int = 5
    stale_after_s: int = 30
    mode: SweepMode = SweepMode.search
    """search: sample n_trials; frontier: bisect the largest stable `frontier_param` per combination."""
    frontier_param: str = "optim.lr"
    frontier_factor: float = 2.0
    """Stop bisecting when the largest stable and smallest diverged values are within this factor."""
    params: Optional[dict] = None
    """The search space in config form: {optim.lr: 'tag(log, interval(1e-5, 1e-1))', precision: 'fp32,bf16_amp'}."""
    pruner: PrunerConfig = field(default_factory=PrunerConfig)
    """Stop unpromising runs early (name=median|percentile|threshold|successive_halving|hyperband): every
    job gets it as ledger.pruner.* and reports its loss to its trial through the storage (sweep/search/pruning.py)."""
