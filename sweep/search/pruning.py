"""Pruning through the ledger: a run reports its loss to its Optuna trial and stops when the pruner says so.

    python -m sweep -m hydra/sweeper=optuna_sweep hydra.sweeper.n_trials=20 \\
        hydra.sweeper.pruner.name=median hydra.sweeper.pruner.report_every=5 'optim.lr=tag(log,interval(1e-5,1e-1))'

Optuna keeps studies, trials and intermediate values in the storage, but not the pruner. So our sweeper
passes its `hydra.sweeper.pruner` to every job as `ledger.pruner.*` overrides, and each job, wherever it
runs (this process, a joblib worker, a Slurm node), loads the study with that pruner and reports to the
trial it was launched for (`ledger.trial_number`). Only every `report_every` steps: one `trial.report`
and one `should_prune`, each a storage round-trip; the other steps touch no database.

Being pruned is not a verdict: the run ends `skipped` with reason "pruned by MedianPruner at step 19
(loss 0.41)" and `pruned_at_step`, and its trial is PRUNED with the intermediate values it reported.
A non-finite loss is never reported (a NaN prunes by itself in ThresholdPruner and spoils the medians):
the run is diverging and the monitor calls it, `diverged` as always.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import optuna

from sweep.config import PrunerConfig, RunConfig
from sweep.search.ledger import mask_url, open_study, storage_url, with_retries

log = logging.getLogger("sweep")


def make_pruner(cfg: PrunerConfig) -> Optional[optuna.pruners.BasePruner]:
    """The Optuna pruner a PrunerConfig names (None for name=none); Optuna's defaults where ours say null."""
    p = optuna.pruners
    optional = lambda **kw: {k: v for k, v in kw.items() if v is not None}  # noqa: E731
    if cfg.name == "none":
        return None
    if cfg.name == "median":
        return p.MedianPruner(
            n_startup_trials=cfg.n_startup_trials, n_warmup_steps=cfg.n_warmup_steps, n_min_trials=cfg.n_min_trials
        )
    if cfg.name == "percentile":
        return p.PercentilePruner(
            cfg.percentile,
            n_startup_trials=cfg.n_startup_trials,
            n_warmup_steps=cfg.n_warmup_steps,
            n_min_trials=cfg.n_min_trials,
        )
    if cfg.name == "threshold":
        return p.ThresholdPruner(lower=cfg.lower, upper=cfg.upper, n_warmup_steps=cfg.n_warmup_steps)
    if cfg.name == "successive_halving":
        return p.SuccessiveHalvingPruner(
            **optional(min_resource=cfg.min_resource, reduction_factor=cfg.reduction_factor),
            min_early_stopping_rate=cfg.min_early_stopping_rate,
        )
    if cfg.name == "hyperband":
        return p.HyperbandPruner(
            **optional(
                min_resource=cfg.min_resource, max_resource=cfg.max_resource, reduction_factor=cfg.reduction_factor
            )
        )
    raise ValueError(f"unknown pruner {cfg.name!r}")  # validate_pruner rejects it first


def pruner_overrides(cfg: PrunerConfig) -> list[str]:
    """`ledger.pruner.*` overrides that give a job the sweeper's pruner (only what differs from the defaults)."""
    if cfg.name == "none":
        return []
    default = PrunerConfig()
    return [
        f"ledger.pruner.{f.name}={'null' if v is None else getattr(v, 'value', v)}"
        for f in dataclasses.fields(cfg)
        if (v := getattr(cfg, f.name)) != getattr(default, f.name) or f.name == "name"
    ]


@dataclass
class Pruned:
    """Why and where a pruner stopped a run (result.json `reason` and `pruned_at_step`)."""

    step: int
    reason: str

    def record(self, result) -> None:
        """Stopped early by the sweeper's pruner: `skipped`, not a verdict (sweep.run.step.Stop)."""
        result.status, result.reason, result.pruned_at_step = "skipped", self.reason, self.step


class PruningHook:
    """A sweep.run.train.StepHook: report the loss every `report_every` steps; stop the run once it is pruned."""

    window_safe = True
    """It reads the step's loss only, so it may see a window's steps after the window ran (sweep/run/window.py)."""

    def __init__(self, trial: optuna.Trial, report_every: int, last_step: int):
        self.trial, self.report_every, self.last_step = trial, report_every, last_step
        self.name = type(trial.study.pruner).__name__
        self.pruned: Optional[Pruned] = None
        self._off = False

    def after_step(self, step: int, loss: float, parts: Any) -> Pruned | None:
        if self._off or (step + 1) % self.report_every or not math.isfinite(loss):
            return None
        try:
            with_retries(lambda: self.trial.report(loss, step), "report")
            # The last step finishes the run anyway: its value is the trial's, nothing left to save.
            if step >= self.last_step or not with_retries(self.trial.should_prune, "should_prune"):
                return None
        except Exception as e:  # noqa: BLE001  (storage gone: the run itself is still worth finishing)
            log.warning("pruning: cannot reach the ledger (%s: %s); this run continues unpruned", type(e).__name__, e)
            self._off = True
            return None
        self.pruned = Pruned(step, f"pruned by {self.name} at step {step} (loss {loss:.3g})")
        return self.pruned


def pruning_hooks(run: RunConfig, sweep_dir: Path) -> list[PruningHook]:
    """The pruning hook of a job our Optuna sweeper launched with a pruner; [] for every other run."""
    ledger = run.ledger
    if ledger.pruner.name == "none" or not ledger.enabled:
        return []
    if ledger.trial_number is None:
        log.warning(
            "ledger.pruner: a run prunes only as a trial of our Optuna sweeper "
            "(hydra/sweeper=optuna_sweep hydra.sweeper.pruner.name=...); not pruning"
        )
        return []
    url = storage_url(ledger, sweep_dir)
    try:
        study = open_study(ledger, sweep_dir)
        study.pruner = make_pruner(ledger.pruner)
        trial_id = with_retries(
            lambda: study._storage.get_trial_id_from_study_id_trial_number(study._study_id, ledger.trial_number),
            "get_trial_id",
        )
        trial = optuna.Trial(study, trial_id)
        if trial._cached_frozen_trial.state is not optuna.trial.TrialState.RUNNING:  # a job re-run by hand
            log.warning("pruning: trial %s is already finished; not pruning", ledger.trial_number)
            return []
    except Exception as e:  # noqa: BLE001
        log.warning(
            "pruning: cannot open trial %s in %s (%s); not pruning",
            ledger.trial_number,
            mask_url(url),
            str(e).replace(url, mask_url(url)),
        )
        return []
    return [PruningHook(trial, ledger.pruner.report_every, last_step=run.steps - 1)]
