"""A ledger that cannot take a trial when its run ends: locked by another process, replaced by garbage,
its server stopped. The run's result.json stands, the wait is bounded, the log names the cause, and the
trial is recorded later (sweep/search/pending.py)."""

from __future__ import annotations

import json
import logging
import subprocess
import time

import optuna
import pytest
from optuna.trial import TrialState

from sweep.job import record
from sweep.search.pending import PENDING_FILE, pending_runs, record_pending
from sweep.sync_ledger import main as sync_main

from .cluster_servers import LEDGER_FROM_ENV, postgres_url  # noqa: F401  (fixture)
from .conftest import REPO, make_run, read_result, run_cli


def result(status="stable", **kw) -> dict:
    return {
        "status": status,
        "final_loss": 0.5,
        "initial_loss": 1.0,
        "steps_run": 3,
        "params": {"optim.lr": 1e-3},
        **kw,
    }


def trials(sweep_dir):
    return optuna.load_study(study_name=str(sweep_dir), storage=f"sqlite:///{sweep_dir / 'ledger.db'}").trials


@pytest.mark.parametrize("seconds", ["-1", "0", "nan", "inf"])
def test_sync_ledger_refuses_a_lock_timeout_the_config_would_refuse(tmp_path, capsys, seconds):
    """ledger.lock_timeout_s must be a finite number > 0; --lock-timeout -1 or nan was taken as it came."""
    with pytest.raises(SystemExit) as e:
        sync_main([str(tmp_path), "--lock-timeout", seconds])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and err[-1].endswith(f"must be a finite number of seconds > 0, got '{seconds}'"), err


HOLD_LOCK = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")  # a write transaction another process keeps open
print("locked", flush=True)
sys.stdin.read()  # until the test closes our stdin
conn.execute("ROLLBACK")
"""


def test_a_locked_ledger_is_waited_for_a_bounded_time_then_the_trial_is_recorded_later(tmp_path, caplog):
    sweep_dir = tmp_path
    run = make_run("ledger.lock_timeout_s=1")
    (sweep_dir / "0").mkdir()
    record(run, sweep_dir, sweep_dir / "0", result())  # the ledger exists, with one trial
    (sweep_dir / "1").mkdir()
    (sweep_dir / "1" / "result.json").write_text(json.dumps(result("diverged", verdict="loss_spike")))

    holder = run_cli("-c", HOLD_LOCK, str(sweep_dir / "ledger.db"), background=True, stdin=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "locked"
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="sweep"):
            record(run, sweep_dir, sweep_dir / "1", read_result(sweep_dir / "1"))
        waited = time.monotonic() - start
        assert waited < 8, waited  # about lock_timeout_s, not minutes
        line = caplog.records[-1].getMessage()
        assert caplog.records[-1].levelno == logging.WARNING
        assert "is locked by another process (waited 1 s, ledger.lock_timeout_s)" in line
        assert f"python -m sweep.sync_ledger {sweep_dir}" in line
        assert pending_runs(sweep_dir) == [sweep_dir / "1"]
        assert record_pending(sweep_dir, lock_timeout_s=0.5)[1]  # still locked: still pending, said why
        assert pending_runs(sweep_dir) == [sweep_dir / "1"]
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)

    assert sync_main([str(sweep_dir)]) == 0  # the lock went away: recorded
    assert not (sweep_dir / "1" / PENDING_FILE).exists()
    recorded = {t.user_attrs["run_dir"]: t for t in trials(sweep_dir)}
    late = recorded[str((sweep_dir / "1").resolve())]
    assert late.state is TrialState.COMPLETE and late.user_attrs["verdict"] == "loss_spike"
    assert len(recorded) == 2


def test_a_ledger_file_replaced_by_random_bytes_loses_no_result_and_says_so(tmp_path, caplog):
    sweep_dir = tmp_path
    run = make_run()
    (sweep_dir / "0").mkdir()
    record(run, sweep_dir, sweep_dir / "0", result())
    (sweep_dir / "ledger.db").write_bytes(bytes(range(256)) * 64)  # mid-sweep, something overwrote it
    (sweep_dir / "1").mkdir()
    (sweep_dir / "1" / "result.json").write_text(json.dumps(result()))
    with caplog.at_level(logging.ERROR, logger="sweep"):
        record(run, sweep_dir, sweep_dir / "1", result())
    line = caplog.records[-1].getMessage()
    assert f"could not record {sweep_dir / '1'}" in line and "file is not a database" in line
    assert "it will be recorded at the end of the sweep" in line
    assert read_result(sweep_dir / "1")["status"] == "stable"
    assert pending_runs(sweep_dir) == [sweep_dir / "1"]
    assert sync_main([str(sweep_dir)]) == 1  # still garbage: still pending, exit 1

    (sweep_dir / "ledger.db").unlink()  # the user moves the damaged file away: a fresh ledger takes it
    assert sync_main([str(sweep_dir)]) == 0
    assert [t.user_attrs["status"] for t in trials(sweep_dir)] == ["stable"]


@pytest.mark.parametrize("value", ["0", "-1"])
def test_lock_timeout_must_be_positive(value):
    from sweep.config import ConfigError

    with pytest.raises(ConfigError, match="ledger.lock_timeout_s: must be > 0"):
        make_run(f"ledger.lock_timeout_s={value}")


@pytest.mark.slow
@pytest.mark.xdist_group("servers")  # it stops the shared server: never beside another PostgreSQL test
def test_postgres_stopped_mid_sweep_loses_no_trial(tmp_path, monkeypatch, postgres_url, capsys):
    """The server goes down while job 1 trains: jobs 1 and 2 keep their results and leave their trials
    pending (the log names the cause); once it is back, python -m sweep.sync_ledger records them."""
    import sweep.run.execute

    from .conftest import multirun_in_process

    sweep_dir = tmp_path / "sweep"
    real = sweep.run.execute.execute_runs

    def execute_runs(runs, out_dirs, *args, **kwargs):
        if out_dirs[0].name == "1":
            subprocess.run(["bash", str(REPO / "scripts" / "postgres.sh"), "stop"], check=True, capture_output=True)
        return real(runs, out_dirs, *args, **kwargs)

    monkeypatch.setattr(sweep.run.execute, "execute_runs", execute_runs)
    monkeypatch.setenv("SWEEP_LEDGER_URL", postgres_url)
    try:
        multirun_in_process(sweep_dir, "optim.lr=1e-3,2e-3,3e-3", "steps=2", LEDGER_FROM_ENV, "ledger.lock_timeout_s=1")
    finally:
        subprocess.run(["bash", str(REPO / "scripts" / "postgres.sh")], check=True, capture_output=True)
    out = "".join(capsys.readouterr())  # Hydra's job logging replaces the handlers caplog would use
    errors = [line for line in out.splitlines() if "ledger: could not record" in line]
    assert len(errors) == 2 and all("failed: Connection refused" in e for e in errors), out[-3000:]
    assert "it will be recorded at the end of the sweep" in errors[0]
    assert out.count("ledger: still not recorded") == 2  # the sweep's end tried again
    assert pending_runs(sweep_dir) == [sweep_dir / "1", sweep_dir / "2"]
    assert all(read_result(sweep_dir / n)["status"] == "stable" for n in "012")

    assert sync_main([str(sweep_dir)]) == 0  # the URL comes from SWEEP_LEDGER_URL, as it did for the sweep
    study = optuna.load_study(study_name=str(sweep_dir), storage=postgres_url)
    assert sorted(t.user_attrs["run_dir"] for t in study.trials) == [str(sweep_dir / n) for n in "012"]
    assert pending_runs(sweep_dir) == []


def test_a_sweeper_trial_failed_before_its_run_was_recorded_gets_a_new_trial_with_its_params(tmp_path):
    """Recorded late, a sweeper's trial has been failed meanwhile (the sweeper settles what its job left
    RUNNING): the run becomes a new trial in the sweeper's search space, with the asked params."""
    from dataclasses import replace

    from sweep.config import LedgerConfig
    from sweep.search.ledger import record_run

    storage = f"sqlite:///{tmp_path / 'ledger.db'}"
    study = optuna.create_study(study_name=str(tmp_path), storage=storage)
    asked = study.ask({"optim.lr": optuna.distributions.FloatDistribution(1e-5, 1e-1, log=True)})
    study.tell(asked, state=TrialState.FAIL)
    number = record_run(replace(LedgerConfig(), trial_number=asked.number), tmp_path, tmp_path / "0", result())
    late = trials(tmp_path)[number]
    assert number != asked.number and late.state is TrialState.COMPLETE
    assert late.params == asked.params and late.distributions == asked.distributions
    assert late.user_attrs["status"] == "stable"


def test_a_refused_connection_is_not_retried_but_a_locked_database_is():
    """Nothing listening at the server's address: the run is left pending at once (it used to wait ~10 s of
    backoff per run); a SQLite lock held by another writer is a race, retried until it is free."""
    from sweep.search.ledger import with_retries

    calls = []

    def refused():
        calls.append(1)
        raise RuntimeError('connection to server at "127.0.0.1", port 9 failed: Connection refused')

    with pytest.raises(RuntimeError, match="Connection refused"):
        with_retries(refused, "create_study")
    assert len(calls) == 1

    def locked_twice():
        calls.append(1)
        if len(calls) < 4:
            raise RuntimeError("database is locked")
        return "recorded"

    assert with_retries(locked_twice, "create_study") == "recorded" and len(calls) == 4


def test_a_sweep_dir_spelled_with_dots_keeps_its_late_trial_in_its_one_study(tmp_path, monkeypatch):
    """issue 45 (red team, 2): `hydra.sweep.dir=x/../s` and a ledger locked when one run ended. The jobs recorded
    into a study named `x/../s`, the late trial into one named by the resolved path: two studies, one sweep."""
    import sqlite3

    import sweep.job

    from .conftest import multirun_in_process

    real, calls = sweep.job.record_run, []

    def locked_once(*args, **kwargs):
        calls.append(args[2])
        if len(calls) == 1:
            raise sqlite3.OperationalError("database is locked")
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep.job, "record_run", locked_once)
    (tmp_path / "x").mkdir()
    multirun_in_process(tmp_path / "x" / ".." / "s", "ledger.lock_timeout_s=1", "steps=2", "optim.lr=1e-3,2e-3")
    assert len(calls) == 2 and not pending_runs(tmp_path / "s")  # the first recorded at the sweep's end
    url = f"sqlite:///{tmp_path / 's' / 'ledger.db'}"
    assert optuna.get_all_study_names(url) == [str(tmp_path / "s")]
    assert len(trials(tmp_path / "s")) == 2


class Killed(BaseException):
    """What a job killed mid-record amounts to here: it never returns from writing the ledger."""


def test_a_job_killed_while_it_records_leaves_its_trial_pending_not_lost(tmp_path, monkeypatch):
    """joblib kills a sweep's other workers when one job exits (sweep/run/interrupt.py), sometimes while one
    of them records its trial. Before, its result.json stood and its trial was lost; now the marker is left
    before the ledger is written, and removed once the trial is in."""
    sweep_dir, run_dir = tmp_path, tmp_path / "0"
    run_dir.mkdir()
    (run_dir / "result.json").write_text(json.dumps(result("interrupted", interrupted_at_step=3)))

    def killed(*args, **kwargs):
        raise Killed

    monkeypatch.setattr("sweep.job.record_run", killed)
    with pytest.raises(Killed):
        record(make_run(), sweep_dir, run_dir, read_result(run_dir))
    assert pending_runs(sweep_dir) == [run_dir]
    monkeypatch.undo()

    assert record_pending(sweep_dir) == ([run_dir], [])
    (trial,) = trials(sweep_dir)
    assert trial.user_attrs["status"] == "interrupted" and trial.user_attrs["interrupted_at_step"] == 3
    record(make_run(), sweep_dir, run_dir, read_result(run_dir))  # recorded at once: no marker stays behind
    assert pending_runs(sweep_dir) == [] and len(trials(sweep_dir)) == 2


def test_a_pending_trial_whose_job_still_writes_its_directory_is_left_to_that_job(tmp_path):
    """A marker exists while its job records (above): a sweep that starts meanwhile (another worker of a
    cluster sweep) or sync_ledger must not record that trial a second time."""
    from sweep.run.results import hold_run_dir, release_run_dir
    from sweep.search.pending import RECORDING, mark_pending

    run_dir = tmp_path / "0"
    run_dir.mkdir()
    (run_dir / "result.json").write_text(json.dumps(result()))
    run = make_run()
    assert mark_pending(run.ledger, tmp_path, run_dir, 10.0, RECORDING)
    hold_run_dir(run_dir)  # this process is the job: a live writer of the directory
    try:
        assert pending_runs(tmp_path) == [] and record_pending(tmp_path) == ([], [])
    finally:
        release_run_dir(run_dir)
    assert pending_runs(tmp_path) == [run_dir]
