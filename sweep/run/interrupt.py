"""Ctrl-C (SIGINT) and SIGTERM (what `timeout`, Slurm's scancel and its time limit send) during a run.

The first signal asks the run to stop: `StopOnSignal`, a StepHook, stops training after the step in
progress, so the run ends with status `interrupted`, `interrupted_at_step` = the last step it ran, and
its result.json and metrics.csv valid up to that step; the job then records its trial and the sweep
stops (sweep/job.py). A second signal exits at once (status 128 + signal number), as kill would: the job
directory is then left without result.json, which a report calls `interrupted` too.

The handlers are installed only around a job, and only in the main thread (Python delivers signals
there); the ones before are put back after it.

A signal while a run is set up (`setting_up`: the model, the data, the checkpoint and the compiled graph are
built, before step 0) does not wait for a step: the set-up is stopped at once (`SetUpInterrupted`, raised by
the handler in the main thread, as Ctrl-C's KeyboardInterrupt would be), and the run ends `interrupted` before
its first step (sweep/run/execute.py). Before, a run whose set-up took long (per-step tables of `steps=1e11`)
ignored SIGTERM until a step that never came.

Commands made of several runs (`python -m sweep.diagnose`, the sweep's monitor.diagnose=auto) install the
handlers around all of them: each run stops after its step (or during its set-up) and records itself as
`interrupted`, and `stop_if_asked` then raises `Stopped`, which the command turns into one line and exit status
128 + the signal's number, its own result (diagnosis.json) not written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_RT = getattr(signal, "SIGRTMIN", None)
FORWARDED = (
    {_RT + 1: signal.SIGINT, _RT + 2: signal.SIGTERM}
    if _RT is not None
    else {signal.SIGUSR1: signal.SIGINT, signal.SIGUSR2: signal.SIGTERM}
)
"""How a sweep passes a stop on to jobs in processes of their own (`forwarding_signals`): a signal of its
own, so that a job that got the same Ctrl-C from the terminal (the whole process group does) does not
count the forwarded one as a second signal. A forwarded signal never exits at once. Real-time signals
where there are (Linux): submitit's jobs take SIGUSR2 as "preempted" and requeue themselves."""
FORWARD_AS = {original: forwarded for forwarded, original in FORWARDED.items()}


@dataclasses.dataclass
class StopRequest:
    """Which signal asked the run to stop (None: none did)."""

    signum: int | None = None
    setting_up: bool = False
    """A run is being set up (`setting_up`): the first signal stops it at once (SetUpInterrupted)."""

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


class SignalStop(BaseException):
    """A stop signal, raised: a BaseException, as KeyboardInterrupt is, so that no `except Exception` on the way
    swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class SetUpInterrupted(SignalStop):
    """A signal came while a run was set up (before step 0), raised in the main thread by the handler;
    sweep/run/execute.py records the run as `interrupted`."""


class Stopped(SignalStop):
    """A command of several runs was asked to stop (`stop_if_asked`): its caller says so in one line and exits
    with 128 + signum, its own result unwritten (each run it made records itself)."""


_ACTIVE: list[StopRequest] = []
"""The requests of the `stopping_on_signals` this process is inside, innermost last (main thread only)."""


def active_request() -> StopRequest | None:
    """The request of the innermost `stopping_on_signals` this process is in, None outside any."""
    return _ACTIVE[-1] if _ACTIVE else None


def stop_if_asked() -> None:
    """Raise Stopped when a signal asked this process to stop (a command between its runs)."""
    request = active_request()
    if request is not None and request.signum is not None:
        raise Stopped(request.signum)


@contextlib.contextmanager
def setting_up() -> Iterator[None]:
    """While a run is set up: a stop signal (one that came before too) raises SetUpInterrupted here."""
    request = active_request()
    if request is None:
        yield
        return
    if request.signum is not None:  # asked before the set-up began
        raise SetUpInterrupted(request.signum)
    request.setting_up = True
    try:
        yield
    finally:
        request.setting_up = False


@dataclasses.dataclass
class Interrupted:
    """Where a signal stopped a run (result.json `reason` and `interrupted_at_step`)."""

    step: int
    reason: str

    def record(self, result) -> None:
        """Ctrl-C or SIGTERM: the files hold the steps run (sweep.run.step.Stop)."""
        result.status, result.reason, result.interrupted_at_step = "interrupted", self.reason, self.step


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
        if signum in FORWARDED:  # the sweep passes on a signal it got: stop after the step, unless already asked
            if request.signum is None:
                handler(FORWARDED[signum], frame)
            return
        name = signal.Signals(signum).name
        if request.signum is not None:
            # Only async-signal-safe calls here: the main thread may be anywhere, even inside a write.
            os.write(2, f"\nsweep: second {name}: exiting now, the run in progress is left unfinished\n".encode())
            os._exit(128 + signum)
        request.signum = signum
        now = "the set-up now" if request.setting_up else when
        os.write(2, f"\nsweep: {name}: stopping {now} ({name} again to exit at once)\n".encode())
        if request.setting_up:
            request.setting_up = False
            raise SetUpInterrupted(signum)

    previous = {s: signal.getsignal(s) for s in (*signals, *FORWARDED)}
    for s in previous:
        signal.signal(s, handler)
    _ACTIVE.append(request)
    try:
        yield request
    finally:
        _ACTIVE.remove(request)
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


class StopOnSignal:
    """A sweep.run.train.StepHook: stop the run after a step once `request` is set.

    A request that comes after the last step stops nothing: the run finished (`interrupted` stays None).
    """

    window_safe = True
    """It may see a window's steps after the window ran (sweep/run/window.py): the run stops within a window."""

    def __init__(self, request: StopRequest, steps: int) -> None:
        self.request, self.steps = request, steps
        self.interrupted: Interrupted | None = None

    def after_step(self, step: int, loss: float, parts) -> Interrupted | None:
        if self.request.signum is None or step + 1 >= self.steps:
            return None
        self.interrupted = Interrupted(step, f"{self.request.name} after step {step} of {self.steps}")
        return self.interrupted


# Launchers whose jobs run in processes of their own on this machine: a signal to the sweep process reaches
# only it (`timeout`, `kill`, a batch system's SIGTERM), so the sweep forwards it to the jobs.
LOCAL_PROCESS_LAUNCHERS = (
    "hydra_plugins.hydra_joblib_launcher.",  # hydra/launcher=joblib: loky worker processes
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",  # hydra/launcher=submitit_local
)


def runs_jobs_in_local_processes(launcher) -> bool:
    """Whether `launcher` (a Hydra launcher) runs its jobs in child processes of this one."""
    name = f"{type(launcher).__module__}.{type(launcher).__qualname__}"
    return any(name.startswith(prefix) for prefix in LOCAL_PROCESS_LAUNCHERS)


@contextlib.contextmanager
def forwarding_signals(
    launcher, sweep_dir: str | None = None, signals: tuple[int, ...] = STOP_SIGNALS, wait_s: float = 120
) -> Iterator[StopRequest]:
    """Around a launch: with a launcher that runs its jobs in child processes, the first of `signals` is
    forwarded to them (each run stops after its step, writes its files and closes its trial, as in-process).
    The handler then waits (at most `wait_s`) until no job directory of `sweep_dir` is being written, so a
    launcher that cancels its other jobs on the first one's exit (joblib) kills none mid-record; a second
    signal is forwarded too and exits at once. With any other launcher (in-process jobs install their own
    handlers) it does nothing. The caller exits with 128 + signal."""
    if not runs_jobs_in_local_processes(launcher) or threading.current_thread() is not threading.main_thread():
        yield StopRequest()
        return
    request = StopRequest()

    def handler(signum, frame) -> None:
        name = signal.Signals(signum).name
        if request.signum is not None:  # the second: to every job as itself (each exits at once), then us
            for pid in job_processes():
                with contextlib.suppress(OSError):
                    os.kill(pid, signum)
            os.write(2, f"\nsweep: second {name}: exiting now, the runs in progress are left unfinished\n".encode())
            os._exit(128 + signum)
        request.signum = signum
        os.write(2, f"\nsweep: {name}: forwarded to the jobs; each stops after its current step\n".encode())
        # Only to jobs whose run listens (a starting job or an idle worker would die of it, and joblib then
        # kills the others mid-record); again until no job directory is being written, for jobs that start.
        forwarded, deadline = set(), time.monotonic() + wait_s
        while True:
            starting = []  # submitit's job processes whose run does not listen yet
            for pid in job_processes():
                if pid not in forwarded and catches(pid, FORWARD_AS[signum]):
                    with contextlib.suppress(OSError):
                        os.kill(pid, FORWARD_AS[signum])
                    forwarded.add(pid)
                elif pid not in forwarded and not _is_worker_or_controller(pid):
                    starting.append(pid)
            if time.monotonic() > deadline or not (starting or (forwarded and _being_written(sweep_dir))):
                break
            time.sleep(0.1)

    previous = {s: signal.getsignal(s) for s in signals}
    for s in signals:
        signal.signal(s, handler)
    try:
        with _submitit_controllers_ignoring_ctrl_c():
            yield request
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _submitit_controllers_ignoring_ctrl_c() -> Iterator[None]:
    """submitit's local controller (a process per job, in the terminal's process group) took Ctrl-C as a
    KeyboardInterrupt: it printed its own traceback and killed its job (SIGINT, then SIGKILL a second
    later), sometimes before the run had recorded its trial. Started with SIGINT ignored (kept across exec,
    and then Python installs no KeyboardInterrupt), it waits for its job, which stops on the forwarded
    signal. The job inherits the ignore until its run installs its own handlers (stopping_on_signals)."""
    try:
        from submitit.local import local
    except ImportError:
        yield
        return
    start = local.start_controller

    def start_controller(*args, **kwargs):
        before = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return start(*args, **kwargs)
        finally:
            signal.signal(signal.SIGINT, before)

    local.start_controller = start_controller
    try:
        yield
    finally:
        local.start_controller = start


def _being_written(sweep_dir: str | None) -> bool:
    """Whether a job directory of the sweep is being written (its run not yet recorded)."""
    from sweep.run.results import RUNNING_LOCK, is_being_written

    return sweep_dir is not None and any(is_being_written(p.parent) for p in Path(sweep_dir).glob(f"*/{RUNNING_LOCK}"))


def _is_worker_or_controller(pid: int) -> bool:
    """A loky worker (idle between jobs, it never listens), submitit's local controller or a process that has
    exited (not yet reaped): no run to wait for."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return True  # gone
    return not cmdline or b"loky" in cmdline or b"submitit.local._local" in cmdline  # empty: exited, a zombie


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler installed for `signum` (Linux: SigCgt in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def job_processes(root: int | None = None) -> list[int]:
    """The descendants of `root` (this process) that run jobs: every one but loky's resource tracker,
    which holds no run and must outlive the workers. Read from /proc (Linux); empty elsewhere."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"resource_tracker" not in cmdline:
            found.append(pid)
        todo += children.get(pid, [])
    return found


def launch_forwarding_signals(
    launcher, job_overrides, initial_job_idx: int, after_stop: Callable[[], object] | None = None
):
    """`launcher.launch(...)` inside `forwarding_signals`: after a forwarded signal, whatever the jobs did
    (an interrupted job raises SystemExit in its process, which the launcher passes on, or, under submitit_local,
    returns its result: sweep/job.py), the sweep says so in one line and exits with 128 + the signal's number,
    as with in-process jobs. Before that, `after_stop` (the sweepers: record the trials that jobs killed while they
    recorded left pending, sweep/search/pending.py; joblib kills its other workers when one job exits)."""
    config = getattr(launcher, "config", None)  # Hydra's launchers keep the sweep's config from setup()
    sweep_dir = None
    with contextlib.suppress(Exception):  # a DictConfig: no omegaconf import in run/ (tests/test_layout.py)
        sweep_dir = str(config.hydra.sweep.dir)
    with forwarding_signals(launcher, sweep_dir) as request:
        try:
            returns = launcher.launch(job_overrides, initial_job_idx=initial_job_idx)
        except BaseException:
            if request.signum is None:
                raise
    if request.signum is not None:
        if after_stop is not None:
            _wait_while_written(sweep_dir, 5.0)  # a job process killed a moment ago may still hold its directory
            after_stop()
        logging.getLogger("sweep").warning(
            "%s: the jobs stopped; run the same command again to resume the unfinished cells", request.name
        )
        raise SystemExit(128 + request.signum)
    return returns


def _wait_while_written(sweep_dir: str | None, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while _being_written(sweep_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
