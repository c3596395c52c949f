"""The ledger in PostgreSQL (started by scripts/postgres.sh): concurrent sweepers, killed workers, no password leaks."""

from __future__ import annotations

import subprocess
import time

import optuna
import pytest
from optuna.trial import TrialState

from .cluster_servers import LEDGER_FROM_ENV, postgres_url, sweep_cmd  # noqa: F401  (fixture)
from .conftest import SMALL_MODEL, kill_mid_run, multirun_in_process, read_result, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("servers")]  # one worker: apt and the server


def trials(url, sweep_dir):
    return optuna.load_study(study_name=str(sweep_dir), storage=url).trials


def cell(t):
    return tuple(sorted(t.params.items()))


def test_four_concurrent_workers_run_an_8_cell_grid_each_cell_once(tmp_path, postgres_url):
    """Twice as many cells as workers: all four race for the first cells, and the winners race again for the rest
    (20 cells checked nothing more, at 12 more job compositions). The test server trusts loopback, so a password
    in the URL is sent but never checked: it must still reach no file of the sweep (Hydra's saved configs, logs,
    result.json, summaries)."""
    secret = "not-a-real-pw-7f3a"
    with_password = postgres_url.replace("://sweep@", f"://sweep:{secret}@")
    sweep_dir = tmp_path / "sweep"
    grid = [
        "hydra.sweeper.sampler.name=grid",
        "precision=fp32,fp16_pure",
        "optim.lr=choice(1e-4,1e-3)",
        "seed=choice(0,1)",
        "steps=2",
        "hydra.sweeper.heartbeat_s=1",
        LEDGER_FROM_ENV,
    ]
    cmd = sweep_cmd(sweep_dir, *grid)  # the same command on four "nodes", one shared study
    workers = [run_cli(*cmd, cwd=tmp_path, env={"SWEEP_LEDGER_URL": with_password}, background=True) for _ in range(4)]
    outs = [w.communicate(timeout=600) for w in workers]
    assert [w.returncode for w in workers] == [0] * 4, [err[-2000:] for _, err in outs]
    ts = trials(postgres_url, sweep_dir)
    assert len(ts) == 8 and all(t.state is TrialState.COMPLETE for t in ts)  # nothing claimed twice, not even as FAIL
    assert len({cell(t) for t in ts}) == 8
    for t in ts:  # each run finished its own trial: stable feasible, diverged (pure fp16 AdamW) infeasible
        result = read_result(sweep_dir / t.user_attrs["run_dir"])
        assert (
            t.user_attrs["status"]
            == result["status"]
            == ("diverged" if t.params["precision"] == "fp16_pure" else "stable")
        )
        assert t.system_attrs["constraints"] == ([1.0] if result["status"] == "diverged" else [-1.0])
    assert len({t.user_attrs["run_dir"] for t in ts}) == 8
    # the workers really ran side by side: some runs overlap in time
    spans = sorted((t.datetime_start, t.datetime_complete) for t in ts)
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:]))
    leaked = [p for p in sweep_dir.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaked and not any(secret in out + err for out, err in outs)


def test_killed_worker_resumes_with_exactly_the_missing_runs(tmp_path, postgres_url, monkeypatch):
    sweep_dir = tmp_path / "sweep"
    args = [
        "hydra.sweeper.sampler.name=grid",
        "precision=fp32,bf16_amp",
        "optim.lr=choice(1e-4,1e-3)",
        "hydra.sweeper.heartbeat_s=1",
        "hydra.sweeper.stale_after_s=3",
        LEDGER_FROM_ENV,
    ]
    proc = run_cli(
        *sweep_cmd(sweep_dir, "steps=150", "progress=log", "log_every=1", *args),  # steps in the jobs' logs
        cwd=tmp_path,
        env={"SWEEP_LEDGER_URL": postgres_url},
        background=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    kill_mid_run(proc, sweep_dir, "step 3/150")  # the second run mid-way
    killed = trials(postgres_url, sweep_dir)
    running = [t.number for t in killed if t.state is TrialState.RUNNING]
    assert len(running) == 1, [t.state for t in killed]
    done_before = {t.number: (t.params, t.value) for t in killed if t.state is TrialState.COMPLETE}
    assert 1 <= len(done_before) < 4
    time.sleep(3.5)  # past stale_after_s: the killed worker's heartbeat is too old
    # The resume in this process (no interpreter start-up): only the killed worker had to be a process of its own.
    monkeypatch.setenv("SWEEP_LEDGER_URL", postgres_url)
    multirun_in_process(sweep_dir, *SMALL_MODEL, "hydra/sweeper=optuna_sweep", "steps=4", *args)
    ts = trials(postgres_url, sweep_dir)
    assert ts[running[0]].state is TrialState.FAIL and ts[running[0]].system_attrs["stale"]
    assert len(ts) == len(killed) + (4 - len(done_before))  # exactly the missing cells ran
    complete = [cell(t) for t in ts if t.state is TrialState.COMPLETE]
    assert len(complete) == 4 == len(set(complete))
    assert all((ts[n].params, ts[n].value) == before for n, before in done_before.items())  # nothing lost or redone
