"""The end-of-multirun summary (sweep.callbacks.SweepSummary): in-process on a synthetic sweep, and for a
real small `python -m sweep -m` grid, whose run directories and ledger then give the same report."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from sweep.callbacks import SweepSummary
from sweep.report.__main__ import main as report_main

from .conftest import FAST, run_cli
from .test_report_tables import make_grid

TITLES = (
    "Divergence map (columns: precision/attention",
    "Stability frontier",
    "LR sensitivity",
    "Effect of each toggle",
    "Root causes",
    "Recommendation",
)


def test_callback_prints_the_tables_and_saves_them(tmp_path, capsys):
    root = make_grid(tmp_path / "sweep")
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(root)}}}))
    out = capsys.readouterr().out
    for title in TITLES:
        assert title in out
    assert "Use precision=bf16_amp attention=flash optim.lr=0.01" in out
    assert f"python -m sweep.report {root}" in out
    for name in ("summary.md", "summary.csv", "summary.parquet", "summary_frontier.csv"):
        assert (root / name).exists(), name


def test_callback_on_a_sweep_without_results_says_so(tmp_path, capsys, caplog):
    (tmp_path / "empty").mkdir()
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "empty")}}}))
    assert "no run of this sweep wrote a result.json" in caplog.text
    assert not (tmp_path / "empty" / "summary.md").exists()


@pytest.mark.slow
def test_real_multirun_ends_with_the_summary_and_both_sources_agree(tmp_path, capsys):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        "-m",
        "sweep",
        "-m",
        "precision=fp32,fp16_pure",
        "optim.lr=1e-4,1e-3",
        "steps=3",
        *FAST,
        f"hydra.sweep.dir={sweep_dir}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout
    assert "4 runs: 2 stable, 2 diverged" in printed
    for title in (
        "Divergence map (columns: precision",
        "Stability frontier",
        "LR sensitivity",
        "Effect of each toggle",
        "Root causes",
        "Recommendation",
    ):
        assert title in printed
    assert "nan-loss@" in printed and "Use precision=fp32 optim.lr=0.001 (eval loss" in printed
    assert {"summary.md", "summary.csv", "summary.parquet"} <= {p.name for p in sweep_dir.iterdir()}

    assert report_main([str(sweep_dir), "--no-html"]) == 0
    from_dirs = capsys.readouterr().out
    assert report_main([str(sweep_dir / "ledger.db")]) == 0  # the ledger the runs wrote themselves
    assert capsys.readouterr().out == from_dirs
    assert from_dirs.split("\n\nRecommendation")[0] in printed  # the same tables as at the end of the sweep
    page = (sweep_dir / "report.html").read_text()
    assert page.count('id="curves-') == 2  # fp32 and fp16_pure, curves read from the trials' run dirs


def test_a_job_marks_its_directory_as_being_written_until_recorded(tmp_path, monkeypatch, capsys):
    """What tells a running job from a killed one: the job's lock, held from its start to its record."""
    import sweep.job
    from sweep.report.runs import runs_from_dirs
    from sweep.run.results import RUNNING_LOCK, is_being_written

    from .conftest import multirun_in_process

    seen, real = [], sweep.job.execute

    def execute(run, out_dir, *a, **k):
        seen.append((is_being_written(out_dir), runs_from_dirs(tmp_path / "s", starting_s=0).status.tolist()))
        return real(run, out_dir, *a, **k)

    monkeypatch.setattr(sweep.job, "execute", execute)
    multirun_in_process(tmp_path / "s", "steps=2", "optim.lr=1e-4,1e-3")
    assert seen == [(True, ["running"]), (True, ["stable", "running"])]
    assert not any((tmp_path / "s" / n / RUNNING_LOCK).exists() for n in ("0", "1"))
    assert "2 runs: 2 stable" in capsys.readouterr().out
