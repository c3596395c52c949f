"""A real `mlflow server` for tests/test_loggers.py: SQLite backend, 127.0.0.1, a free port.

Its start-up costs ~15 s of imports and database migrations on a 2-core machine, so conftest starts it in
the background as soon as the collected tests include test_loggers.py (`start_early`), and the tests
before that module hide it; `MlflowServer.wait` waits for /health. It runs in its own process group
(the CLI, its uvicorn worker), which `kill` ends; the job-runner processes of MLflow's server are off.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest


class MlflowServer:
    def __init__(self, root: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = root / "server.log"
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
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own group: the server and its worker, nothing else
        self.proc.wait(timeout=30)


_EARLY: list[MlflowServer] = []


def start_early() -> None:
    if not _EARLY:
        _EARLY.append(MlflowServer(Path(tempfile.mkdtemp(prefix="test_mlflow_server_"))))


def take_early() -> MlflowServer:
    """The server conftest started (a new one when it did not: a test module run some other way)."""
    start_early()
    return _EARLY[0]


def stop_early() -> None:
    while _EARLY:
        _EARLY.pop().kill()
