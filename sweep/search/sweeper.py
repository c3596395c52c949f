"""A divergence-aware Optuna sweeper for Hydra, on modern Optuna's ask/tell.

    python -m sweep -m hydra/sweeper=optuna_sweep hydra.sweeper.n_trials=20 \\
        'optim.lr=tag(log,interval(1e-5,1e-1))' precision=bf16_amp,fp16_amp hydra.sweep.dir=outputs/sweeps/lr

Why not hydra-optuna-sweeper 1.3: it pins optuna<3 (which fails on SQLAlchemy 2), aborts the sweep
when a job returns NaN, re-runs every trial on resume and leaves a killed trial RUNNING forever.

How it works: the sweeper asks Optuna for a batch of `n_jobs` trials, launches them through whatever
Hydra launcher is configured, each job with `ledger.trial_number=N`, and each job finishes its own
trial in the shared storage (sweep/search/ledger.py): a diverged run is a COMPLETE trial with a penalty value
and an infeasible constraint, so the sampler learns where runs diverge and nothing crashes. The
sweeper uses the same study as the jobs: the primary config's `ledger.storage`/`ledger.study_name`
(default: sqlite:///<sweep dir>/ledger.db), so it never passes a storage URL on a job's command line.

Pruning: `hydra.sweeper.pruner.name=median` (or percentile, threshold, successive_halving, hyperband)
reaches every job as `ledger.pruner.*` overrides; the job reports its loss to its trial every
`pruner.report_every` steps through the storage and stops when pruned (sweep/search/pruning.py).

Resume: run the same command again with the same `hydra.sweep.dir` (or the same ledger storage and
study name). Trials left RUNNING by a killed sweep are failed once their heartbeat is older than
`stale_after_s` (the sweeper beats for every trial it launched, every `heartbeat_s`), and only what is missing runs:
up to `n_trials` finished trials, or for `sampler.name=grid` exactly the cells with no finished trial.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import functools
import hashlib
import logging
import math
import threading
import time
import warnings
from pathlib import Path
from typing import Any, List, Optional

import optuna
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf
from optuna.trial import TrialState

from sweep.callbacks import record_pending_trials
from sweep.config import (
    ConfigError,
    LedgerConfig,
    PrunerConfig,
    check_device_name,
    check_storage,
    launches_here,
    validate_pruner,
)
from sweep.run.interrupt import launch_forwarding_signals, stopping_on_signals
from sweep.run.progress import as_mode, closing_sweep, open_sweep
from sweep.run.urls import scrub
from sweep.search import space as search_space
from sweep.search.composed import ComposedOnce
from sweep.search.conf import PrunerName, SamplerConf, SamplerName, SweepMode
from sweep.search.frontier import BRACKET_COLUMNS, Bracket, grid_runs, marginal_edges
from sweep.search.ledger import (
    CONSTRAINTS_KEY,
    STALE_ATTR,
    mask_url,
    open_storage,
    storage_error_line,
    storage_url,
    study_name,
    with_retries,
)
from sweep.search.pruning import make_pruner, pruner_overrides
from sweep.search.replicates import replicate_overrides

log = logging.getLogger("sweep")
# We beat for our trials ourselves (Heartbeat below) rather than through Study.optimize.
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


READS_CONSTRAINTS = int(optuna.__version__.split(".")[0]) >= 5
"""Optuna 5's TPE reads every trial's constraints from its system attrs, where the ledger writes them
(CONSTRAINTS_KEY), and deprecates `constraints_func` with a FutureWarning on every sweep's terminal; Optuna 4's
reads them only through `constraints_func`."""


def make_sampler(conf: SamplerConf, space: dict) -> optuna.samplers.BaseSampler:
    """The Optuna sampler; constrained samplers learn the infeasible (diverged) region."""
    name = SamplerName(conf.name)
    if name is SamplerName.tpe:
        constrained = {} if READS_CONSTRAINTS else {"constraints_func": _recorded_constraints}
        return optuna.samplers.TPESampler(seed=conf.seed, n_startup_trials=conf.n_startup_trials, **constrained)
    if name in (SamplerName.random, SamplerName.grid):  # grid cells are enqueued explicitly, see _grid_batch
        return optuna.samplers.RandomSampler(seed=conf.seed)
    if name is SamplerName.cmaes:
        return optuna.samplers.CmaEsSampler(seed=conf.seed)
    if name is SamplerName.qmc:
        return optuna.samplers.QMCSampler(seed=conf.seed)
    raise AssertionError(name)  # the schema admits only the names above


def _recorded_constraints(trial: optuna.trial.FrozenTrial):
    """What the ledger wrote for the trial (infeasible: > 0), for Optuna 4's TPE."""
    return trial.system_attrs.get(CONSTRAINTS_KEY, (0.0,))


class Heartbeat:
    """Records heartbeats for RUNNING trials from a daemon thread, so a killed process's trials go stale."""

    def __init__(self, study: optuna.Study, interval_s: float):
        self.study, self.interval_s = study, interval_s
        self.trial_ids: set[int] = set()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def beat(self) -> None:
        storage = rdb_storage(self.study)
        if storage is None:
            return
        for trial_id in list(self.trial_ids):
            with_retries(lambda: storage.record_heartbeat(trial_id), "record_heartbeat")  # noqa: B023  (called now)

    def __enter__(self) -> "Heartbeat":
        def loop():
            while not self._stop.wait(self.interval_s):
                self.beat()

        self._thread = threading.Thread(target=loop, name="ledger-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()


def fail_stale_trials(study: optuna.Study, stale_after_s: int) -> list[int]:
    """Fail RUNNING trials nobody beats for anymore (a killed sweep's); returns their numbers.

    RDB storages use Optuna's heartbeat table, so trials of other live sweepers on the same study are
    left alone. The journal storage has no heartbeats: there, every RUNNING trial older than
    `stale_after_s` counts as stale, which is right only with one sweeper per study.
    """
    storage = study._storage
    if rdb_storage(study) is not None:
        stale_ids = rdb_storage(study)._get_stale_trial_ids(study._study_id)
    else:
        now = datetime.datetime.now()
        stale_ids = [
            t._trial_id
            for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if t.datetime_start is None or (now - t.datetime_start).total_seconds() > stale_after_s
        ]
    failed = []
    for trial_id in stale_ids:
        storage.set_trial_system_attr(trial_id, STALE_ATTR, True)
        if storage.set_trial_state_values(trial_id, TrialState.FAIL):
            failed.append(storage.get_trial_number_from_id(trial_id))
    return failed


def rdb_storage(study: optuna.Study) -> Optional[optuna.storages.RDBStorage]:
    """The study's RDBStorage (optuna.create_study wraps it in a cache), or None for other storages."""
    storage = getattr(study._storage, "_backend", study._storage)
    return storage if isinstance(storage, optuna.storages.RDBStorage) else None


@contextlib.contextmanager
def claim_lock(study: optuna.Study):
    """Held while a sweeper reads which trials are missing and claims them (enqueue + ask).

    Several sweepers may work on one study at once (one per node, or a rerun next to a live one);
    without this lock two of them can see the same grid cell missing and both run it. PostgreSQL:
    a session advisory lock, MySQL: GET_LOCK, both released by the server if the process dies;
    SQLite and the journal file: an exclusive flock on a file beside the database (those storages
    live on one machine anyway). An in-memory storage needs no lock.
    """
    key = f"dit-sweep claim {study.study_name}".encode()
    rdb = rdb_storage(study)
    if rdb is not None and rdb.engine.dialect.name in ("postgresql", "mysql"):
        from sqlalchemy import text

        pg = rdb.engine.dialect.name == "postgresql"
        lock_id = (
            int.from_bytes(hashlib.sha1(key).digest()[:8], "big", signed=True) if pg else hashlib.sha1(key).hexdigest()
        )
        take, free = (
            ("SELECT pg_advisory_lock(:k)", "SELECT pg_advisory_unlock(:k)")
            if pg
            else ("SELECT GET_LOCK(:k, -1)", "SELECT RELEASE_LOCK(:k)")
        )
        with rdb.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(take), {"k": lock_id})
            try:
                yield
            finally:
                conn.execute(text(free), {"k": lock_id})
        return
    if rdb is not None and rdb.engine.dialect.name == "sqlite":
        path = rdb.engine.url.database
    else:
        path = getattr(getattr(study._storage, "_backend", None), "_file_path", None)  # JournalFileBackend
    if not path or path == ":memory:":
        yield
        return
    with open(f"{path}.claim", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
        yield


class OptunaSweeperImpl(Sweeper):
    """Ask/tell over Hydra's launcher; jobs tell their own trial through the shared storage.

    Built by the plugin (hydra_plugins/dit_sweep/optuna_sweep.py) from `hydra.sweeper`'s settings
    (sweep.search.conf.OptunaSweepConf); a bad setting is a ConfigError, one line like any other.
    """

    def __init__(
        self,
        sampler: Any,
        n_trials: int,
        n_jobs: int,
        heartbeat_s: int,
        stale_after_s: int,
        mode: str = "search",
        frontier_param: str = "optim.lr",
        frontier_factor: float = 2.0,
        params: Optional[dict] = None,
        pruner: Any = None,
    ):
        if mode not in tuple(SweepMode):
            raise ConfigError(f"hydra.sweeper.mode: must be search or frontier, got {mode!r}")
        if not (math.isfinite(frontier_factor) and frontier_factor > 1):  # nan passed `<= 1`
            raise ConfigError(f"hydra.sweeper.frontier_factor: must be a finite number > 1, got {frontier_factor}")
        mode = SweepMode(mode)
        self.mode, self.frontier_param, self.frontier_factor = mode, frontier_param, frontier_factor
        sampler = OmegaConf.to_container(sampler) if OmegaConf.is_config(sampler) else sampler
        self.sampler_conf = sampler if isinstance(sampler, SamplerConf) else SamplerConf(**(sampler or {}))
        if self.sampler_conf.name not in tuple(SamplerName):
            raise ConfigError(
                f"hydra.sweeper.sampler.name: unknown sampler {self.sampler_conf.name!r}; "
                f"choose {', '.join(s.value for s in SamplerName)}"
            )
        self.n_trials, self.n_jobs = n_trials, n_jobs
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.params = dict(params or {})
        pruner = OmegaConf.to_container(pruner) if OmegaConf.is_config(pruner) else pruner
        self.pruner_conf = validate_pruner(
            pruner if isinstance(pruner, PrunerConfig) else PrunerConfig(**(pruner or {})), "hydra.sweeper.pruner"
        )
        if (
            mode is SweepMode.frontier and self.pruner_conf.name is not PrunerName.none
        ):  # a pruned probe decides no bracket
            raise ConfigError("hydra.sweeper.pruner: frontier mode needs every run to finish; prune in search mode")

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        hydra_context = HydraContext(  # the launcher runs the config validate_batch_is_legal composed for a trial
            config_loader=ComposedOnce(hydra_context.config_loader), callbacks=hydra_context.callbacks
        )
        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def _check_trial_dirs(self, fixed: list) -> None:
        """Job directories are numbered by trial (hydra.sweep.subdir, default ${hydra.job.num}); a sampler may give two
        trials the same values (the grid's replicates, a categorical, a resumed study), so the subdir must tell any two
        trials apart: two of the same values, composed as their jobs are (`ledger.trial_number` included, which
        ${hydra.job.override_dirname} holds), must get two directories inside the sweep dir. Else one trial would
        overwrite another's result.json: a ConfigError before any run."""
        from sweep.config.inputs import check_job_dir, written_subdir  # the grid's checks of a job dir

        loader = self.hydra_context.config_loader
        ours = "ledger" in self.config
        first, second = (
            check_job_dir(loader.load_sweep_config(self.config, [*fixed, *([f"ledger.trial_number={n}"] * ours)]), n)
            for n in (0, 1)
        )
        if first == second:
            raise ConfigError(
                f"hydra.sweep.subdir: the optuna sweeper numbers its job directories by trial, but "
                f"{written_subdir(self.config)!r} gives two trials of the same values the one directory {first}, so "
                "one would overwrite the other's result.json; put the trial number in it, e.g. "
                "${hydra.job.num}_lr${optim.lr}"
            )

    def validate_batch_is_legal(self, batch) -> None:
        """Hydra's check that every job composes, and that none spells out a secret (a cell's own experiment)
        before Hydra writes it into the job's .hydra/config.yaml."""
        from sweep.config.secrets import check_no_literal_secrets

        for overrides in batch:
            cfg = self.hydra_context.config_loader.compose_and_keep(self.config, list(overrides))
            try:
                check_no_literal_secrets(cfg)
            except ConfigError as e:
                raise ConfigError(f"{e} (in the sweep cell {' '.join(overrides)})") from None

    def _study(self) -> optuna.Study:
        node = self.config.get("ledger")  # absent when the app is not ours (Hydra's own test apps)
        ledger = LedgerConfig(**OmegaConf.to_container(node, resolve=True)) if node is not None else LedgerConfig()
        check_storage(
            ledger.storage
        )  # a malformed URL is the grid sweeper's one line too (before: a 40-line traceback)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        url = storage_url(ledger, sweep_dir)
        try:
            storage = open_storage(url, heartbeat_s=self.heartbeat_s, stale_after_s=self.stale_after_s)
            name = study_name(ledger, sweep_dir, storage)  # the jobs' (sweep.search.ledger.record_run)
            log.info("optuna sweeper: study %r in %s", name, mask_url(url))
            return with_retries(
                lambda: optuna.create_study(
                    storage=storage, study_name=name, direction="minimize", load_if_exists=True
                ),
                "create_study",
            )
        except Exception as e:  # noqa: BLE001  (a server down, a driver missing, a file it cannot open)
            # The grid sweeper's runs record their trials later (pending); this sweeper asks its trials from the
            # storage, so it cannot start without it. Before: 160 lines of SQLAlchemy traceback.
            raise ConfigError(
                f"ledger.storage: the optuna sweeper cannot open {mask_url(url)} "
                f"({scrub(storage_error_line(e), url)}), "
                "and it asks for its trials there; start the server (or install its driver), or leave "
                "ledger.storage unset for the sweep directory's SQLite ledger"
            ) from None

    def sweep(self, arguments: List[str]) -> Any:
        if OmegaConf.select(self.config, "ledger.enabled", default=True) is False:
            # The jobs record their trials' verdicts in the study; without, each trial ended FAIL (a warning each),
            # a search chose blind and a frontier reported "undecided: a run at lr=1 was error" for a diverged run.
            raise ConfigError(
                "ledger.enabled=false: the optuna sweeper's study is the ledger (each run records its verdict there, "
                "and the sweeper reads it to choose the next run); leave the ledger on, or use the grid sweeper"
            )
        args = [f"{k}={v}" for k, v in self.params.items()] + list(arguments)
        replicates = OmegaConf.select(self.config, "replicates", default=1) or 1
        extra = replicate_overrides(args, replicates, OmegaConf.select(self.config, "seed", default=0))
        if extra and (self.mode is SweepMode.frontier or self.sampler_conf.name != SamplerName.grid):
            raise ConfigError(
                f"replicates={replicates}: the optuna sweeper runs replicates with hydra.sweeper.sampler.name=grid "
                "only (a search or frontier samples one seed per trial); use the grid sweeper, or the grid sampler"
            )
        params = [f"{k}={v}" for k, v in self.params.items()]
        problem = search_space.repeated_value(args) or search_space.shadowed_axis(params, list(arguments))
        if problem:
            raise ConfigError(problem)
        space, fixed = search_space.parse(args + extra)
        if "device" not in space and launches_here(self.config):  # a swept device: each job checks its own
            check_device_name(str(OmegaConf.select(self.config, "device", default="auto")))
        if not space:
            raise ConfigError(
                "the optuna sweeper needs at least one swept axis (e.g. 'optim.lr=tag(log,interval(1e-5,1e-1))')"
            )
        self._check_trial_dirs(fixed)
        Path(self.config.hydra.sweep.dir).mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, Path(self.config.hydra.sweep.dir) / "multirun.yaml")
        study = self._study()
        study.sampler = make_sampler(self.sampler_conf, space)
        # The jobs prune; here the pruner only shapes asking (Hyperband gives each bracket its own sampler view).
        study.pruner = make_pruner(self.pruner_conf) or optuna.pruners.NopPruner()
        with claim_lock(study):  # two sweepers starting at once must not both fail the same trial
            stale = fail_stale_trials(study, self.stale_after_s)
        if stale:
            log.info("optuna sweeper: failed stale RUNNING trials %s (left by a killed sweep)", stale)
        grid = search_space.grid_cells(space) if self.sampler_conf.name == SamplerName.grid else None
        self._attempted: set = set()
        if self.mode is SweepMode.frontier:
            self._check_frontier_space(space)
        returns = []
        self._open_progress(study, grid)
        with Heartbeat(study, self.heartbeat_s) as heartbeat, closing_sweep():
            while True:
                # A signal while asking is held until the batch is asked: its trials are then failed, not left
                # RUNNING until they go stale (the jobs install their own handlers; sweep/run/interrupt.py).
                with (
                    stopping_on_signals(when="once the next trials are asked") as request,
                    claim_lock(study),
                ):  # concurrent sweepers never claim one trial
                    batch = (
                        self._frontier_batch(study, space)
                        if self.mode is SweepMode.frontier
                        else self._next_batch(study, space, grid)
                    )
                if request.signum is not None:
                    self._fail_unfinished(study, batch)
                    log.warning(
                        "%s: stopped while asking for the next trials (%s failed, no run started); run the same "
                        "command again to resume the unfinished cells",
                        request.name,
                        ", ".join(str(t.number) for t in batch) or "none",
                    )
                    raise SystemExit(128 + request.signum)
                if not batch:
                    if self._wait_for_running(study):
                        continue  # a dead sweep's trials failed as stale: their cells are missing again
                    break
                heartbeat.trial_ids = {t._trial_id for t in batch}
                heartbeat.beat()
                ours = "ledger" in self.config  # jobs of our app finish their own trial in the ledger
                overrides = [
                    fixed
                    + [search_space.as_override(k, v) for k, v in t.params.items()]
                    + ([f"ledger.trial_number={t.number}", *pruner_overrides(self.pruner_conf)] if ours else [])
                    for t in batch
                ]
                # Job dirs are named by trial number: unique even with other sweepers on this study.
                try:
                    self.validate_batch_is_legal(overrides)  # a cell that does not compose, or spells out a secret
                    # after a signal, first: the trials of job processes killed while they recorded (pending.py)
                    results = launch_forwarding_signals(
                        self.launcher, overrides, batch[0].number, functools.partial(record_pending_trials, self.config)
                    )
                except BaseException:  # a refused cell, Ctrl-C/SIGTERM (sweep/run/interrupt.py), a crash: none RUNNING
                    self._fail_unfinished(study, batch)
                    raise
                for trial, ret in zip(batch, results):
                    self._settle(study, trial, ret)
                returns.append(results)
        log.info("optuna sweeper: %d finished trials in the study", len(self._finished(study)))
        if self.mode is SweepMode.frontier:
            self._report_frontier(study, space)
        return returns

    def _open_progress(self, study: optuna.Study, grid: Optional[list]) -> None:
        """The sweep's "k/N, m diverged, ETA" on each run's line (sweep/run/progress.py), as the grid sweeper's: N is
        the grid's cells without a finished trial, or the trials left to n_trials. A frontier search knows no N."""
        if self.mode is SweepMode.frontier:
            return
        finished = [t for t in self._finished(study) if t.state is not TrialState.FAIL]
        if grid is not None:
            done = {tuple(sorted(t.params.items())) for t in finished}
            total = sum(tuple(sorted(c.items())) not in done for c in grid)
        else:
            total = self.n_trials - len(self._finished(study))
        if total > 0:
            open_sweep(total, as_mode(OmegaConf.select(self.config, "progress", default="auto")))

    # -- frontier mode ---------------------------------------------------------------------------

    def _check_frontier_space(self, space: dict) -> None:
        dist = space.get(self.frontier_param)
        if not isinstance(dist, optuna.distributions.FloatDistribution) or dist.low <= 0:
            raise ConfigError(
                f"hydra.sweeper.frontier_param: frontier mode needs {self.frontier_param}="
                "tag(log,interval(low,high)) with low > 0"
            )

    def _brackets(self, study: optuna.Study, space: dict) -> dict[tuple, Bracket]:
        """Each combination's bracket, rebuilt from the finished trials in the ledger."""
        dist = space[self.frontier_param]
        axes = sorted(k for k in space if k != self.frontier_param)
        cells = search_space.grid_cells({k: space[k] for k in axes}) if axes else [{}]
        brackets = {tuple(sorted(c.items())): Bracket(dist.low, dist.high) for c in cells}
        for t in self._finished(study):
            key = tuple(sorted((k, t.params.get(k)) for k in axes))
            lr = t.params.get(self.frontier_param)
            if key in brackets and lr is not None:  # a FAIL without status crashed outside its run: error
                brackets[key].observe(lr, t.user_attrs.get("status", "error"))
        return brackets

    def _frontier_batch(self, study: optuna.Study, space: dict) -> list:
        running = {
            tuple(sorted((k, v) for k, v in t.params.items() if k != self.frontier_param))
            for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        }
        batch = []
        for key, bracket in self._brackets(study, space).items():
            lr = bracket.next_lr(self.frontier_factor)
            if lr is None or key in running or len(batch) >= self.n_jobs:
                continue
            study.enqueue_trial({**dict(key), self.frontier_param: lr}, skip_if_exists=False)
            batch.append(study.ask(space))
        return batch

    def _report_frontier(self, study: optuna.Study, space: dict) -> None:
        """frontier.csv in the sweep dir, and a table with the runs it took against a grid's."""
        import pandas as pd

        dist = space[self.frontier_param]
        rows = []
        for key, b in self._brackets(study, space).items():
            rows.append(
                {
                    **dict(key),
                    "max_stable": b.stable,
                    "min_diverged": b.diverged,
                    "runs": b.runs,
                    "verdict": b.verdict(),
                }
            )
        table = pd.DataFrame(rows)
        table["marginal"] = marginal_edges(Path(self.config.hydra.sweep.dir), table, self.frontier_param)
        table.to_csv(Path(self.config.hydra.sweep.dir) / "frontier.csv", index=False)
        per_grid = grid_runs(dist.low, dist.high, self.frontier_factor)
        print(
            f"\nFrontier of {self.frontier_param} within {self.frontier_factor:g}x over "
            f"[{dist.low:g}, {dist.high:g}]: {int(table.runs.sum())} runs; a grid at the same resolution "
            f"needs {per_grid * len(table)} ({per_grid} per combination)\n"
            + table.drop(columns="marginal").to_string(index=False, float_format=lambda x: f"{x:.3g}", na_rep="-")
            + "".join(
                f"\n{' '.join(f'{k}={v}' for k, v in row.iloc[: -len(BRACKET_COLUMNS)].items())}: max stable "
                f"{row.max_stable:.3g} "
                "is marginal (stable, but far worse than its best lr): the summary's frontier stops below it"
                for _, row in table[table.marginal].iterrows()
            ),
            flush=True,
        )

    def _finished(self, study: optuna.Study, trials: Optional[list] = None) -> list:
        """Trials that count as done: not failed as stale, not stopped by Ctrl-C/SIGTERM (a resume runs them again)."""
        return [
            t
            for t in (study.get_trials(deepcopy=False) if trials is None else trials)
            if t.state.is_finished()
            and not t.system_attrs.get(STALE_ATTR)
            and t.user_attrs.get("status") != "interrupted"
        ]

    def _wait_for_running(self, study: optuna.Study) -> bool:
        """Nothing left to ask, but trials of the study are RUNNING: another live sweeper's, or a killed one's
        too young to be stale yet (the same command run at once after kill -9). Wait while any is RUNNING,
        at most until a dead one would be stale (`stale_after_s` and a beat), failing the stale ones; True
        when some were failed (the caller asks again), False when none is RUNNING or the rest are alive."""

        def running() -> int:
            return len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))

        if not running():
            return False
        log.info(
            "optuna sweeper: %d trials still RUNNING (another sweeper's, or a killed sweep's): waiting up to "
            "%d s for them to finish or go stale",
            running(),
            self.stale_after_s + self.heartbeat_s,
        )
        deadline = time.monotonic() + self.stale_after_s + 2 * self.heartbeat_s
        while time.monotonic() < deadline and running():
            time.sleep(self.heartbeat_s)
            with claim_lock(study):
                stale = fail_stale_trials(study, self.stale_after_s)
            if stale:
                log.info("optuna sweeper: failed stale RUNNING trials %s (left by a killed sweep)", stale)
                return True
        return False

    def _fail_unfinished(self, study: optuna.Study, batch: list) -> None:
        """The sweep stops inside a batch: fail its trials no job finished, marked stale (they do not count as
        done, so a resume runs them), rather than leave them RUNNING until their heartbeat goes stale."""
        for trial in batch:
            try:
                if study._storage.get_trial(trial._trial_id).state is TrialState.RUNNING:
                    study._storage.set_trial_system_attr(trial._trial_id, STALE_ATTR, True)
                    study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
            except Exception as e:  # noqa: BLE001  (the ledger may be what failed; resume fails them as stale)
                log.warning("optuna sweeper: could not fail trial %d: %s", trial.number, e)

    def _next_batch(self, study: optuna.Study, space: dict, grid: Optional[list]) -> list:
        """Ask for the next trials: the missing grid cells, or enough to reach n_trials."""
        # One read of the trials: a run that finishes between two reads would look neither running nor done.
        trials = study.get_trials(deepcopy=False)
        running_trials = [t for t in trials if t.state is TrialState.RUNNING]
        if grid is not None:
            done = {
                tuple(sorted(t.params.items())) for t in self._finished(study, trials) if t.state is not TrialState.FAIL
            }
            running = {tuple(sorted(t.params.items())) for t in running_trials}
            todo = [c for c in grid if tuple(sorted(c.items())) not in done | running | self._attempted][: self.n_jobs]
            self._attempted |= {tuple(sorted(c.items())) for c in todo}  # a failing cell is not retried in a loop
            for cell in todo:
                study.enqueue_trial(cell, skip_if_exists=False)
            return [study.ask(space) for _ in todo]
        missing = self.n_trials - len(self._finished(study, trials)) - len(running_trials)
        return [study.ask(space) for _ in range(max(0, min(self.n_jobs, missing)))]

    def _settle(self, study: optuna.Study, trial: optuna.Trial, ret: Any) -> None:
        """Finish a trial its job did not record: an app without our ledger returns its value (a
        finite number is told as COMPLETE), anything else (a crash outside the run) is FAIL."""
        if study._storage.get_trial(trial._trial_id).state is not TrialState.RUNNING:
            return
        value = getattr(ret, "_return_value", None)
        if ret.status.name == "COMPLETED" and isinstance(value, (int, float)) and math.isfinite(value):
            study.tell(trial, float(value), skip_if_finished=True)
            return
        log.warning(
            "optuna sweeper: trial %d was not recorded by its job (%s); marking it FAIL",
            trial.number,
            type(value).__name__ if isinstance(value, BaseException) else ret.status.name,
        )
        study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
