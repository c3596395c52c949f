"""The summary tables on synthetic sweeps whose right answers are known by construction.

The base grid is precision {fp32, bf16_amp, fp16_pure} x optim.lr {1e-4, 1e-3, 1e-2} x attention
{flash, math}, one seed:
- fp16_pure diverges everywhere: nan-loss at step 1, in the optimizer (it is also the fastest, 9 steps/s,
  so "fastest *stable* precision" must skip it);
- fp32 spikes at lr 1e-2 (step 7, loss), with either attention;
- bf16_amp (7 steps/s, faster than fp32's 5) is stable everywhere except math at 1e-2 (nan-grad at
  step 3, backward);
- a stable run's final loss is 0.9 / 0.5 / 0.4 at lr 1e-4 / 1e-3 / 1e-2, +0.01 with math; initial loss 1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sweep.config import Verdict
from sweep.report.causes import root_causes
from sweep.report.recommend import recommend
from sweep.report.runs import runs_from_dirs
from sweep.report.summary import summarize
from sweep.report.tables import SHORT, divergence_map, frontier, lr_sensitivity, swept_axes, toggle_effects
from sweep.report.text import parquet_safe, render_markdown, render_text, write_summary

from .conftest import read_result

PRECISIONS = ["fp32", "bf16_amp", "fp16_pure"]
LRS = [1e-4, 1e-3, 1e-2]
ATTENTIONS = ["flash", "math"]
SPEED = {"fp32": 5.0, "bf16_amp": 7.0, "fp16_pure": 9.0}
FINAL = {1e-4: 0.9, 1e-3: 0.5, 1e-2: 0.4}


def outcome(precision: str, lr: float, attention: str, seed: int = 0) -> dict:
    """The known outcome of one cell of the base grid (result.json fields)."""
    if precision == "fp16_pure":
        return diverged("nonfinite_loss", 1, "optimizer")
    if precision == "fp32" and lr == 1e-2:
        return diverged("loss_spike", 7, "loss")
    if precision == "bf16_amp" and lr == 1e-2 and attention == "math":
        return diverged("nonfinite_grad", 3, "backward")
    return {"status": "stable", "final_loss": FINAL[lr] + (0.01 if attention == "math" else 0.0)}


def diverged(verdict: str, step: int, where: str | None) -> dict:
    return {
        "status": "diverged",
        "verdict": verdict,
        "first_bad_step": step,
        "cause": {"where": where, "module": "blocks.0.attn" if where else None, "detail": "synthetic"},
    }


def write_run(root: Path, n: int, params: dict, result: dict | None, steps: int = 8) -> Path:
    """A job directory as Hydra and sweep.run.execute leave it; result None = started, no result yet."""
    run_dir = root / str(n)
    (run_dir / ".hydra").mkdir(parents=True)
    overrides = [f"{k}={v}" for k, v in params.items()]
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if result is None:
        return run_dir
    full = {
        "status": "stable",
        "verdict": None,
        "first_bad_step": None,
        "cause": None,
        "final_loss": None,
        "min_loss": None,
        "initial_loss": 1.0,
        "steps_run": steps,
        "max_grad_norm": 1.0,
        "seconds": 1.0,
        "steps_per_second": SPEED.get(params.get("precision"), 6.0),
        "params": params,
        "versions": {},
        "seed": params.get("seed", 0),
        "device": "cpu",
        **result,
    }
    (run_dir / "result.json").write_text(json.dumps(full, indent=1))
    bad = full["first_bad_step"]
    rows = ["step,loss,grad_norm,lr,loss_scale,skipped,unchanged_fraction,zero_grad_fraction"]
    for step in range(bad + 1 if bad is not None else steps):
        loss = "nan" if bad == step and full["verdict"] == "nonfinite_loss" else 1.0 - 0.05 * step
        scale = 65536.0 / 2**step if params.get("precision") == "bf16_amp" else ""
        rows.append(f"{step},{loss},{1.0 + step},{params.get('optim.lr', '')},{scale},0,,")
    (run_dir / "metrics.csv").write_text("\n".join(rows) + "\n")
    return run_dir


def make_grid(root: Path, seeds=(0,), changes: dict | None = None, skip=(), running=()) -> Path:
    """The base grid under `root`; `changes[(prec, lr, att, seed)]` overrides a cell's outcome,
    `skip` leaves cells out, `running` writes them as started but unfinished."""
    n = 0
    for p in PRECISIONS:
        for lr in LRS:
            for a in ATTENTIONS:
                for seed in seeds:
                    cell = (p, lr, a, seed)
                    if cell in skip:
                        continue
                    params = {"precision": p, "optim.lr": lr, "attention": a, "steps": 8}
                    if len(seeds) > 1:
                        params["seed"] = seed
                    result = None if cell in running else (changes or {}).get(cell, outcome(p, lr, a, seed))
                    write_run(root, n, params, result)
                    n += 1
    return root


@pytest.fixture
def grid(tmp_path):
    return runs_from_dirs(make_grid(tmp_path / "sweep"))


def test_runs_table_reads_every_run_with_its_params(grid):
    assert len(grid) == 18 and set(grid.status) == {"stable", "diverged"}
    assert swept_axes(grid) == ["precision", "optim.lr", "attention"]  # steps=8 everywhere: not an axis
    assert grid["param:optim.lr"].map(type).eq(float).all()


def test_divergence_map_cells(grid):
    table, legend = divergence_map(grid)
    assert legend == "precision/attention"
    assert list(table.index) == LRS and table.index.name == "optim.lr"
    assert list(table.columns) == [
        ("bf16_amp", "flash"),
        ("bf16_amp", "math"),
        ("fp16_pure", "flash"),
        ("fp16_pure", "math"),
        ("fp32", "flash"),
        ("fp32", "math"),
    ]
    assert table.loc[1e-2].tolist() == ["stable", "nan-grad@3", "nan-loss@1", "nan-loss@1", "spike@7", "spike@7"]
    assert table.loc[1e-4].tolist() == ["stable", "stable", "nan-loss@1", "nan-loss@1", "stable", "stable"]


def test_frontier(grid):
    f = frontier(grid)
    assert f.index.name == "precision/attention"
    expect = {  # max stable lr, min diverging lr, quality at the former (the final loss: no run has an eval loss)
        "bf16_amp/flash": (1e-2, None, 0.4),
        "bf16_amp/math": (1e-3, 1e-2, 0.51),
        "fp16_pure/flash": (None, 1e-4, None),
        "fp16_pure/math": (None, 1e-4, None),
        "fp32/flash": (1e-3, 1e-2, 0.5),
        "fp32/math": (1e-3, 1e-2, 0.51),
    }
    assert list(f.index) == list(expect)
    for combo, values in expect.items():
        got = f.loc[combo, ["max_stable_lr", "min_diverging_lr", "eval_at_max_stable"]].tolist()
        assert got == pytest.approx([np.nan if v is None else v for v in values], nan_ok=True), combo
    assert f.loc["bf16_amp/flash", "steps_per_s"] == 7.0 and f.runs.eq(3).all()
    assert f.eval_spread.isna().all() and f.replicates.tolist() == [1, 1, 0, 0, 1, 1]  # one seed: no spread
    assert f.loc["bf16_amp/flash", "best_lr"] == 1e-2 and f.loc["fp32/math", "best_lr"] == 1e-3


def test_lr_sensitivity_by_hand(grid):
    s = lr_sensitivity(grid)
    # fp32/flash: scores 0.9, 0.5, 1.0 (diverged: initial loss); best 0.5; mean(0.4, 0, 0.5)
    assert s.loc["fp32/flash", "lr_sensitivity"] == pytest.approx(0.3)
    assert s.loc["fp32/flash", "best_loss"] == pytest.approx(0.5) and s.loc["fp32/flash", "best_lr"] == 1e-3
    assert s.loc["fp32/math", "lr_sensitivity"] == pytest.approx((0.4 + 0.0 + 0.49) / 3)
    assert s.loc["bf16_amp/flash", "lr_sensitivity"] == pytest.approx((0.5 + 0.1 + 0.0) / 3)
    assert s.loc["bf16_amp/flash", "best_lr"] == 1e-2
    assert math.isnan(s.loc["fp16_pure/flash", "lr_sensitivity"])  # never stable: undefined, not 0
    assert s.loc["fp16_pure/flash", "diverged_runs"] == 3 and s.lrs.eq(3).all()


def test_lr_sensitivity_clamps_at_initial_loss_and_fills_a_missing_one(tmp_path):
    root = tmp_path / "s"
    write_run(root, 0, {"optim.lr": 1e-3}, {"status": "stable", "final_loss": 0.6, "initial_loss": 2.0})
    write_run(root, 1, {"optim.lr": 1e-2}, {"status": "stable", "final_loss": 5.0, "initial_loss": 2.0})
    write_run(root, 2, {"optim.lr": 1e-1}, {**diverged("nonfinite_loss", 0, "forward"), "initial_loss": None})
    s = lr_sensitivity(runs_from_dirs(root))
    # scores: 0.6, min(5, 2) = 2, and the combination's mean initial loss 2 for the run that has none
    assert s.loc["all", "lr_sensitivity"] == pytest.approx((0 + 1.4 + 1.4) / 3)
    assert s.loc["all", "best_loss"] == pytest.approx(0.6)


def test_toggle_effects(grid):
    t = toggle_effects(grid).set_index(["axis", "a", "b"])
    row = t.loc[("attention", "flash", "math")]
    assert (row.pairs, row.diverged_a, row.diverged_b, row.combos) == (9, 4, 5, 3)
    assert row.lr_steps == pytest.approx(-1 / 3)  # bf16_amp loses one lr step with math, the others none
    row = t.loc[("precision", "bf16_amp", "fp16_pure")]
    assert (row.pairs, row.diverged_a, row.diverged_b) == (6, 1, 6)
    assert row.lr_steps == pytest.approx(-2.5)  # flash 1e-2 -> none (-3), math 1e-3 -> none (-2)
    assert t.loc[("precision", "fp16_pure", "fp32")].lr_steps == pytest.approx(2.0)
    assert len(t) == 4  # three precision pairs, one attention pair; lr is no toggle


def test_root_causes(grid):
    rc = root_causes(grid)  # runs recorded without a mechanism: "-"
    assert rc.loc[("nonfinite_loss", "-"), "optimizer"] == 6 and rc.loc[("loss_spike", "-"), "loss"] == 2
    assert rc.loc[("nonfinite_grad", "-"), "backward"] == 1
    assert rc.total.sum() == 9 and list(rc.columns) == ["loss", "backward", "optimizer", "total"]
    with_mechanism = grid.assign(
        mechanism=grid.verdict.map({"nonfinite_loss": "update_underflow", "loss_spike": "lr_too_high"})
    )
    rc = root_causes(with_mechanism)
    assert rc.loc[("nonfinite_loss", "update_underflow"), "optimizer"] == 6
    assert rc.loc[("loss_spike", "lr_too_high"), "total"] == 2 and rc.loc[("nonfinite_grad", "-"), "total"] == 1
    assert list(rc.index.names) == ["verdict", "mechanism"]


def test_root_causes_count_a_diagnosed_failures_other_runs_under_its_diagnosis(tmp_path):
    """The demo's seed-1 twins of its diagnosed lr 3e-2 spikes were counted `unexplained` (their recorded
    mechanism) beside their diagnosed seed-0 runs' `lr_too_high`: a run of the same distinct failure (verdict,
    recorded mechanism and swept values but the lr and seed) now counts under the diagnosis, marked; a run of
    another failure keeps its own."""
    import json

    def run(name, precision, seed, mechanism, diagnosed):
        d = tmp_path / name
        d.mkdir()
        (d / "result.json").write_text(json.dumps({"mechanism": {"name": "unexplained"}}))
        if diagnosed:
            (d / "diagnosis.json").write_text(json.dumps({"mechanism": mechanism}))
        return {
            "status": "diverged",
            "verdict": "loss_spike",
            "cause_where": "optimizer",
            "mechanism": mechanism,
            "run_dir": str(d),
            "param:precision": precision,
            "param:optim.lr": 0.03,
            "param:seed": seed,
        }

    runs = pd.DataFrame(
        [
            run("a", "fp32", 0, "lr_too_high", True),
            run("b", "fp32", 1, "unexplained", False),  # its twin
            run("c", "bf16_amp", 1, "unexplained", False),  # another failure, not diagnosed
        ]
    )
    same = runs.assign(mechanism=["unexplained", "unexplained", "unexplained"])  # the diagnosis agreed: plain
    assert root_causes(same).total.to_dict() == {("loss_spike", "unexplained"): 3}
    rc = root_causes(runs)
    assert rc.total.to_dict() == {
        ("loss_spike", "lr_too_high"): 1,
        ("loss_spike", "lr_too_high (group's diagnosis)"): 1,
        ("loss_spike", "unexplained"): 1,
    }


def test_every_verdict_has_a_short_name_and_the_root_causes_follow_their_order(grid):
    assert set(SHORT) == set(Verdict) and len(set(SHORT.values())) == len(Verdict)
    newer = grid.assign(verdict=grid.verdict.replace({"nonfinite_grad": "a_newer_verdict"}))  # plain words, as read
    rc = root_causes(newer)
    assert [v for v, _ in rc.index] == [
        "nonfinite_loss",
        "loss_spike",
        "a_newer_verdict",
    ]  # SHORT's order, unknown last
    assert divergence_map(newer)[0].loc[1e-2].tolist()[1] == "a_newer_verdict@3"


def test_recommendation_names_the_best_stable_setting_its_margin_and_toggles(grid):
    rec = recommend(grid)
    # the lowest loss among the settings stable in every replicate: bf16_amp/flash at 1e-2 (0.4); fp16_pure
    # is faster but never stable; one seed, so no noise to tie on
    assert rec.precision == "bf16_amp"
    assert rec.settings == {"precision": "bf16_amp", "attention": "flash", "optim.lr": 1e-2}
    assert not rec.margin and rec.ties == 1
    assert "no lr up to 0.01 diverged" in rec.line and "[frontier: bf16_amp/flash]" in rec.line
    assert "noise not measured" in rec.line and "7 steps/s (lone runs)" in rec.line
    assert [(a.axis, a.better, a.worse) for a in rec.advice] == [("attention", "flash", "math")]
    assert "prefer attention=flash over math" in rec.line and "[toggles: attention flash vs math]" in rec.line
    assert "\n" not in rec.line


def test_the_frontier_and_the_recommendation_give_one_speed_from_runs_of_one_packing(tmp_path):
    """A packed sweep whose last run ran alone (9 runs, packs of 8): the frontier's steps_per_s was the mean over
    both (9.6), the recommendation's the lone run's (36.2): two speeds for one setting. Both now come from runs of
    one packing (sweep/report/speed.py)."""
    for n in range(9):
        packed = {"packed": 8, "steps_per_second": 6.25} if n < 8 else {"packed": None, "steps_per_second": 36.2}
        write_run(tmp_path, n, {"optim.lr": [1e-3, 3e-3, 1e-2][n // 3], "seed": n % 3}, {"eval_loss": 0.2, **packed})
    runs = runs_from_dirs(tmp_path)
    rec = recommend(runs)
    assert frontier(runs).loc["all"].steps_per_s == 36.2 and "36.2 steps/s (lone runs)" in rec.line
    import shutil

    shutil.rmtree(tmp_path / "8")  # every run packed: both say the packed speed
    runs = runs_from_dirs(tmp_path)
    assert frontier(runs).loc["all"].steps_per_s == 6.25 and "6.25 steps/s (runs packed 8 at a time)" in (
        recommend(runs).line
    )


@pytest.mark.parametrize("fp16, tied", [([0.29, 0.199, 0.26], True), ([0.29, 0.193, 0.242], False)])
def test_one_replicate_ties_by_the_toggle_tables_paired_noise(tmp_path, fp16, tied):
    """One seed: the replicates measure no noise, but the toggle table measures the precision axis over its matched
    runs. Where it calls bf16_amp vs fp16_amp a `tie`, fp16_amp's 0.5% lower eval loss at the best lr does not
    decide (before: fp16_amp, "the best"; the table said tie): the cheaper bf16_amp on cuda, citing the row. Where
    the table says fp16_amp is better (a steady 3%), fp16_amp it is."""
    bf16 = [0.30, 0.20, 0.25]
    for n, (lr, a, b) in enumerate(zip([1e-3, 3e-3, 1e-2], bf16, fp16)):
        write_run(tmp_path, 2 * n, {"precision": "bf16_amp", "optim.lr": lr}, {"eval_loss": a})
        write_run(tmp_path, 2 * n + 1, {"precision": "fp16_amp", "optim.lr": lr}, {"eval_loss": b})
    runs = runs_from_dirs(tmp_path)
    row = toggle_effects(runs).iloc[0]
    assert row.quality == ("tie" if tied else "fp16_amp better")
    rec = recommend(runs)
    assert rec.settings == {"precision": "bf16_amp" if tied else "fp16_amp", "optim.lr": 3e-3}
    cited = "(a tie by the toggle table's paired noise [toggles: precision bf16_amp vs fp16_amp])"
    assert (cited in rec.line) == tied and "noise not measured" in rec.line


def test_several_seeds(tmp_path):
    # seed 1 of fp32/flash at 1e-3 spikes at step 5; every other replicate as in the base grid
    runs = runs_from_dirs(
        make_grid(tmp_path / "s", seeds=(0, 1), changes={("fp32", 1e-3, "flash", 1): diverged("loss_spike", 5, "loss")})
    )
    assert "seed" not in swept_axes(runs)
    table, _ = divergence_map(runs)
    assert table.loc[1e-3, ("fp32", "flash")] == "1/2 div"
    assert table.loc[1e-2, ("fp32", "math")] == "2/2 div" and table.loc[1e-4, ("fp32", "math")] == "0/2 div"
    f = frontier(runs)  # an lr is stable only if every replicate is
    assert f.loc["fp32/flash", "max_stable_lr"] == 1e-4 and f.loc["fp32/flash", "min_diverging_lr"] == 1e-3
    s = lr_sensitivity(runs)  # per-lr means 0.9, (0.5 + 1.0) / 2, 1.0; best 0.75
    assert s.loc["fp32/flash", "lr_sensitivity"] == pytest.approx((0.15 + 0 + 0.25) / 3)
    t = toggle_effects(runs).set_index(["axis", "a", "b"]).loc[("attention", "flash", "math")]
    assert (t.pairs, t.diverged_a, t.diverged_b) == (18, 9, 10)  # pairs match seed to seed


def test_partial_sweep_missing_and_running_runs(tmp_path):
    runs = runs_from_dirs(
        make_grid(tmp_path / "s", skip={("bf16_amp", 1e-2, "math", 0)}, running={("fp32", 1e-3, "math", 0)})
    )
    assert len(runs) == 17 and (runs.status == "running").sum() == 1
    table, _ = divergence_map(runs)
    assert table.loc[1e-2, ("bf16_amp", "math")] == "-"
    assert table.loc[1e-3, ("fp32", "math")] == "running"
    f = frontier(runs)
    assert f.loc["bf16_amp/math", "max_stable_lr"] == 1e-3 and pd.isna(f.loc["bf16_amp/math", "min_diverging_lr"])
    assert f.loc["fp32/math", "max_stable_lr"] == 1e-4 and f.loc["fp32/math", "min_diverging_lr"] == 1e-2
    t = toggle_effects(runs).set_index(["axis", "a", "b"]).loc[("attention", "flash", "math")]
    assert t.pairs == 7  # 9 less the missing and the running partner
    assert t.lr_steps == 0  # compared on the lrs decided on both sides: no lr step lost to a hole
    assert lr_sensitivity(runs).loc["fp32/math", "lrs"] == 2
    text = render_text(summarize(runs))
    assert text.startswith("17 runs: 8 stable, 8 diverged, 1 running")


def test_unknown_axes_are_discovered(tmp_path):
    # no precision at all; two axes no code knows: qk-norm (bool) and a made-up one
    root, n = tmp_path / "s", 0
    for lr in LRS:
        for qk in (False, True):
            for knob in ("x", "y"):
                spike = lr == 1e-2 and not qk
                result = (
                    diverged("loss_spike", 2, "forward") if spike else {"status": "stable", "final_loss": FINAL[lr]}
                )
                write_run(root, n, {"optim.lr": lr, "model.qk_norm": qk, "optim.frobnicate": knob}, result)
                n += 1
    runs = runs_from_dirs(root)
    assert swept_axes(runs) == ["optim.lr", "model.qk_norm", "optim.frobnicate"]
    table, legend = divergence_map(runs)
    assert legend == "model.qk_norm/optim.frobnicate"
    assert table.loc[1e-2].tolist() == ["spike@2", "spike@2", "stable", "stable"]
    t = toggle_effects(runs).set_index(["axis", "a", "b"])
    row = t.loc[("model.qk_norm", False, True)]
    assert (row.pairs, row.diverged_a, row.diverged_b, row.lr_steps) == (6, 2, 0, 1.0)
    assert t.loc[("optim.frobnicate", "x", "y")].lr_steps == 0
    rec = recommend(runs)
    assert rec.precision is None and rec.settings["model.qk_norm"] is True and rec.settings["optim.lr"] == 1e-2
    assert "prefer model.qk_norm=True over False" in rec.line


def test_no_stable_run_and_no_lr_axis(tmp_path):
    root = tmp_path / "s"
    write_run(root, 0, {"precision": "fp16_pure"}, diverged("nonfinite_loss", 1, "optimizer"))
    write_run(root, 1, {"precision": "fp16_pure", "modulate": "fused"}, {"status": "error", "reason": "boom"})
    write_run(root, 2, {"precision": "fp16_pure", "modulate": "eager"}, {"status": "skipped", "reason": "cuda"})
    runs = runs_from_dirs(root)
    s = summarize(runs)
    assert "No stable run" in s.recommendation.line
    assert "ERROR" in s.divergence_map.to_string() and "skipped" in s.divergence_map.to_string()
    assert s.frontier.empty is False or "optim.lr" not in runs  # no lr param: no frontier rows needed
    render_text(s)  # every table renders with holes in it


def test_text_fits_100_columns_and_files_are_written(tmp_path):
    root = make_grid(tmp_path / "s")
    s = summarize(runs_from_dirs(root))
    text = render_text(s)
    assert max(len(line) for line in text.splitlines()) <= 100
    for title in (
        "Divergence map (columns: precision/attention",
        "Stability frontier",
        "LR sensitivity",
        "Effect of each toggle",
        "Root causes",
        "Recommendation",
    ):
        assert title in text
    written = {p.name for p in write_summary(root, s)}
    assert {
        "summary.md",
        "summary.csv",
        "summary.parquet",
        "summary_frontier.csv",
        "summary_toggles.csv",
        "summary_divergence_map.csv",
        "summary_lr_sensitivity.csv",
        "summary_root_causes.csv",
    } <= written
    back = pd.read_parquet(root / "summary.parquet")
    assert len(back) == 18 and set(back.status) == {"stable", "diverged"}
    cells = pd.read_csv(root / "summary_divergence_map.csv")
    assert len(cells) == 18 and "spike@7" in set(cells.label)
    md = (root / "summary.md").read_text()
    assert "| optim.lr | bf16_amp/flash |" in md and "## Recommendation" in md


def test_markdown_and_parquet_survive_hostile_and_mixed_params(tmp_path):
    root = tmp_path / "s"
    write_run(root, 0, {"optim.lr": 1e-3, "tag": "a|b<script>"}, {"status": "stable", "final_loss": 0.5})
    write_run(root, 1, {"optim.lr": 1e-2, "tag": 3}, {"status": "stable", "final_loss": 0.4})
    runs = runs_from_dirs(root)
    md = render_markdown(summarize(runs))
    assert "a\\|b\\<script\\>" in md and "<script>" not in md
    assert parquet_safe(runs)["param:tag"].tolist() == ["a|b<script>", "3"]


def test_hundred_run_summary_is_fast(tmp_path):
    import time

    root, n = tmp_path / "s", 0
    for p in ("fp32", "bf16_amp", "fp16_amp", "fp16_pure"):
        for lr in (1e-4, 3e-4, 1e-3, 3e-3, 1e-2):
            for a in ("flash", "math", "eager", "efficient", "cudnn"):
                result = (
                    outcome(p if p != "fp16_amp" else "fp32", min(lr, 1e-2), "flash")
                    if lr in FINAL
                    else {"status": "stable", "final_loss": 0.7}
                )
                write_run(root, n, {"precision": p, "optim.lr": lr, "attention": a}, result)
                n += 1
    start = time.process_time()  # this process's CPU: another pytest worker's load does not count
    s = summarize(runs_from_dirs(root))
    render_text(s)
    write_summary(root, s)
    assert time.process_time() - start < 1.5  # measured ~0.2 s on 2 busy cores


def test_toggles_when_each_combination_tried_its_own_lrs(tmp_path):
    # as an Optuna or frontier search leaves it: no lr shared between qk_norm=False and True
    root = tmp_path / "s"
    runs = [(1e-4, False, "stable"), (1e-3, False, "diverged"), (2e-4, True, "stable"), (5e-3, True, "stable")]
    for n, (lr, qk, status) in enumerate(runs):
        write_run(
            root,
            n,
            {"optim.lr": lr, "model.qk_norm": qk},
            {"status": "stable", "final_loss": 0.5} if status == "stable" else diverged("loss_spike", 3, "loss"),
        )
    table = runs_from_dirs(root)
    row = toggle_effects(table).set_index("axis").loc["model.qk_norm"]
    assert (row.pairs, row.combos, row.lr_steps) == (0, 1, 3.0)  # 1e-4 is lr #0 of 4, 5e-3 is lr #3
    assert divergence_map(table)[0].loc[2e-4].tolist() == ["-", "stable"]


def test_a_replicate_still_running_is_marked(tmp_path):
    runs = runs_from_dirs(make_grid(tmp_path / "s", seeds=(0, 1), running={("fp32", 1e-3, "flash", 1)}))
    table, _ = divergence_map(runs)
    assert table.loc[1e-3, ("fp32", "flash")] == "0/1 div*" and table.loc[1e-3, ("fp32", "math")] == "0/2 div"
    assert "* = more runs still running" in render_text(summarize(runs))


def test_no_margin_below_the_lowest_stable_lr_is_said(tmp_path):
    root = tmp_path / "s"
    write_run(root, 0, {"precision": "fp32", "optim.lr": 1e-3}, {"status": "stable", "final_loss": 0.5})
    write_run(root, 1, {"precision": "fp32", "optim.lr": 1e-2}, diverged("loss_spike", 4, "loss"))
    rec = recommend(runs_from_dirs(root))
    assert rec.settings == {"precision": "fp32", "optim.lr": 1e-3} and not rec.margin
    assert "no margin, the next grid lr 0.01 diverged" in rec.line and "[frontier: all]" in rec.line


def test_a_kernel_that_fails_parity_is_never_recommended_however_good_its_loss(tmp_path):
    """The OpenDiT scenario's 20 steps: fused_buggy trains stable and its eval loss is the lowest, yet its kernel is
    wrong (python -m sweep.parity); the recommendation takes the best setting with a right kernel and says why."""
    root = tmp_path / "s"
    for n, (modulate, loss) in enumerate([("eager", 0.21), ("fused", 0.2101), ("fused_buggy", 0.18)]):
        write_run(root, n, {"modulate": modulate}, {"status": "stable", "final_loss": loss})
    rec = recommend(runs_from_dirs(root))
    assert rec.settings["modulate"] in ("eager", "fused")
    assert "Not modulate=fused_buggy: its kernel fails the parity check" in rec.line
    buggy_only = tmp_path / "b"
    write_run(buggy_only, 0, {"modulate": "fused_buggy", "optim.lr": 1e-3}, {"status": "stable", "final_loss": 0.2})
    assert (
        "Every stable setting uses a kernel that fails the parity check" in recommend(runs_from_dirs(buggy_only)).line
    )


def test_killed_and_resumed_sweep_interrupted_runs(tmp_path):
    """kill -9 of a sweep, then the same command again: the killed jobs' directories have no result.json.

    The Optuna sweeper redoes a killed cell as a new trial in a new directory (18 here): the old one is
    interrupted and superseded by it. A cell nobody redid, with no live process, is interrupted; only a
    directory whose job holds its lock is running."""
    import os

    from sweep.run.results import hold_run_dir, release_run_dir

    root = make_grid(
        tmp_path / "s",
        running={("fp32", 1e-3, "math", 0), ("bf16_amp", 1e-2, "flash", 0), ("fp16_pure", 1e-4, "math", 0)},
    )
    redone = {"precision": "fp32", "optim.lr": 1e-3, "attention": "math", "steps": 8}
    write_run(root, 18, {**redone, "ledger.trial_number": 18}, outcome("fp32", 1e-3, "math"))
    result = read_result(root / "18")
    result["params"] = redone  # a job's params leave ledger.* out
    (root / "18" / "result.json").write_text(json.dumps(result))
    long_ago = 1_000_000_000
    for job in root.iterdir():
        os.utime(job / ".hydra" / "overrides.yaml", (long_ago, long_ago))
    live = next(
        r
        for r in root.iterdir()
        if "fp16_pure" in (r / ".hydra" / "overrides.yaml").read_text()
        and "attention=math" in (r / ".hydra" / "overrides.yaml").read_text()
        and not (r / "result.json").exists()
    )
    hold_run_dir(live)
    try:
        runs = runs_from_dirs(root)
    finally:
        release_run_dir(live)
    by_dir = runs.set_index(runs.run_dir.map(lambda d: Path(d).name))
    assert len(runs) == 19 and (runs.status == "running").sum() == 1 and by_dir.loc[live.name, "status"] == "running"
    killed = by_dir[by_dir.status == "interrupted"]
    assert len(killed) == 2
    superseded = killed[killed.superseded_by.notna()]
    assert len(superseded) == 1 and Path(superseded.superseded_by.iloc[0]).name == "18"
    assert superseded.iloc[0]["param:precision"] == "fp32" and superseded.iloc[0]["param:optim.lr"] == 1e-3
    text = render_text(summarize(runs))
    assert text.startswith("19 runs: 8 stable, 8 diverged, 1 running, 2 interrupted (1 superseded)"), text[:80]
    table, _ = divergence_map(summarize(runs).runs)
    assert table.loc[1e-2, ("bf16_amp", "flash")] == "interrupted"

    # Nothing holds a lock once the sweep is over: the summary at its end counts no run as running.
    runs = runs_from_dirs(root, starting_s=0)
    assert (runs.status == "running").sum() == 0 and (runs.status == "interrupted").sum() == 3


def test_resumed_grid_summary_is_every_cell_once(tmp_path):
    """The issue's sweep: 12 cells, one killed mid-run and redone by the same command."""
    root = tmp_path / "s"
    n = 0
    for p in ["fp32", "bf16_amp"]:
        for lr in LRS:
            for a in ATTENTIONS:
                write_run(
                    root, n, {"precision": p, "optim.lr": lr, "attention": a}, None if n == 5 else outcome(p, lr, a)
                )
                n += 1
    write_run(root, 12, {"precision": "fp32", "optim.lr": 1e-2, "attention": "math"}, outcome("fp32", 1e-2, "math"))
    runs = runs_from_dirs(root, starting_s=0)
    assert summarize(runs).counts_line() == "13 runs: 9 stable, 3 diverged, 1 interrupted (superseded)"


def test_a_setting_that_barely_trained_is_named_under_the_frontier_and_in_the_recommendation(tmp_path):
    """`stable` says only that nothing blew up: at width 512 under SP (docs/ladder.md, v3) every stable run ended
    at an eval loss of 0.8-1.1 of the untrained model's, and the recommendation called 0.83 "the best" (before:
    no word). A setting whose eval loss is still 60% or more of its runs' first training loss (initial_loss 1.0
    here) is named; one that trained (0.2) is not; without an eval loss (one minibatch's final loss) nothing is
    said."""
    n = 0
    for precision, best in (("fp32", 0.83), ("bf16_amp", 0.2)):
        for lr in (1e-3, 3e-3, 1e-2):
            value = best * (1 + abs(math.log10(lr / 3e-3)))
            write_run(
                tmp_path / "s", n, {"precision": precision, "optim.lr": lr}, {"eval_loss": value, "steps_run": 30}
            )
            write_run(tmp_path / "f", n, {"precision": precision, "optim.lr": lr}, {"final_loss": value})
            n += 1
    table = frontier(runs_from_dirs(tmp_path / "s"))
    assert table.attrs["learned"] == [
        "Barely trained in 30 steps: even the best lr's eval loss is at least 60% of the first training loss, so its"
        " frontier is where runs stopped blowing up, not where they train well: fp32 (0.83 against 1) (a longer"
        " horizon, more steps, tells)"
    ]
    s = summarize(runs_from_dirs(tmp_path / "s"), target="cuda")
    assert s.recommendation.settings["precision"] == "bf16_amp" and "barely trained" not in s.recommendation.line
    only = summarize(runs_from_dirs(tmp_path / "s").query("`param:precision` == 'fp32'"), target="cuda")
    assert " Warning: this setting barely trained in 30 steps: its eval loss 0.83 is 83% of its runs' first" in (
        only.recommendation.line
    )
    assert "Barely trained in 30 steps" in render_text(s)
    assert frontier(runs_from_dirs(tmp_path / "f")).attrs["learned"] == []
    for path in (tmp_path / "s").glob("*/result.json"):  # fine-tuned from weights: near its end from its start
        path.write_text(json.dumps(json.loads(path.read_text()) | {"loaded": "/ckpt/base.safetensors"}))
    assert frontier(runs_from_dirs(tmp_path / "s")).attrs["learned"] == []
