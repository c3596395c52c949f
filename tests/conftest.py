"""Shared test helpers: compose a RunConfig from the real conf/ tree, exactly as `python -m sweep` does."""

from __future__ import annotations

import os
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n 2 on 2 cores: one OpenMP thread per worker (and per `python -m sweep` it starts), set before
    # torch is imported. Two workers of 2 spinning threads each ran a scenario 15x slower (0.24 vs 3.6 steps/s).
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import sweep.config  # noqa: F401  (registers the schema)
from sweep.config import RunConfig, to_run_config

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = str(REPO / "conf")

# Small and fast: 4 frames of 8x8, a handful of steps. Tests that need the real default size say so.
# The device stays `auto` (CUDA where there is one), so the suite runs the GPU path on a GPU machine; a test
# of a CPU fact (a CPU profiler op name, an emulated GEMM, a refusal on CPU) pins device=cpu itself.
# A multirun's diagnoses of its diverged runs (monitor.diagnose=auto) are tested in tests/test_diagnose.py.
FAST = [
    "data.frames=4",
    "data.height=8",
    "data.width=8",
    "data.num_samples=32",
    "progress=none",
    "monitor.diagnose=off",
]


def compose_cfg(overrides: list[str] | None = None):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides or []))


def make_run(*overrides: str, fast: bool = True) -> RunConfig:
    """A validated RunConfig from conf/ plus overrides."""
    return to_run_config(compose_cfg((FAST if fast else []) + list(overrides)))


def multirun_in_process(sweep_dir: Path, *overrides: str) -> list:
    """`python -m sweep -m ...` in this process (no interpreter start-up: seconds per test), with the
    real conf/, our task function and the configured sweeper, launcher and end-of-sweep summary."""
    from sweep.job import run_job

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return GlobalHydra.instance().hydra.multirun(
                config_name="config",
                task_function=run_job,
                with_log_configuration=False,
                overrides=["hydra.mode=MULTIRUN", *FAST, "threads=1", f"hydra.sweep.dir={sweep_dir}", *overrides],
            )
    finally:
        GlobalHydra.instance().clear()


@pytest.fixture(autouse=True)
def _quiet_ci(monkeypatch):
    monkeypatch.setenv("CI", os.environ.get("CI", "1"))


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` are skipped, with the reason, where torch sees no CUDA device (`make test-gpu` runs
    them). tests/test_loggers.py needs a real mlflow server (~15 s to start): start it now, in the background,
    so the tests before that module hide its start-up."""
    import torch

    if not torch.cuda.is_available():
        no_cuda = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False): make test-gpu")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(no_cuda)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n: every worker collects everything; the one that
        return  # runs test_loggers.py starts the server when its first test asks (mlflow_server.take_early)
    if any("test_loggers.py::" in item.nodeid for item in items):
        from .mlflow_server import start_early

        start_early()


def pytest_sessionfinish(session, exitstatus):
    from .mlflow_server import stop_early  # the server, if a collected test_loggers.py never ran

    stop_early()
