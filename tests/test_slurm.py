"""Sweeps through submitit: on a real single-node Slurm (scripts/slurm.sh) and with submitit's local executor.

The Slurm test needs the daemons; scripts/slurm.sh starts them (root, Debian 12) or exits 3 with the
reason, and then the test is skipped with that reason while the submitit_local sweep still runs.
"""

from __future__ import annotations

import subprocess

import optuna
import pytest
from optuna.trial import TrialState

from .cluster_servers import LEDGER_FROM_ENV, postgres_url, sweep_cmd  # noqa: F401  (fixture)
from .conftest import REPO, read_result, run_cli

pytestmark = pytest.mark.xdist_group("servers")  # with pytest -n: one worker runs apt and the servers

GRID = [
    "hydra.sweeper.sampler.name=grid",
    "precision=fp32,fp16_pure",
    "steps=4",
    "hydra.sweeper.n_jobs=4",
    "hydra.launcher.cpus_per_task=1",
    LEDGER_FROM_ENV,
]
"""Two cells, one stable and one diverged (pure fp16 AdamW), launched as one batch: two jobs show that each job
finishes its own trial with its own verdict as well as four did, at half the job start-ups (an interpreter and
torch import each)."""


@pytest.fixture(scope="session")
def slurm_partition() -> str:
    proc = subprocess.run(["bash", str(REPO / "scripts" / "slurm.sh")], capture_output=True, text=True, timeout=240)
    if proc.returncode == 3:  # the script's "cannot run Slurm here: <why>"
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def run_sweep(tmp_path, url, *launcher):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(*sweep_cmd(sweep_dir, *launcher, *GRID), cwd=tmp_path, env={"SWEEP_LEDGER_URL": url})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep_dir, proc


def check_ledger_and_summary(url, sweep_dir, proc):
    trials = optuna.load_study(study_name=str(sweep_dir), storage=url).trials
    assert len(trials) == 2 and all(t.state is TrialState.COMPLETE for t in trials)
    assert {t.params["precision"] for t in trials} == {"fp32", "fp16_pure"}  # each cell once
    for t in trials:  # each job finished its own trial with its run's verdict
        result = read_result(sweep_dir / t.user_attrs["run_dir"])
        assert (
            t.user_attrs["status"]
            == result["status"]
            == ("diverged" if t.params["precision"] == "fp16_pure" else "stable")
        )
        assert t.user_attrs["steps_run"] == result["steps_run"]
    # the end summary, printed by the sweep command once every job is back
    assert "Divergence map" in proc.stdout and "fp16_pure" in proc.stdout
    assert (sweep_dir / "summary.md").exists()


@pytest.mark.slow
def test_sweep_on_a_real_slurm_cluster_records_every_job(tmp_path, postgres_url, slurm_partition):
    sweep_dir, proc = run_sweep(
        tmp_path,
        postgres_url,
        "hydra/launcher=slurm",
        f"hydra.launcher.partition={slurm_partition}",
        "hydra.launcher.mem_gb=1",
    )
    check_ledger_and_summary(postgres_url, sweep_dir, proc)
    # the runs were Slurm jobs: one array, one submitit folder per array task, named by Slurm's job id
    tasks = sorted(p.name for p in (sweep_dir / ".submitit").iterdir() if p.is_dir() and "_" in p.name)
    assert len(tasks) == 2 and all(t.split("_")[0].isdigit() for t in tasks), tasks  # <slurm job id>_<array index>
    assert len({t.split("_")[0] for t in tasks}) == 1  # one job array for the batch of 2


@pytest.mark.slow
def test_sweep_through_submitit_local_records_every_job(tmp_path, postgres_url):
    # Hydra's basic grid sweeper this time: each job adds its own trial (no trial asked beforehand)
    sweep_dir = tmp_path / "sweep"
    cmd = [
        c
        for c in sweep_cmd(
            sweep_dir,
            "hydra/launcher=submitit_local",
            "hydra.launcher.cpus_per_task=1",
            "precision=fp32,fp16_pure",
            "steps=4",
            LEDGER_FROM_ENV,
        )
        if c != "hydra/sweeper=optuna_sweep"
    ]
    proc = run_cli(*cmd, cwd=tmp_path, env={"SWEEP_LEDGER_URL": postgres_url})
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_ledger_and_summary(postgres_url, sweep_dir, proc)


def test_a_slurm_job_uses_the_cores_it_was_given(monkeypatch):
    from omegaconf import OmegaConf

    from sweep.job import parallel_threads

    slurm = OmegaConf.create(
        {
            "launcher": {
                "_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
                "cpus_per_task": 3,
            }
        }
    )
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    assert parallel_threads(slurm) == 0
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "3")
    assert parallel_threads(slurm) == 3
