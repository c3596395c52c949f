"""Ctrl-C and SIGTERM during a run or a sweep: the run stops after its step, its files and trial say
`interrupted` at that step, a second signal exits at once, and the same command resumes the unfinished cells."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import threading
import time

import optuna
import pytest
from optuna.trial import TrialState

from sweep.config import LedgerConfig
from sweep.run.execute import execute
from sweep.run.interrupt import StopOnSignal, stopping_on_signals
from sweep.search.ledger import record_run

from .cluster_servers import sweep_cmd
from .conftest import FAST as FAST_ARGS
from .conftest import SMALL_MODEL, make_run, multirun_in_process, read_result, run_cli


class SignalAt:
    """A StepHook that sends this process `signum` after `step`, as a user's Ctrl-C would arrive mid-run."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def after_step(self, step, loss, parts) -> bool:
        if step == self.step:
            os.kill(os.getpid(), self.signum)
        return False


def metrics_rows(run_dir) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_run_after_its_step_with_files_valid_up_to_it(tmp_path, signum):
    run = make_run(*SMALL_MODEL, "steps=40", "threads=1")
    before = signal.getsignal(signum)
    with stopping_on_signals() as request:
        result = execute(run, tmp_path, {"optim.lr": 1e-3}, hooks=[SignalAt(2, signum), StopOnSignal(request, 40)])
    assert signal.getsignal(signum) is before  # put back after the job
    assert request.signum == signum

    saved = read_result(tmp_path)
    name = signal.Signals(signum).name
    assert saved["status"] == "interrupted" and saved["interrupted_at_step"] == 2
    assert saved["reason"] == f"{name} after step 2 of 40" and saved["verdict"] is None
    rows = metrics_rows(tmp_path)
    assert [int(r["step"]) for r in rows] == [0, 1, 2] and saved["steps_run"] == 3
    assert saved["final_loss"] == pytest.approx(float(rows[-1]["loss"]))
    assert saved["initial_loss"] == pytest.approx(float(rows[0]["loss"]))
    assert result.headline() == f"interrupted: {name} after step 2 of 40"

    # Closed in the ledger, as a failed trial that says why: not RUNNING, not a result the sampler learns from.
    record_run(LedgerConfig(), tmp_path, tmp_path, result.to_dict())
    (trial,) = optuna.load_study(study_name=str(tmp_path), storage=f"sqlite:///{tmp_path / 'ledger.db'}").trials
    assert trial.state is TrialState.FAIL
    assert trial.user_attrs["status"] == "interrupted" and trial.user_attrs["interrupted_at_step"] == 2


def test_a_signal_after_the_last_step_interrupts_nothing(tmp_path):
    run = make_run(*SMALL_MODEL, "steps=3", "threads=1")
    with stopping_on_signals() as request:
        result = execute(run, tmp_path, {}, hooks=[SignalAt(2, signal.SIGINT), StopOnSignal(request, 3)])
    assert result.status == "stable" and result.steps_run == 3 and result.interrupted_at_step is None


SECOND_SIGNAL = """
import sys, time
from sweep.run.interrupt import stopping_on_signals
with stopping_on_signals() as request:
    print("ready", flush=True)
    time.sleep(60)  # a step that takes long: the first signal waits for it, the second does not
print("finished the step", flush=True)
"""


def test_a_second_ctrl_c_exits_at_once():
    proc = run_cli("-c", SECOND_SIGNAL, background=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    # Wait for the handler to have seen it: two signals still pending at once count as one.
    first = proc.stderr.readline() + proc.stderr.readline()
    assert "SIGINT: stopping after the current step (SIGINT again to exit at once)" in first
    assert proc.poll() is None  # the first one only asked the step to finish
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGINT and time.monotonic() - start < 5
    assert "finished the step" not in out and "second SIGINT: exiting now" in err


class SignalledLocalLauncher:
    """A launcher by the name of Hydra's joblib one: its launch gets a Ctrl-C, as a sweep's does."""

    __module__ = "hydra_plugins.hydra_joblib_launcher.joblib_launcher"

    def launch(self, job_overrides, initial_job_idx):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # the handler runs (it finds no job process to forward to)
        return []


def test_a_stopped_launch_of_job_processes_runs_after_stop_then_exits_128_plus_signal(monkeypatch):
    """The sweepers pass after_stop: it records the trials of jobs killed while they recorded (joblib kills a
    sweep's other workers when one exits) before the sweep exits."""
    from sweep.run.interrupt import launch_forwarding_signals

    # This process's children are no jobs (an xdist worker may hold a test server): the handler would wait 120 s
    # for them to listen.
    monkeypatch.setattr("sweep.run.interrupt.job_processes", lambda root=None: [])
    calls = []
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as exit_:
        launch_forwarding_signals(SignalledLocalLauncher(), [["a=1"]], 0, lambda: calls.append("after_stop"))
    assert exit_.value.code == 128 + signal.SIGINT and calls == ["after_stop"]
    assert signal.getsignal(signal.SIGINT) is before


def test_ctrl_c_outside_a_run_is_one_line_and_exit_130(capsys, monkeypatch):
    """While Hydra composes, the sweeper checks its cells, between runs or in the sweep's end (its tables): a
    KeyboardInterrupt traceback before, through Hydra's frames."""
    from sweep.__main__ import command_line

    monkeypatch.setenv("HYDRA_FULL_ERROR", "")  # unset for command_line, which sets it; put back after
    with pytest.raises(SystemExit) as exit_:
        with command_line():
            raise KeyboardInterrupt
    assert exit_.value.code == 128 + signal.SIGINT
    err = capsys.readouterr().err.strip()
    assert err.startswith("sweep: SIGINT: stopped; every result.json written so far stands") and "\n" not in err


class Died(BaseException):
    """A job's end by an exception (as a KeyboardInterrupt that comes before its run listens was)."""


def test_a_job_that_ends_by_an_exception_leaves_its_directory_unheld(tmp_path, monkeypatch):
    """Before, the directory stayed held by the live worker process (a loky one is reused), and a Ctrl-C to a
    sweep with job processes waited 120 s for it to be written (sweep/run/interrupt.py forwarding_signals)."""
    from sweep.run.results import is_being_written

    def dies(job):
        assert is_being_written(job.run_dir)  # held while the job runs
        raise Died

    monkeypatch.setattr("sweep.job.state_hooks", dies)
    with pytest.raises(Died):
        multirun_in_process(tmp_path, *SMALL_MODEL, "steps=2")
    assert (tmp_path / "0").is_dir() and not is_being_written(tmp_path / "0")


def _lines_until(proc, needle: str, seen: list[str], timeout: float = 120) -> None:
    """Read the process's output until a line holds `needle` (the rest keeps being read in the background)."""
    found = threading.Event()

    def read():
        for line in proc.stdout:
            seen.append(line)
            if needle in line:
                found.set()
        found.set()

    threading.Thread(target=read, daemon=True).start()
    assert found.wait(timeout), "".join(seen)


@pytest.mark.slow
def test_sigterm_stops_a_sweep_process_and_closes_its_trial(tmp_path):
    sweep_dir = tmp_path / "sweep"
    axes = ["hydra.sweeper.sampler.name=grid", "optim.lr=choice(1e-3,2e-3)", "progress=log", "log_every=1"]
    proc = run_cli(*sweep_cmd(sweep_dir, *axes, "steps=400"), background=True, stderr=subprocess.STDOUT)
    seen: list[str] = []
    try:
        _lines_until(proc, "step 3/400", seen)
        proc.send_signal(signal.SIGTERM)  # what Slurm and `timeout` send
        proc.wait(timeout=60)
    finally:
        proc.kill()
    out = "".join(seen)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "run the same command again to resume the unfinished cells" in out

    result = read_result(sweep_dir / "0")
    step = result["interrupted_at_step"]
    assert result["status"] == "interrupted" and 2 <= step < 399
    rows = metrics_rows(sweep_dir / "0")
    assert len(rows) == step + 1 == result["steps_run"] and result["final_loss"] == pytest.approx(
        float(rows[-1]["loss"])
    )
    assert not (sweep_dir / "1").exists()  # the sweep stopped: no further cell started

    storage = f"sqlite:///{sweep_dir / 'ledger.db'}"
    (trial,) = optuna.load_study(study_name=str(sweep_dir), storage=storage).trials
    assert trial.state is TrialState.FAIL and trial.user_attrs["status"] == "interrupted"


@pytest.mark.slow
def test_ctrl_c_stops_a_grid_and_the_same_command_runs_only_the_unfinished_cells(tmp_path, monkeypatch):
    import sweep.run.execute

    real, ran = sweep.run.execute.execute_runs, []

    def execute_runs(runs, out_dirs, params, labels, hooks=(), *args, **kwargs):
        ran.append(out_dirs[0].name)
        if out_dirs[0].name == "1" and len(ran) == 2:  # Ctrl-C while cell 1 trains, the first time only
            hooks = [SignalAt(1, signal.SIGINT), *hooks]
        return real(runs, out_dirs, params, labels, hooks, *args, **kwargs)

    monkeypatch.setattr(sweep.run.execute, "execute_runs", execute_runs)
    grid = ("optim.lr=1e-3,2e-3,3e-3", "steps=4")
    with pytest.raises(SystemExit) as exit_:
        multirun_in_process(tmp_path, *SMALL_MODEL, *grid)
    assert exit_.value.code == 128 + signal.SIGINT and ran == ["0", "1"]  # no cell after the interrupted one
    stopped = read_result(tmp_path / "1")
    assert (stopped["status"], stopped["interrupted_at_step"], stopped["steps_run"]) == ("interrupted", 1, 2)
    first = (tmp_path / "0" / "result.json").read_text()

    ran.clear()
    multirun_in_process(tmp_path, *SMALL_MODEL, *grid, "threads=1")  # the same sweep (threads does not change a run)
    assert ran == ["1", "2"]  # the finished cell 0 is kept, the interrupted one and the rest run
    assert (tmp_path / "0" / "result.json").read_text() == first
    assert [read_result(tmp_path / n)["status"] for n in "12"] == ["stable", "stable"]


def test_an_interrupted_run_redone_by_a_resume_is_superseded_in_the_report(tmp_path):
    """The Optuna sweeper redoes an interrupted cell as a new trial in a new directory: the report counts
    the cell once, by its finished run."""
    from sweep.report.runs import runs_from_dirs
    from sweep.run.results import RunResult, write_result

    params = {"optim.lr": 1e-3}
    write_result(tmp_path / "0", RunResult("interrupted", params=params, reason="SIGINT after step 1 of 9"))
    write_result(tmp_path / "1", RunResult("stable", params=params, final_loss=0.5, steps_run=9))
    write_result(tmp_path / "2", RunResult("interrupted", params={"optim.lr": 2e-3}))  # not redone yet
    runs = runs_from_dirs(tmp_path).set_index("run_dir")
    assert runs.loc[str((tmp_path / "0").resolve()), "superseded_by"] == str((tmp_path / "1").resolve())
    assert runs.superseded_by.notna().sum() == 1


@pytest.mark.slow
def test_an_interrupted_optuna_batch_leaves_no_trial_running_and_resumes(tmp_path, monkeypatch):
    """n_jobs=2: the first job is interrupted, so the second never starts; its asked trial is failed as
    stale instead of staying RUNNING until its heartbeat goes stale. Neither counts as done: the same
    command runs both cells."""
    import sweep.run.execute
    from sweep.search.ledger import STALE_ATTR

    real = sweep.run.execute.execute_runs

    def execute_runs(runs, out_dirs, params, labels, hooks=(), *args, **kwargs):
        return real(runs, out_dirs, params, labels, [SignalAt(0, signal.SIGTERM), *hooks], *args, **kwargs)

    monkeypatch.setattr(sweep.run.execute, "execute_runs", execute_runs)
    axes = ("hydra/sweeper=optuna_sweep", "hydra.sweeper.sampler.name=grid", "optim.lr=choice(1e-3,2e-3)")
    with pytest.raises(SystemExit):
        multirun_in_process(tmp_path, *SMALL_MODEL, *axes, "hydra.sweeper.n_jobs=2", "steps=5")
    trials = optuna.load_study(study_name=str(tmp_path), storage=f"sqlite:///{tmp_path / 'ledger.db'}").trials
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.FAIL]
    assert trials[0].user_attrs["status"] == "interrupted" and trials[0].user_attrs["interrupted_at_step"] == 0
    assert trials[1].system_attrs.get(STALE_ATTR) is True and not (tmp_path / "1" / "result.json").exists()

    monkeypatch.setattr(sweep.run.execute, "execute_runs", real)  # the same axes again: both cells run
    multirun_in_process(tmp_path, *SMALL_MODEL, *axes, "steps=2")
    trials = optuna.load_study(study_name=str(tmp_path), storage=f"sqlite:///{tmp_path / 'ledger.db'}").trials
    done = sorted(t.params["optim.lr"] for t in trials if t.state is TrialState.COMPLETE)
    assert done == [1e-3, 2e-3] and len(trials) == 4


@pytest.mark.slow
def test_ctrl_c_in_a_packed_sweep_finishes_the_pack_and_starts_no_other(tmp_path, monkeypatch):
    """hydra/launcher=packed: the pack in progress is the window a signal waits for; the same command
    then runs only the packs that did not start."""
    import sweep.run.packing

    real, packs = sweep.run.packing.execute_pack, []

    def execute_pack(runs, out_dirs, *args, **kwargs):
        packs.append(sorted(d.name for d in out_dirs))
        if len(packs) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # while the first pack trains
        return real(runs, out_dirs, *args, **kwargs)

    monkeypatch.setattr(sweep.run.packing, "execute_pack", execute_pack)
    grid = ("hydra/launcher=packed", "hydra.launcher.pack=2", "optim.lr=1e-3,2e-3,3e-3,4e-3", "steps=3")
    with pytest.raises(SystemExit) as exit_:
        multirun_in_process(tmp_path, *SMALL_MODEL, *grid)
    assert exit_.value.code == 128 + signal.SIGINT and len(packs) == 1
    done = sorted(p.parent.name for p in tmp_path.glob("*/result.json"))
    assert done == packs[0] and len(done) == 2
    kept = {n: (tmp_path / n / "result.json").read_text() for n in done}

    multirun_in_process(tmp_path, *SMALL_MODEL, *grid)
    assert sorted(n for p in packs[1:] for n in p) == sorted({"0", "1", "2", "3"} - set(done))
    assert all((tmp_path / n / "result.json").read_text() == text for n, text in kept.items())
    assert len(list(tmp_path.glob("*/result.json"))) == 4


# `python -m sweep`, with Study.ask sending this process a signal once it has asked its first trial: the
# moment the sweeper is asking for a batch (deterministic, no sleep; nothing in the sweep is patched).
SIGNAL_WHILE_ASKING = """
import os, runpy, sys, optuna
real = optuna.Study.ask
def ask(self, *args, **kwargs):
    trial = real(self, *args, **kwargs)
    if trial.number == 0:
        os.kill(os.getpid(), int(os.environ["SIGNAL_AT_ASK"]))
    return trial
optuna.Study.ask = ask
sys.argv = ["sweep", *sys.argv[1:]]
runpy.run_module("sweep", run_name="__main__")
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_optuna_sweeper_asks_fails_the_asked_trials_and_resumes(tmp_path, signum):
    """A signal between two asks of one batch: before, SIGTERM killed the process and SIGINT raised out of
    the ask, both leaving trial 0 RUNNING until it went stale. Now the batch is asked, its trials are
    failed as stale (no run started), exit 128 + signal; the same command runs both cells (the resume needs no
    process of its own: sweep_cmd's overrides through multirun_in_process, one interpreter start-up less)."""
    sweep_dir = tmp_path / "sweep"
    axes = ["hydra.sweeper.sampler.name=grid", "hydra.sweeper.n_jobs=2", "optim.lr=choice(1e-3,2e-3)", "steps=2"]
    cmd = sweep_cmd(sweep_dir, *axes)
    proc = run_cli("-c", SIGNAL_WHILE_ASKING, *cmd[2:], env={"SIGNAL_AT_ASK": str(int(signum))})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 128 + signum, out
    assert "Traceback" not in out and "stopped while asking for the next trials (0, 1 failed" in out, out
    assert not list(sweep_dir.glob("*/result.json"))
    storage = f"sqlite:///{sweep_dir / 'ledger.db'}"
    trials = optuna.load_study(study_name=str(sweep_dir), storage=storage).trials
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.FAIL], out

    # the same command (sweep_cmd's model and axes), in this process
    multirun_in_process(sweep_dir, *SMALL_MODEL, "hydra/sweeper=optuna_sweep", *axes)
    trials = optuna.load_study(study_name=str(sweep_dir), storage=storage).trials
    assert sorted(t.params["optim.lr"] for t in trials if t.state is TrialState.COMPLETE) == [1e-3, 2e-3]
    assert not [t for t in trials if t.state is TrialState.RUNNING]


def _job_logs(sweep_dir) -> dict:
    """The text of every job's log (in the sweep's job directories and a submitit job's log files), by path."""
    logs = {}
    for f in [*sweep_dir.glob("*/*.log"), *sweep_dir.glob(".submitit/*/*_log.*")]:
        try:
            logs[f] = f.read_text(errors="replace")
        except OSError:
            pass
    return logs


def _cells_reached(sweep_dir, step: str, before: dict) -> bool:
    """Whether some job has logged `step` since the logs were `before` (_job_logs then)."""
    for f, text in _job_logs(sweep_dir).items():
        old = before.get(f, "")
        if step in (text[len(old) :] if text.startswith(old) else text):
            return True
    return False


def _signal_the_sweep_at_step_3(cmd, sweep_dir, signum, to_group: bool) -> tuple[int, str]:
    """Start `python -m sweep *cmd` in a process group of its own, send `signum` once a job has logged step 3
    (to the whole group, or the sweep process only), wait until no process of the group is left (asserted), and
    return the sweep's exit status and what it printed."""
    before = _job_logs(sweep_dir)
    proc = run_cli(
        *cmd,
        background=True,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, as a shell gives a command
    )
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 180
        while not (_cells_reached(sweep_dir, "step 3/60", before) or any("step 3/60" in ln for ln in out)):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(out)
            time.sleep(0.2)
        os.killpg(proc.pid, signum) if to_group else proc.send_signal(signum)
        proc.wait(timeout=120)
        for _ in range(600):  # loky's workers and resource tracker notice their parent is gone within seconds
            left = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
            if not left:
                break
            time.sleep(0.1)
    finally:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert not left, subprocess.run(
        ["ps", "-o", "pid,ppid,stat,args", "-g", str(proc.pid)], capture_output=True, text=True
    ).stdout
    return proc.returncode, "".join(out)


def _trials(sweep_dir, storage: str, text: str) -> list:
    """The sweep's trials; an assertion that says what the sweep printed when its study is missing (CI once: the
    jobs' results written, no trial recorded)."""
    try:
        return optuna.load_study(study_name=str(sweep_dir), storage=storage).trials
    except KeyError:
        raise AssertionError(f"no study {sweep_dir} in {storage}; the sweep printed:\n{text}") from None


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])
def test_a_signal_to_a_sweep_with_job_processes_stops_every_run_and_resumes(tmp_path, launcher):
    """Jobs in processes of their own: before, SIGTERM killed only the sweep process (its jobs trained on,
    orphaned) and Ctrl-C with joblib was a KeyboardInterrupt traceback that killed a worker mid-record. Now
    the sweep forwards the signal: every run started ends `interrupted` with its trial closed, no process is
    left, exit 128 + signal, and the same command runs every cell. Both signals, one per start of the same
    command: Ctrl-C to the whole process group (a terminal's), then, on the resume, SIGTERM to the sweep process
    only (`kill`/`timeout`'s), which must reach the jobs through the sweep."""
    sweep_dir = tmp_path / "sweep"
    grid = [f"hydra/launcher={launcher}", "optim.lr=1e-3,2e-3", "threads=1", "log_every=1", "progress=log"]
    grid += ["steps=60"]
    grid += ["hydra.launcher.n_jobs=2"] if launcher == "joblib" else []
    cmd = ["-m", "sweep", "-m", *FAST_ARGS, f"hydra.sweep.dir={sweep_dir}", *grid]
    storage = f"sqlite:///{sweep_dir / 'ledger.db'}"

    code, text = _signal_the_sweep_at_step_3(cmd, sweep_dir, signal.SIGINT, to_group=True)
    assert code == 128 + signal.SIGINT, text
    # Ctrl-C to the group reaches submitit's own controller process too: it used to print a KeyboardInterrupt
    # traceback and kill its job before the trial was recorded; it now ignores SIGINT. No traceback at all.
    assert "Traceback" not in text, text
    first = {p.parent.name: p.read_text() for p in sweep_dir.glob("*/result.json")}
    assert first and all(json.loads(r)["status"] == "interrupted" for r in first.values()), first
    trials = _trials(sweep_dir, storage, text)
    assert len(trials) == len(first) and all(t.user_attrs.get("status") == "interrupted" for t in trials), text
    assert not [t for t in trials if t.state is TrialState.RUNNING]
    # A Ctrl-C to the group reaches a job that is still starting (before its run listens) too: it dies as
    # under kill -9, with no result.json and no trial, and the resume below runs it.

    submitted = set(sweep_dir.glob(".submitit/*"))
    code, text = _signal_the_sweep_at_step_3(cmd, sweep_dir, signal.SIGTERM, to_group=False)
    assert code == 128 + signal.SIGTERM, text
    assert "Traceback" not in text, text
    cells = {p.name for p in sweep_dir.iterdir() if p.name.isdigit()}
    results = {
        n: (sweep_dir / n / "result.json").read_text() for n in cells if (sweep_dir / n / "result.json").exists()
    }
    assert set(results) == cells == {"0", "1"}, (cells, results)  # every cell ran again: the one that died starting too
    assert all(text != first.get(n) and json.loads(text)["status"] == "interrupted" for n, text in results.items())
    if launcher == "submitit_local":
        # each stopped job hands submitit its result: one that exits without it (SystemExit) kept the sweep
        # waiting 15 s for the file (submitit's _results_timeout_s) before it could exit
        pickles = [p for p in sweep_dir.glob(".submitit/*/*_result.pkl") if p.parent not in submitted]
        assert len(pickles) == len(results), (pickles, results)
    trials = _trials(sweep_dir, storage, text)
    assert len(trials) == len(first) + len(results), text
    assert all(t.user_attrs.get("status") == "interrupted" for t in trials)
    assert not [t for t in trials if t.state is TrialState.RUNNING]
