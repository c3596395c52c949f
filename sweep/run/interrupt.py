"""Ctrl-C (SIGINT) and SIGTERM (what `timeout`, Slurm's scancel and its time limit send) during a run.

The first signal asks the run to stop: `StopOnSignal`, a StepHook, stops training after the step in
progress, so the run ends with status `interrupted`, `interrupted_at_step` = the last step it ran, and
its result.json and metrics.csv valid up to that step; the job then records its trial and the sweep
stops (sweep/job.py). A second signal exits at once (status 128 + signal number), as kill would: the job
directory is then left without result.json, which a report calls `interrupted` too.

The handlers are installed only around a job, and only in the main thread (Python delivers signals
there); the ones before are put back after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
from typing import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclasses.dataclass
class StopRequest:
    """Which signal asked the run to stop (None: none did)."""

    signum: int | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


@dataclasses.dataclass
class Interrupted:
    """Where a signal stopped a run (result.json `reason` and `interrupted_at_step`)."""

    step: int
    reason: str


@contextlib.contextmanager
def stopping_on_signals(
    signals: tuple[int, ...] = STOP_SIGNALS, when: str = "after the current step"
) -> Iterator[StopRequest]:
    """While inside, the first of `signals` sets the request; a second one exits the process at once.
    `when` tells the user when the stop takes effect."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():  # signal.signal works in the main thread only
        yield request
        return

    def handler(signum, frame) -> None:
        name = signal.Signals(signum).name
        if request.signum is not None:
            # Only async-signal-safe calls here: the main thread may be anywhere, even inside a write.
            os.write(2, f"\nsweep: second {name}: exiting now, the run in progress is left unfinished\n".encode())
            os._exit(128 + signum)
        request.signum = signum
        os.write(2, f"\nsweep: {name}: stopping {when} ({name} again to exit at once)\n".encode())

    previous = {s: signal.getsignal(s) for s in signals}
    for s in signals:
        signal.signal(s, handler)
    try:
        yield request
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


class StopOnSignal:
    """A sweep.run.train.StepHook: stop the run after a step once `request` is set.

    A request that comes after the last step stops nothing: the run finished (`interrupted` stays None).
    """

    def __init__(self, request: StopRequest, steps: int) -> None:
        self.request, self.steps = request, steps
        self.interrupted: Interrupted | None = None

    def after_step(self, step: int, loss: float, parts) -> bool:
        if self.request.signum is None or step + 1 >= self.steps:
            return False
        self.interrupted = Interrupted(step, f"{self.request.name} after step {step} of {self.steps}")
        return True
