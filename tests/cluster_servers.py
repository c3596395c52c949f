"""Session fixtures that start the project's own servers: PostgreSQL (scripts/postgres.sh), Slurm (scripts/slurm.sh).

Import the fixtures into a test module (`from .cluster_servers import postgres_url`). The scripts are
idempotent: the first call installs and starts, later calls only print what is running.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from .conftest import FAST, REPO, SMALL_MODEL


def _script(name: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / name)], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """The URL of the test PostgreSQL server on 127.0.0.1 (no password: trust on loopback)."""
    proc = _script("postgres.sh")
    if proc.returncode != 0:
        if os.geteuid() == 0:  # CI runs as root with apt: there the server must start
            pytest.fail(f"scripts/postgres.sh failed: {proc.stderr.strip()[-2000:]}")
        pytest.skip(f"scripts/postgres.sh could not start PostgreSQL (not root): {proc.stderr.strip()[-300:]}")
    return proc.stdout.strip().splitlines()[-1]


def sweep_cmd(sweep_dir, *args) -> list[str]:
    """run_cli's arguments for `python -m sweep -m` with our Optuna sweeper, small fast runs, one thread per run."""
    return [
        "-m",
        "sweep",
        "-m",
        "hydra/sweeper=optuna_sweep",
        *FAST,
        *SMALL_MODEL,
        "threads=1",
        f"hydra.sweep.dir={sweep_dir}",
        *args,
    ]


LEDGER_FROM_ENV = "ledger.storage=${oc.env:SWEEP_LEDGER_URL}"
"""The ledger URL travels in SWEEP_LEDGER_URL (run_cli(..., env={"SWEEP_LEDGER_URL": url})), never on the command
line."""
