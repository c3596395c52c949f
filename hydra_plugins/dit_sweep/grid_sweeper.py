"""Hydra's grid sweeper, plus a check of every cell's values before the first run starts.

Hydra's basic sweeper already composes every job of a batch before launching it (so a typo'd key
fails early); this one also converts each composed config with sweep.config.to_run_config, so a bad
value (optim.lr=-1 in one cell of a 72-cell grid) fails before any run instead of at that cell.
Selected by default in conf/config.yaml (`override hydra/sweeper: grid`). No `from __future__ import
annotations` here: Hydra execs plugin modules outside sys.modules, where string annotations break dataclasses.
"""

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper


@dataclass
class GridSweeperConf:
    _target_: str = "hydra_plugins.dit_sweep.grid_sweeper.GridSweeper"
    max_batch_size: Optional[int] = None
    params: Optional[Dict[str, str]] = None


ConfigStore.instance().store(group="hydra/sweeper", name="grid", node=GridSweeperConf, provider="dit_sweep")


class GridSweeper(BasicSweeper):
    """The basic grid sweeper that validates every cell's values up front."""

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        from omegaconf import OmegaConf

        from sweep.config import ConfigError, RunConfig, to_run_config  # late: plugin discovery stays cheap

        for overrides in batch:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            if OmegaConf.get_type(cfg) is not RunConfig:  # another app's config: Hydra's checks only
                continue
            try:
                to_run_config(cfg)
            except ConfigError as e:
                raise ConfigError(f"{e} (in the sweep cell {' '.join(overrides)})") from None
