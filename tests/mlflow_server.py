"""A real `mlflow server` for tests/test_loggers.py: SQLite backend, 127.0.0.1, a free port.

Its start-up costs ~5 s of CPU (imports, database migrations), 7-15 s of wall time on a 2-core machine, so conftest
starts it in the background before the tests that need it (`start_early`): under pytest -n, the controller starts
it before the workers exist and hands it to them in the environment (HANDED_OVER; the worker that runs
test_loggers.py adopts it, `take_early`), so it comes up while the workers collect; without -n, once the
collected tests include test_loggers.py. `MlflowServer.wait` waits for /health. It runs in its own process group
(the CLI, its uvicorn worker), which `kill` ends; the job-runner processes of MLflow's server are off.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

HANDED_OVER = "DIT_SWEEP_TEST_MLFLOW_SERVER"
"""Environment variable: `<port> <pid> <log>` of the server the pytest -n controller started for its workers."""


class Adopted:
    """The server process as seen from a pytest -n worker: the controller's child, not this process's, so it has
    no exit status here; poll() says whether it has ended (a zombie until the controller reaps it counts)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self):
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = "X"
        if state in ("Z", "X") and self.returncode is None:
            self.returncode = -signal.SIGKILL  # the real status is the controller's to read
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"mlflow server {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


class MlflowServer:
    @classmethod
    def adopt(cls, handed_over: str) -> MlflowServer:
        """The server a pytest -n controller started (HANDED_OVER's value)."""
        port, pid, log = handed_over.split(" ", 2)
        server = cls.__new__(cls)
        server.port, server.log, server.proc, server.ready = int(port), Path(log), Adopted(int(pid)), False
        server.root = None  # the controller's folder: it removes it
        server.uri = f"http://127.0.0.1:{server.port}"
        return server

    def hand_over(self) -> str:
        return f"{self.port} {self.proc.pid} {self.log}"

    def __init__(self, root: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.root, self.log = root, root / "server.log"
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "art")]
        cmd += ["--workers", "1"]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job-runner processes
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.ready = False

    def wait(self, timeout_s: float = 180) -> str:
        """The server's URI once /health answers; fails the test with the server's log otherwise."""
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            if self.proc.poll() is not None:
                pytest.fail(f"mlflow server exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server not up after {timeout_s} s:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    self.ready = r.status == 200
            except OSError:
                time.sleep(0.25)
        return self.uri

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # a worker's kill (the test's) came first
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own group: the server and its worker, nothing else
        self.proc.wait(timeout=30)
        if self.root is not None:  # its database, artifacts and log: not left in the temp folder
            shutil.rmtree(self.root, ignore_errors=True)


_EARLY: list[MlflowServer] = []


def start_early() -> MlflowServer:
    if not _EARLY:
        _EARLY.append(MlflowServer(Path(tempfile.mkdtemp(prefix="test_mlflow_server_"))))
    return _EARLY[0]


def take_early() -> MlflowServer:
    """The server conftest started: in this process, or handed over by the pytest -n controller (a new one when
    neither did: a test module run some other way)."""
    if not _EARLY and os.environ.get(HANDED_OVER):
        _EARLY.append(MlflowServer.adopt(os.environ[HANDED_OVER]))
    return start_early()


def stop_early() -> None:
    while _EARLY:
        _EARLY.pop().kill()
