"""The end-of-run verdicts slow_divergence and no_progress (sweep/run/trend.py): the rules on synthetic curves, then
real runs: each verdict end to end, lone == packed, windows == one sync per step, monitor.trend=false, bad values."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import statistics
from pathlib import Path

import pytest

from sweep.config import ConfigError, MonitorConfig, Verdict
from sweep.diagnose.counterfactual import healthy_until
from sweep.diagnose.diagnosis import diagnose, render
from sweep.diagnose.mechanism import decide
from sweep.diagnose.signals import RunRecord
from sweep.run.execute import execute
from sweep.run.packing import execute_pack
from sweep.run.trend import Context, Weights, _rolling_median, judge, needs_initial_eval, window

from .conftest import SMALL_MODEL, make_run, multirun_in_process, read_result

# The thresholds each synthetic case is built around, spelled out so that moving a default does not move the cases.
CFG = MonitorConfig(
    trend_samples=40, trend_end_factor=3.0, trend_rise=2.0, trend_rise_t=4.0, trend_progress=0.6, trend_weight_path=1.0
)
STILL = Weights(norm0=10.0, norm=10.0, path=0.05)  # weights that barely moved (a low lr)
THRASHED = Weights(norm0=10.0, norm=14.0, path=30.0)  # 3x their norm along


def curve(levels: list[float], sigma: float, seed: int = 0) -> list[dict]:
    """Metrics rows of a loss that follows `levels` times log-normal noise: a batch of 4 at random timesteps swings
    the training loss tens of times from step to step (sigma ~0.8 in log at the demo's sizes)."""
    rng = random.Random(seed)
    return [
        {"step": i, "loss": x * math.exp(rng.gauss(0, sigma)), "grad_norm": 1.0, "attn_max_logit": ""}
        for i, x in enumerate(levels)
    ]


def trained(n: int, floor: float = 0.1, tau: float = 20.0) -> list[float]:
    return [floor + (1 - floor) * math.exp(-i / tau) for i in range(n)]


@pytest.mark.parametrize("seed", range(10))
def test_a_healthy_noisy_curve_gets_no_verdict(seed):
    t = judge(curve(trained(200), sigma=0.8, seed=seed), THRASHED, CFG)
    assert t.judged and t.verdict is None, t.detail
    assert t.window == 20  # a tenth of the run: the smallest of fewer medians is less far below the curve by chance


def test_a_slow_low_lr_curve_is_not_no_progress():
    """The demo's lr 1e-4 runs: ~0.91 of their initial loss after 30 steps, with weights that barely moved."""
    rows = curve([1.0 - 0.09 * i / 29 for i in range(30)], sigma=0.1)
    t = judge(rows, STILL, CFG)
    assert t.verdict is None and t.progress > CFG.trend_progress and t.weight_path < CFG.trend_weight_path
    assert judge(rows, THRASHED, CFG).verdict == Verdict.no_progress  # the weights' travel is what tells them apart


def test_a_run_that_ends_far_above_its_minimum_is_slow_divergence():
    levels = trained(60) + [0.1 * math.exp(math.log(6) * i / 139) for i in range(1, 141)]  # back up 6x by the end
    t = judge(curve(levels, sigma=0.8), STILL, CFG)
    assert t.verdict == Verdict.slow_divergence and t.end_over_min >= 3
    assert 40 <= t.first_bad_step <= 90  # the smoothed minimum, where the rise began
    assert "slow divergence" in t.detail and f"{t.end_over_min:.2f}x" in t.detail


def test_a_steady_rise_short_of_the_end_factor_is_slow_divergence():
    levels = trained(60) + [0.1 * math.exp(math.log(2.6) * i / 139) for i in range(1, 141)]
    t = judge(curve(levels, sigma=0.2), STILL, CFG)
    assert t.verdict == Verdict.slow_divergence and t.end_over_min < 3 and t.rise >= 2 and t.rise_t >= 4, t.detail
    assert "a rise of" in t.detail
    flat = judge(curve(trained(200, tau=10), sigma=0.2), STILL, CFG)  # a plateau: the same noise, no trend
    assert flat.verdict is None and flat.rise_steps >= 20 and abs(flat.rise_t) < 4


def test_no_progress_needs_an_untrained_start_and_far_travelled_weights():
    rows = curve([1.0] * 60, sigma=0.3)
    t = judge(rows, THRASHED, CFG)
    assert t.verdict == Verdict.no_progress and t.first_bad_step == 59 and "travelled 3x" in t.detail
    assert judge(rows, THRASHED, CFG, Context(fresh=False)).verdict is None  # a resumed run did not start untrained
    assert judge(rows, Weights(None, None, 0.0), CFG).verdict is None  # travel unknown: no verdict


def test_with_eval_losses_progress_compares_the_untrained_and_the_last_weights():
    """The first batch's loss depends on its timesteps (under v-prediction the untrained model's loss on the eval set
    was 0.37 where that batch's was 0.35), and a median of training losses can sit far below the eval loss (a run
    warmed up to lr 3e-2: training median 0.41x the first loss, eval loss 1.03x the untrained weights')."""
    rows = curve(trained(60), sigma=0.3)  # the training losses say it learned
    learned = Context(eval_loss=0.15, eval_initial=1.0)
    assert judge(rows, THRASHED, CFG, learned).verdict is None
    t = judge(rows, THRASHED, CFG, Context(eval_loss=1.03, eval_initial=1.0))
    assert t.verdict == Verdict.no_progress and t.progress == pytest.approx(1.03) and t.end_over_initial < 0.3
    assert "the eval loss after the last step 1.03 is 1.03x the untrained weights' 1" in t.detail
    flat = curve([1.0] * 60, sigma=0.3)  # the training losses say it went nowhere, the eval losses that it learned
    assert judge(flat, THRASHED, CFG, learned).verdict is None
    assert judge(flat, THRASHED, CFG, Context(eval_loss=0.15)).verdict == Verdict.no_progress  # no untrained eval
    assert needs_initial_eval(THRASHED, CFG, learned) and not needs_initial_eval(STILL, CFG, learned)
    assert not needs_initial_eval(THRASHED, CFG, Context(fresh=False, eval_loss=0.15))
    assert not needs_initial_eval(THRASHED, CFG, Context())  # no eval loss: nothing to compare it with


def test_a_median_holds_trend_samples_samples_and_a_tenth_of_the_run():
    assert [window(CFG, b, 60) for b in (1, 4, 16, 64)] == [40, 10, 6, 6]  # 6: a tenth of 60 steps
    assert window(CFG, 4, 600) == 60 and window(CFG, 64, 20) == 3


def test_the_rolling_median_is_each_windows_median():
    rng = random.Random(0)
    for n, w in [(30, 3), (200, 20), (57, 10), (10, 10), (5, 2)]:
        v = [rng.random() for _ in range(n)]
        assert _rolling_median(v, w) == [statistics.median(v[i + 1 - w : i + 1]) for i in range(w - 1, n)]


def test_a_run_too_short_for_two_windows_is_not_judged():
    t = judge(curve([1.0] * 19, sigma=0.3), THRASHED, CFG)
    assert not t.judged and t.verdict is None and "fewer than 2 windows of 10" in t.reason


def test_the_evidence_names_logits_and_gradient_norms():
    rows = curve([1.0] * 40, sigma=0.3)
    for r in rows:
        r["grad_norm"] = 1.0 + r["step"] / 10
        if r["step"] % 10 == 0:
            r["attn_max_logit"] = 2.0 * 3 ** (r["step"] // 10)
    t = judge(rows, THRASHED, CFG)
    assert t.logits == {"first": 2.0, "max": 54.0, "last": 54.0}
    assert (t.grad_norm["first"], t.grad_norm["last"]) == pytest.approx((1.45, 4.45))  # medians of steps 0-9, 30-39
    assert "attention logits 2 -> max 54" in t.detail and "grad norm (median of 10)" in t.detail


# Real runs. A cheap config that trains: the tiny video DiT on tiny clips, no ledger.
CHEAP = ["steps=40", "ledger.enabled=false", "monitor.forensics=false", "threads=1"]
# Warming up to a too-high lr: it learns while the lr is small, then the growing steps undo it, with no 10x spike.
# Measured (its smoothed loss at the end over its minimum at step 29; its largest loss over its initial one) on
# AVX-512 kernels 3.72x and 1.6x, on AVX2's (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2, bf16 GEMMs emulated)
# 3.70x and 1.6x, on the default ones 3.80x and 4.7x. It ends at step 48 of the 60-step warm-up: later, its loss
# is chaotic: at 60 steps AVX2's kernels spike 10x at step 59 and the default ones at step 49 (AVX-512's do not).
WARMED_TOO_HIGH = [*CHEAP, "steps=48", "optim.lr=0.03", "optim.warmup_steps=60"]
# Warmed up to lr 5e-2 over its 40 steps: it never gets anywhere (1.58x its initial loss), weights 3.5 norms along.
THRASHING = [*CHEAP, "optim.lr=0.05", "optim.warmup_steps=40"]


def result_of(tmp_path, *overrides, name="run"):
    execute(make_run(*overrides), tmp_path / name, params={})
    return json.loads((tmp_path / name / "result.json").read_text())


@pytest.fixture(scope="module")
def thrashing(tmp_path_factory) -> tuple[Path, dict]:
    """THRASHING run once (a multirun of one: its run dir has the .hydra config a diagnosis reads), for the three
    tests that read it: (its run dir, its result.json as the run wrote it, before any diagnosis)."""
    root = tmp_path_factory.mktemp("thrashing")
    multirun_in_process(root, *THRASHING)
    return root / "0", read_result(root / "0")


@pytest.mark.slow
def test_a_healthy_run_stays_stable_and_records_its_trend(tmp_path):
    r = result_of(tmp_path, *SMALL_MODEL, *CHEAP, "optim.lr=1e-3")
    assert r["status"] == "stable" and r["verdict"] is None
    t = r["trend"]
    assert t["judged"] and t["verdict"] is None and t["end_over_initial"] < 0.5 and 0 < t["weight_path"] < 1
    assert t["detail"].startswith("trained: ")
    assert t["eval_initial"] is None and t["progress"] == t["end_over_initial"]  # measured only where it could matter


@pytest.mark.slow
@pytest.mark.xdist_group("thrashing")  # the module's thrashing run, run once: on one worker
def test_each_verdict_end_to_end(tmp_path, thrashing):
    slow = result_of(tmp_path, *WARMED_TOO_HIGH, name="slow")
    assert (slow["status"], slow["verdict"]) == ("diverged", "slow_divergence"), slow["trend"]["detail"]
    assert slow["first_bad_step"] == slow["trend"]["min_step"] < 47
    assert slow["cause"]["where"] == "optimizer" and slow["cause"]["detail"] == slow["trend"]["detail"]
    assert slow["mechanism"]["name"] in ("lr_too_high", "attention_logit_growth")
    _, stuck = thrashing
    assert (stuck["status"], stuck["verdict"], stuck["first_bad_step"]) == ("diverged", "no_progress", 39)
    assert stuck["trend"]["weight_path"] >= 1 and stuck["trend"]["progress"] >= 0.6
    assert stuck["trend"]["eval_initial"] > 0 and stuck["trend"]["progress"] == stuck["trend"]["eval_over_initial"]
    assert stuck["mechanism"]["name"] in ("lr_too_high", "attention_logit_growth")


@pytest.mark.slow
def test_monitor_trend_false_turns_it_off(tmp_path):
    r = result_of(tmp_path, *SMALL_MODEL, *THRASHING, "monitor.trend=false")
    assert r["status"] == "stable" and r["trend"] is None


@pytest.mark.slow
@pytest.mark.xdist_group("thrashing")  # the module's thrashing run, run once: on one worker
def test_windows_give_the_verdict_of_one_sync_per_step(tmp_path, thrashing):
    _, one = thrashing  # one sync per step (monitor.sync_every=1, the default)
    windowed = result_of(tmp_path, *THRASHING, "monitor.sync_every=7", name="windowed")
    assert windowed["sync"]["windows"] > 0
    for key in ("status", "verdict", "first_bad_step", "cause", "trend"):
        assert windowed[key] == one[key], key


@pytest.mark.slow
def test_a_packed_run_gets_the_verdict_it_gets_alone(tmp_path):
    """conclude judges a packed run from its own rows and the travel its own monitor measured in the pack. At a high
    lr a pack's rounding parts its curve from the lone run's chaotically (docs/packing.md), so the runs here train
    where a pack keeps to a relative 1e-4 (fp32, lr 1e-3), and thresholds set for the test give one a verdict."""
    forced = ["monitor.trend_progress=0.01", "monitor.trend_weight_path=0.01"]  # any run that moved at all
    short = [*CHEAP, "steps=30", "optim.lr=1e-3"]
    overrides = [[*short, *forced], [*short, "seed=1"]]
    runs = [make_run(*SMALL_MODEL, *o) for o in overrides]
    alone = [execute(r, tmp_path / f"alone{i}", {}) for i, r in enumerate(runs)]
    packed = execute_pack(runs, [tmp_path / f"packed{i}" for i in range(2)], [{}] * 2, [""] * 2)
    assert [p.packed for p in packed] == [2, 2]
    assert [(r.status, r.verdict, r.first_bad_step) for r in alone] == [
        ("diverged", Verdict.no_progress, 29),
        ("stable", None, None),
    ]
    assert [(r.status, r.verdict, r.first_bad_step) for r in packed] == [
        (r.status, r.verdict, r.first_bad_step) for r in alone
    ]
    for a, p in zip(alone, packed):
        for key in ("weight_path", "weight_growth", "end_over_min", "progress"):
            assert p.trend[key] == pytest.approx(a.trend[key], rel=1e-3), key
    assert packed[0].trend["eval_initial"] == alone[0].trend["eval_initial"]  # the same untrained weights, rebuilt


@pytest.mark.slow
def test_a_run_stopped_before_its_last_step_is_not_judged(tmp_path):
    from sweep.diagnose.trials import StopAfter

    r = execute(make_run(*SMALL_MODEL, *THRASHING), tmp_path / "run", params={}, hooks=[StopAfter(20)])
    assert r.status == "stable" and r.trend is None


@pytest.mark.parametrize(
    "override,key",
    [
        ("monitor.trend_samples=0", "monitor.trend_samples"),
        ("monitor.trend_end_factor=1", "monitor.trend_end_factor"),
        ("monitor.trend_rise=0.5", "monitor.trend_rise"),
        ("monitor.trend_rise_t=0", "monitor.trend_rise_t"),
        ("monitor.trend_progress=-1", "monitor.trend_progress"),
        ("monitor.trend_weight_path=0", "monitor.trend_weight_path"),
        ("monitor.trend_end_factor=nan", "monitor.trend_end_factor"),
    ],
)
def test_bad_thresholds_fail_at_composition_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=f"^{key}: must be"):
        make_run(override)


def test_the_thresholds_are_recorded_with_the_numbers():
    t = judge(curve(trained(40), sigma=0.3), STILL, dataclasses.replace(CFG, trend_end_factor=5.0))
    assert t.to_dict()["thresholds"]["end_factor"] == 5.0


def trend_record(verdict: str, rows: list[dict], weight_path: float | None, start: int = 0) -> RunRecord:
    result = {"status": "diverged", "verdict": verdict, "first_bad_step": 30, "cause": {"where": "optimizer"}}
    result |= {"trend": {"weight_path": weight_path}, "start_step": start, "params": {}}
    run = make_run()
    if start:  # a run that starts past step 0 resumed from a checkpoint
        run = dataclasses.replace(run, checkpoint=dataclasses.replace(run.checkpoint, resume_from="step_10"))
    return RunRecord(Path("."), result, rows, None, run)


def test_the_mechanism_of_an_end_of_run_verdict_comes_from_its_evidence():
    flat = [{"step": float(s), "loss": 1.0} for s in range(40)]
    far = decide(trend_record("no_progress", flat, weight_path=3.0))
    assert far.name == "lr_too_high" and "travelled 3x their initial norm (>= 1)" in far.summary
    assert decide(trend_record("slow_divergence", flat, weight_path=0.2)).name == "unexplained"
    grown = [dict(r) for r in flat]
    for r, (logit, entropy) in zip(grown[::10], [(2.0, 1.4), (30.0, 0.5), (300.0, 0.1), (280.0, 0.1)]):
        r |= {"attn_max_logit": logit, "attn_min_entropy": entropy}
    m = decide(trend_record("slow_divergence", grown, weight_path=3.0))  # growth after the first bad step counts too
    assert m.name == "attention_logit_growth" and "over the run, whose loss rose after its minimum" in m.summary


def test_an_end_of_run_verdict_is_replayed_from_the_run_start_to_its_end():
    rows = [{"step": float(s), "loss": 1.0} for s in range(40)]
    assert healthy_until(trend_record("slow_divergence", rows, 3.0)) == 0
    assert healthy_until(trend_record("no_progress", rows, 3.0, start=10)) == 10


@pytest.mark.slow
@pytest.mark.xdist_group("thrashing")  # the module's thrashing run, run once: on one worker
def test_the_diagnosis_of_no_progress_reruns_the_whole_run(tmp_path, thrashing):
    run_dir = tmp_path / "0"  # a copy: the diagnosis writes into its run dir, which the other tests read
    shutil.copytree(thrashing[0], run_dir)
    assert read_result(run_dir)["verdict"] == "no_progress"
    d = diagnose(run_dir, fix=False, progress=lambda _line: None)
    table = d["counterfactuals"]
    assert (table["from_step"], table["through_step"], table["last_bad_step"]) == (0, 39, 39)
    same = next(r for r in table["rows"] if r["name"] == "same config")["outcome"]
    assert (same["verdict"], same["first_bad_step"]) == ("no_progress", 39)  # reproduced, not nondeterministic
    record = next(
        Path(same["run_dir"]) / n for n in ("trial.json", "result.json") if (Path(same["run_dir"]) / n).is_file()
    )
    assert json.loads(record.read_text())["trend"]["eval_initial"] > 0  # the row compared eval losses, as the run did
    assert d["mechanism"] in ("lr_too_high", "attention_logit_growth") and "no_progress@39" in render(d)
