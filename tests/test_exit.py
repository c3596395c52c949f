"""sweep.exit: a command ends without the interpreter's teardown, yet with everything an exit must still do."""

from __future__ import annotations

import pytest

from sweep.exit import exit_status

from .conftest import run_cli

ENDS = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from sweep.exit import exit_after

def main():
    atexit.register(lambda: print("atexit ran", flush=False))
    pool = ThreadPoolExecutor(1)
    pool.submit(lambda: (time.sleep(0.3), print("pool task finished", flush=False)))
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished", flush=False))).start()
    print("buffered, not flushed", end="")  # stdout is a pipe here: block-buffered
    sys.stderr.write("on stderr\\n")
    return {code}

exit_after(main)
"""


@pytest.mark.parametrize(
    "code, status, stderr", [("None", 0, ""), ("3", 3, ""), ("sys.exit(2)", 2, ""), ("'a message'", 1, "a message")]
)
def test_a_command_ends_with_its_status_its_threads_joined_and_its_output_flushed(code, status, stderr):
    proc = run_cli("-c", ENDS.format(code=code))
    assert proc.returncode == status, proc.stderr
    out = proc.stdout
    assert out.startswith("buffered, not flushed"), out
    assert "thread finished" in out and "pool task finished" in out and out.rstrip().endswith("atexit ran"), out
    assert proc.stderr.startswith("on stderr") and stderr in proc.stderr


def test_an_exception_is_left_to_python():
    proc = run_cli(
        "-c", "from sweep.exit import exit_after\ndef main():\n    raise ValueError('a bug')\nexit_after(main)"
    )
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "ValueError: a bug" in proc.stderr


def test_exit_status_follows_sys_exit():
    assert [exit_status(c) for c in (None, 0, 2, 130, True, False)] == [0, 0, 2, 130, 1, 0]
