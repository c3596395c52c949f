"""Windows of steps that run with no device sync, and how one is taken back.

With `monitor.sync_every` > 1 the lone loop (sweep/run/train.py) runs up to that many steps back to
back without asking the host anything: every step's row (sweep.run.step.Steps.record) stays on the
device, AdamW steps unconditionally, and the host fetches the window's rows in one sync at its end.
If every step of the window is one the host would have let through (the scaler said step and the
monitor found nothing), the window stands: its rows are judged and logged in order, exactly as they
would have been one by one. Otherwise the window is taken back (`Snapshot.restore`: weights, AdamW's
state, the RNGs, the scaler, the monitor) and its steps run again one sync per step up to the first
step the host had to decide, which then decides as it always did. Every verdict, first bad step,
cause and metrics row is therefore the same as with sync_every=1, bit for bit
(tests/test_window.py); the price of a skipped or bad step is running its window twice.

A window ends early where the host must see a step by itself: after a stall check (it compares the
weights of that step), after a step whose eval loss is due, and before a step that records attention
logits (their statistics are fetched after it); hooks that must see every step's state (checkpoints)
or a forensics probe turn windows off.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from sweep.config import RunConfig
from sweep.run.build import RunParts
from sweep.run.evaluate import Evaluator


def window_end(run: RunConfig, step: int, evaluator: Evaluator | None, size: int) -> int:
    """The first step after the window that starts at `step` (at most `size` steps, at least one)."""
    m = run.monitor
    end = min(step + size, run.steps)
    for s in range(step, end):
        if s > step and s % m.logit_every == 0:  # a logit step starts the next window (collected at its end)
            return s
        if (s + 1) % m.stall_window == 0 or (evaluator is not None and evaluator.due(s)):
            return s + 1
    return end


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

    def window(self, ran_to: int, stood: bool, at: int | None) -> None:
        """A window that ran the steps before `ran_to`: it stood, or step `at` took it back."""
        self.syncs, self.windows = self.syncs + 1, self.windows + 1
        if not stood:
            self.taken_back += 1
            self.taken_back_at[at] = ran_to

    def close(self, first_bad_step: int | None) -> "Syncs":
        """Count the steps run past the first bad one, now that the run knows it."""
        if first_bad_step in self.taken_back_at:
            self.ran_past_first_bad = max(0, self.taken_back_at[first_bad_step] - 1 - first_bad_step)
        return self

    def to_dict(self) -> dict:
        keys = ("every", "syncs", "windows", "taken_back", "ran_past_first_bad", "replayed")
        return {k: getattr(self, k) for k in keys}


class Snapshot:
    """Everything a window changes, as it was at the window's start."""

    def __init__(self, parts: RunParts, params: list[torch.Tensor]):
        self.parts, self.params = parts, params
        self.weights = [p.detach().clone() for p in params]
        self.optim = {
            p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for p, s in parts.optimizer.state.items()
        }
        self.noise = parts.noise_gen.get_state()
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(parts.device) if parts.device.type == "cuda" else None
        self.scaler = parts.scaler.state()
        numbers, tensors = parts.monitor.state_dict()
        self.monitor = (copy.deepcopy(numbers), dict(tensors), parts.monitor.updates)

    def restore(self) -> None:
        parts = self.parts
        with torch.no_grad():
            for p, w in zip(self.params, self.weights):
                p.copy_(w)
        state = parts.optimizer.state  # in place: a captured update writes the tensors it was captured with
        for p in [p for p in state if p not in self.optim]:
            del state[p]  # a window's first update creates AdamW's state: that goes
        for p, saved in self.optim.items():
            for k, v in saved.items():
                state[p][k].copy_(v)
        parts.noise_gen.set_state(self.noise)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, parts.device)
        parts.scaler.restore(self.scaler)
        numbers, tensors, updates = self.monitor
        parts.monitor.load_state_dict(numbers, tensors)
        parts.monitor.updates = updates
        parts.optimizer.zero_grad(set_to_none=True)
