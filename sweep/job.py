"""The Hydra task function: one composed config in, one recorded run out.

Hydra composes the config and picks the job directory; this module converts the config at the
boundary (sweep.config.to_run_config), works out the swept params under their dotted names, and hands
over to sweep.run.execute.execute, then records the run in the ledger (sweep.search.ledger). A bad value is a user
mistake: one line on stderr and exit status 2 (sweep/errors.py). Anything that happens during the run is a result,
never an exception.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from enum import Enum
from pathlib import Path

from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from sweep.config import ConfigError, RunConfig, check_device, check_inputs, enum_choices, to_run_config
from sweep.config.inputs import release_checked_models
from sweep.errors import exiting_on_config_error
from sweep.run.interrupt import StopOnSignal, stopping_on_signals
from sweep.run.once import per_sweep
from sweep.run.progress import current_sweep
from sweep.run.results import hold_run_dir, release_run_dir
from sweep.run.trackers import open_sinks
from sweep.run.urls import install_secret_filter, scrub
from sweep.search.ledger import is_locked, mask_url, record_run, storage_error_line, storage_url
from sweep.search.pending import RECORDING, mark_pending, unmark_pending
from sweep.search.pruning import pruning_hooks

log = logging.getLogger("sweep")


def swept_params(cfg: DictConfig, overrides: list[str], choices: dict) -> dict:
    """The job's overrides as {dotted.key: value}: a config-group choice by its option name."""
    params = {}
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        if key.startswith(("hydra", "ledger", "logger")) or override.is_delete():
            continue
        if key in choices:
            params[key] = choices[key]
        else:
            value = OmegaConf.select(cfg, key)
            value = value.value if isinstance(value, Enum) else value
            params[key] = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    return params


@dataclasses.dataclass
class JobSpec:
    """One Hydra job, converted at the boundary: what to run, where, and how it is named."""

    run: RunConfig
    run_dir: Path
    sweep_dir: Path
    params: dict
    label: str
    num: int
    multirun: bool


def job_spec(cfg: DictConfig) -> JobSpec:
    """The current Hydra job as a JobSpec; raises ConfigError for a bad value."""
    run = check_device(check_inputs(to_run_config(cfg)))
    release_checked_models()  # the run builds its own model
    hc = HydraConfig.get()
    if run.replicates > 1 and hc.mode.name != "MULTIRUN":
        raise ConfigError(f"replicates={run.replicates}: runs each combination of a sweep with that many seeds; add -m")
    if run.threads == 0:
        run = dataclasses.replace(run, threads=parallel_threads(hc))
    # unresolved: a resolved ${oc.env:...} URL with ?key=value is no override grammar, and holds its secrets
    params = swept_params(cfg, OmegaConf.to_container(hc.overrides.task, resolve=False), dict(hc.runtime.choices))
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode.name == "MULTIRUN"
    return JobSpec(
        run,
        run_dir,
        Path(hc.sweep.dir if multirun else run_dir),
        params,
        " ".join(f"{k}={v}" for k, v in params.items()),
        hc.job.num if multirun else 0,
        multirun,
    )


def job_spec_task(cfg: DictConfig) -> JobSpec:
    """job_spec as a Hydra task function: a bad value exits with one line and status 2.

    Exit here: raised, Hydra would print "Error executing job with overrides" before our line.
    """
    with exiting_on_config_error():
        return job_spec(cfg)


def run_job(cfg: DictConfig) -> dict:
    """The Hydra task function: run the composed config in Hydra's job directory; returns result.json's content.

    Ctrl-C or SIGTERM stops the run after its current step (or its set-up, or before it: a signal from the
    job's first line on); its files and trial are written, then the process exits with 128 + the signal's
    number, ending the sweep (sweep/run/interrupt.py)."""
    with stopping_on_signals() as request:
        job = job_spec_task(cfg)
        hold_run_dir(job.run_dir)  # a report tells this job (running) from a killed one (interrupted)
        try:
            # Imported at the first run: it imports torch (~2 s), and a command line that fails composition or
            # validation says so and exits without it.
            from sweep.run.execute import execute_runs

            install_secret_filter(job.run.ledger.storage, job.run.logger.mlflow.tracking_uri)  # Hydra's job logging
            # pruning_hooks: reports to the ledger's trial, only with our sweeper's pruner (sweep/search/pruning.py)
            hooks = [*pruning_hooks(job.run, job.sweep_dir), StopOnSignal(request, job.run.steps), *state_hooks(job)]
            with per_sweep(job.sweep_dir if job.multirun else None):  # a line every run would repeat: once per sweep
                (result,) = execute_runs([job.run], [job.run_dir], [job.params], [job.label], hooks, [job_sinks(job)])
            returned = finish_job(job, result)
        finally:  # finish_job released it; a job that ends by an exception writes the directory no more either
            release_run_dir(job.run_dir)
    if request.signum is not None:
        stopped(job, result, request.signum)
    return returned


def stopped(job: JobSpec, result, signum: int) -> None:
    """After a signal stopped the job's run: say so, and exit with 128 + signum (a submitit_local job returns:
    submitit then writes its result at once, where a job that exits without one keeps the sweep waiting 15 s for
    it, submitit's _results_timeout_s, before it can exit with 128 + signal itself:
    sweep.run.interrupt.launch_forwarding_signals)."""
    where = f" {job.run_dir} after step {result.interrupted_at_step}"
    if result.interrupted_at_step is None:
        where = f" {job.run_dir} during its set-up"
    log.warning(
        "%s: stopped%s; run the same command again to resume the unfinished %s",
        signal.Signals(signum).name,
        where if result.status == "interrupted" else "",
        "cells" if job.multirun else "run",
    )
    if not os.environ.get("SUBMITIT_LOCAL_JOB_ID"):
        raise SystemExit(128 + signum)


def state_hooks(job: JobSpec) -> list:
    """A multirun that confirms its answer at a longer horizon continues its runs from their final states, kept
    in this process (sweep/confirm/state.py)."""
    from sweep.confirm.state import KeepFinalState, keeps_state

    launcher = str(OmegaConf.select(HydraConfig.get(), "launcher._target_", default="")) if job.multirun else ""
    return [KeepFinalState(job.run_dir, job.run.steps)] if keeps_state(job.run, job.multirun, launcher) else []


def job_sinks(job: JobSpec) -> list:
    """The trackers of `logger` for this job, each run named by its job number and swept params."""
    name = f"{job.num}: {job.label}" if job.multirun else job.label or job.run_dir.name
    sinks = open_sinks(job.run.logger, job.run_dir, job.sweep_dir, job.params, name)
    install_secret_filter()  # a tracker's library may have made handlers of its own
    return sinks


def finish_job(job: JobSpec, result) -> dict:
    """Log the run's line and record it in the ledger; returns result.json's content. In a sweep whose sweeper
    counts its runs in this process (the grid sweeper: sweep/run/progress.py), the line starts with k/N and ends
    with the sweep's counts and ETA."""
    line = f"[{job.num}] {job.label}: {result.headline()}" if job.multirun else result.headline()
    sweep = current_sweep() if job.multirun else None
    if sweep is not None:
        sweep.finished(job.num, result.status)
        sweep.clear()
        line = f"{sweep.position()} {line}; {sweep.counts()}"
    log.info("%s", line)
    try:
        record(job.run, job.sweep_dir, job.run_dir, result.to_dict())
    finally:
        release_run_dir(job.run_dir)
    return result.to_dict()


def parallel_threads(hc) -> int:
    """Threads per run when a launcher runs several at once on this machine (joblib): cores / n_jobs.

    Two torch processes with all cores' worth of OpenMP threads each run ~18x slower on 2 cores than
    one alone (measured), so parallel jobs must split the cores. 0 = leave torch's default.
    A Slurm job (hydra/launcher=slurm) uses the cores it was given: torch would count the whole node.
    """
    n_jobs = OmegaConf.select(hc, "launcher.n_jobs", default=None)
    if not n_jobs or "joblib" not in str(OmegaConf.select(hc, "launcher._target_", default="")):
        return int(os.environ.get("SLURM_CPUS_PER_TASK") or 0)
    cores = os.cpu_count() or 1
    workers = cores if n_jobs < 0 else min(n_jobs, cores)
    return max(1, cores // workers)


_GROUP_OPTIONS: dict[str, tuple[object, list]] = {}
"""key -> (the config loader asked, its group options): Hydra builds a config repository for each question
(~10 ms), and the ledger asks 9 per run; the answer holds while the loader is the same."""


def group_or_enum_choices(key: str) -> list | None:
    """Every option a string param could take: a config group's options, or an enum's values."""
    if GlobalHydra.instance().is_initialized():
        loader = GlobalHydra.instance().config_loader()
        cached = _GROUP_OPTIONS.get(key)
        if cached is None or cached[0] is not loader:
            cached = _GROUP_OPTIONS[key] = (loader, loader.get_group_options(key))
        if cached[1]:
            return list(cached[1])
    return enum_choices(key)


def record(run: RunConfig, sweep_dir: Path, run_dir: Path, result: dict) -> None:
    """Write the run into the ledger; a ledger failure is logged, never raised (result.json is written),
    and the trial is left to be recorded later (sweep/search/pending.py). The marker that says so is left
    before the ledger is written, so a job killed while it records loses no trial either."""
    if not run.ledger.enabled:
        return
    mark_pending(run.ledger, sweep_dir, run_dir, run.monitor.spike_factor, RECORDING, quiet=True)
    try:
        record_run(run.ledger, sweep_dir, run_dir, result, group_or_enum_choices, run.monitor.spike_factor)
        unmark_pending(run_dir)
        return
    except Exception as e:  # noqa: BLE001
        url = mask_url(storage_url(run.ledger, sweep_dir))
        error = scrub(storage_error_line(e).replace(run.ledger.storage or "\0", url), run.ledger.storage or "")
        locked = is_locked(e)
    later = f"it will be recorded at the end of the sweep, or by: python -m sweep.sync_ledger {sweep_dir}"
    if not mark_pending(run.ledger, sweep_dir, run_dir, run.monitor.spike_factor, error):
        later = "and it cannot be recorded later"
    if locked:
        log.warning(
            "ledger: %s is locked by another process (waited %g s, ledger.lock_timeout_s); %s is not recorded yet: %s",
            url,
            run.ledger.lock_timeout_s,
            run_dir,
            later,
        )
    else:
        log.error("ledger: could not record %s in %s: %s; %s", run_dir, url, error, later)
