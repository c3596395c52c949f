"""Registers our divergence-aware Optuna sweeper as `hydra/sweeper=optuna_sweep`.

The implementation is sweep/search/sweeper.py; Hydra only instantiates plugin classes defined
inside the hydra_plugins package, hence the subclass here.
"""

from hydra.core.config_store import ConfigStore

from sweep.search.sweeper import OptunaSweepConf
from sweep.search.sweeper import OptunaSweeper as _OptunaSweeper


class OptunaSweeper(_OptunaSweeper):
    """hydra/sweeper=optuna_sweep (see sweep.search.sweeper)."""


ConfigStore.instance().store(group="hydra/sweeper", name="optuna_sweep", node=OptunaSweepConf, provider="dit_sweep")
