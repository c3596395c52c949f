"""How a command ends: everything Python does at exit that matters, without the interpreter's teardown.

A process that has loaded torch spends about a second after its last statement tearing the interpreter down
(module and C++ object finalization; docs/overhead.md "Process exit"), which every `python -m sweep`, its
diagnosis and its replay paid after their files were written and their exit status decided. `exit_after`
runs a command's `main`, then does what matters of that teardown itself (threading's exit hooks and the join
of non-daemon threads, the atexit handlers: logging's flush, loky's and Optuna's own; then it flushes stdout
and stderr) and ends the process with `os._exit`. An exception other than SystemExit is left to Python (its
traceback, its teardown).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import Callable, Iterator, NoReturn


def exit_after(main: Callable[[], object]) -> NoReturn:
    """Run `main` (its return value is the exit status, as for sys.exit(main())), then end the process."""
    with exiting():
        raise SystemExit(main())


@contextlib.contextmanager
def exiting() -> Iterator[NoReturn]:
    """Around a command's main: when it ends (its SystemExit's code, or 0), end the process with that status, as
    `exit_after` does; the command's own frames stay as they are (python -m sweep runs its Hydra task inside)."""
    code: object = None
    try:
        yield
    except SystemExit as e:
        code = e.code
    status = exit_status(code)
    _finish()
    os._exit(status)


def exit_status(code: object) -> int:
    """sys.exit's rule: None is 0, an int is itself, anything else is printed to stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return int(code)
    print(code, file=sys.stderr)
    return 1


def _finish() -> None:
    """What the interpreter's shutdown does before it finalizes modules: threading's exit hooks and the join
    of the threads that are not daemons, the atexit handlers, the flush of the standard streams."""
    # CPython's own exit path, in its order (Py_FinalizeEx): threading's exit hooks (concurrent.futures and
    # loky stop their executors' manager threads there) and the join of the non-daemon threads, then the
    # atexit handlers. Both are private, and both are what os._exit would otherwise skip.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to deliver
            pass
