"""Local parallel runs (hydra/launcher=joblib) give the same results as the sequential launcher."""

from __future__ import annotations

import os

import optuna
import pytest

from .conftest import FAST, SMALL_MODEL, multirun_in_process, read_result, run_cli

GRID = ["precision=fp32,fp16_amp", "optim.lr=1e-4,1e-1", "steps=8", *FAST, *SMALL_MODEL]
"""Two cells stable and two diverged (lr 1e-1 spikes by step 4 at the small model: fp32 and fp16_amp alike)."""


def sweep(tmp_path, name, *args, in_process=False):
    """The grid into tmp_path/name, on the command line (or through the same multirun in this process):
    {(precision, lr): (status, verdict, first bad step, metrics.csv)} and the sweep dir."""
    out = tmp_path / name
    if in_process:
        multirun_in_process(out, *GRID, *args)
    else:
        proc = run_cli("-m", "sweep", "-m", *GRID, *args, f"hydra.sweep.dir={out}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
    runs = {}
    for run_dir in (p.parent for p in out.glob("*/result.json")):
        r = read_result(run_dir)
        key = (r["params"]["precision"], r["params"]["optim.lr"])
        runs[key] = (r["status"], r["verdict"], r["first_bad_step"], (run_dir / "metrics.csv").read_text())
    return runs, out


@pytest.mark.slow
def test_joblib_with_two_workers_matches_sequential_bit_for_bit(tmp_path):
    sequential, _ = sweep(tmp_path, "seq", "threads=1", in_process=True)  # the basic launcher: in this process
    parallel, out = sweep(tmp_path, "joblib", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2")  # threads: auto
    assert len(sequential) == 4 and sequential == parallel  # same verdicts and identical loss curves
    assert any(v[0] == "diverged" for v in parallel.values()) and any(v[0] == "stable" for v in parallel.values())
    (summary,) = optuna.get_all_study_summaries(f"sqlite:///{out / 'ledger.db'}")
    assert summary.n_trials == 4  # two worker processes wrote into the one ledger


def test_parallel_jobs_split_the_cores(monkeypatch):
    from omegaconf import OmegaConf

    from sweep.job import parallel_threads

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    joblib = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
    assert parallel_threads(OmegaConf.create({"launcher": {"_target_": joblib, "n_jobs": 2}})) == 4
    assert parallel_threads(OmegaConf.create({"launcher": {"_target_": joblib, "n_jobs": -1}})) == 1
    assert parallel_threads(OmegaConf.create({"launcher": {"_target_": joblib, "n_jobs": 16}})) == 1
    basic = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
    assert parallel_threads(OmegaConf.create({"launcher": {"_target_": basic}})) == 0
