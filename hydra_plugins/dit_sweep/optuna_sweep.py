"""Registers our divergence-aware Optuna sweeper as `hydra/sweeper=optuna_sweep`: registration and glue only.

Hydra's plugin discovery imports every module under hydra_plugins/ in every Hydra app installed beside
ours, so this one imports only the settings' schema (sweep/search/conf.py: dataclasses). Optuna and
the implementation (sweep/search/sweeper.py) are imported when Hydra instantiates the sweeper, as
Hydra's own plugins do it. No `from __future__ import annotations` here: Hydra execs plugin modules
outside sys.modules.
"""

from typing import Any, List

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from sweep.search.conf import OptunaSweepConf


class OptunaSweeper(Sweeper):
    """hydra/sweeper=optuna_sweep: builds sweep.search.sweeper.OptunaSweeperImpl and hands over to it."""

    def __init__(self, **settings: Any) -> None:
        from sweep.search.sweeper import OptunaSweeperImpl

        self.sweeper = OptunaSweeperImpl(**settings)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.sweeper.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> Any:
        return self.sweeper.sweep(arguments)


ConfigStore.instance().store(group="hydra/sweeper", name="optuna_sweep", node=OptunaSweepConf, provider="dit_sweep")
