"""One setting's runs at the longer horizon: each seed's grid run again, from its recorded config, to `steps`.

Each run is the grid run's config (its .hydra/config.yaml, sweep.config.recorded.load_recorded) with `steps`
overridden and validated again, trained by
sweep.run.execute.execute into <sweep>/confirm/<setting>/seed_<s>/ with its record named trial.json (TRIAL_FILE:
the sweep's runs alone have a result.json), no ledger trial, no trackers, no forensics replay, and beside it the
config it is (the grid run's, resolved, at the longer `steps`: .hydra/config.yaml), so that `python -m
sweep.diagnose` and `sweep.replay` take a setting that failed there as they take a grid run. How it trains:
- continued: where the grid run's final state was kept (sweep/confirm/state.py), it is written as a checkpoint in
  the run's folder and resumed, with the grid run's metrics rows as the first rows, so only the steps the grid run
  did not train are trained, and the record (metrics.csv, losses, verdicts) is the whole run's from step 0;
- packed from step 0: on a GPU, the seeds train as one pack (sweep/run/packing.py), where a pack of K runs costs
  about one run (4-9x, docs/packing.md); on this CPU a pack costs what its runs cost alone (~1.0x), so there a
  continuation, which saves a quarter of the steps at 4x, is the better buy;
- alone from step 0: anything else (a cosine schedule, no kept state).
Seeds run in seed order and stop at the first that fails: the setting has failed, whatever the others do.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from sweep.config import Progress, RunConfig, validate
from sweep.config.recorded import load_recorded
from sweep.confirm.state import continuation_refusal, take
from sweep.run.build import resolve_device
from sweep.run.checkpoint import write
from sweep.run.execute import execute
from sweep.run.interrupt import StopOnSignal, StopRequest
from sweep.run.packing import execute_pack, refusal
from sweep.run.results import METRICS_FILE, RESULT_FILE, TRIAL_FILE, RunResult

CONTINUED, PACKED, FROM_ZERO = "continued", "packed from step 0", "from step 0"
STATE_DIR = "state"
"""A continued run's checkpoint, in its folder while it trains (removed after)."""


@dataclasses.dataclass
class SeedRun:
    """One seed of a setting to confirm: its grid run, the config to run and where."""

    seed: int
    grid_run: Path
    run: RunConfig
    grid_steps: int
    params: dict
    out_dir: Path
    config: DictConfig | None = None
    """The grid run's saved config, resolved, at the longer horizon: written as the run's .hydra/config.yaml."""

    def start(self) -> None:
        """An empty folder for the run, holding the config it is."""
        shutil.rmtree(self.out_dir, ignore_errors=True)
        if self.config is not None:
            (self.out_dir / ".hydra").mkdir(parents=True)
            OmegaConf.save(self.config, self.out_dir / ".hydra" / "config.yaml")


def seed_runs(members: list[tuple[int, Path]], out_dir: Path, steps: Callable[[RunConfig], int]) -> list[SeedRun]:
    """The runs of a setting's seeds (`members`: (seed, grid run dir)), each at `steps(grid run's config)`."""
    out = []
    for seed, grid_run in members:
        config, recorded = load_recorded(grid_run)
        horizon = steps(recorded)
        run = dataclasses.replace(
            recorded,
            steps=horizon,
            confirm=dataclasses.replace(recorded.confirm, steps=None),  # a run of its own, not a sweep's
            progress=Progress.none,
            monitor=dataclasses.replace(recorded.monitor, forensics=False),  # the verdict and step, not the replay
            ledger=dataclasses.replace(recorded.ledger, enabled=False),  # the ledger holds the sweep's runs
            checkpoint=dataclasses.replace(recorded.checkpoint, every=0, keep=0, inject=None, inject_tensor=None),
        )
        run = validate(run)  # the longer horizon too
        params = {**_grid_params(grid_run), "steps": horizon}
        OmegaConf.update(config, "steps", horizon)
        out.append(SeedRun(seed, grid_run, run, recorded.steps, params, out_dir / f"seed_{seed}", config))
    return out


def _grid_params(grid_run: Path) -> dict:
    try:
        return dict(json.loads((grid_run / RESULT_FILE).read_text()).get("params") or {})
    except (OSError, ValueError):
        return {}


def packs_pay(runs: list[SeedRun]) -> bool:
    """Whether the seeds should train as one pack from step 0: on a GPU (4-9x there), when they can pack."""
    if len(runs) < 2:
        return False
    device = resolve_device(runs[0].run.device)
    return device.type == "cuda" and all(refusal(r.run, device) is None for r in runs)


def run_seeds(runs: list[SeedRun], request: StopRequest, packed: bool, done: Callable[[SeedRun, dict], None]) -> None:
    """Train the seeds (alone in seed order, stopping at the first that does not hold; or as one pack) and hand
    each outcome to `done` as it comes."""
    if packed:
        for r in runs:
            r.start()
        start = time.perf_counter()
        results = execute_pack(
            [r.run for r in runs],
            [r.out_dir for r in runs],
            [r.params for r in runs],
            [f"confirm seed {r.seed}" for r in runs],
            record=TRIAL_FILE,
        )
        seconds = (time.perf_counter() - start) / len(runs)
        for r, result in zip(runs, results):
            done(r, outcome(r, result, PACKED, seconds))
        return
    for r in runs:
        if request.signum is not None:
            return
        o = run_alone(r, request)
        done(r, o)
        if o["status"] != "stable":
            return


def run_alone(r: SeedRun, request: StopRequest) -> dict:
    """One seed alone: continued from the grid run's kept final state where there is one, else from step 0."""
    r.start()
    kept = take(r.grid_run)
    run, history, how = r.run, [], FROM_ZERO
    if kept is not None and kept.steps == r.grid_steps < r.run.steps and continuation_refusal(r.run) is None:
        state = write(r.out_dir / STATE_DIR, kept.state)
        checkpoint = dataclasses.replace(run.checkpoint, resume_from=str(state), resume_optimizer=True, verify=True)
        run, history, how = dataclasses.replace(run, checkpoint=checkpoint), read_rows(r.grid_run), CONTINUED
    start = time.perf_counter()
    try:
        result = execute(
            run, r.out_dir, r.params, hooks=[StopOnSignal(request, run.steps)], record=TRIAL_FILE, history=history
        )
    finally:
        shutil.rmtree(r.out_dir / STATE_DIR, ignore_errors=True)
    return outcome(r, result, how, time.perf_counter() - start)


def read_rows(run_dir: Path) -> list[dict]:
    """A run's metrics.csv rows as the run logged them: ints, floats, and "" where a statistic was not taken."""
    ints = ("step", "skipped")
    with open(run_dir / METRICS_FILE, newline="") as f:
        return [
            {k: (int(v) if k in ints else float(v)) if v != "" else "" for k, v in row.items()}
            for row in csv.DictReader(f)
        ]


def outcome(r: SeedRun, result: RunResult, how: str, seconds: float) -> dict:
    """One seed's line of confirmation.json."""
    d = result.to_dict()
    status = d["status"]
    reached = {
        "stable": r.run.steps,
        "diverged": (d["first_bad_step"] + 1) if d.get("first_bad_step") is not None else None,
        "interrupted": (d["interrupted_at_step"] + 1) if d.get("interrupted_at_step") is not None else None,
    }.get(status, d.get("steps_run"))
    return {
        "seed": r.seed,
        "status": status,
        "verdict": d.get("verdict"),
        "first_bad_step": d.get("first_bad_step"),
        "eval_loss": d.get("eval_loss"),
        "final_loss": d.get("final_loss"),
        "steps_run": reached,
        "start_step": d.get("start_step") or 0,
        "how": how,
        "reason": d.get("reason"),
        "seconds": round(seconds, 3),
        "grid_run": str(r.grid_run),
        "record": str(r.out_dir / TRIAL_FILE),
    }
