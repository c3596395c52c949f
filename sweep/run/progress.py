"""Progress of one run and of a sweep: a bar on a terminal, lines in CI and pipes.

One run (`RunProgress`): a bar of its steps on a terminal, periodic log lines on request (progress=log),
nothing in CI and redirected output.

A sweep (`SweepProgress`: "run k of N, m diverged, ETA"): the grid sweeper knows N (the grid's cells, less
those a resumed sweep finished) and opens one in its process (`open_sweep`); so does the Optuna sweeper (the
grid sampler's cells without a finished trial, or the trials left to n_trials; a frontier search knows no N).
Where its runs run in that process (Hydra's basic launcher, the packed launcher), each run's line
(sweep/job.py `finish_job`) is prefixed `k/N` and ends with the sweep's counts and ETA:

    3/24 [2] optim.lr=0.001: stable: final loss 0.9393 after 50 steps (3.1 steps/s); 1 diverged so far, ETA 1m40s

and at a terminal one bar for the sweep (k/N, counts, ETA, and the current run's step and loss) takes the
place of the run's own bar. Where runs run in other processes (joblib, submitit, Slurm), the sweeper's
process watches their job directories for result.json and says one line per finished run
(hydra_plugins/dit_sweep/grid_sweeper.py); the runs' own lines there keep their `[num]` form, without k/N,
which they cannot see. The ETA is the wall time per finished run so far times the runs left (parallel
workers and packs finish several runs per interval, which that rate already counts), less the time the
run in progress has had.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections import Counter
from typing import Iterator

from tqdm import tqdm

from sweep.config import Progress

log = logging.getLogger("sweep")


def as_mode(value) -> Progress:
    """A sweep config's `progress` value (a Progress, or its word) as a Progress; none (no bar) for another app's
    config, whose `progress` means something else or is not there."""
    try:
        return Progress(getattr(value, "value", value))
    except ValueError:
        return Progress.none


def resolve_mode(mode: Progress) -> Progress:
    """auto: a bar only for a person at a terminal; CI and redirected output get no per-step output."""
    if mode is not Progress.auto:
        return mode
    if os.environ.get("CI") or not sys.stderr.isatty():
        return Progress.none
    return Progress.bar


def duration(seconds: float) -> str:
    """45s, 1m40s, 2h03m."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class SweepProgress:
    """The runs of a sweep finished so far, by status, and the time left; at a terminal, its bar."""

    def __init__(self, total: int, mode: Progress) -> None:
        self.total = total
        self.start = time.monotonic()
        self.done: dict[int, str] = {}  # job number -> status, in the order they finished
        self.last = self.start  # when the latest run finished
        self.lock = threading.Lock()  # the job directory watcher reports from a thread
        self.bar = (
            tqdm(
                total=total,
                unit="run",
                leave=False,
                file=sys.stderr,
                bar_format="sweep {n_fmt}/{total_fmt} |{bar:20}| {desc}",
            )
            if resolve_mode(mode) is Progress.bar
            else None
        )
        self._drawn = 0.0
        self.clear()  # drawn at the first step: lines logged before it (Hydra's) must not be glued to it

    def finished(self, num: int, status: str) -> bool:
        """Count job `num` as finished with `status` (once: False when it was counted already)."""
        with self.lock:
            if num in self.done:
                return False
            self.done[num] = status
            self.last = time.monotonic()
            if self.bar is not None:
                self.bar.n = len(self.done)
                self.bar.set_description_str(self.counts(), refresh=False)
            return True

    def position(self) -> str:
        """'3/24': runs finished and runs in the sweep."""
        return f"{len(self.done)}/{max(self.total, len(self.done))}"

    def counts(self) -> str:
        """'1 diverged, 2 skipped so far, ETA 1m40s', or '3 diverged; done in 8m12s' after the last run."""
        by = Counter(self.done.values())
        said = (
            ", ".join(f"{by[s]} {s}" for s in ("diverged", "error", "skipped", "interrupted") if by[s]) or "0 diverged"
        )
        now, left = time.monotonic(), self.total - len(self.done)
        if left <= 0:
            return f"{said}; done in {duration(now - self.start)}"
        if not self.done:
            return f"{said} so far, ETA -"
        per_run = (self.last - self.start) / len(self.done)  # the rate so far, less the run in progress
        return f"{said} so far, ETA {duration(max(0.0, per_run * left - (now - self.last)))}"

    def step(self, text: str) -> None:
        """The current run's step, shown on the sweep's bar (redrawn at most 10 times a second)."""
        if self.bar is None:
            return
        self.bar.set_description_str(f"{self.counts()} | {text}", refresh=False)
        now = time.monotonic()
        if now - self._drawn > 0.1:
            self.bar.refresh()
            self._drawn = now

    def clear(self) -> None:
        """Take the bar off the terminal before a line is logged; the next step draws it again (a line logged
        while it shows would be glued to it)."""
        if self.bar is not None:
            self.bar.clear()
            self._drawn = 0.0

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


_sweep: SweepProgress | None = None


def open_sweep(total: int, mode: Progress) -> SweepProgress:
    """The sweep's progress, for its runs in this process to report to (closed by close_sweep)."""
    global _sweep
    close_sweep()
    _sweep = SweepProgress(total, mode)
    return _sweep


def current_sweep() -> SweepProgress | None:
    """The sweep this process runs, when its sweeper opened one (the grid sweeper does)."""
    return _sweep


def close_sweep() -> None:
    global _sweep
    if _sweep is not None:
        _sweep.close()
    _sweep = None


@contextlib.contextmanager
def closing_sweep() -> Iterator[None]:
    """close_sweep when the block ends, however it ends (the Optuna sweeper's loop)."""
    try:
        yield
    finally:
        close_sweep()


class RunProgress:
    """Reports the steps of one run (on the sweep's bar, when a sweep in this process has one)."""

    def __init__(self, total: int, mode: Progress, log_every: int, label: str = ""):
        self.mode = resolve_mode(mode)
        self.log_every = log_every
        self.total = total
        self.label = label
        sweep = current_sweep() if self.mode is Progress.bar else None
        self.sweep = sweep if sweep is not None and sweep.bar is not None else None
        self._bar = (
            tqdm(total=total, desc=label or "train", leave=False, dynamic_ncols=True, file=sys.stderr)
            if self.mode is Progress.bar and self.sweep is None
            else None
        )

    def update(self, step: int, loss: float, scale: float | None = None) -> None:
        if self.sweep is not None:
            self.sweep.step(f"step {step + 1}/{self.total} loss {loss:.4g}" + (f" scale {scale:g}" if scale else ""))
        elif self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4g}", **({"scale": f"{scale:g}"} if scale else {}), refresh=False)
        elif self.mode is Progress.log and (step + 1) % self.log_every == 0:
            log.info(
                "%sstep %d/%d loss %.4g%s",
                f"{self.label} " if self.label else "",
                step + 1,
                self.total,
                loss,
                f" scale {scale:g}" if scale else "",
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self.sweep is not None:
            self.sweep.clear()
