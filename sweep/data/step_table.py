"""A table with a row per step, on the run's device, a window of steps at a time.

What a step reads on the device at the step its clock holds (a (1,) step index there), so that a window of steps,
and a CUDA graph of one, runs without the host: its batch's sample indices (sweep/data/device.py) and its lr
(sweep/run/adamw.py). These were tables of every step of the run, made before step 0: a 30M-step run spent 27 s and
2.1 GB building them, and `steps=1e11` never reached step 0 (issue 45). A StepTable holds `span` steps' rows from
its first step; before the steps it is about to run, the host moves it on (`cover`), refilling the same tensor in
place (a captured graph reads the new rows), and the device reads row `clock - first`. So a run of any length costs
`span` rows up front, and a refill every `span` steps.

A stacked table (a pack's runs, sweep/run/packed.py) has a column per run: row s is every run's value at step s, a
run past its own last step repeating its last row (it has left the pack by then).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

SPAN = 4096
"""Steps a table holds at once (the host refills it every SPAN steps: a few milliseconds of Python)."""

Rows = Callable[[int, int], Tensor]
"""rows(start, stop): a run's rows of steps [start, stop) on the host, a (stop - start, ...) tensor."""


class StepTable:
    """Rows of steps [first, first + span) of one run (`rows`) or of several, stacked (`stacked`), on a device."""

    def __init__(self, rows: Sequence[Rows], steps: Sequence[int], device: torch.device, span: int, stacked: bool):
        self.parts, self.steps, self.stacked = list(rows), list(steps), stacked
        self.span = max(1, min(span, max(self.steps)))
        self.first = 0
        self.table = self._rows(0, self.span).to(device)  # (span, ...) or (span, K, ...)
        self.base = torch.zeros(1, dtype=torch.long, device=device)
        """`first` on the device: a captured step reads it."""

    @classmethod
    def of(cls, rows: Rows, steps: int, device: torch.device, span: int = SPAN) -> "StepTable":
        """One run's table."""
        return cls([rows], [steps], device, span, stacked=False)

    @classmethod
    def stack(cls, tables: Sequence["StepTable"], span: int | None = None) -> "StepTable":
        """Several runs' tables as one, a column per run (each from step 0, on the first one's device)."""
        parts = [t.parts[0] for t in tables]
        steps = [t.steps[0] for t in tables]
        return cls(parts, steps, tables[0].table.device, span or max(t.span for t in tables), stacked=True)

    def _rows(self, start: int, stop: int) -> Tensor:
        if not self.stacked:
            return self.parts[0](start, stop)
        # a run past its last step repeats its last row: it has left the pack by then
        columns = [_clamped(rows, steps, start, stop) for rows, steps in zip(self.parts, self.steps)]
        return torch.stack(columns, dim=1)

    def cover(self, start: int, stop: int) -> None:
        """Make steps [start, stop) readable on the device (clipped to the run's steps): refilled from `start` in
        place when they are not all held. A window of steps (and a graph's warm-up) is at most `span` long."""
        stop = min(stop, max(self.steps))
        if self.first <= start and stop <= self.first + self.span:
            return
        if stop - start > self.span:
            raise ValueError(f"steps {start}-{stop - 1} at once: over the table's span of {self.span} steps")
        n = min(self.span, max(self.steps) - start)
        self.table[:n].copy_(self._rows(start, start + n))
        self.first = start
        self.base.fill_(start)

    def at(self, clock: Tensor) -> Tensor:
        """The row of the step the device index `clock` (1,) holds: (1, ...) (or (1, K, ...) stacked)."""
        return self.table.index_select(0, clock - self.base)

    def keep(self, positions: Sequence[int]) -> None:
        """A stacked table's columns at these positions (a pack compacting: a new tensor)."""
        index = torch.tensor(list(positions), dtype=torch.long, device=self.table.device)
        self.table = self.table.index_select(1, index)
        self.parts = [self.parts[i] for i in positions]
        self.steps = [self.steps[i] for i in positions]


def _clamped(rows: Rows, steps: int, start: int, stop: int) -> Tensor:
    """rows(start, stop) of a run of `steps` steps, its last row repeated past them."""
    if stop <= steps:
        return rows(start, stop)
    last = rows(steps - 1, steps)
    if start >= steps:
        return last.expand(stop - start, *last.shape[1:])
    return torch.cat([rows(start, steps), last.expand(stop - steps, *last.shape[1:])])
