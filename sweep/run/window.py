"""Windows of steps that run with no device sync, how one is taken back, and the one driver of both loops.

With `monitor.sync_every` > 1 a loop (sweep/run/train.py alone, sweep/run/packed.py packed) runs up to that
many steps back to back without asking the host anything: every step's row (sweep.run.step.Steps.record)
stays on the device, AdamW steps unconditionally, and the host fetches the window's rows in one sync at
its end (`judge_window`). If every step of the window is one the host would have let through (the scaler
said step and the monitor found nothing), the window stands: its rows are judged and logged in order,
exactly as they would have been one by one. Otherwise the window is taken back (`Snapshot.restore`:
weights, AdamW's state, the RNGs, the scaler, the monitors) and its steps run again one sync per step up to
the first step the host had to decide, which then decides as it always did. Every verdict, first bad step,
cause and metrics row is therefore the same as with sync_every=1, bit for bit (tests/test_window.py); the
price of a skipped or bad step is running its window twice. `drive` is that policy, written once: each
loop hands it a `Stepper` (its `one`, `window` and `snapshot`).

A window ends early where the host must see a step by itself: after a stall check (it compares the
weights of that step) and after a step whose eval loss is due; hooks that must see every step's state
(checkpoints) or a forensics probe turn windows off. Attention-logit steps (every monitor.logit_every) run
anywhere in a window: the loop keeps each one's statistics on the device (`Stepper.stepped`) and reads them
at the window's end.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol, Sequence

import torch

from sweep.config import RunConfig
from sweep.run.adamw import copies, copy_back
from sweep.run.evaluate import Evaluator
from sweep.run.graph import StepGraph
from sweep.run.monitor import DivergenceMonitor
from sweep.run.scaler import DeviceLossScaler
from sweep.run.step import Decision, Row, Steps


def window_end(run: RunConfig, step: int, evaluator: Evaluator | None, size: int) -> int:
    """The first step after the window that starts at `step` (at most `size` steps, at least one)."""
    m = run.monitor
    end = min(step + size, run.steps)
    for s in range(step, end):
        if (s + 1) % m.stall_window == 0 or (evaluator is not None and evaluator.due(s)):
            return s + 1
    return end


class WindowResult(NamedTuple):
    """How a window of steps ended."""

    taken_back_at: int | None = None
    """The step the host must decide by itself (an overflow skip, a verdict, a bad batch): the window is taken
    back and runs again one sync per step up to it. None: every step stood and is logged."""
    stopped_at: int | None = None
    """The step of a window that stood whose verdict or hook stopped the run; None: the run goes on."""


@dataclass
class Syncs:
    """How a run's steps met the host, result.json's `sync` (counts over the run)."""

    every: int = 1
    """monitor.sync_every as it ran (set by the loop that runs it): 1 when windows were off (sync_every=1, a
    checkpoint hook, a forensics probe)."""
    syncs: int = 0
    """The device syncs the monitor made: one per step run alone, one per window."""
    windows: int = 0
    """Windows of several steps run, taken back ones included."""
    taken_back: int = 0
    """Windows taken back because a step needed the host (an overflow skip, a verdict, a bad batch)."""
    ran_past_first_bad: int = 0
    """Steps that ran after the first bad step before the host saw it: at most every - 1, all of them taken
    back with their window, so none is in metrics.csv or the weights."""
    replayed: int = 0
    """Window steps replayed from a CUDA graph of the step (graph=true on CUDA, sweep/run/graph.py), taken-back
    windows' included: 0 where the steps ran eagerly."""
    taken_back_at: dict[int, int] = field(default_factory=dict)
    """Per taken-back window: the step that took it back -> the first step the window did not run."""

    def one(self) -> None:
        """A step run alone: its own sync."""
        self.syncs += 1

    def window(self, ran_to: int, result: WindowResult, replayed: int) -> None:
        """A window that ran the steps before `ran_to`, `replayed` of them from a CUDA graph."""
        self.syncs, self.windows, self.replayed = self.syncs + 1, self.windows + 1, self.replayed + replayed
        if result.taken_back_at is not None:
            self.taken_back += 1
            self.taken_back_at[result.taken_back_at] = ran_to

    def close(self, first_bad_step: int | None) -> "Syncs":
        """Count the steps run past the first bad one, now that the run knows it."""
        if first_bad_step in self.taken_back_at:
            self.ran_past_first_bad = max(0, self.taken_back_at[first_bad_step] - 1 - first_bad_step)
        return self

    def to_dict(self) -> dict:
        keys = ("every", "syncs", "windows", "taken_back", "ran_past_first_bad", "replayed")
        return {k: getattr(self, k) for k in keys}


class Stepper(Protocol):
    """A loop's steps, as `drive` runs them: sweep.run.train.Lone (one run) or sweep.run.packed.Pack (K runs)."""

    steps: Steps
    """The runs' scaler, monitors and after-backward sequence (sweep/run/step.py)."""
    clock: torch.Tensor
    """The device step index a window's step reads its batch and lr from, and moves on."""
    flagged: bool
    """Whether a window step's row carries the per-run bad-batch flags (batches drawn and checked on the device)."""

    def live(self, step: int) -> list[Syncs]:
        """The Syncs of the runs that train at `step` (none: the loop is done)."""

    def window_end(self, step: int) -> int:
        """The first step after the window that would start at `step` (step + 1: no window)."""

    def at(self, start: int, stop: int) -> None:
        """A window of steps [start, stop) is about to run from the device: the clock at `start`, the per-step tables
        (lr, batch indices: sweep/data/step_table.py) holding those steps and a CUDA graph's warm-up after them."""

    def snapshot(self, reuse: "Snapshot | None" = None) -> "Snapshot":
        """Everything a window changes, as it is now (in `reuse`'s buffers, a snapshot no longer needed)."""

    def one(self, step: int) -> bool:
        """Step `step` by itself, with its own sync; True stops the loop."""

    def graph_at(self, step: int) -> StepGraph | None:
        """The CUDA graph window step `step` replays (graph=true on CUDA; a lone run's logit steps have their
        own), or None: eager."""

    def eager_step(self, step: int) -> tuple | None:
        """Window step `step`, run eagerly: (row, pred, batch); None when a batch read from files is bad."""

    def stepped(self, step: int) -> None:
        """After window step `step` ran (replayed or eager): keep aside what the window's end reads of it (a lone
        run's attention statistics on a logit step)."""

    def stand(self, start: int, decisions: list, pred: torch.Tensor, batch) -> WindowResult:
        """A window whose steps all stood: each step's stall check, metrics row, hooks, in order (`pred` and
        `batch` are its last step's)."""

    def drop(self) -> None:
        """Forget what a window taken back left besides its state (the lone run's attention statistics)."""

    def zero_grad(self) -> None:
        """Drop the gradients."""


def drive(stepper: Stepper, step: int) -> None:
    """Run the loop's steps from `step`: windows where they may stand, one sync per step up to the step that
    took a window back, and a step by itself wherever the host must see it."""
    host_until = -1  # steps up to host_until run one sync each (a window taken back)
    snapshot = None  # the last window's, whose buffers the next one's takes
    while syncs := stepper.live(step):
        end = stepper.window_end(step) if step > host_until else step + 1
        if end - step == 1:
            for s in syncs:
                s.one()
            if stepper.one(step):
                return
            step += 1
            continue
        snapshot = stepper.snapshot(reuse=snapshot)
        result, ran_to, replayed = _window(stepper, step, end)
        for s in syncs:
            s.window(ran_to, result, replayed)
        if result.taken_back_at is not None:
            snapshot.restore()
            stepper.drop()
            host_until = result.taken_back_at
        elif result.stopped_at is not None:
            return
        else:
            step = end


def _window(stepper: Stepper, start: int, end: int) -> tuple[WindowResult, int, int]:
    """Steps start..end-1 with one sync: (how it ended, the first step it did not run, the steps replayed from
    the graph). AdamW steps unconditionally: a step the scaler or monitor would have stopped takes it back."""
    rows, replayed = [], 0
    stepper.at(start, end)  # the optimizer's clock, which each step moves on, and the tables it reads
    for step in range(start, end):
        if step > start:  # the last step's gradients stay for the stall check
            stepper.zero_grad()
        if (graph := stepper.graph_at(step)) is not None and graph.ready(step):
            out = graph()
            replayed += graph.graph is not None  # not when the capture failed
        else:
            out = stepper.eager_step(step)
        if out is None:  # a bad batch read from files: the host's check decides it
            return WindowResult(taken_back_at=step), step, replayed
        stepper.stepped(step)
        rows.append(out[0])
    decisions, bad = judge_window(stepper.steps, start, rows, stepper.flagged)
    if bad is not None:
        return WindowResult(taken_back_at=bad), end, replayed
    return stepper.stand(start, decisions, *out[1:]), end, replayed


def judge_window(steps: Steps, start: int, rows: list[torch.Tensor], flagged: bool):
    """The window's one sync, and the host's reading of it: (each step's decisions, in pack order; the first
    step the host must decide by itself, or None). `rows` are the steps' `Steps.record` rows, each with one
    more row of per-run bad-batch flags when `flagged` (batches drawn and checked on the device): a flagged
    batch is decided by the host's check, with the steps before it one by one, before any step is judged."""
    fetched = torch.stack(rows).tolist()  # (steps, len(Row) [+ the flags], K): the window's one sync
    bad = next((s for s, row in enumerate(fetched, start) if flagged and any(row[-1])), None)
    if bad is not None:
        return [], bad
    decisions: list[list[Decision]] = [steps.judge(s, row[: len(Row)]) for s, row in enumerate(fetched, start)]
    bad = next((s for s, ds in enumerate(decisions, start) if not all(d.stepping for d in ds)), None)
    return decisions, bad


class Snapshot:
    """Everything a window changes, as it was at the window's start: the weights, the optimizer's state (its
    `saved()`), the runs' noise generators, the global RNGs (the CUDA one too on a CUDA device), the loss
    scaler and the monitors. `restore` puts it all back in place (a captured step writes the tensors it was
    captured with), then calls `after` (the loop drops its gradients and whatever the steps left). `reuse`: a
    snapshot no longer needed (the last window's, stood or restored), whose buffers this one writes over."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        optimizer,
        generators: Sequence[torch.Generator],
        scaler: DeviceLossScaler,
        monitors: Sequence[DivergenceMonitor],
        after: Callable[[], None],
        reuse: "Snapshot | None" = None,
    ):
        self.params, self.generators, self.scaler, self.after = list(params), list(generators), scaler, after
        self.weights = copies([p.detach() for p in self.params], reuse.weights if reuse else None)
        self.optimizer = optimizer.saved(reuse.optimizer.copies if reuse else None)
        self.noise = [g.get_state() for g in self.generators]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        self.scaler_state = scaler.state()
        self.monitors = []
        for m in monitors:
            numbers, tensors = m.state_dict()
            self.monitors.append((m, copy.deepcopy(numbers), dict(tensors), m.updates))

    def restore(self) -> None:
        with torch.no_grad():
            copy_back(self.params, self.weights)
        self.optimizer()
        for g, state in zip(self.generators, self.noise):
            g.set_state(state)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)
        self.scaler.restore(self.scaler_state)
        for m, numbers, tensors, updates in self.monitors:
            m.load_state_dict(numbers, tensors)
            m.updates = updates
        self.after()
