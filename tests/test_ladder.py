"""The frontier across sizes (sweep/report/ladder.py, +ladder=width|depth; issue #17 part 3)."""

from __future__ import annotations

import html
import math
import re

import numpy as np
import pytest

from sweep.config import ConfigError
from sweep.report.figures import ladder_figure
from sweep.report.html import render_html
from sweep.report.ladder import fit_line, ladder_fit, ladder_lines
from sweep.report.runs import runs_from_dirs
from sweep.report.summary import summarize
from sweep.report.text import render_text

from .conftest import CONF_DIR, make_run, multirun_in_process
from .test_report_tables import diverged, write_run

LRS = [2.0**-k for k in range(1, 15)]  # a 2x grid, 0.5 .. 6e-5


def power_law_sweep(root, widths=(32, 64, 128, 256)):
    """Runs that diverge above lr = c * (width / 32)^-0.5, c = 0.1 in fp32 and 0.025 in bf16_amp."""
    n = 0
    for precision, c in (("fp32", 0.1), ("bf16_amp", 0.025)):
        for w in widths:
            for lr in LRS:
                ok = lr <= c * (w / 32) ** -0.5
                result = {"status": "stable", "final_loss": 0.5} if ok else diverged("loss_spike", 3, "loss")
                write_run(root, n, {"precision": precision, "model.width": w, "optim.lr": lr}, result)
                n += 1
    return runs_from_dirs(root)


def test_the_fit_recovers_a_known_power_law_and_its_interval_holds_the_truth(tmp_path):
    runs = power_law_sweep(tmp_path / "s")
    table = ladder_fit(runs, target=1024, confidence=0.9)
    assert table.attrs["axis"] == "model.width" and list(table.index) == ["bf16_amp", "fp32"]
    for precision, c in (("fp32", 0.1), ("bf16_amp", 0.025)):
        r = table.loc[precision]
        assert r.sizes == 4 and r.left_out == 0
        assert r.exponent == pytest.approx(-0.5, abs=0.2)  # a 2x grid quantises each frontier
        truth = c * (1024 / 32) ** -0.5
        assert r.low < truth < r.high and r.low < r.predicted_lr < r.high
        assert r.high / r.low < 100  # an interval that says something
    lines = ladder_lines(table)
    assert lines[1].startswith("fp32: max stable lr ∝ width^-0.") and "at width 1024: " in lines[1]
    assert "90% interval" in lines[1]


def test_the_best_eval_lr_gets_a_fit_of_its_own_and_a_best_at_the_grids_edge_is_left_out(tmp_path):
    """The lr that trains best falls as width^-1 here while the largest stable lr falls as width^-0.5 (SP-like):
    its own fit recovers -1 and its interval holds the true best lr at the target; the recommendation cites it.
    A width whose best eval lr is the grid's smallest lr (the best may lie below the grid) is left out."""
    n = 0
    for w in (32, 64, 128, 256, 512):
        for seed in (0, 1):
            for lr in LRS:
                edge, best = 0.1 * (w / 32) ** -0.5, 0.01 * (w / 32) ** -1.0
                best = best if w < 512 else LRS[-1] / 2  # 512: the best would be below the grid
                ok = {"status": "stable", "eval_loss": 0.2 * (1 + abs(math.log(lr / best))), "seed": seed}
                result = ok if lr <= edge else diverged("loss_spike", 3, "loss")
                write_run(tmp_path, n, {"model.width": w, "optim.lr": lr, "seed": seed}, result)
                n += 1
    s = summarize(runs_from_dirs(tmp_path), ladder_target=1024)
    r, truth = s.ladder.loc["all"], 0.01 * (1024 / 32) ** -1.0
    assert r.best_sizes == 4 and r.best_exponent == pytest.approx(-1.0, abs=0.1)
    assert r.best_low < truth < r.best_high and r.best_high / r.best_low < 10
    assert "; best eval lr ∝ width^-1.00 over 4 sizes, at width 1024: " in ladder_lines(s.ladder)[0]
    cited = f" and a best eval lr of {r.predicted_best_lr:.3g} ({r.best_low:.3g}..{r.best_high:.3g}) [ladder: all]"
    assert cited in s.recommendation.line  # at width 512, whose best lies below the grid: it says so
    assert f"lr {LRS[-1]:.4g} is the smallest lr swept: a lower one may train better" in s.recommendation.line
    names = [t.name for t in ladder_figure(s.ladder).data]
    assert "all: best eval lr measured" in names and "all: best eval lr fit, exponent -1.00" in names
    assert "all: best eval lr predicted at width 1024" in names and f"all: fit, exponent {r.exponent:.2f}" in names


def test_a_best_eval_lr_below_the_grid_gives_no_fit_and_the_recommendation_says_to_sweep_lower(tmp_path):
    """Every width's best eval lr (over its seeds) is the grid's smallest lr, as µP's was on an lr grid centred on
    the edge (docs/ladder.md, v3); one seed of width 64 alone has a best inside the grid. Fitting that one seed's
    point with the censored ones left out made a line through it ("best eval lr ∝ width^-0.00 over 0 sizes"), and
    the recommendation cited it; now no width gives a point, and the recommendation says its lr is the smallest
    swept."""
    n, grid = 0, sorted(LRS[2:10])  # ascending: 0.000977 .. 0.125, whose top lrs diverge
    for w in (32, 64, 128):
        for seed in (0, 1):
            for lr in grid:
                inside = w == 64 and seed == 1
                best, slope = (grid[3], 0.5) if inside else (grid[0] / 2, 1.0)
                ok = {"status": "stable", "eval_loss": 0.2 * (1 + slope * abs(math.log(lr / best))), "seed": seed}
                result = ok if lr <= 0.1 * (w / 32) ** -0.5 else diverged("loss_spike", 3, "loss")
                write_run(tmp_path, n, {"model.width": w, "optim.lr": lr, "seed": seed}, result)
                n += 1
    s = summarize(runs_from_dirs(tmp_path), ladder_target=512)
    r = s.ladder.loc["all"]
    assert np.isnan(r.best_exponent) and r.best_sizes == 0
    assert ladder_lines(s.ladder)[0].endswith("best eval lr: 0 size(s) with one inside the lr grid, too few to fit")
    line = s.recommendation.line
    assert s.recommendation.settings == {"model.width": 128, "optim.lr": grid[0]} and "a best eval lr of" not in line
    assert f"lr {grid[0]:.4g} is the smallest lr swept: a lower one may train better, sweep lower lrs" in line


def test_a_size_that_barely_trained_is_named_in_the_ladders_sentence(tmp_path):
    """SP at width 512 in 30 steps (docs/ladder.md, v3): stable runs that learned nothing give a bracket where runs
    stopped blowing up; the ladder's sentence says so for that size, as the frontier does (before: no word)."""
    root, n = tmp_path, 0
    for w in (32, 64, 128):
        for lr in LRS:
            best = 0.85 if w == 128 else 0.2  # 128: 85% of the first training loss (1.0) at its best lr
            ok = {"status": "stable", "eval_loss": best * (1 + 0.1 * abs(math.log(lr / 0.004)))}
            result = ok if lr <= 0.1 * (w / 32) ** -0.5 else diverged("loss_spike", 3, "loss")
            write_run(root, n, {"model.width": w, "optim.lr": lr}, result)
            n += 1
    table = ladder_fit(runs_from_dirs(root), target=512)
    assert table.attrs["barely"] == {"all": [128.0]}
    (line,) = ladder_lines(table)
    assert "; barely trained at width 128 (even the best lr's eval loss at least 60% of the first training loss):" in (
        line
    )


def test_with_no_fit_of_the_edge_the_recommendation_still_cites_the_best_eval_lr_fit(tmp_path):
    """No size diverged (no bracket: the edge cannot be fitted), while each width's best eval lr lies inside the
    grid: the recommendation says the edge has no fit and gives the best eval lr's prediction (before: only the
    former)."""
    n = 0
    for w in (32, 64, 128):
        for lr in LRS[6:12]:
            ok = {"status": "stable", "eval_loss": 0.2 * (1 + abs(math.log(lr / (0.004 * 32 / w))))}
            write_run(tmp_path, n, {"model.width": w, "optim.lr": lr}, ok)
            n += 1
    s = summarize(runs_from_dirs(tmp_path), ladder_target=512)
    r = s.ladder.loc["all"]
    assert np.isnan(r.predicted_lr) and r.predicted_best_lr > 0
    said = "for the largest stable lr at the size you train, no fit of its sizes; at width 512 (ladder.target) the"
    assert f"{said} ladder predicts a best eval lr of {r.predicted_best_lr:.3g}" in s.recommendation.line


def test_two_sizes_give_a_line_but_no_interval_and_an_open_bracket_is_left_out():
    row = fit_line([(32, 0.01, 0.02, math.sqrt(2e-4)), (64, 0.005, 0.01, math.sqrt(5e-5))], 256, 0.9)
    assert row["exponent"] == pytest.approx(-1.0) and row["predicted_lr"] > 0 and np.isnan(row["low"])
    row = fit_line([(32, 0.01, 0.02, math.sqrt(2e-4)), (64, 0.005, None, np.nan)], 256, 0.9)
    assert row["sizes"] == 1 and np.isnan(row["exponent"])


def test_the_summary_prints_the_ladder_and_the_report_plots_it(tmp_path):
    runs = power_law_sweep(tmp_path / "s", widths=(32, 64, 128))
    s = summarize(runs, ladder_target=512)
    text = render_text(s)
    assert "Frontier across sizes" in text and "at width 512: " in text
    fig = ladder_figure(s.ladder)
    names = [t.name for t in fig.data]
    assert "fp32: predicted at width 512" in names and any(n.startswith("fp32: fit, exponent -0.") for n in names)
    far = summarize(runs, ladder_target=2048)  # 16x the largest width: its lines warn, and report.html says it too
    page = render_html(far, "t", "s")
    assert any("warning: width 2048 is 16.0x the largest measured width" in line for line in ladder_lines(far.ladder))
    for line in ladder_lines(far.ladder):
        assert html.escape(line) in page


def test_a_ladder_recommends_at_its_largest_size_and_cites_the_prediction_at_the_target(tmp_path):
    """A ladder's size is what the user trains at, not a choice: the recommendation is at the largest size measured
    (here width 64 has the lowest eval loss: before, it recommended model.width=64, with toggle advice to prefer one
    width over another), and it cites the ladder's prediction at ladder.target for its combination."""
    n = 0
    for w, best in ((32, 0.30), (64, 0.20), (128, 0.25)):  # a noisy short horizon: 64 happens to train best
        for lr in LRS:
            ok = lr <= 0.1 * (w / 32) ** -0.5
            result = {"status": "stable", "eval_loss": best * (1 + abs(math.log(lr / 0.01)))} if ok else None
            write_run(tmp_path, n, {"model.width": w, "optim.lr": lr}, result or diverged("loss_spike", 3, "loss"))
            n += 1
    s = summarize(runs_from_dirs(tmp_path), ladder_target=512)
    rec, row = s.recommendation, s.ladder.loc["all"]
    assert rec.settings["model.width"] == 128 and not any(a.axis == "model.width" for a in rec.advice)
    said = "A ladder over width: this is at the largest width with a stable setting, 128; at width 512 (ladder.target)"
    assert said in rec.line
    assert f"predicts a largest stable lr of {row.predicted_lr:.3g} (90% interval {row.low:.3g}..{row.high:.3g};" in (
        rec.line
    )
    lr = rec.settings["optim.lr"]
    margin = f"is {row.predicted_lr / lr:.2g}x below that prediction, inside its interval (low end {row.low:.3g})"
    assert (
        row.low < lr < row.predicted_lr and f"[ladder: all]; the lr recommended here, {lr:.3g}, {margin}." in rec.line
    )
    untargeted = summarize(runs_from_dirs(tmp_path)).recommendation.line
    assert "for the lr at the size you train, set ladder.target (or --ladder-target) [ladder: all]." in untargeted


def test_a_ladder_warns_where_the_recommended_lr_is_past_the_prediction_at_the_target(tmp_path):
    """Standard parametrization: the largest stable lr falls with width, so the best lr of width 128, right at its
    edge, is above what the ladder predicts is stable at width 2048 (before: the line cited the prediction and
    recommended that lr with no word on the two; a user training at 2048 took an lr that diverges there)."""
    n = 0
    for w in (32, 64, 128):
        for lr in LRS:
            edge = 0.1 * (w / 32) ** -0.5
            result = {"status": "stable", "eval_loss": 0.2 * (1 + abs(math.log(lr / edge)))} if lr <= edge else None
            write_run(tmp_path, n, {"model.width": w, "optim.lr": lr}, result or diverged("loss_spike", 3, "loss"))
            n += 1
    s = summarize(runs_from_dirs(tmp_path), ladder_target=2048)
    rec, row = s.recommendation, s.ladder.loc["all"]
    assert rec.settings == {"model.width": 128, "optim.lr": 0.03125}, rec.settings
    words = (
        f"is at or above that prediction: at width 2048 it would likely diverge, so start below {row.predicted_lr:.3g}"
    )
    assert (
        row.predicted_lr < 0.03125 and f"[ladder: all]; warning: the lr recommended here, 0.0312, {words}" in rec.line
    )


def test_ladder_configs_compose_a_search_over_the_size():
    """v2 (issue #30) made the default a sqrt(2) lr grid with replicates over 4 sizes (tests/test_ladder_v2.py);
    the v1 frontier search is one override away."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+ladder=width"], return_hydra_config=True)
        assert cfg.ladder.axis == "width" and cfg.ladder.target == 1152
        assert cfg.hydra.sweeper.params["model.width"] == "32,64,128,256"
        frontier = ["+ladder=width", "hydra.sweeper.mode=frontier", "hydra.sweeper.frontier_factor=1.41"]
        cfg = compose(config_name="config", overrides=frontier, return_hydra_config=True)
        assert cfg.hydra.sweeper.mode == "frontier" and cfg.hydra.sweeper.frontier_factor == 1.41
        cfg = compose(config_name="config", overrides=["+ladder=depth"], return_hydra_config=True)
        assert cfg.ladder.axis == "depth" and cfg.hydra.sweeper.params["model.depth"] == "2,4,8,16"
    GlobalHydra.instance().clear()


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.width=48", "model.width: must be a positive multiple of 32 (the head dim of size tiny), got 48"),
        ("model.depth=3", "model.depth: video_dit spends its blocks as (spatial, temporal) pairs: must be even"),
        ("ladder.target=0", "ladder.target: must be a width or depth from 1 to 1,000,000, got 0"),
    ],
)
def test_bad_size_values_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_run(override)


def test_width_and_depth_build_the_model_they_name():
    from models import build_model, count_params

    kw = dict(input_size=8, in_channels=3, num_frames=4)
    small, wide = (
        build_model("video_dit", "tiny", width=32, **kw),
        build_model("video_dit", "tiny", width=64, depth=2, **kw),
    )
    heads = [{m.num_heads for m in model.modules() if hasattr(m, "head_dim")} for model in (small, wide)]
    assert heads == [{1}, {2}]  # the head dim (32) is kept
    assert len(wide.blocks) == 2 and len(small.blocks) == 4  # depth 2 = one (spatial, temporal) pair
    assert count_params(build_model("video_dit", "tiny", **kw)) > count_params(wide) > count_params(small) / 2


@pytest.mark.slow
def test_a_real_size_grid_gives_a_ladder_table(tmp_path):
    multirun_in_process(tmp_path, "model.width=32,64,96", "optim.lr=1e-3,3e-2,1.0", "steps=8", "ledger.enabled=false")
    runs = runs_from_dirs(tmp_path)
    assert len(runs) == 9 and set(runs.status) <= {"stable", "diverged"}
    table = summarize(runs, ladder_target=256).ladder
    assert table.attrs["axis"] == "model.width" and table.loc["all"].sizes + table.loc["all"].left_out == 3


@pytest.mark.parametrize("ladder,single", [("width", "model.width=32"), ("depth", "model.depth=2")])
def test_a_single_size_on_a_ladder_is_refused_saying_what_to_write(tmp_path, ladder, single):
    """issue 33: `+ladder=width model.width=32` ignored the single width and ran 32, 64 and 128 (only a comma
    list replaced the ladder's sizes). Now one line names the list to write instead, before any run."""
    key = single.split("=")[0]
    says = (  # the Optuna/frontier ladder names the axis it sweeps; the grid ladder (v2's default) the list to write
        rf"^{key}: (this sweep already sweeps {key} over .* \({key}=a,b,\.\.\.\)"
        rf"|a ladder needs at least 3 sizes to give an interval, got 1 .*: write a list \({key}=a,b,c,\.\.\.\))"
    )
    with pytest.raises(ConfigError, match=says):
        multirun_in_process(tmp_path / "s", f"+ladder={ladder}", single, "steps=2", "ledger.enabled=false")
    assert not list((tmp_path / "s").glob("*/result.json"))


def test_a_list_replaces_the_ladders_sizes_and_the_comments_advice_is_accepted():
    from pathlib import Path

    from sweep.search.space import shadowed_axis

    params = ["model.width=32,64,128", "optim.lr=tag(log,interval(1e-4,1.0))"]
    assert shadowed_axis(params, ["model.width=32,64,128,256", "precision=fp32"]) is None
    assert shadowed_axis(params, ["model.width=32"]) is not None
    for name, key in (("width", "model.width"), ("depth", "model.depth")):
        text = (Path(__file__).parents[1] / "conf" / "ladder" / f"{name}.yaml").read_text()
        advice = [
            w for line in text.splitlines() if line.startswith("#") for w in line.split() if w.startswith(key + "=")
        ]
        assert advice and all(shadowed_axis(params, [a.rstrip(";,.")]) is None for a in advice if "," in a), advice


@pytest.mark.parametrize("target", ["0", "-3", "inf", "nan", "1e308", "1e-300", "1" + "0" * 320, "0.5"])
def test_a_ladder_target_with_no_logarithm_is_one_line_and_exit_2(tmp_path, capsys, target):
    """issue 33: `python -m sweep.report DIR --ladder-target 0` (or -3) was a traceback (math domain error);
    inf was accepted and predicted lr 0. issue 45: 1e308, 1e-300 and 10**320 (inf as a float) were tracebacks
    (OverflowError: the prediction's exp): a target is a width or depth from 1 to LADDER_TARGET_MAX."""
    from sweep.report.__main__ import main

    power_law_sweep(tmp_path / "s", widths=(32, 64, 128))
    assert main([str(tmp_path / "s"), "--no-html", "--ladder-target", target]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ladder-target: must be a width or depth from 1 to 1,000,000, got" in err[0], err


def test_a_ladder_target_of_inf_in_the_config_is_refused():
    with pytest.raises(Exception, match="ladder.target"):
        make_run("+ladder=width", "ladder.target=1e400")


@pytest.mark.parametrize(
    "target,shown", [("1" + "0" * 320, "an integer of 321 digits"), ("0", "0"), ("2000000", "2e+06")]
)
def test_a_ladder_target_out_of_range_in_the_config_is_one_line(target, shown):
    """issue 45: ladder.target=10**320 (an int: the key is an integer) was an OverflowError traceback at
    composition (math.isfinite converts it to a float)."""
    with pytest.raises(
        ConfigError, match=rf"^ladder.target: must be a width or depth from 1 to 1,000,000, got {re.escape(shown)}$"
    ):
        make_run("+ladder=width", f"ladder.target={target}")


def test_a_steep_fit_far_from_its_sizes_predicts_inf_not_a_traceback():
    """issue 45: exp(a + b log target) past float's range raised OverflowError; the prediction is then inf."""
    points = [
        (s, 10.0 ** (k - 9), 2 * 10.0 ** (k - 9), math.sqrt(2) * 10.0 ** (k - 9)) for k, s in enumerate((32, 64, 128))
    ]
    row = fit_line(
        [
            (s, lo * 10.0 ** (40 * i), hi * 10.0 ** (40 * i), lr * 10.0 ** (40 * i))
            for i, (s, lo, hi, lr) in enumerate(points)
        ],
        1e6,
        0.9,
    )
    assert row["exponent"] > 100 and row["predicted_lr"] == math.inf and row["high"] == math.inf
