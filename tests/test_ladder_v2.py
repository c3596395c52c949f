"""Ladder v2 (sweep/report/ladder.py, issue #30 part 3): a sqrt(2) lr grid with replicates, SP and µP fitted
side by side, the curvature test, the reach warning, and at least three sizes. Synthetic brackets whose
answer is known."""

from __future__ import annotations

import math

import pytest

from sweep.report.ladder import check_ladder_sizes, curvature_test, fit_line, ladder_fit, ladder_lines
from sweep.report.runs import runs_from_dirs

from .conftest import CONF_DIR, sweep_forked
from .test_report_tables import diverged, write_run

GRID = [2 ** (-k / 2) for k in range(2, 24)]  # sqrt(2)-spaced, 0.5 .. 0.0005


def bracket(truth: float) -> tuple[float, float]:
    """The sqrt(2)-grid bracket [max stable, min diverging) around a true largest stable lr."""
    lo = max(lr for lr in GRID if lr <= truth)
    return lo, lo * math.sqrt(2)


def points(sizes, law):
    return [(s, *bracket(law(s)), math.sqrt(bracket(law(s))[0] * bracket(law(s))[1])) for s in sizes]


def test_sp_and_mup_are_fitted_side_by_side_from_replicates(tmp_path):
    """sp: lr* = 0.1 (w/32)^-0.5, mup: flat at 0.05; two seeds per cell, seed 1 diverging one grid step lower
    at width 128 (sp): an lr counts as stable only when both seeds are."""
    n = 0
    for param, law in (("sp", lambda w: 0.1 * (w / 32) ** -0.5), ("mup", lambda w: 0.05)):
        for w in (32, 64, 128, 256):
            for seed in (0, 1):
                for lr in GRID:
                    limit = law(w) / (math.sqrt(2) if (param, w, seed) == ("sp", 128, 1) else 1)
                    ok = lr <= limit
                    result = {"status": "stable", "final_loss": 0.5} if ok else diverged("loss_spike", 3, "loss")
                    params = {"model.param": param, "model.width": w, "optim.lr": lr, "seed": seed}
                    write_run(tmp_path, n, params, result)
                    n += 1
    table = ladder_fit(runs_from_dirs(tmp_path), target=1024, confidence=0.9)
    assert sorted(table.index) == ["mup", "sp"] and table.index.name == "model.param"
    sp, mup = table.loc["sp"], table.loc["mup"]
    assert sp.sizes == mup.sizes == 4 and sp.points == mup.points == 8  # each seed's bracket is a point
    assert sp.exponent == pytest.approx(-0.5, abs=0.15) and mup.exponent == pytest.approx(0, abs=1e-9)
    assert sp.low < 0.1 * 32**-0.5 < sp.high and mup.low < 0.05 < mup.high
    w128 = [p for p in table.attrs["points"]["sp"] if p[0] == 128][0]
    assert w128[1] == bracket(0.1 * 4**-0.5 / math.sqrt(2))[0]  # the lower replicate sets the size's bracket
    seeds128 = sorted(p[1] for p in table.attrs["seed_points"]["sp"] if p[0] == 128)
    assert seeds128 == [bracket(0.1 * 4**-0.5 / math.sqrt(2))[0], bracket(0.1 * 4**-0.5)[0]]  # and its own
    assert "over 4 sizes, 8 seed brackets" in ladder_lines(table)[0]


def test_the_interval_from_replicates_covers_a_new_run_as_often_as_it_says():
    """Simulated ladders with a known line: 4 widths x 2 seeds, each seed's largest stable lr the line plus seed
    noise (sd 0.2 in log), rounded into a sqrt(2) grid at a random offset. The 90% interval at 2x the largest
    width, fitted on each seed's bracket, holds a new run's largest stable lr about 90% of the time (at least
    85% over 400 ladders), and is narrower than the fit on one merged bracket per width (n - 2 = 2 degrees of
    freedom), which over-covers."""
    import numpy as np

    rng = np.random.default_rng(0)
    step = math.log(math.sqrt(2))
    widths, target = (32, 64, 128, 256), 512
    law = lambda w: math.log(0.1) - 0.5 * math.log(w / 32)  # noqa: E731
    covered, per_seed_widths, merged_widths = 0, [], []
    for _ in range(400):
        offset = rng.uniform(0, step)

        def seed_bracket(log_lr, offset=offset):
            lo = offset + math.floor((log_lr - offset) / step) * step
            return math.exp(lo), math.exp(lo + step)

        seeds, merged = [], []
        for w in widths:
            brackets = [seed_bracket(law(w) + rng.normal(0, 0.2)) for _ in range(2)]
            seeds += [(w, lo, hi, math.sqrt(lo * hi)) for lo, hi in brackets]
            lo, hi = min(b[0] for b in brackets), min(b[1] for b in brackets)
            merged.append((w, lo, hi, math.sqrt(lo * hi)))
        row = fit_line(seeds, target, 0.9)
        assert row["points"] == 8 and row["sizes"] == 4
        covered += row["low"] <= math.exp(law(target) + rng.normal(0, 0.2)) <= row["high"]
        per_seed_widths.append(row["high"] / row["low"])
        merged_row = fit_line(merged, target, 0.9)
        merged_widths.append(merged_row["high"] / merged_row["low"])
    assert 0.85 <= covered / 400 <= 0.99
    assert np.median(per_seed_widths) < 0.8 * np.median(merged_widths)  # measured: 3.3x against 4.7x


def test_a_straight_line_recovers_its_slope_and_its_interval_holds_the_truth():
    law = lambda s: 0.2 * (s / 32) ** -0.7  # noqa: E731
    row = fit_line(points([32, 64, 128, 256, 512], law), 1024, 0.9)
    assert row["exponent"] == pytest.approx(-0.7, abs=0.1)
    assert row["low"] < law(1024) < row["high"]
    assert row["curved"] is False and row["curvature_p"] > 0.05


def test_a_clearly_curved_series_is_flagged_and_a_straight_one_is_not():
    # log lr* falls ever faster with log size: flat at 32, 25x lower at 1024.
    curved = lambda s: 0.1 * math.exp(-0.45 * math.log(s / 32) ** 2)  # noqa: E731
    row = curvature_test(points([32, 64, 128, 256, 512, 1024], curved))
    assert row["curved"] is True and row["curvature"] < 0 and row["curvature_p"] < 0.01
    straight = lambda s: 0.1 * (s / 32) ** -1.0  # noqa: E731
    assert curvature_test(points([32, 64, 128, 256, 512, 1024], straight))["curved"] is False
    assert curvature_test(points([32, 64, 128], straight))["curved"] is None  # 3 sizes: no test


def test_a_target_far_beyond_the_sizes_is_warned_about(tmp_path):
    law = lambda s: 0.1 * (s / 32) ** -0.5  # noqa: E731
    near = fit_line(points([32, 64, 128, 256], law), 1024, 0.9)
    far = fit_line(points([32, 64, 128, 256], law), 1152, 0.9)
    assert near["reach"] == 4 and far["reach"] == 4.5
    import pandas as pd

    table = pd.DataFrame([{"combination": "sp", **near, "left_out": 0}, {"combination": "mup", **far, "left_out": 0}])
    table = table.set_index("combination")
    table.attrs.update(axis="model.width", confidence=0.9)
    lines = ladder_lines(table)
    assert "warning" not in lines[0] and "warning: width 1152 is 4.5x the largest measured width" in lines[1]
    assert "no significant curvature" in lines[0]


def test_fewer_than_three_sizes_is_refused():
    assert check_ladder_sizes("width", ["32", "64"]).startswith("model.width: a ladder needs at least 3 sizes")
    assert check_ladder_sizes("width", ["32", "64", "128"]) is None
    assert check_ladder_sizes("depth", ["range(2,10,2)"]) is None  # not counted here


def test_ladder_configs_compose_v2_defaults():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+ladder=width"], return_hydra_config=True)
        params = cfg.hydra.sweeper.params
        lrs = [float(v) for v in params["optim.lr"].split(",")]
        assert len(params["model.width"].split(",")) >= 4 and params["model.param"] == "sp,mup"
        assert cfg.replicates == 2 and cfg.model.base_width == 32
        assert all(b / a == pytest.approx(math.sqrt(2), rel=0.01) for a, b in zip(lrs, lrs[1:]))
        cfg = compose(config_name="config", overrides=["+ladder=depth"], return_hydra_config=True)
        assert len(cfg.hydra.sweeper.params["model.depth"].split(",")) >= 4 and cfg.replicates == 2
    GlobalHydra.instance().clear()


@pytest.mark.parametrize("mode", [[], ["hydra.sweeper.mode=frontier"]], ids=["grid", "frontier"])
def test_a_ladder_sweep_of_two_sizes_is_one_line_exit_2(tmp_path, mode):
    proc = sweep_forked(
        "-m", "+ladder=width", "model.width=32,64", *mode, f"hydra.sweep.dir={tmp_path}/s", cwd=tmp_path
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "model.width: a ladder needs at least 3 sizes" in lines[0]
    assert not list(tmp_path.rglob("result.json"))


def test_the_real_width_experiment_fits_four_widths_packed_one_pack_per_width():
    """conf/experiment/mup_real_width.yaml (issue #48 item 5): µP on the 12-block video DiT, base width 64, four
    fitted widths on a sqrt(2) grid of 14 lrs x 2 seeds; runs of one width share a pack key, two widths never, so
    the header's pack=28 is one pack per width; and every held-out width's run config validates."""
    import dataclasses

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from models.registry import sized
    from sweep.config import Param, to_run_config
    from sweep.run.packing import pack_key, refusal

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=mup_real_width"], return_hydra_config=True)
        params = cfg.hydra.sweeper.params
        cfg.model.param = "mup"
        run = to_run_config(cfg)
        wide = compose(config_name="config", overrides=["+experiment=mup_real_width", "model.width=2048",
                                                        "model.param=mup"])  # fmt: skip
    GlobalHydra.instance().clear()
    lrs = [float(v) for v in params["optim.lr"].split(",")]
    assert len(lrs) == 14 and all(b / a == pytest.approx(math.sqrt(2), rel=0.01) for a, b in zip(lrs, lrs[1:]))
    assert params["model.width"] == "64,128,256,512" and params["model.param"] == "mup"
    assert (run.model.size, run.model.depth, run.model.base_width, run.replicates, run.steps) == ("S", None, 64, 2, 300)
    assert sized("S", 2048, None) == dict(hidden_size=2048, depth=12, num_heads=32)  # DiT-S's 12 blocks, head dim 64
    assert run.model.param is Param.mup and run.ladder.target == 2048 and refusal(run) is None
    assert to_run_config(wide).model.width == 2048

    def key(width, lr, seed):
        one = dataclasses.replace(run, seed=seed, optim=dataclasses.replace(run.optim, lr=lr))
        return pack_key(dataclasses.replace(one, model=dataclasses.replace(run.model, width=width)))

    assert key(64, lrs[0], 0) == key(64, lrs[-1], 1) and key(64, lrs[0], 0) != key(128, lrs[0], 0)


def load_bench(name: str):
    import importlib.util

    from .conftest import REPO

    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_held_out_width_is_swept_on_the_grid_inside_the_interval_and_one_each_side():
    """bench/ladder_heldout.py --window picks the lrs a GPU visit sweeps at a held-out width: the fit's 90%
    interval on the fitted grid, and one more on each side, so the measured bracket can land outside it."""
    heldout = load_bench("ladder_heldout")
    grid = GRID[::-1]  # ascending
    chosen = heldout.window(grid, 0.01, 0.05)
    assert min(chosen) < 0.01 and max(chosen) > 0.05 and all(lr in grid for lr in chosen)
    assert [lr for lr in chosen if 0.01 <= lr <= 0.05] == [lr for lr in grid if 0.01 <= lr <= 0.05]
    assert len(chosen) == len([lr for lr in grid if 0.01 <= lr <= 0.05]) + 2
    between = heldout.window(grid, 0.0101, 0.0102)  # no grid value inside: the two around it, one more each side
    assert len(between) == 4 and between[1] < 0.0101 < 0.0102 < between[2]
    assert heldout.window(grid, 10.0, 20.0) == grid[-2:] and heldout.window(grid, 1e-9, 1e-8) == grid[:2]


def test_an_open_bracket_at_the_target_is_judged_only_on_its_known_side():
    heldout = load_bench("ladder_heldout")
    assert heldout.measured_text(0.01, 0.05, 0.02, 0.028) == "measured [0.02, 0.028) inside"
    assert heldout.measured_text(0.01, 0.05, 0.04, 0.057).endswith("NOT inside")
    assert "NOT inside: above" in heldout.measured_text(0.01, 0.05, 0.08, None)  # stable at every lr swept
    assert "undecided" in heldout.measured_text(0.01, 0.05, 0.03, None)
    assert "NOT inside: below" in heldout.measured_text(0.01, 0.05, None, 0.005)  # none stable
    assert "undecided" in heldout.measured_text(0.01, 0.05, None, 0.02)
    assert "not monotone" in heldout.measured_text(0.01, 0.05, 0.03, 0.02)
    assert heldout.measured_text(0.01, 0.05, None, None) == "measured: no run at the target (not checked)"


@pytest.mark.parametrize(
    "flags,said",
    [
        (["--confidence", "2"], "--confidence: must be in (0, 1), got 2"),  # printed "inf .. inf" and "NOT inside"
        (["--confidence", "nan"], "--confidence: must be in (0, 1), got nan"),
        (["--target", "-1"], "--target: must be a width or depth from 1"),  # a math domain error (a traceback)
        (["--beyond", "0"], "--beyond: must be a width or depth from 1"),  # taken as no --beyond
    ],
)
def test_the_held_out_check_refuses_a_confidence_or_size_it_cannot_use(tmp_path, capsys, flags, said):
    heldout = load_bench("ladder_heldout")
    with pytest.raises(SystemExit) as e:
        heldout.main([str(tmp_path), "--fit-max", "64", "--target", "128", *flags])
    assert e.value.code == 2 and said in capsys.readouterr().err


def test_the_held_out_check_sets_the_best_eval_lr_fit_against_the_best_measured_at_the_target():
    heldout = load_bench("ladder_heldout")
    row = {"best_exponent": -1.0, "predicted_best_lr": 0.01, "best_low": 0.005, "best_high": 0.02}
    inside = heldout.best_text(row, [(64, 0.01, 0.02, 0.0141), (512, 0.006, 0.011, 0.008)], 512)
    assert inside.endswith("measured 0.008 (within [0.006, 0.011)) inside") and "exponent -1.00: 0.01" in inside
    assert heldout.best_text(row, [(512, 0.03, 0.05, 0.04)], 512).endswith("NOT inside")
    assert heldout.best_text(row, [(512, None, None, float("nan"))], 512).endswith("(not checked)")
    assert "too few sizes" in heldout.best_text({"best_exponent": float("nan")}, [], 512)
