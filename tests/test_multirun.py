"""A real `python -m sweep -m` grid in a subprocess: every job writes its files, the summary prints."""

from __future__ import annotations

import pytest

from .conftest import FAST, SMALL_MODEL, read_result, run_cli


@pytest.mark.slow
def test_multirun_grid_records_every_job_and_prints_the_summary(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        "-m",
        "sweep",
        "-m",
        "precision=fp32,fp16_pure",
        "optim.lr=1e-4,1e-3",
        "attention=flash,math",
        "steps=4",
        *FAST,
        *SMALL_MODEL,
        f"hydra.sweep.dir={sweep_dir}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dirs = sorted(p.parent for p in sweep_dir.glob("*/result.json"))
    assert len(run_dirs) == 8
    for run_dir in run_dirs:
        r = read_result(run_dir)
        if r["device"].startswith("cuda") and (r["params"]["precision"], r["params"]["attention"]) == ("fp32", "flash"):
            assert r["status"] == "skipped" and "needs fp16/bf16" in r["reason"], r  # CUDA's flash: half only
            continue
        assert r["status"] in ("stable", "diverged"), r
        # params: every override of the run under its dotted name (the sweep varies three of them)
        assert {"precision", "optim.lr", "attention", "steps"} <= set(r["params"])
        assert r["params"]["precision"] in ("fp32", "fp16_pure") and r["params"]["optim.lr"] in (1e-4, 1e-3)
        assert (run_dir / "metrics.csv").exists() and (run_dir / ".hydra" / "config.yaml").exists()
        if r["params"]["precision"] == "fp16_pure":
            assert r["status"] == "diverged"  # AdamW in pure fp16: the first update is 0/0
    assert "Divergence map (columns: precision/attention" in proc.stdout and "fp16_pure/flash" in proc.stdout
    assert (sweep_dir / "summary.md").exists() and (sweep_dir / "summary.csv").exists()
