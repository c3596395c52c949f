"""optuna-dashboard opens our ledger and shows our trials with their verdicts (its HTTP API, on loopback)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from sweep.config import LedgerConfig
from sweep.search.ledger import record_run, storage_url

# The console script beside this interpreter (make test does not activate the venv), else on PATH.
DASHBOARD = (
    str(Path(sys.executable).parent / "optuna-dashboard")
    if (Path(sys.executable).parent / "optuna-dashboard").exists()
    else shutil.which("optuna-dashboard")
)
pytestmark = pytest.mark.skipif(
    DASHBOARD is None, reason="optuna-dashboard not installed (pip install -e '.[dashboard]')"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, deadline: float):
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.3)


def test_dashboard_shows_our_trials(tmp_path):
    cfg = LedgerConfig(study_name="demo")
    for i, status in enumerate(["stable", "diverged"]):
        record_run(
            cfg,
            tmp_path,
            tmp_path / str(i),
            {
                "status": status,
                "verdict": "nonfinite_loss" if status == "diverged" else None,
                "final_loss": 0.5,
                "initial_loss": 1.0,
                "first_bad_step": 1 if status == "diverged" else None,
                "params": {"optim.lr": 10.0 ** -(i + 3)},
            },
        )
    from sweep.report.study import runs_from_study
    from sweep.report.summary import summarize
    from sweep.search.answer import record_sweep_answer

    answer = summarize(runs_from_study(storage_url(cfg, tmp_path))[0])
    assert record_sweep_answer(cfg, tmp_path, answer) is None  # what the end of every multirun writes
    port = free_port()
    proc = subprocess.Popen(
        [DASHBOARD, storage_url(cfg, tmp_path), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 30
        (summary,) = get(f"http://127.0.0.1:{port}/api/studies", deadline)["study_summaries"]
        assert summary["study_name"] == "demo"
        trials = get(f"http://127.0.0.1:{port}/api/studies/{summary['study_id']}?after=0", deadline)["trials"]
        assert [t["state"] for t in trials] == ["Complete", "Complete"]
        verdicts = [{a["key"]: a["value"] for a in t["user_attrs"]}["verdict"] for t in trials]
        assert verdicts == ["null", "nonfinite_loss"]  # the dashboard shows attrs as JSON
        # The study page's "Study User Attributes" table: the sweep's answer, strings as they are, the rest as JSON.
        detail = get(f"http://127.0.0.1:{port}/api/studies/{summary['study_id']}?after=0", deadline)
        shown = {a["key"]: a["value"] for a in detail["user_attrs"]}
        assert shown["recommendation"] == answer.recommendation.line and shown["recommended_trials"] == "[0]"
        assert shown["recommended"] == '{"optim.lr": 0.001}'
    finally:
        proc.terminate()
        proc.wait(timeout=10)
