"""Shared test helpers: compose a RunConfig from the real conf/ tree, exactly as `python -m sweep` does; run a
command line in a subprocess (run_cli); read what a run wrote (read_result, read_results)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
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
# A multirun's diagnoses of its diverged runs (monitor.diagnose=auto) are tested in tests/test_diagnose.py, its
# confirmation at a longer horizon (confirm.mode=auto) in tests/test_confirm.py.
FAST = [
    "data.frames=4",
    "data.height=8",
    "data.width=8",
    "data.num_samples=32",
    "progress=none",
    "monitor.diagnose=off",
    "confirm.mode=off",
]

SMALL_MODEL = ["model.width=64", "model.depth=2"]
"""The built-in video DiT at half tiny's width and depth (hidden 64, one spatial-temporal pair: 40 fp32 steps on
FAST's clips take 0.37 CPU-s against tiny's 1.33), for the modules whose checks hold for any model: a sweep's
bookkeeping, or two ways of running the same steps compared. A module puts it before its own overrides; each that
does passed with it on three kernel sets (AVX-512's; AVX2's and the default ones, see docs/suite_durations.md).
The tests whose expected verdicts, steps or values were measured on tiny keep tiny."""


def compose_cfg(overrides: list[str] | None = None, conf_dir: Path | str = CONF_DIR):
    """conf_dir's config.yaml (conf/ unless a test's own copy) composed with `overrides`, as Hydra composes it."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides or []))


def hydra_cfg(*overrides: str):
    """conf/ plus FAST and `overrides`, composed with its `hydra` node (what a run directory's checks read)."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return compose(config_name="config", overrides=[*FAST, *overrides], return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def make_run(*overrides: str, fast: bool = True) -> RunConfig:
    """A validated RunConfig from conf/ plus overrides."""
    return to_run_config(compose_cfg((FAST if fast else []) + list(overrides)))


@contextlib.contextmanager
def logging_kept():
    """Give the process's logging back as it was: a multirun's launcher and jobs configure it (Hydra's
    hydra_logging and job_logging: root's handlers replaced by a console handler on the sys.stdout of that moment
    and a file handler on the job's log). A CLI process owns its logging; a test's does not: left in place, the
    console handler held a test's capsys stream, and a later test's first log line on that worker printed dozens
    of lines of "--- Logging error --- ... I/O operation on closed file" into its stderr (a CI failure,
    order-dependent under xdist)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        added = [handler for handler in root.handlers if handler not in handlers]
        root.handlers[:] = handlers
        root.setLevel(level)
        for handler in added:
            handler.close()


def multirun_in_process(sweep_dir: Path, *overrides: str, fast: bool = True) -> list:
    """`python -m sweep -m ...` in this process (no interpreter start-up: seconds per test), with the
    real conf/, our task function and the configured sweeper, launcher and end-of-sweep summary. With
    fast=False, without FAST and threads=1 (a scenario's own data sizes and torch's thread count stand)."""
    from sweep.job import run_job

    small = [*FAST, "threads=1"] if fast else []
    GlobalHydra.instance().clear()
    try:
        with logging_kept(), initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return GlobalHydra.instance().hydra.multirun(
                config_name="config",
                task_function=run_job,
                with_log_configuration=False,
                overrides=["hydra.mode=MULTIRUN", *small, f"hydra.sweep.dir={sweep_dir}", *overrides],
            )
    finally:
        GlobalHydra.instance().clear()


def cli_env(**changes: str | None) -> dict[str, str]:
    """The environment of a command-line subprocess: this process's, with the repository importable, CI=1 (no
    progress bar) and one OpenMP thread per process unless OMP_NUM_THREADS says otherwise; then `changes` (a value
    of None removes that variable)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CI": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_cli(
    *argv: str,
    cwd: Path | str = REPO,
    env: dict[str, str | None] | None = None,
    timeout: float = 600,
    background: bool = False,
    **popen,
) -> subprocess.CompletedProcess | subprocess.Popen:
    """`python *argv` (e.g. run_cli("-m", "sweep", "-m", ...)) in a subprocess with cli_env(**env), from `cwd`.

    Waits for it and returns the CompletedProcess, stdout and stderr captured as text. With background=True it
    returns the running Popen instead (stdout and stderr text pipes unless `popen` says otherwise), for a test
    that signals, kills or races the process. Other keywords go to subprocess.run / Popen as they are."""
    cmd, environ = [sys.executable, *argv], cli_env(**(env or {}))
    if background:
        return subprocess.Popen(
            cmd, cwd=cwd, env=environ, **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen}
        )
    return subprocess.run(cmd, cwd=cwd, env=environ, capture_output=True, text=True, timeout=timeout, **popen)


def sweep_forked(
    *argv: str, cwd: Path | str = REPO, env: dict[str, str | None] | None = None
) -> subprocess.CompletedProcess:
    """`python -m sweep *argv` from `cwd` with cli_env(**env), as run_cli("-m", "sweep", *argv, ...) runs it, its
    exit status, stdout and stderr captured; in a fork of one server process per test process that has imported
    and warmed sweep already (tests/cli_fork.py): no interpreter start-up or torch import per command line (~2 s).
    A test of how `python -m sweep` itself starts (its imports, its speed), ends or takes a signal keeps run_cli."""
    import torch

    if torch.cuda.is_available():  # a fork of a process that asked CUDA anything (validation does) cannot use it
        return run_cli("-m", "sweep", *argv, cwd=cwd, env=env)  # so on a GPU machine: a process each, as before
    from .cli_fork import run_forked

    code, out, err = run_forked(list(argv), cwd, cli_env(**(env or {})))
    return subprocess.CompletedProcess(["python", "-m", "sweep", *argv], code, out, err)


def run_cli_refusals(*cases: tuple[list[str], Path]) -> list[subprocess.CompletedProcess]:
    """sweep_forked(*ARGV, cwd=cwd) for each (ARGV, cwd): the command lines of a module that `python -m sweep`
    refuses before any run, one CompletedProcess each."""
    return [sweep_forked(*argv, cwd=cwd) for argv, cwd in cases]


def kill_mid_run(proc: subprocess.Popen, sweep_dir: Path, step: str, timeout_s: float = 300) -> None:
    """SIGKILL the sweep `proc` (started with start_new_session=True: its whole group) once a job of it has logged
    `step` (e.g. "step 3/60": run with progress=log and log_every=1) and has no result.json yet, while another job
    has its result.json: one trial done, another training (RUNNING). A fixed sleep could catch the second job
    after its run, recording its trial."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the sweep ended before it could be killed mid-run"
        logs = {log.parent: log for log in Path(sweep_dir).glob("*/*.log")}
        done = {d for d in logs if (d / "result.json").exists()}
        if done and any(d not in done and step in log.read_text(errors="replace") for d, log in logs.items()):
            break
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def read_result(run_dir: Path | str) -> dict:
    """The result.json a run wrote into `run_dir`."""
    return json.loads((Path(run_dir) / "result.json").read_text())


def read_results(sweep_dir: Path | str) -> list[dict]:
    """Every result.json of a sweep directory's jobs, in the order of their paths."""
    return [read_result(p.parent) for p in sorted(Path(sweep_dir).glob("*/result.json"))]


@pytest.fixture(autouse=True)
def _quiet_ci(monkeypatch):
    monkeypatch.setenv("CI", os.environ.get("CI", "1"))


LONGEST = REPO / "tests" / "data" / "longest_tests.txt"
"""The longest test functions, longest first (`#` starts a comment)."""


def longest_first(items: list) -> None:
    """Put the modules holding the tests of LONGEST first, in the order of their longest test, the others after them;
    inside a module the tests keep their own order (test_loggers kills its server in its last test). Under pytest -n
    the workers take tests in this order, so neither ends the suite on a long one while the other waits."""
    names = [line.split("#")[0].strip() for line in LONGEST.read_text().splitlines()]
    rank: dict[str, int] = {}
    for i, name in enumerate(n for n in names if n):
        rank.setdefault(name.split("::")[0], i)
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: a module's order holds


LOGGERS = REPO / "tests" / "test_loggers.py"
"""The module whose tests need a real mlflow server (tests/mlflow_server.py)."""


def runs_module(config, module: Path) -> bool:
    """Whether this pytest command's paths (its arguments, or testpaths) include `module`."""
    for arg in config.args:
        target = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if target == module or (target.is_dir() and module.is_relative_to(target)):
            return True
    return False


def pytest_configure(config):
    """Under pytest -n, the controller starts test_loggers.py's mlflow server (~5 s of CPU, 7-15 s to come up)
    before its workers exist, and hands it to them in the environment: it comes up while they collect, where
    the worker that took the module used to wait for it (10-15 s). Not when -k or -m may leave the module out."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not config.getoption("numprocesses", None):
        return
    if config.getoption("keyword") or config.getoption("markexpr") or not runs_module(config, LOGGERS):
        return
    from .mlflow_server import HANDED_OVER, start_early

    os.environ[HANDED_OVER] = start_early().hand_over()


def pytest_collection_modifyitems(config, items):
    """The longest tests first (longest_first). Tests marked `cuda` are skipped, with the reason, where torch sees
    no CUDA device (`make test-gpu` runs them). tests/test_loggers.py needs a real mlflow server (~15 s to start):
    start it now, in the background, so the tests before that module hide its start-up."""
    import torch

    longest_first(items)

    if not torch.cuda.is_available():
        no_cuda = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False): make test-gpu")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(no_cuda)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n: every worker collects everything; the one that runs
        return  # test_loggers.py adopts the controller's server (pytest_configure) or starts one (take_early)
    if any("test_loggers.py::" in item.nodeid for item in items):
        from .mlflow_server import start_early

        start_early()


def pytest_sessionfinish(session, exitstatus):
    from .cli_fork import stop
    from .mlflow_server import stop_early  # the server, if a collected test_loggers.py never ran (under pytest -n, in
    # the controller: the one it started, killed by a worker or not, now reaped)

    stop()
    stop_early()
