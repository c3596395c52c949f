"""`hydra/launcher=packed`: trains the runs of a batch that share an architecture as vectorised packs.

    python -m sweep -m hydra/launcher=packed hydra.launcher.pack=8 precision=fp32,bf16_amp \
        optim.lr=1e-4,3e-4,1e-3,3e-3,1e-2,3e-2,1e-1,3e-1

The sweeper (Hydra's grid, or our Optuna sweeper with n_jobs) decides the runs; this launcher runs
them in this process in two phases. First every job is set up exactly as Hydra's basic launcher does
(its job directory, `.hydra/` files, callbacks), which is where each run's config, params and
directory are fixed. Then the runs are grouped (sweep.run.packing.plan: same model, precision, kernels
and data shapes; at most `pack` per group) and each group trains as one pack (sweep/run/packed.py); a
run that cannot be packed trains alone. Every run still writes its own result.json and metrics.csv
and records its own trial, so the ledger, the summary and resume see no difference.

No `from __future__ import annotations` here: Hydra execs plugin modules outside sys.modules, where
string annotations break dataclasses.
"""

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger("sweep")


@dataclass
class PackedLauncherConf:
    _target_: str = "hydra_plugins.dit_sweep.packed_launcher.PackedLauncher"
    pack: int = 8
    """The most runs trained together in one pack; 1 runs every job alone (the basic launcher)."""


ConfigStore.instance().store(group="hydra/launcher", name="packed", node=PackedLauncherConf, provider="dit_sweep")


class PackedLauncher(Launcher):
    """Sets jobs up one by one, then trains them in packs (see the module docstring)."""

    def __init__(self, pack: int = 8) -> None:
        if pack < 1:
            from sweep.config import ConfigError

            raise ConfigError(f"hydra.launcher.pack: must be >= 1, got {pack}")
        self.pack = pack
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from sweep.config import RunConfig
        from sweep.job import finish_job, job_sinks, job_spec_task
        from sweep.run.interrupt import stopping_on_signals
        from sweep.run.once import per_sweep
        from sweep.run.packing import alone_lines, execute_pack, plan

        setup_globals()
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info("Launching %d jobs in packs of up to %d", len(job_overrides), self.pack)
        returns: List[JobReturn] = []
        specs = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(cfg):
                cfg.hydra.job.id = cfg.hydra.job.num = idx
            if OmegaConf.get_type(cfg) is not RunConfig:  # another app: run it as the basic launcher would
                returns.append(
                    run_job(
                        hydra_context=self.hydra_context,
                        task_function=self.task_function,
                        config=cfg,
                        job_dir_key="hydra.sweep.dir",
                        job_subdir_key="hydra.sweep.subdir",
                    )
                )
                specs.append(None)
                continue
            # Phase 1: Hydra sets the job up (directory, .hydra/ files, callbacks); the task only takes its spec.
            returns.append(
                run_job(
                    hydra_context=self.hydra_context,
                    task_function=job_spec_task,
                    config=cfg,
                    job_dir_key="hydra.sweep.dir",
                    job_subdir_key="hydra.sweep.subdir",
                )
            )
            specs.append(returns[-1].return_value)
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        ours = [i for i, spec in enumerate(specs) if spec is not None]
        for line in alone_lines([specs[i].run for i in ours]):  # asked to pack: say which runs will not, and why
            log.warning(line)
        # Ctrl-C/SIGTERM: the pack in progress trains to its end and is recorded, no later pack starts (their
        # job dirs have no result.json: a resume runs them); a second signal exits at once (sweep/run/interrupt.py).
        with stopping_on_signals() as request, per_sweep(self.config.hydra.sweep.dir):
            for members in plan([specs[i].run for i in ours], self.pack):  # Phase 2: train, pack by pack
                jobs = [specs[ours[m]] for m in members]
                if len(jobs) > 1:
                    log.info("Packing %d runs: %s", len(jobs), ", ".join(f"#{j.num}" for j in jobs))
                results = execute_pack(
                    [j.run for j in jobs],
                    [j.run_dir for j in jobs],
                    [j.params for j in jobs],
                    [j.label for j in jobs],
                    [job_sinks(j) for j in jobs],
                )
                for m, job, result in zip(members, jobs, results):
                    ret = returns[ours[m]]
                    ret.return_value, ret.status = finish_job(job, result), JobStatus.COMPLETED
                if request.signum is not None:
                    break
        if request.signum is not None:
            log.warning("%s: stopped after the pack in progress; run the same command again to resume", request.name)
            raise SystemExit(128 + request.signum)
        return returns
