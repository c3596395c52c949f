"""`python -m sweep ARGV` for a test that reads what a command line did, without an interpreter start-up each.

One server process per test process (per pytest -n worker) starts as `python -m sweep` would and imports what it
imports. It then refuses two command lines itself (a run and a grid), so that what every case loads first (torch,
the models, the sweepers, Hydra's plugins, conf/'s YAML: ~3 s of CPU) is loaded once. Each case then runs in a fork
of it: the case's environment, working directory and argv, file descriptors 1 and 2 sent to the case's own files,
then exactly what `python -m sweep` runs (sweep/__main__.py's `exiting()` and `command_line()` around Hydra's main),
which ends the process with its status. An exception that escapes is printed to the case's stderr as Python would,
with status 1. Each case starts from the same state (nothing one case does reaches the next) and costs its own
work only (~0.1-0.5 s for a refusal), where a `python -m sweep` start costs ~2 s before it.

For what a test reads of a command line: its exit status, stdout and stderr, the files it left. A test of how
`python -m sweep` itself starts (what it imports, how fast), ends, or takes a signal keeps conftest.run_cli, and so
does one whose case sets an environment variable that a module reads when it is imported (the server's environment,
cli_env(), was the one at import: OMP_NUM_THREADS for torch, say). A case still running after its time-out is killed;
the server goes on. On a machine where torch sees CUDA, conftest.sweep_forked starts a process each instead: the
warm-up's validation asks CUDA (sweep/config/inputs.py), and a fork of a process that has cannot use it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import tempfile
import time
from pathlib import Path

SERVER = r"""
import contextlib, json, os, sys, tempfile, threading, traceback

import sweep.__main__
from hydra.core.global_hydra import GlobalHydra
from sweep.exit import exiting

# Warm-up: two command lines refused at validation, a run and a grid, in this process (as run_cli_refusals ran
# all its cases, one after another, before): what every case imports and parses first (torch, the models, the
# sweepers and their report, Hydra's plugins, conf/'s YAML) is then loaded once, not in each fork. Hydra makes the
# run and sweep dirs before the refusal: a temporary folder's (the server may not write anywhere else).
environ, argv = dict(os.environ), sys.argv
warm_dir = tempfile.TemporaryDirectory(prefix="cli_fork_warm_")
for warm in (["optim.lr=-1"], ["-m", "optim.lr=1e-3,-1", "steps=1"]):
    dirs = [f"hydra.run.dir={warm_dir.name}/run", f"hydra.sweep.dir={warm_dir.name}/sweep"]
    sys.argv = [sweep.__main__.__file__, *warm, *dirs]
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
            with sweep.__main__.command_line():
                sweep.__main__._hydra_main()
    except SystemExit as e:
        assert e.code == 2, (warm, e.code)  # refused before any run, as it must be
    GlobalHydra.instance().clear()
    os.environ.clear()
    os.environ.update(environ)
sys.argv = argv
warm_dir.cleanup()
assert threading.active_count() == 1, threading.enumerate()  # forking is safe: one thread, no torch op run yet


def case(argv, cwd, env, out, err):
    pid = os.fork()
    if pid:
        print(json.dumps({"pid": pid}), flush=True)  # the caller's to kill when the case runs past its time-out
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    try:
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        for fd, path in ((1, out), (2, err)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(f, fd)
            os.close(f)
        sys.argv = [sweep.__main__.__file__, *argv]
        with exiting(), sweep.__main__.command_line():  # python -m sweep's own lines (sweep/__main__.py)
            sweep.__main__._hydra_main()
    except BaseException:
        traceback.print_exc()
    finally:  # exiting() ends the process with the command's status; here only what escaped it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


for line in sys.stdin:
    print(json.dumps({"status": case(*json.loads(line))}), flush=True)
"""

_servers: list[subprocess.Popen] = []
_unread = bytearray()
"""What the server wrote after the last line read (its lines are read from the file descriptor, not a buffered file:
select() must see every byte not yet taken)."""


def _server() -> subprocess.Popen:
    from .conftest import run_cli

    if not _servers or _servers[0].poll() is not None:
        server = run_cli("-c", SERVER, background=True, stdin=subprocess.PIPE, stderr=None, text=False, bufsize=0)
        _servers[:], _unread[:] = [server], b""
    return _servers[0]


def _line(server: subprocess.Popen, timeout: float) -> dict | None:
    """The server's next line, as JSON; None when `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while b"\n" not in _unread:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([server.stdout], [], [], left)[0]:
            return None
        chunk = os.read(server.stdout.fileno(), 65536)
        if not chunk:
            raise RuntimeError(f"the fork server ended (status {server.wait()})")
        _unread.extend(chunk)
    line, _, rest = bytes(_unread).partition(b"\n")
    _unread[:] = rest
    return json.loads(line)


def run_forked(argv: list[str], cwd: Path | str, env: dict[str, str], timeout: float = 600) -> tuple[int, str, str]:
    """`python -m sweep *argv` from `cwd` with exactly the environment `env`, in a fork of the server: (exit
    status, stdout, stderr). A case still running after `timeout` seconds is killed (the server goes on), and
    raises TimeoutError."""
    server = _server()
    with tempfile.TemporaryDirectory() as d:
        out, err = Path(d) / "out", Path(d) / "err"
        server.stdin.write((json.dumps([list(argv), str(cwd), env, str(out), str(err)]) + "\n").encode())
        forked = _line(server, 60)
        if forked is None:
            raise RuntimeError(f"the fork server did not fork python -m sweep {' '.join(argv)} within 60 s")
        done = _line(server, timeout)
        if done is None:
            os.kill(forked["pid"], signal.SIGKILL)
            _line(server, 60)  # the server reaps it and says so
            raise TimeoutError(f"python -m sweep {' '.join(argv)}: still running after {timeout} s (killed)")
        return done["status"], out.read_text(), err.read_text()


def stop() -> None:
    """End the server (at the end of the test session)."""
    while _servers:
        server = _servers.pop()
        server.stdin.close()
        server.wait(timeout=30)
