"""Tables that tell signal from noise: replicates, the eval loss as quality, ties, and a recommendation
that weighs quality against margin (sweep/report/noise.py, tables.py, recommend.py; issue #16).

The synthetic sweeps write result.json files whose right answers are known by construction; the last
test trains real runs.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from sweep.config import ConfigError
from sweep.report.noise import Spread, paired_change, within_noise
from sweep.report.recommend import recommend
from sweep.report.runs import runs_from_dirs
from sweep.report.summary import summarize
from sweep.report.tables import frontier, lr_sensitivity, toggle_effects
from sweep.report.text import render_text
from sweep.search.replicates import replicate_overrides

from .conftest import SMALL_MODEL, multirun_in_process, read_result, sweep_forked
from .test_report_tables import diverged, write_run


def stable(eval_loss: float, **extra) -> dict:
    return {"status": "stable", "final_loss": eval_loss + 0.3, "eval_loss": eval_loss, **extra}


def write_sweep(root: Path, cells: list[tuple[dict, dict]]) -> pd.DataFrame:
    for n, (params, result) in enumerate(cells):
        write_run(root, n, params, result)
    return runs_from_dirs(root)


# --- the noise rule ------------------------------------------------------------------------------


def test_the_tie_rule_is_two_standard_errors_and_unmeasured_with_one_replicate():
    a, b = Spread.of([1.0, 1.1, 0.9]), Spread.of([1.05, 1.15, 0.95])  # sd 0.1 each: 2 SE of the gap = 0.163
    assert a.sd == pytest.approx(0.1) and within_noise(a, b) is True
    assert within_noise(a, Spread.of([1.3, 1.4, 1.2])) is False  # a gap of 0.3
    assert within_noise(Spread.of([1.0]), Spread.of([1.3])) is None  # one replicate: not measured
    assert within_noise(Spread.of([1.0]), Spread.of([1.0 + 1e-7])) is True  # under 0.1%: a tie regardless
    change, noise, n = paired_change([(1.0, 0.9), (2.0, 1.8), (0.5, 0.45)])  # b 10% lower in every pair
    assert (change, noise, n) == (pytest.approx(-0.1), pytest.approx(0.0, abs=1e-12), 3)


# --- the recommendation ------------------------------------------------------------------------


def test_the_issue_grid_recommends_the_lr_that_trains_not_the_one_below_it(tmp_path):
    """The 6-run CPU grid of issue #16: at 1e-4 the loss barely moved (0.9), at 1e-3 it reached 0.07, 3e-2
    diverged. The old rule recommended 1e-4 ("one grid step below its largest stable lr")."""
    cells = []
    for precision in ("fp32", "fp16_pure"):
        for lr, result in ((1e-4, stable(0.9)), (1e-3, stable(0.07)), (3e-2, diverged("nonfinite_loss", 4, "forward"))):
            cells.append(({"precision": precision, "optim.lr": lr}, result))
    rec = recommend(write_sweep(tmp_path / "s", cells))
    assert rec.settings["optim.lr"] == 1e-3 and not rec.margin
    assert "eval loss 0.07 (1 replicate), the best" in rec.line
    assert "lr 0.001: no margin, the next grid lr 0.03 diverged" in rec.line


def test_settings_tied_within_noise_go_to_the_one_with_more_margin(tmp_path):
    """Three seeds each: 3e-4 and 1e-3 are within noise (0.100 vs 0.098, sd 0.01), 1e-4 is far worse and 3e-3
    diverged. Among the tie the lr two grid steps below the diverging one wins over the one next to it."""
    evals = {1e-4: (0.50, 0.51, 0.49), 3e-4: (0.100, 0.110, 0.090), 1e-3: (0.098, 0.108, 0.088)}
    cells = []
    for seed in range(3):
        for lr in (1e-4, 3e-4, 1e-3, 3e-3):
            result = diverged("loss_spike", 3, "loss") if lr == 3e-3 else stable(evals[lr][seed])
            cells.append(({"optim.lr": lr, "seed": seed}, result))
    runs = write_sweep(tmp_path / "s", cells)
    f = frontier(runs).loc["all"]
    assert (f.max_stable_lr, f.best_lr, f.replicates) == (1e-3, 1e-3, 3)
    assert f.eval_spread == pytest.approx(0.01)
    rec = recommend(runs)
    assert rec.settings == {"optim.lr": 3e-4} and rec.margin and rec.ties == 2
    assert "eval loss 0.1 ± 0.01 (3 replicates), within noise of the best 0.098, one of 2 tied settings" in rec.line
    assert "lr 0.0003: 2 grid steps below the smallest diverging lr 0.003" in rec.line
    assert "best-eval stable lr 0.001: no margin, the next grid lr 0.003 diverged" in rec.line


def test_speeds_compare_lone_runs_with_lone_runs_not_with_a_packs_share(tmp_path):
    """bf16_amp and fp32 tie on quality. bf16_amp is faster alone (8 vs 5 steps/s); fp32's packed runs report
    9 steps/s each, a share of a pack's wall time that no lone run can be compared with."""
    cells = []
    for seed in range(2):
        cells.append(({"precision": "bf16_amp", "optim.lr": 1e-3, "seed": seed}, stable(0.1, steps_per_second=8.0)))
        cells.append(({"precision": "fp32", "optim.lr": 1e-3, "seed": seed}, stable(0.1, steps_per_second=5.0)))
        cells.append(
            ({"precision": "fp32", "optim.lr": 1e-3, "seed": seed + 2}, stable(0.1, steps_per_second=9.0, packed=4))
        )
    rec = recommend(write_sweep(tmp_path / "s", cells), target="cpu")  # the runs ran on a CPU: their speeds count
    assert rec.precision == "bf16_amp"
    assert "fastest of those (tie-break: steps/s measured on cpu), bf16_amp at 8 steps/s (lone runs)" in rec.line


def stable_adamw_sweep(root: Path, lr: float | None = None) -> pd.DataFrame:
    """optim.update_clip {0.5, 2} x optim.betas {[0.9, 0.95], [0.9, 0.999]} x 3 seeds, no lr axis (as
    conf/experiment/stable_adamw.yaml). beta2 0.999 with clip 2 has the lowest eval loss in its one stable
    seed (0.15) but diverged in the other two; every other combination is stable in every seed, the best
    of them clip 0.5 with beta2 0.95 (0.20). `lr` writes one fixed optim.lr into every run."""
    cells = []
    for clip in (0.5, 2.0):
        for beta2 in (0.95, 0.999):
            for seed in range(3):
                if (clip, beta2) == (2.0, 0.999):
                    result = stable(0.15) if seed == 0 else diverged("loss_spike", 5, "optimizer")
                else:
                    result = stable(
                        {(0.5, 0.95): 0.20, (0.5, 0.999): 0.30, (2.0, 0.95): 0.25}[clip, beta2] + 0.001 * seed
                    )
                params = {"optim.update_clip": clip, "optim.betas": [0.9, beta2], "seed": seed}
                cells.append(({**params, "optim.lr": lr} if lr else params, result))
    return write_sweep(root, cells)


def test_without_an_lr_axis_a_combination_must_be_stable_in_every_replicate_too(tmp_path):
    """The stable_adamw sweep recommended beta2 0.999 with clip 2 (2 of 3 seeds diverged) because without an
    lr axis any combination with one stable run was a candidate. The rule is the one an lr axis applies:
    the same sweep with one fixed lr in every run recommends the same combination."""
    rec = recommend(stable_adamw_sweep(tmp_path / "no_lr"))
    assert rec.settings == {"optim.update_clip": 0.5, "optim.betas": "[0.9, 0.95]"}  # a list param reads as its text
    assert "eval loss 0.201 ± 0.001 (3 replicates), the best" in rec.line
    with_lr = recommend(stable_adamw_sweep(tmp_path / "lr", lr=1e-3))
    assert with_lr.settings == {**rec.settings, "optim.lr": 1e-3}
    assert with_lr.quality == rec.quality


def test_without_an_lr_axis_no_combination_stable_in_every_replicate_is_said(tmp_path):
    cells = [
        ({"modulate": m, "seed": s}, stable(0.2) if s else diverged("loss_spike", 5, "optimizer"))
        for m in ("fused", "eager")
        for s in (0, 1)
    ]
    rec = recommend(write_sweep(tmp_path / "s", cells))
    assert rec.combination is None
    assert rec.line == (
        "No combination was stable in every replicate: nothing to recommend; all 2 failed runs: loss_spike: a lower "
        "lr (optim.lr) or a precision with fp32 master weights."
    )


# --- tables that say when a difference is noise --------------------------------------------------


def toggle_sweep(root: Path) -> pd.DataFrame:
    """lr {1e-3, 1e-2} x attention {flash, math} x warmup {0, 3000} x 3 seeds. attention does not change
    the math (equal eval losses); a 3000-step warmup in a short run leaves the lr ~100x too low (eval 3x
    worse); 1e-2 with warmup 0 diverges in seed 2."""
    cells = []
    for seed in range(3):
        for lr in (1e-3, 1e-2):
            for attention in ("flash", "math"):
                for warmup in (0, 3000):
                    base = {1e-3: 0.20, 1e-2: 0.15}[lr] * (3 if warmup else 1) + 0.01 * seed
                    result = stable(base)
                    if lr == 1e-2 and warmup == 0 and seed == 2:
                        result = diverged("loss_spike", 5, "loss")
                    params = {"optim.lr": lr, "attention": attention, "optim.warmup_steps": warmup, "seed": seed}
                    cells.append((params, result))
    return write_sweep(root, cells)


def test_toggle_table_calls_an_equal_toggle_a_tie_and_a_worse_one_worse(tmp_path):
    runs = toggle_sweep(tmp_path / "s")
    t = toggle_effects(runs).set_index(["axis", "a", "b"])
    att = t.loc[("attention", "flash", "math")]
    assert att.quality == "tie" and att.eval_change == 0
    warm = t.loc[("optim.warmup_steps", 0, 3000)]
    assert warm.quality == "0 better" and warm.eval_change > 1.0  # about 3x the loss
    s = lr_sensitivity(runs)
    assert set(s.vs_best) <= {"best", "tie", "worse"} and s.spread.notna().all()
    rec = recommend(runs)
    assert rec.settings["optim.warmup_steps"] == 0 and rec.settings["optim.lr"] == 1e-3  # 1e-2 diverged once
    assert [(a.axis, a.better) for a in rec.advice if a.axis == "attention"] == []  # a tie advises nothing
    text = render_text(summarize(runs))
    assert "quality: tie when within noise" in text and "spread" in text


# --- replicates=N ------------------------------------------------------------------------------


def test_replicates_become_a_seed_axis_and_clash_with_a_seed_sweep():
    assert replicate_overrides(["optim.lr=1e-4,1e-3"], 3, 5) == ["seed=5,6,7"]
    assert replicate_overrides(["optim.lr=1e-4,1e-3"], 1, 0) == []
    with pytest.raises(ConfigError, match="replicates=2 and a seed override both given"):
        replicate_overrides(["seed=0,1"], 2, 0)
    # seed=5 on the command line is the config's seed here: the advice names the seeds replicates=2 would run from it
    with pytest.raises(ConfigError, match=r"give one, e.g. seed=5,6 for the 2 seeds from 5$"):
        replicate_overrides(["seed=5"], 2, 5)


def test_replicates_needs_a_multirun(tmp_path):
    p = sweep_forked("replicates=2", f"hydra.run.dir={tmp_path}")
    assert p.returncode == 2 and "replicates=2" in p.stderr and "add -m" in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_real_runs_rank_an_lr_100x_too_low_lower_and_call_the_attention_toggle_a_tie(tmp_path):
    """Trained runs, two seeds each: lr 1e-5 is 100x too low next to 1e-3; attention flash vs math computes
    the same function. The tables must rank 1e-5 lower and call the toggle a tie."""
    multirun_in_process(  # device=cpu: fp32 flash is a CPU kernel (CUDA's flash needs fp16/bf16: skipped there)
        tmp_path,
        *SMALL_MODEL,
        "optim.lr=1e-5,1e-3",
        "attention=flash,math",
        "device=cpu",
        "replicates=2",
        "steps=12",
        "ledger.enabled=false",
    )
    runs = runs_from_dirs(tmp_path)
    assert len(runs) == 8 and set(runs.status) == {"stable"} and sorted(set(runs.seed)) == [0, 1]
    f = frontier(runs)
    assert (f.best_lr == 1e-3).all() and (f.replicates == 2).all()
    low = runs[runs["param:optim.lr"] == 1e-5].eval_loss.mean()
    assert low > runs[runs["param:optim.lr"] == 1e-3].eval_loss.mean() * 1.05
    att = toggle_effects(runs).set_index("axis").loc["attention"]
    assert att.quality == "tie", att.to_dict()
    rec = recommend(runs)
    assert rec.settings["optim.lr"] == 1e-3 and "(2 replicates)" in rec.line
    result = read_result(tmp_path / "0")
    assert result["params"]["seed"] in (0, 1) and result["eval_loss"] is not None
    from sweep.report.html import curve_figures

    for fig in curve_figures(runs):  # the report's curves: an eval-loss row, a noise band per lr
        assert [a["text"] for a in fig["layout"]["annotations"]] == ["loss", "eval loss", "grad norm"]
        bands = sorted(t["name"] for t in fig["data"] if t.get("fill") == "tonexty")
        assert bands == ["lr=0.001 mean ± sd", "lr=1e-05 mean ± sd"]
