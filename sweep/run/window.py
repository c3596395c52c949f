"""Windows of steps that run with no device sync, and how one is taken back: the loop's GPU path.

With `monitor.sync_every` > 1 the loop (sweep/run/train.py, one run or a pack) runs up to that
many steps back to back without asking the host anything: every step's row (sweep.run.step.Steps.record)
stays on the device, AdamW steps unconditionally, and the host fetches the window's rows in one sync at
its end (`judge_window`). If every step of the window is one the host would have let through (the scaler
said step and the monitor found nothing), the window stands: its rows are judged and logged in order,
exactly as they would have been one by one. Otherwise the window is taken back (`Snapshot.restore`:
weights, AdamW's state, the RNGs, the scaler, the monitors) and its steps run again one sync per step up to
the first step the host had to decide, which then decides as it always did. Every verdict, first bad step,
cause and metrics row is therefore the same as with sync_every=1, bit for bit (tests/test_window.py); the
price of a skipped or bad step is running its window twice. `Windows` is that policy, written once for the
one loop (sweep.run.train.Loop) in either layout: the layout's `device_step` is a window's step.

A window ends early where the host must see a step by itself: after a stall check (it compares the
weights of that step) and after a step whose eval loss is due; hooks that must see every step's state
(checkpoints) or a forensics probe turn windows off. Attention-logit steps (every monitor.logit_every) run
anywhere in a window: each one's statistics stay on the device (`Windows.parked`) until the window's end.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch

from sweep.config import MonitorConfig
from sweep.run.adamw import copies, copy_back
from sweep.run.evaluate import Evaluator
from sweep.run.graph import WARMUP, StepGraph, wanted
from sweep.run.monitor import DivergenceMonitor
from sweep.run.scaler import DeviceLossScaler
from sweep.run.step import Decision, Row, Steps


def window_end(m: MonitorConfig, steps: int, step: int, evaluator: Evaluator | None, size: int) -> int:
    """The first step after the window that starts at `step` (at most `size` steps, at least one) of a run of
    `steps` steps with monitor section `m` (its stall checks end windows)."""
    end = min(step + size, steps)
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


class Windows:
    """A loop's windows (sweep.run.train.Loop, whose `windows` this is when monitor.sync_every > 1): where the
    next one ends, running it with one sync, standing it or taking it back, and the CUDA graphs its steps replay
    (graph=true on CUDA, sweep/run/graph.py). Steps up to `host_until` run one sync each (a window taken back)."""

    def __init__(self, loop):
        self.loop, self.layout = loop, loop.layout
        self.host_until = -1
        self.snapshot: Snapshot | None = None  # the last window's, whose buffers the next one's takes
        self.parked: dict[int, tuple] = {}  # a window's logit steps' statistics, on the device until its end
        self.graph = self.logit_graph = None
        if wanted(loop.runs[0].graph, self.layout.device):  # graph is in pack_key: the same for every run
            steps = max(r.steps for r in loop.runs)
            snapshot = lambda: Snapshot.of(self.layout)  # noqa: E731
            self.graph = StepGraph(self.layout, steps, snapshot)
            if self.layout.logit_stats is not None:  # a logit step is its own capture (its statistics are outputs)
                self.logit_graph = StepGraph(self.layout, steps, snapshot, self.layout.logit_stats)

    def end(self, step: int) -> int:
        """The first step after the window that would start at `step` (step + 1: the step runs by itself)."""
        if step <= self.host_until:
            return step + 1
        loop = self.loop
        size = min(loop.runs[k].monitor.sync_every for k in loop.training)
        runs = loop.runs
        return min(window_end(runs[k].monitor, runs[k].steps, step, loop.evaluators[k], size) for k in loop.training)

    def run(self, start: int, end: int) -> int:
        """Steps start..end-1 with one sync; the step the loop goes on from (`start` again when taken back)."""
        self.snapshot = Snapshot.of(self.layout, reuse=self.snapshot)
        result, ran_to, replayed = self._window(start, end)
        for k in self.loop.training:
            self.loop.syncs[k].window(ran_to, result, replayed)
        if result.taken_back_at is None:
            return end
        self.snapshot.restore()
        self.parked.clear()  # the taken-back steps run again one sync each, with their statistics
        if self.layout.logit_stats is not None:
            self.layout.logit_stats.take()
        self.host_until = result.taken_back_at
        return start

    def recapture(self) -> None:
        """The tensors the graphs captured were replaced (a pack compacting): capture again when next asked."""
        if self.graph is not None:
            self.graph.reset()

    def _window(self, start: int, end: int) -> tuple[WindowResult, int, int]:
        """Steps start..end-1 with one sync: (how it ended, the first step it did not run, the steps replayed from
        a graph). AdamW steps unconditionally: a step the scaler or monitor would have stopped takes it back."""
        layout, rows, replayed = self.layout, [], 0
        layout.optimizer.at(start, end + WARMUP)  # the clock, which each step moves on; a warm-up reads past the end
        if layout.device_batches is not None:
            layout.device_batches.cover(start, end + WARMUP)
        for step in range(start, end):
            if step > start:  # the last step's gradients stay for the stall check
                layout.zero_grad()
            logits = self.loop.logit_step(step)
            if (graph := self._graph_at(logits)) is not None and graph.ready(step):
                out = graph()
                replayed += graph.graph is not None  # not when the capture failed
            elif layout.device_batches is not None:  # batches drawn and checked on the device
                out = layout.device_step(layout.packed, None, logits)
            else:  # batches read from files: a bad one is the host's check to decide
                batches, issues = layout.batches(step, layout.packed)
                if issues:
                    return WindowResult(taken_back_at=step), step, replayed
                out = layout.device_step(layout.packed, batches, logits)
            if logits:  # copies: the next replay of a logit graph rewrites its outputs
                maxes, entropies = layout.logit_stats.take()
                self.parked[step] = ([t.clone() for t in maxes], [t.clone() for t in entropies])
            rows.append(out[0])
        decisions, bad = judge_window(layout.steps, start, rows, layout.flagged)
        if bad is not None:
            return WindowResult(taken_back_at=bad), end, replayed
        return self._stand(start, decisions, *out[1:]), end, replayed

    def _graph_at(self, logits: bool) -> StepGraph | None:
        """The graph a window step replays, or None: eager. A logit step's is not tried after the step's failed."""
        if self.graph is None or not logits:
            return self.graph
        return None if self.graph.failed else self.logit_graph

    def _stand(self, start: int, decisions: list, pred: torch.Tensor, batches: dict) -> WindowResult:
        """A window whose steps all stood: each step's finish, in order (`pred` and `batches` are its last step's)."""
        loop, layout = self.loop, self.layout
        grads, last = layout.grads(), start + len(decisions) - 1
        for s, ds in enumerate(decisions, start):
            logits = ("", "")
            if s in self.parked:  # a logit step: its statistics, read now that the window has synced
                layout.logit_stats.put(self.parked.pop(s))
                logits = layout.logit_stats.collect()
            if loop.finish(s, ds, grads, pred, batches, logits, batch_step=last):
                # A run stopped (a verdict, a hook): windows end at every run's stall check, and a pack's runs have
                # no hooks, so only a lone run stops inside a window, and its loop ends here.
                return WindowResult(stopped_at=s)
        layout.zero_grad()
        return WindowResult()


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

    @classmethod
    def of(cls, layout, reuse: "Snapshot | None" = None) -> "Snapshot":
        """A loop's layout (sweep/run/lone.py, packed.py) as it is now: its trained weights, optimizer, the noise
        generators of its runs, their scaler and monitors; `restore` ends with its zero_grad."""
        steps = layout.steps
        return cls(
            layout.params, layout.optimizer, layout.generators, steps.scaler, steps.monitors, layout.zero_grad, reuse
        )

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
