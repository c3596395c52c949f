"""report.html (issue 45 item 6): written at the end of every multirun unless report.html=false, plotly.js loaded
from one file beside it (never inlined, never a CDN) unless --self-contained, and its curves downsampled so that a
100-run sweep of 1000-step runs makes a page under 2 MB; a downsampled curve keeps its spikes and the diverged
run's first bad step."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from sweep.callbacks import SweepSummary
from sweep.report.__main__ import main as report_main
from sweep.report.html import MAX_POINTS, curve, curve_figures, plotly_js_name
from sweep.report.runs import runs_from_dirs

from .conftest import SMALL_MODEL, multirun_in_process
from .test_report_tables import make_grid, write_run

STEPS = 1000


def write_long_run(root, n: int, params: dict, result: dict, loss: np.ndarray) -> None:
    """A run of write_run's, its metrics.csv replaced by `loss` (and a grad norm, a loss scale, an eval loss
    every 50 steps) at full float precision, as the loop writes it."""
    run_dir = write_run(root, n, params, result, steps=len(loss))
    rng = np.random.default_rng(n)
    rows = ["step,loss,grad_norm,lr,loss_scale,eval_loss"]
    for step, value in enumerate(loss):
        ev = repr(float(value) + 0.01) if step % 50 == 0 and np.isfinite(value) else ""
        rows.append(
            f"{step},{float(value)!r},{float(rng.random())!r},{params['optim.lr']},{65536.0 / 2 ** (step // 300)},{ev}"
        )
    (run_dir / "metrics.csv").write_text("\n".join(rows) + "\n")


def noisy_loss(seed: int, steps: int = STEPS) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 0.3 + 0.7 * np.exp(-np.arange(steps) / 200) + rng.normal(0, 0.02, steps)


@pytest.fixture(scope="module")
def sweep_100(tmp_path_factory):
    """100 runs of 1000 steps: 5 precisions x 5 lrs x 2 attentions x 2 seeds, the largest lr diverged."""
    root = tmp_path_factory.mktemp("html") / "sweep"
    n = 0
    for precision in ("fp32", "bf16_amp", "fp16_amp", "fp16_pure", "bf16_pure"):
        for lr in (1e-4, 3e-4, 1e-3, 3e-3, 3e-2):
            for attention in ("flash", "math"):
                for seed in (0, 1):
                    params = {"precision": precision, "optim.lr": lr, "attention": attention, "seed": seed}
                    loss, result = noisy_loss(n), {"status": "stable", "final_loss": 0.3}
                    if lr == 3e-2:
                        loss, result = (
                            loss[:801],
                            {"status": "diverged", "verdict": "loss_spike", "first_bad_step": 800},
                        )
                    write_long_run(root, n, params, result, loss)
                    n += 1
    return root


def test_a_100_run_report_loads_plotly_beside_it_and_stays_under_2_mb(sweep_100, capsys):
    """Before: plotly.js (4.8 MB) inline and every point of every curve at full precision (17 digits)."""
    assert report_main([str(sweep_100)]) == 0
    page = (sweep_100 / "report.html").read_text()
    script = sweep_100 / plotly_js_name()
    assert script.is_file() and script.stat().st_size > 1_000_000
    assert f'<script type="text/javascript" src="{script.name}"></script>' in page
    assert "https://" not in page.split("<body>")[0]  # no CDN
    assert "plotly.js v" not in page and len(page.encode()) < 2_000_000, len(page.encode())
    assert "python -m sweep.report SWEEP_DIR --self-contained" in page  # what to do when the script is missing
    assert page.count('id="curves-') == 10
    before = script.stat().st_mtime_ns
    assert report_main([str(sweep_100), "--no-html"]) == 0 and report_main([str(sweep_100)]) == 0
    assert script.stat().st_mtime_ns == before  # written once: not rewritten while it is there, whole


def test_self_contained_inlines_plotly(sweep_100, tmp_path, capsys):
    out = tmp_path / "mail" / "one.html"
    out.parent.mkdir()
    assert report_main([str(sweep_100), "--self-contained", "--html", str(out)]) == 0
    page = out.read_text()
    assert "plotly.js v" in page and 'src="plotly-' not in page and "plotly-missing" not in page
    assert [p.name for p in out.parent.iterdir()] == ["one.html"]


def test_downsampling_keeps_the_spike_the_bad_step_and_the_ends():
    loss = noisy_loss(0)
    loss[437] = 50.0  # a one-step spike
    loss[999] = np.nan  # the run's last step: its loss went non-finite
    x, y = curve(pd.Series(np.arange(STEPS)), pd.Series(loss), keep=777)
    assert len(x) <= MAX_POINTS + 4 and x == sorted(x)
    assert y[x.index(437)] == 50.0 and 777 in x and x[0] == 0 and x[-1] == 999 and y[-1] is None
    assert min(v for v in y if v is not None) == float(f"{np.nanmin(loss):.4g}")  # the lowest point stays too
    assert all(v is None or len(repr(v).replace("-", "").lstrip("0.")) <= 10 for v in y)  # 4 digits, not 17
    short = noisy_loss(1, 30)
    assert curve(pd.Series(range(30)), pd.Series(short))[0] == list(range(30))  # short runs untouched


def test_a_diverged_run_keeps_its_bad_step_marker_after_downsampling(sweep_100):
    runs = runs_from_dirs(sweep_100)
    fig = curve_figures(runs[runs["param:precision"] == "fp32"])[0]
    marks = [t for t in fig["data"] if t["mode"] == "markers" and t["marker"]["symbol"] == "x"]
    assert len(marks) == 2 and all(t["x"] == [800] for t in marks)  # one per diverged run (2 seeds)
    lines = [t for t in fig["data"] if t["mode"] == "lines" and t["yaxis"] == "y" and len(t["x"]) > 100]
    assert lines and all(len(t["x"]) <= MAX_POINTS + 4 for t in lines)
    assert all(800 in t["x"] for t in lines if t["x"][-1] == 800)  # the diverged runs' lines reach it


def test_the_curve_figures_are_plotlys_own_form_of_them(sweep_100, tmp_path):
    """curve_figures builds dicts, not validated plotly objects (its speed): plotly's validation of each figure
    must change nothing, over diverged runs, replicate seeds (noise bands), eval losses and loss scales."""
    import plotly.graph_objects as go

    grid = tmp_path / "grid"
    multirun_in_process(grid, *SMALL_MODEL, "steps=3", "precision=fp16_amp", "replicates=2", "ledger.enabled=false")
    runs = pd.concat([runs_from_dirs(sweep_100), runs_from_dirs(grid)], ignore_index=True)
    figs = curve_figures(runs)
    traces = [t for f in figs for t in f["data"]]
    assert {"eval loss", "loss scale"} <= {a["text"] for f in figs for a in f["layout"]["annotations"]}
    assert any(t.get("fill") == "tonexty" for t in traces) and any(t["mode"] == "markers" for t in traces)
    for fig in figs:
        assert json.loads(go.Figure(fig).to_json()) == json.loads(json.dumps(fig))


def test_a_multirun_writes_report_html_unless_report_html_false(tmp_path, capsys):
    on, off = tmp_path / "on", tmp_path / "off"
    multirun_in_process(on, "steps=2", "optim.lr=1e-4,1e-3", "ledger.enabled=false")
    assert f"HTML report: {on / 'report.html'}" in capsys.readouterr().out
    assert (on / "report.html").is_file() and (on / plotly_js_name()).is_file()
    multirun_in_process(off, "steps=2", "optim.lr=1e-4,1e-3", "ledger.enabled=false", "report.html=false")
    assert f"HTML report: python -m sweep.report {off}" in capsys.readouterr().out
    assert (off / "summary.md").is_file() and not (off / "report.html").exists()
    assert not list(off.glob("plotly-*"))
    assert json.loads((off / "0" / "result.json").read_text())["status"] == "stable"


def test_a_report_that_cannot_be_written_is_one_warning_line(tmp_path, capsys, caplog, monkeypatch):
    """The summary files are written and printed; the page's failure is one line, never a traceback."""
    import sweep.report.html

    def broken(*a, **k):
        raise OSError(28, "No space left on device", str(tmp_path / "s" / "report.html"))

    monkeypatch.setattr(sweep.report.html, "write_report", broken)
    root = make_grid(tmp_path / "s")
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(root)}}}))
    out = capsys.readouterr().out
    assert "Recommendation" in out and (root / "summary.md").is_file()
    assert f"HTML report: python -m sweep.report {root}" in out
    lines = [r for r in caplog.records if "report.html" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None
    assert "No space left on device" in lines[0].getMessage() and "python -m sweep.report" in lines[0].getMessage()


def test_report_html_is_a_bool_named_in_one_line():
    from sweep.config.schema import ConfigError, ReportConfig
    from sweep.config.validate import _check_report

    from .conftest import make_run

    assert make_run().report.html is True and make_run("report.html=false").report.html is False
    with pytest.raises(ConfigError, match="^report.html: must be true or false, got 'yes'$"):
        _check_report(ReportConfig(html="yes"))
