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

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import HydraContext

log = logging.getLogger(__name__)


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


class GridSweeper(BasicSweeper):
    """The basic grid sweeper that validates every cell's values up front and runs only the cells a
    previous run of the same sweep did not finish (mode=grid; see `finished_result`), or the Optuna
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
        if max_batch_size is not None and max_batch_size < 1:  # Hydra's own check is an assert (a traceback)
            from sweep.config import ConfigError

            raise ConfigError(f"hydra.sweeper.max_batch_size: must be >= 1 (or null: one batch), got {max_batch_size}")
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
            self.config = config  # check_ladder reads it
            return
        from sweep.callbacks import record_pending_trials
        from sweep.search.composed import ComposedOnce

        context = HydraContext(
            config_loader=ComposedOnce(hydra_context.config_loader), callbacks=hydra_context.callbacks
        )
        super().setup(hydra_context=context, task_function=task_function, config=config)
        self.finished: Dict[int, JobReturn] = {}  # job number -> the return of a cell already finished
        self.job_dirs: Dict[int, Path] = {}  # job number -> its directory (what a watcher of remote jobs reads)
        self.dir_cells: Dict[str, Sequence[str]] = {}  # a job directory, normalised -> the cell that runs there
        self.cells_seen = 0
        # after a signal: record the trials of job processes killed while they recorded (sweep/search/pending.py)
        self.launcher = ResumingLauncher(
            self.launcher, self.finished, self.job_dirs, functools.partial(record_pending_trials, config)
        )

    def check_ladder(self, arguments: List[str]) -> None:
        """A ladder sweep (`+ladder=width|depth`) over fewer than three sizes is a ConfigError (one line, exit 2):
        the fit would give no interval (sweep/report/ladder.py)."""
        from omegaconf import OmegaConf

        from sweep.config import ConfigError
        from sweep.report.ladder import check_ladder_sizes

        axis = OmegaConf.select(self.config, "ladder.axis", default=None)
        if axis is None:
            return
        axis = getattr(axis, "value", axis)
        key, spec = f"model.{axis}", None
        for k, v in (self.params or {}).items():
            if k == key:
                spec = str(v)
        for argument in arguments:
            k, _, v = argument.partition("=")
            if k.lstrip("+~") == key:
                spec = v
        reason = check_ladder_sizes(axis, spec.split(",")) if spec is not None else None
        if reason:
            raise ConfigError(reason)

    def sweep(self, arguments: List[str]) -> Any:
        """Hydra's grid, plus the replicate seeds of `replicates=N` (sweep/search/replicates.py)."""
        from sweep.config import ConfigError
        from sweep.search.space import repeated_value

        # (A single value for a key hydra.sweeper.params sweeps replaces that axis in Hydra's grid; the frontier
        # search, which would ignore it, refuses it: sweep/search/space.py shadowed_axis.)
        problem = repeated_value([*self._parse_config(), *arguments])
        if problem:
            raise ConfigError(problem)
        self.check_ladder(arguments)
        if self.frontier is not None:
            return self.frontier.sweep(arguments)
        from omegaconf import OmegaConf

        from sweep.run.progress import close_sweep
        from sweep.search.replicates import replicate_overrides

        replicates = OmegaConf.select(self.config, "replicates", default=1)
        seed = OmegaConf.select(self.config, "seed", default=0)
        extra = replicate_overrides([*self._parse_config(), *arguments], replicates, seed) if replicates else []
        try:
            return super().sweep([*arguments, *extra])
        finally:
            close_sweep()

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        from omegaconf import OmegaConf

        from sweep.config import (  # late: discovery stays cheap
            ConfigError,
            RunConfig,
            check_device,
            check_inputs,
            launches_here,
            to_run_config,
        )
        from sweep.config.inputs import check_job_dir, release_checked_models
        from sweep.config.secrets import check_no_literal_secrets

        loader = self.hydra_context.config_loader
        compose = getattr(loader, "compose_and_keep", loader.load_sweep_config)
        first, self.cells_seen = self.cells_seen, self.cells_seen + len(batch)  # batches come in launch order
        if first == 0:
            self.job_dirs_ahead(compose, len(batch))
        for num, overrides in enumerate(batch, start=first):
            cfg = compose(self.config, list(overrides))
            if OmegaConf.get_type(cfg) is not RunConfig:  # another app's config: Hydra's checks only
                continue
            try:
                check_no_literal_secrets(cfg)  # a cell's own experiment: before Hydra writes its .hydra/config.yaml
                run = check_inputs(to_run_config(cfg))  # after a scenario's pretraining: its checkpoint exists now
                if launches_here(self.config):
                    check_device(run)
                job_dir = check_job_dir(cfg, num)
            except ConfigError as e:
                raise ConfigError(f"{e} (in the sweep cell {' '.join(overrides)})") from None
            self.claim_job_dir(job_dir, overrides)
            self.job_dirs[num] = job_dir
            result = finished_result(job_dir, overrides)
            if result is not None:
                self.finished[num] = JobReturn(
                    overrides=list(overrides),
                    working_dir=str(job_dir),
                    status=JobStatus.COMPLETED,
                    _return_value=result,
                )
        release_checked_models()  # the custom models the checks built: the runs build their own
        self.count_runs(first, batch)
        if any(first <= n < self.cells_seen for n in self.finished):
            log.info(
                "grid: %d of %d cells already finished in %s (a result.json says so): not run again",
                sum(first <= n < self.cells_seen for n in self.finished),
                len(batch),
                self.config.hydra.sweep.dir,
            )

    def claim_job_dir(self, job_dir: Path, overrides: Sequence[str]) -> None:
        """A ConfigError when another cell of this grid has the same job directory: the two would overwrite each
        other's result.json (issue 45: `hydra.sweep.subdir=lr${optim.lr}` with replicates ran 4 cells into 2)."""
        from sweep.config import ConfigError
        from sweep.config.inputs import written_subdir

        key = os.path.normpath(os.path.abspath(job_dir))
        other = self.dir_cells.setdefault(key, overrides)
        if other is not overrides and list(other) != list(overrides):
            every = set.intersection(*(set(cell) for batch in self.overrides for cell in batch))
            other, overrides = ([o for o in cell if o not in every] or cell for cell in (other, overrides))
            raise ConfigError(
                f"hydra.sweep.subdir: the cells '{' '.join(other)}' and '{' '.join(overrides)}' share the job "
                f"directory {job_dir} (subdir {written_subdir(self.config)!r}), so one would overwrite the other's "
                "result.json; "
                "make the subdir tell every cell apart, e.g. add ${hydra.job.num}"
            )

    def job_dirs_ahead(self, compose, first_batch: int) -> None:
        """With hydra.sweeper.max_batch_size, the job directories of the later batches' cells too, before the first
        run (their configs are kept for their own batch: each cell is still composed once)."""
        from omegaconf import OmegaConf

        from sweep.config import ConfigError, RunConfig
        from sweep.config.inputs import check_job_dir

        num = first_batch
        for batch in self.overrides[1:]:
            for overrides in batch:
                cfg = compose(self.config, list(overrides))
                if OmegaConf.get_type(cfg) is RunConfig:
                    try:
                        self.claim_job_dir(check_job_dir(cfg, num), overrides)
                    except ConfigError as e:
                        raise ConfigError(f"{e} (in the sweep cell {' '.join(overrides)})") from None
                num += 1

    def count_runs(self, first: int, batch: Sequence[Sequence[str]]) -> None:
        """The sweep's progress (sweep/run/progress.py): opened at the first batch with every cell of the grid, less
        those already finished; a later batch takes off its own finished cells."""
        from omegaconf import OmegaConf

        from sweep.run.progress import as_mode, current_sweep, open_sweep

        done_here = sum(first <= n < first + len(batch) for n in self.finished)
        if first == 0:
            cells = sum(len(b) for b in self.overrides)
            open_sweep(cells - done_here, as_mode(OmegaConf.select(self.config, "progress", default="auto")))
        elif current_sweep() is not None:
            current_sweep().total -= done_here


FINISHED = ("stable", "diverged", "skipped")
"""Statuses a resumed grid keeps; `error` and `interrupted` cells (and those without result.json) run again."""


def finished_result(job_dir: Path, overrides: Sequence[str]) -> Optional[dict]:
    """The result.json of a cell a previous run of this sweep finished, or None. The job directory must
    hold this very cell (its .hydra/overrides.yaml, less what does not change a run's outcome)."""
    import json

    from omegaconf import OmegaConf

    from sweep.callbacks import NOT_WHAT_RUNS

    try:
        result = json.loads((job_dir / "result.json").read_text())
        theirs = [str(o) for o in OmegaConf.load(job_dir / ".hydra" / "overrides.yaml")]
    except Exception:  # noqa: BLE001  (missing, unreadable or damaged: not finished)
        return None

    def outcome(ovs):
        return [o for o in ovs if not o.split("=", 1)[0].lstrip("+~").startswith(NOT_WHAT_RUNS)]

    if not isinstance(result, dict) or result.get("status") not in FINISHED or outcome(theirs) != outcome(overrides):
        return None
    return result


IN_PROCESS = ("BasicLauncher", "PackedLauncher")
"""Launchers that run the jobs in the sweeper's process: the runs count themselves (sweep/job.py finish_job)."""


class ResumingLauncher:
    """The configured launcher, given only the cells not finished yet; the finished ones return their
    result.json. Unfinished cells keep their job numbers (and so their directories): each run of
    consecutive ones is launched on its own. Runs launched elsewhere (joblib, submitit) are counted by
    watching their job directories (ResultWatcher)."""

    def __init__(
        self,
        launcher,
        finished: Dict[int, JobReturn],
        job_dirs: Optional[Dict[int, Path]] = None,
        after_stop: Optional[Callable[[], object]] = None,
    ) -> None:
        self.launcher, self.finished, self.after_stop = launcher, finished, after_stop
        self.job_dirs = job_dirs if job_dirs is not None else {}  # shared: the sweeper fills it as it checks cells

    def __getattr__(self, name):
        if name in ("launcher", "finished", "job_dirs", "after_stop"):
            raise AttributeError(name)
        return getattr(self.launcher, name)

    def launch_some(self, todo: Sequence[Sequence[str]], first: int) -> Sequence[JobReturn]:
        from sweep.run.interrupt import launch_forwarding_signals  # a signal reaches jobs in other processes too

        watched = {n: self.job_dirs[n] for n in range(first, first + len(todo)) if n in self.job_dirs}
        if type(self.launcher).__name__ in IN_PROCESS or not watched:
            return launch_forwarding_signals(self.launcher, todo, first, self.after_stop)
        with ResultWatcher(watched):
            return launch_forwarding_signals(self.launcher, todo, first, self.after_stop)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        returns: List[JobReturn] = []
        todo: List[Sequence[str]] = []
        for num, overrides in enumerate(job_overrides, start=initial_job_idx):
            if num in self.finished:
                if todo:
                    returns += self.launch_some(todo, num - len(todo))
                    todo = []
                returns.append(self.finished[num])
            else:
                todo.append(overrides)
        if todo:
            returns += self.launch_some(todo, initial_job_idx + len(job_overrides) - len(todo))
        return returns


class ResultWatcher:
    """While jobs run in other processes, a thread that looks for each one's result.json every `every` seconds and
    says one line per run finished: `sweep: 3/24 finished: [5] stable; 1 diverged so far, ETA 2m10s`. Files older
    than the launch (a resumed cell's earlier attempt) are not counted."""

    def __init__(self, job_dirs: Dict[int, Path], every: float = 1.0) -> None:
        import threading
        import time

        self.pending, self.every = dict(job_dirs), every
        self.since = time.time() - 1.0  # file times may be coarser than a second
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="sweep-progress", daemon=True)

    def __enter__(self) -> "ResultWatcher":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.poll()  # what finished since the last look

    def _watch(self) -> None:
        while not self.stop.wait(self.every):
            self.poll()

    def poll(self) -> None:
        import json

        from sweep.run.progress import current_sweep

        sweep, found = current_sweep(), []
        for num, job_dir in list(self.pending.items()):
            path = job_dir / "result.json"
            try:
                when = path.stat().st_mtime
                if when < self.since:
                    continue
                found.append((when, num, str(json.loads(path.read_text())["status"])))
            except Exception:  # noqa: BLE001  (not there yet, or being written)
                continue
            del self.pending[num]
        for _, num, status in sorted(found):  # in the order they finished
            if sweep is not None and sweep.finished(num, status):
                say = logging.getLogger("sweep").info  # beside the runs' own lines
                say("sweep: %s finished: [%d] %s; %s", sweep.position(), num, status, sweep.counts())
