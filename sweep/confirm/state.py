"""The final states of a multirun's stable runs, kept in memory so that the confirmation continues them.

A grid run of N steps followed by S - N more steps is the run of S steps from step 0 when nothing in the run
depends on S: the lr schedule (constant, or a linear warmup; a cosine schedule reaches zero at the last step, so
S changes every step's lr), the data order (a pure function of the seed and the step) and the noise (the
generator's state is part of the checkpoint), the monitor's state (its snapshot and numbers are saved). A
checkpoint resumed on the device type that wrote it continues bit-identically (sweep/run/checkpoint.py;
tests/test_confirm.py compares a continued run with one from step 0, step by step). So the confirmation trains
only the S - N steps a grid run has not trained yet, when it has that run's state.

`KeepFinalState` is the StepHook that takes a copy of the state after a run's last step (sweep/job.py adds it to
the jobs of a multirun that will confirm, when they run in this process); `take` hands it to the confirmation,
which writes it as a checkpoint and resumes from it. States are held in this process's memory, up to
`KEEP_BYTES` in all (the tiny video DiT's is 20 MB: weights, AdamW's two moments, the monitor's snapshot), and
dropped when the multirun ends (`clear`). A state that is not here (another process ran the job, the limit was
reached, a resumed sweep) costs the confirmation N more steps, never a different answer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from sweep.config import ConfirmMode, RunConfig, Schedule
from sweep.run.checkpoint import State, state_of

log = logging.getLogger("sweep")

KEEP_BYTES = 2 << 30
"""At most this many bytes of final states in memory (2 GiB: the demo's 24 stable runs hold 0.5 GiB)."""


@dataclass
class Kept:
    """A run's state after its last step: `state` resumes at `steps`, on the device type that trained it."""

    steps: int
    state: State


_KEPT: dict[str, Kept] = {}
_FULL: list[bool] = [False]  # the limit was reached once (said once)


def continuation_refusal(run: RunConfig) -> str | None:
    """Why a run of this config cannot be continued to a longer horizon as the same run (None when it can)."""
    if run.optim.schedule is Schedule.cosine:
        return "optim.schedule=cosine: the lr of every step depends on the total steps, so it reruns from step 0"
    return None


def keeps_state(run: RunConfig, multirun: bool, launcher: str) -> bool:
    """Whether a job should keep its final state: a multirun that confirms (confirm.mode=auto), a run that can be
    continued, and jobs that run in this process (Hydra's basic launcher), where the confirmation will look."""
    return (
        multirun
        and run.confirm.mode is ConfirmMode.auto
        and continuation_refusal(run) is None
        and launcher.endswith("BasicLauncher")
    )


class KeepFinalState:
    """A StepHook: after the run's last step, keep a copy of its state (weights, AdamW, RNG, scaler, monitor)."""

    window_safe = True
    """Only the last step is read, and a window never runs past it: its state is the state after that step."""

    def __init__(self, run_dir: Path, steps: int) -> None:
        self.key, self.steps = key(run_dir), steps

    def after_step(self, step: int, loss: float, parts) -> bool:
        if step + 1 == self.steps:
            if held_bytes() + _size(parts) > KEEP_BYTES:
                if not _FULL[0]:
                    log.info(
                        "confirm: %d MB of final states kept; the confirmation reruns the other runs from step 0",
                        held_bytes() >> 20,
                    )
                _FULL[0] = True
            else:
                _KEPT[self.key] = Kept(self.steps, state_of(parts, self.steps, copy=True))
        return False


def _size(parts) -> int:
    """About the bytes of a state: weights, two AdamW moments and the monitor's snapshot."""
    return 4 * sum(p.numel() * p.element_size() for p in parts.model.parameters())


def key(run_dir: Path) -> str:
    return str(Path(run_dir).resolve())


def take(run_dir: Path) -> Kept | None:
    """The kept state of the run in `run_dir` (removed from the store), or None."""
    return _KEPT.pop(key(run_dir), None)


def has(run_dir: Path) -> bool:
    """Whether the final state of the run in `run_dir` is kept."""
    return key(run_dir) in _KEPT


def held_bytes() -> int:
    return sum(k.state.nbytes for k in _KEPT.values())


def clear() -> None:
    """Drop every kept state (the multirun is over)."""
    _KEPT.clear()
    _FULL[0] = False
