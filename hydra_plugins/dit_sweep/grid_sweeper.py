"""Hydra's grid sweeper, plus a check of every cell's values before the first run starts.

Hydra's basic sweeper already composes every job of a batch before launching it (so a typo'd key
fails early); this one also converts each composed config with sweep.config.to_run_config, so a bad
value (optim.lr=-1 in one cell of a 72-cell grid) fails before any run instead of at that cell, and
checks the files each cell will load exist (sweep.config.check_inputs).
Selected by default in conf/config.yaml (`override hydra/sweeper: grid`). `hydra.sweeper.mode=frontier`
hands the sweep to the Optuna sweeper's frontier search: the `+ladder=width|depth` configs use it, since
Hydra does not let a config appended with `+` replace a sweeper the primary config chose (hydra#3229).
No `from __future__ import annotations` here: Hydra execs plugin modules outside sys.modules, where
string annotations break dataclasses.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.types import HydraContext


@dataclass
class GridSweeperConf:
    _target_: str = "hydra_plugins.dit_sweep.grid_sweeper.GridSweeper"
    max_batch_size: Optional[int] = None
    params: Optional[Dict[str, str]] = None
    mode: str = "grid"
    """grid: every cell; frontier: per combination of the categorical axes, bisect the largest stable
    `frontier_param` within `frontier_factor` (the Optuna sweeper's frontier search, which this one hands
    the sweep to: `+ladder=width` sets it, as a config cannot switch the sweeper the primary one set)."""
    frontier_param: str = "optim.lr"
    frontier_factor: float = 2.0
    n_jobs: int = 1
    """frontier mode: runs launched per batch."""


ConfigStore.instance().store(group="hydra/sweeper", name="grid", node=GridSweeperConf, provider="dit_sweep")


class ComposedOnce:
    """Hydra's config loader, except that the launcher gets the config the cell check composed for a
    cell (once: a later call composes anew), instead of composing every cell twice (~0.1-0.3 s each)."""

    def __init__(self, loader) -> None:
        self.loader, self.kept = loader, {}

    def __getattr__(self, name):  # everything else is the real loader's
        if name in ("loader", "kept"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __getstate__(self):  # a launcher that ships the context to workers (joblib, submitit) ships no configs
        return {"loader": self.loader, "kept": {}}

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)

    def compose_and_keep(self, master, overrides):
        cfg = self.kept[tuple(overrides)] = self.loader.load_sweep_config(master, list(overrides))
        return cfg

    def load_sweep_config(self, master, overrides):
        cfg = self.kept.pop(tuple(overrides), None)
        return cfg if cfg is not None else self.loader.load_sweep_config(master, overrides)


class GridSweeper(BasicSweeper):
    """The basic grid sweeper that validates every cell's values up front (mode=grid), or the Optuna
    sweeper's frontier search (mode=frontier; sweep/search/sweeper.py)."""

    def __init__(
        self,
        max_batch_size: Optional[int] = None,
        params: Optional[Dict[str, str]] = None,
        mode: str = "grid",
        frontier_param: str = "optim.lr",
        frontier_factor: float = 2.0,
        n_jobs: int = 1,
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.frontier = None
        if mode == "frontier":
            from sweep.search.conf import OptunaSweepConf
            from sweep.search.sweeper import OptunaSweeperImpl

            d = OptunaSweepConf()
            self.frontier = OptunaSweeperImpl(
                sampler={},
                n_trials=d.n_trials,
                n_jobs=n_jobs,
                heartbeat_s=d.heartbeat_s,
                stale_after_s=d.stale_after_s,
                mode="frontier",
                frontier_param=frontier_param,
                frontier_factor=frontier_factor,
                params=dict(params or {}),
            )
        elif mode != "grid":
            from sweep.config import ConfigError

            raise ConfigError(f"hydra.sweeper.mode: must be grid or frontier, got {mode!r}")

    def setup(self, *, hydra_context, task_function, config) -> None:
        if self.frontier is not None:
            self.frontier.setup(hydra_context=hydra_context, task_function=task_function, config=config)
            return
        context = HydraContext(
            config_loader=ComposedOnce(hydra_context.config_loader), callbacks=hydra_context.callbacks
        )
        super().setup(hydra_context=context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> Any:
        """Hydra's grid, plus the replicate seeds of `replicates=N` (sweep/search/replicates.py)."""
        if self.frontier is not None:
            return self.frontier.sweep(arguments)
        from omegaconf import OmegaConf

        from sweep.search.replicates import replicate_overrides

        replicates = OmegaConf.select(self.config, "replicates", default=1)
        seed = OmegaConf.select(self.config, "seed", default=0)
        extra = replicate_overrides([*self._parse_config(), *arguments], replicates, seed) if replicates else []
        return super().sweep([*arguments, *extra])

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        from omegaconf import OmegaConf

        from sweep.config import ConfigError, RunConfig, check_inputs, to_run_config  # late: discovery stays cheap

        loader = self.hydra_context.config_loader
        compose = getattr(loader, "compose_and_keep", loader.load_sweep_config)
        for num, overrides in enumerate(batch):
            cfg = compose(self.config, list(overrides))
            if OmegaConf.get_type(cfg) is not RunConfig:  # another app's config: Hydra's checks only
                continue
            try:
                check_inputs(to_run_config(cfg))  # after a scenario's pretraining: its checkpoint exists now
                check_job_dir(cfg, num)
            except ConfigError as e:
                raise ConfigError(f"{e} (in the sweep cell {' '.join(overrides)})") from None


def check_job_dir(cfg, job_num: int) -> None:
    """The cell's job directory, <sweep dir>/<subdir>, can be created: a subdir such as
    ${hydra.job.override_dirname} grows with the overrides. hydra.job.num is set only at launch, so a
    copy gets one (the cell's place in its batch: as many digits, near enough)."""
    import copy

    from omegaconf import OmegaConf, open_dict, read_write

    from sweep.config import check_output_dir

    cfg = copy.deepcopy(cfg)  # the launcher gets the composed cell (ComposedOnce): leave it as it was
    with read_write(cfg), open_dict(cfg):
        cfg.hydra.job.num = job_num
    subdir = OmegaConf.select(cfg, "hydra.sweep.subdir", default="", throw_on_resolution_failure=False)
    check_output_dir(str(Path(str(cfg.hydra.sweep.dir)) / str(subdir or "")), "hydra.sweep.subdir")
