"""The end-of-multirun summary (sweep.callbacks.SweepSummary): in-process on a synthetic sweep, and for a
real small multirun grid, whose run directories and ledger then give the same report."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from sweep.callbacks import SweepSummary
from sweep.report.__main__ import main as report_main

from .conftest import run_cli
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
    assert f"HTML report: {root / 'report.html'}" in out  # issue 45 item 6: written at every multirun end
    for name in ("summary.md", "summary.csv", "summary.parquet", "summary_frontier.csv", "report.html"):
        assert (root / name).exists(), name
    assert len(list(root.glob("plotly-*.min.js"))) == 1


def test_callback_on_a_sweep_without_results_says_so(tmp_path, capsys, caplog):
    (tmp_path / "empty").mkdir()
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "empty")}}}))
    assert "no run of this sweep wrote a result.json" in caplog.text
    assert not (tmp_path / "empty" / "summary.md").exists()


@pytest.mark.slow
def test_real_multirun_ends_with_the_summary_and_both_sources_agree(tmp_path, capsys):
    """A real multirun (Hydra's, with our callbacks) in this process: what the summary prints is read from capsys.
    That `python -m sweep -m` itself prints it and exits 0 is tests/test_multirun.py's."""
    from .conftest import multirun_in_process

    sweep_dir = tmp_path / "sweep"
    multirun_in_process(sweep_dir, "precision=fp32,fp16_pure", "optim.lr=1e-4,1e-3", "steps=3")
    printed = capsys.readouterr().out
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
    import sweep.run.execute
    from sweep.report.runs import runs_from_dirs
    from sweep.run.results import RUNNING_LOCK, is_being_written

    from .conftest import multirun_in_process

    seen, real = [], sweep.run.execute.execute_runs

    def execute_runs(runs, out_dirs, *a, **k):
        seen.append((is_being_written(out_dirs[0]), runs_from_dirs(tmp_path / "s", starting_s=0).status.tolist()))
        return real(runs, out_dirs, *a, **k)

    monkeypatch.setattr(sweep.run.execute, "execute_runs", execute_runs)
    multirun_in_process(tmp_path / "s", "steps=2", "optim.lr=1e-4,1e-3")
    assert seen == [(True, ["running"]), (True, ["stable", "running"])]
    assert not any((tmp_path / "s" / n / RUNNING_LOCK).exists() for n in ("0", "1"))
    assert "2 runs: 2 stable" in capsys.readouterr().out


def ledger_grid(tmp_path) -> tuple:
    """The synthetic grid of test_report_tables, each run recorded in the sweep's ledger as its job would."""
    import json

    from sweep.config import LedgerConfig
    from sweep.search.ledger import record_run

    root, cfg = make_grid(tmp_path / "sweep"), LedgerConfig()
    for path in sorted(root.glob("*/result.json")):
        record_run(cfg, root, path.parent, json.loads(path.read_text()))
    return root, cfg


def end_of(root, **ledger) -> None:
    config = {"hydra": {"sweep": {"dir": str(root)}}, "ledger": {"enabled": True, "lock_timeout_s": 30, **ledger}}
    SweepSummary().on_multirun_end(OmegaConf.create(config))


def test_the_study_carries_the_answer_the_summary_gives(tmp_path, capsys):
    """issue 44 (one answer everywhere): optuna-dashboard shows the study's user attrs, and a finished trial
    cannot change; so the end of a multirun writes the recommendation there: its line and settings, and the
    trials of the recommended setting."""
    import optuna

    from sweep.report.runs import PARAM, runs_from_dirs
    from sweep.report.summary import summarize
    from sweep.search.ledger import storage_url

    root, cfg = ledger_grid(tmp_path)
    end_of(root)
    out = capsys.readouterr().out
    study = optuna.load_study(study_name=str(root), storage=storage_url(cfg, root))
    attrs, summary = study.user_attrs, summarize(runs_from_dirs(root))
    assert attrs["recommendation"] == summary.recommendation.line
    assert " ".join(out.split()).count(" ".join(attrs["recommendation"].split())) == 1  # the line printed
    assert (
        attrs["recommended"]
        == summary.recommendation.settings
        == {
            "precision": "bf16_amp",
            "attention": "flash",
            "optim.lr": 0.01,
        }
    )
    runs = summary.runs
    of_setting = runs[
        (runs.status == "stable")
        & (runs[PARAM + "precision"] == "bf16_amp")
        & (runs[PARAM + "attention"] == "flash")
        & (runs[PARAM + "optim.lr"] == 0.01)
    ]
    number = {t.user_attrs["run_dir"]: t.number for t in study.trials}
    assert attrs["recommended_trials"] == sorted(number[d] for d in of_setting.run_dir) and len(of_setting) == 1
    for n in attrs["recommended_trials"]:
        attrs_n = study.trials[n].user_attrs  # params in user attrs (the strings had no choices here)
        assert attrs_n["params"] | {"status": attrs_n["status"]} == {
            "precision": "bf16_amp",
            "attention": "flash",
            "optim.lr": 0.01,
            "steps": 8,
            "status": "stable",
        }
    assert attrs["marginal_trials"] == [] and attrs["quality"] == "final_loss"


def test_marginal_runs_are_named_by_their_trials():
    """The runs table's `marginal` column (the report's, decided across the sweep) as trial numbers."""
    import types

    import pandas as pd

    from sweep.report.recommend import Recommendation
    from sweep.search.answer import answer_attrs

    runs = pd.DataFrame(
        {
            "status": ["stable", "stable", "stable", "diverged"],
            "run_dir": ["/s/0", "/s/1", "/s/2", "/s/3"],
            "final_loss": [0.1, 0.11, 0.9, None],
            "param:optim.lr": [1e-3, 1e-3, 1e-2, 1e-1],
            "marginal": [False, False, True, pd.NA],
        }
    )
    summary = types.SimpleNamespace(
        runs=runs, recommendation=Recommendation("Use optim.lr=0.001", settings={"optim.lr": 1e-3})
    )
    attrs = answer_attrs(summary, {"/s/0": 4, "/s/1": 5, "/s/2": 6, "/s/3": 7})
    assert (attrs["recommended_trials"], attrs["marginal_trials"]) == ([4, 5], [6])


HOLD_LOCK = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("fault", ["off", "damaged", "unreachable", "locked"])
def test_a_ledger_that_cannot_take_the_answer_costs_one_warning_line_never_the_summary(tmp_path, capsys, caplog, fault):
    import logging
    import subprocess

    root = make_grid(tmp_path / "sweep")
    ledger, holder = {"enabled": fault != "off", "lock_timeout_s": 1}, None
    if fault == "damaged":
        (root / "ledger.db").write_bytes(b"not a database, " * 64)
    if fault == "unreachable":
        ledger["storage"] = "postgresql://sweeper@127.0.0.1:9/sweeps"  # nothing listens on port 9 (discard)
    if fault == "locked":
        ledger_grid(tmp_path / "locked")
        root = tmp_path / "locked" / "sweep"
        holder = run_cli("-c", HOLD_LOCK, str(root / "ledger.db"), background=True, stdin=subprocess.PIPE)
        assert holder.stdout.readline().strip() == "locked"
    try:
        with caplog.at_level(logging.WARNING, logger="sweep"):
            end_of(root, **ledger)
    finally:
        if holder is not None:
            holder.stdin.close()
            holder.wait(timeout=10)
    assert "Use precision=bf16_amp attention=flash optim.lr=0.01" in capsys.readouterr().out  # the summary stands
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    if fault == "off":
        assert not lines and not (root / "ledger.db").exists()  # no ledger is made for the answer alone
        return
    (line,) = lines
    text = line.getMessage()
    assert text.startswith("ledger: the sweep's answer is not in ") and "\n" not in text and not line.exc_info, text
