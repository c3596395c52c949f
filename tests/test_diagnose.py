"""The diagnosis of a diverged run (sweep/diagnose): its mechanism, the counterfactual table, the confirmed fix,
and one-line refusals of what it cannot diagnose."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest

from sweep.config import RunConfig
from sweep.diagnose.__main__ import main
from sweep.diagnose.counterfactual import healthy_until
from sweep.diagnose.diagnosis import DIAGNOSIS_FILE, diagnose
from sweep.diagnose.mechanism import MECHANISMS, decide, second_moment_lag
from sweep.diagnose.record import RunRecord
from sweep.report.__main__ import main as report_main

from .conftest import SMALL_MODEL, make_run, multirun_in_process, read_result

TINY = ["ledger.enabled=false", "steps=12"]


def sweep(tmp_path: Path, *overrides: str) -> list[dict]:
    multirun_in_process(tmp_path, *TINY, *overrides)
    return [read_result(p.parent) | {"dir": p.parent} for p in sorted(tmp_path.glob("*/result.json"))]


def quiet(_line: str) -> None:
    pass


def rows_of(d: dict) -> dict:
    return {r["name"]: r for r in d["counterfactuals"]["rows"]}


def test_a_bad_sample_is_named_left_out_and_the_fix_confirmed(tmp_path):
    """With the data check on (bad_input before the forward) and off (a NaN loss): the same mechanism, the
    row without the sample is the one that keeps the bad steps healthy, and a run without it from step 0 is
    stable. Fails if data.skip_samples does not leave the sample out, or the replay is not bit for bit."""
    runs = sweep(tmp_path, "optim.lr=1e-3", "+data.faults=[{index:5,kind:nan}]", "data.check=true,false")
    assert [(r["verdict"], r["mechanism"]["name"]) for r in runs] == [
        ("bad_input", "bad_input"),
        ("nonfinite_loss", "bad_input"),
    ]
    for r in runs:
        d = diagnose(r["dir"], progress=quiet)
        assert json.loads((r["dir"] / DIAGNOSIS_FILE).read_text())["mechanism"] == d["mechanism"] == "bad_input"
        rows = rows_of(d)
        first = r["first_bad_step"]
        assert rows["same config"]["outcome"]["verdict"] == r["verdict"]
        assert rows["same config"]["outcome"]["first_bad_step"] == first
        assert rows["without extreme samples"]["overrides"] == ["data.skip_samples=[5]"]
        assert rows["without extreme samples"]["healthy"] and not rows["lr/10"]["healthy"]
        assert rows["fp32"]["outcome"] is None and "already fp32" in rows["fp32"]["not_applicable"]
        assert d["counterfactuals"]["from_step"] == first - 1 and d["counterfactuals"]["prefix"]["identical"]
        assert d["agrees"] and d["fix"]["confirmed"] and d["fix"]["overrides"] == ["data.skip_samples=[5]"]
        fixed = json.loads((Path(d["fix"]["run_dir"]) / "trial.json").read_text())  # not a run of the sweep
        assert fixed["status"] == "stable" and fixed["steps_run"] == 12


def test_a_packed_run_is_diagnosed_as_its_own_mechanism_not_as_nondeterministic(tmp_path):
    """A pack's vmapped batch sums in another order, so a packed run's lone replay is never bit for bit its own
    (tiny's loss at step 0: 1.016011357 packed, 1.016011477 alone): the replay is held to packing's tolerance
    instead, and the NaN sample is named, not 'nondeterministic' (as it was), and its fix confirmed."""
    runs = sweep(
        tmp_path,
        *SMALL_MODEL,
        "hydra/launcher=packed",
        "hydra.launcher.pack=2",
        "optim.lr=1e-3,2e-3",
        "+data.faults=[{index:7,kind:nan}]",
        "data.check=false",
    )
    assert [(r["packed"], r["verdict"]) for r in runs] == [(2, "nonfinite_loss"), (2, "nonfinite_loss")]
    d = diagnose(runs[0]["dir"], progress=quiet)
    prefix = d["counterfactuals"]["prefix"]
    assert prefix["matches"] and "replayed alone" in prefix["detail"], prefix
    assert d["mechanism"] == "bad_input" and d["agrees"] and d["fix"]["confirmed"], d["agreement"]


@pytest.mark.xdist_group("auto_sweep")  # the module's auto_sweep, run once: on one worker
def test_a_spike_nothing_specific_explains_is_lr_too_high_when_lr_over_10_holds(auto_sweep):
    """fp32 at lr 3e-2 spikes within a few steps with no logit growth, no lag, nothing in the data: the
    recorded signals leave it unexplained, the lr/10 row keeps it healthy, so lr_too_high, and the fix lr/10
    is confirmed from step 0. The run is auto_sweep's (12 steps, as diagnose() alone would see it), its
    diagnosis the one the multirun's end wrote with diagnose()'s defaults: running both again was the same work."""
    _, runs, _ = auto_sweep
    r = runs[1]
    assert (r["verdict"], r["mechanism"]["recorded"]["name"]) == ("loss_spike", "unexplained")
    d = json.loads((r["dir"] / DIAGNOSIS_FILE).read_text())
    rows = rows_of(d)
    assert rows["lr/10"]["healthy"] and rows["lr/10"]["overrides"] == ["optim.lr=0.003"]
    assert rows["same config"]["outcome"]["verdict"] == "loss_spike"
    assert d["mechanism"] == "lr_too_high" and d["agrees"]
    assert d["fix"]["confirmed"] and d["fix"]["overrides"] == ["optim.lr=0.003"]
    assert d["counterfactuals"]["through_step"] == 11  # the run's last step: 10 past the spike would be beyond it


def record(verdict, cause=None, rows=(), **result) -> RunRecord:
    r = {"status": "diverged", "verdict": verdict, "first_bad_step": 20, "cause": cause or {}, "params": {}}
    r.update(result)
    return RunRecord(Path("."), r, [dict(x) for x in rows], None, run_config(*result.pop("_overrides", [])))


@functools.cache
def run_config(*overrides: str) -> RunConfig:
    """make_run(*overrides), composed once per module: the 26 records below share 12 configs (a Hydra
    composition is ~0.15 s of CPU), and the rules only read them (never mutated: a change is dataclasses.replace)."""
    return make_run(*overrides)


def logit_rows(first: float, peak: float, e0: float, low: float) -> list[dict]:
    return [
        {"step": 0.0, "loss": 1.0, "attn_max_logit": first, "attn_min_entropy": e0},
        {"step": 10.0, "loss": 0.5, "attn_max_logit": peak, "attn_min_entropy": low},
        {"step": 20.0, "loss": 50.0, "attn_max_logit": math.nan, "attn_min_entropy": math.nan},
    ]


def test_mechanisms_from_recorded_signals():
    """Each rule on the signals it reads, and the edges where it must not fire."""
    spike = {"where": "optimizer", "detail": "the loss 50 > 10 x the initial loss"}
    grown = decide(record("loss_spike", spike, logit_rows(1.7, 168.0, 1.36, 0.09)))
    assert grown.name == "attention_logit_growth" and grown.evidence["growth"] == pytest.approx(168 / 1.7)
    # a healthy run's logit grows a few x while it learns: not the mechanism (qk-norm's own run: 1.7 -> 6.6)
    assert decide(record("loss_spike", spike, logit_rows(1.7, 6.6, 1.36, 1.2))).name == "unexplained"
    assert decide(record("loss_spike", spike, logit_rows(1.7, 168.0, 1.36, 1.0))).name == "unexplained"  # no collapse
    lag = "; AdamW's second moment lagged: the 31 squared gradient norms before step 300 average 12.5x its sum"
    kept = "; AdamW's second moment kept up: the 31 squared gradient norms before step 36 average 1.1x its sum"
    assert second_moment_lag(lag) == 12.5 and second_moment_lag(kept) is None
    assert decide(record("loss_spike", {"where": "optimizer", "detail": "x" + lag})).name == "adam_second_moment_lag"
    fp16 = {
        "where": "forward",
        "module": "blocks.0.attn",
        "detail": "blocks.0.attn output is non-finite with finite inputs in float16",
    }
    assert decide(record("scale_collapse", fp16, _overrides=["precision=fp16_amp"])).name == "activation_overflow"
    bf16 = {
        "where": "forward",
        "module": "blocks.0.attn",
        "detail": "output is non-finite with finite inputs in bfloat16",
    }
    assert decide(record("nonfinite_loss", bf16, _overrides=["precision=bf16_amp"])).name == "unexplained"
    nan_update = {"where": "optimizer", "detail": "weight x.weight is non-finite after the update of step 0"}
    sana = decide(record("nonfinite_loss", nan_update, _overrides=["precision=fp16_pure"]))
    assert sana.name == "update_underflow" and sana.evidence["eps_in_fp16"] == 0.0
    assert decide(record("nonfinite_loss", nan_update)).name == "unexplained"  # fp32 weights: eps is no culprit
    lost = {"where": "optimizer", "detail": "updates lost: 100% of the weight mass unchanged"}
    assert decide(record("stalled", lost, _overrides=["precision=bf16_pure"])).name == "update_underflow"
    zeros = {"where": "backward", "detail": "gradients underflowed: 97% of gradient elements are exactly 0"}
    assert decide(record("stalled", zeros, _overrides=["precision=fp16_amp_noscale"])).name == "gradient_underflow"
    # in fp32 no gradient underflows to exactly 0: they are none at all (LoRA on untrained weights), not named
    none = decide(record("stalled", zeros))
    assert none.name == "unexplained" and "exactly 0 in fp32, which no underflow makes" in none.summary
    assert decide(record("corrupt_checkpoint", {"where": "checkpoint"})).name == "corrupt_checkpoint"
    collapse = {"where": "scaler", "detail": "overflow at the minimum scale"}
    rows = [{"step": 0.0, "loss": 1.0, "loss_scale": 1.0}]
    assert (
        decide(record("scale_collapse", collapse, rows, _overrides=["precision=fp16_amp"])).name
        == "loss_scale_collapse"
    )
    buggy = decide(record("loss_spike", spike, _overrides=["modulate=fused_buggy"]))
    assert buggy.name == "kernel" and buggy.evidence["impl"] == "fused_buggy"
    assert decide(record("loss_spike", spike, _overrides=["modulate=fused"])).name == "unexplained"
    assert set(MECHANISMS) >= {grown.name, sana.name, buggy.name, "lr_too_high", "nondeterministic"}


def test_a_stall_that_fp32_keeps_is_offered_a_smaller_eps_then_a_larger_lr():
    """Pure bf16 at lr 1e-6 (or fp16 unscaled at loss weight 1e-7) stalls in fp32 too: the gradients are far below
    AdamW's eps, so precision alone cannot be the fix (bench/diagnosis.py: both confirmed with eps 1e-12)."""
    from sweep.diagnose.counterfactual import Row, Table
    from sweep.diagnose.fix import candidates

    lost = {"where": "optimizer", "detail": "updates lost: 100% of the weight mass unchanged"}
    stall = record("stalled", lost, _overrides=["precision=bf16_pure", "optim.lr=1e-6"])
    stalled_too = {"status": "diverged", "verdict": "stalled", "first_bad_step": 19}
    kept = Table(0, 24, 19, [Row("fp32", ["precision=fp32"], stalled_too, cleared=False)])
    assert candidates(stall, "update_underflow", {}, kept, [], None)[:2] == [
        ["precision=bf16_amp", "optim.eps=1e-12"],
        ["precision=bf16_amp", "optim.lr=1e-05"],
    ]
    cleared = Table(0, 24, 19, [Row("fp32", ["precision=fp32"], {"status": "stable"}, cleared=True)])
    assert candidates(stall, "update_underflow", {}, cleared, [], None)[0] == ["precision=bf16_amp"]
    zeros = {"where": "backward", "detail": "gradients underflowed: 100% of gradient elements are exactly 0"}
    noscale = record("stalled", zeros, _overrides=["precision=fp16_amp_noscale"])
    assert candidates(noscale, "gradient_underflow", {}, kept, [], None)[0] == ["precision=fp16_amp", "optim.eps=1e-12"]
    assert candidates(noscale, "gradient_underflow", {}, cleared, [], None)[0] == ["precision=fp16_amp"]


def test_a_spike_that_lr_10_only_delays_is_the_step_size_once_lr_100_is_stable():
    """bf16 AMP at lr 3e-1 with update clipping spikes at step 1, lr/10 at step 6 (bench/diagnosis.py's
    video_bf16_lr_high_update_clip): no row clears it, so no mechanism from the table; lr/100 is the candidate,
    and only its stable run from step 0 makes it lr_too_high. A row that spikes at the same step proposes nothing."""
    from sweep.diagnose.counterfactual import Row, Table
    from sweep.diagnose.diagnosis import step_size_proven
    from sweep.diagnose.fix import candidates
    from sweep.diagnose.mechanism import Mechanism

    spiked = record("loss_spike", {"where": "optimizer"}, first_bad_step=1, _overrides=["optim.lr=0.3"])
    unexplained = Mechanism("unexplained", "no recorded signal explains it")

    def table(first_bad: int) -> Table:
        later = {"status": "diverged", "verdict": "loss_spike", "first_bad_step": first_bad}
        return Table(0, 11, 1, [Row("lr/10", ["optim.lr=0.03"], later, cleared=False)])

    assert candidates(spiked, "unexplained", {}, table(6), [], None) == [["optim.lr=0.003"]]
    assert candidates(spiked, "unexplained", {}, table(1), [], None) == []
    stable = {"overrides": ["optim.lr=0.003"], "confirmed": True}
    m, agrees, why = step_size_proven(spiked, unexplained, table(6), stable)
    assert (m.name, agrees, m.evidence["lr/10 first bad step"]) == ("lr_too_high", True, 6), why
    assert step_size_proven(spiked, unexplained, table(6), stable | {"confirmed": False}) is None
    assert step_size_proven(spiked, unexplained, table(1), stable) is None


def test_a_kernel_whose_reference_alone_is_stable_from_step_0_is_proven_though_its_row_was_too_late():
    """OpenDiT's modulate diverges after ~390 steps of adaLN drift: from the last healthy state the reference kernels
    cannot undo the weights' drift, but modulate=eager alone from step 0 is stable (conf/scenario/opendit_*). A
    kernel run that the lower lr fixed instead (the reference kernels diverging too) stays a disagreement."""
    from sweep.diagnose.diagnosis import kernel_proven
    from sweep.diagnose.mechanism import Mechanism

    drifted = record("scale_collapse", {"where": "scaler"}, first_bad_step=390, _overrides=["modulate=fused_buggy"])
    kernel = Mechanism("kernel", "modulate=fused_buggy disagrees with its reference", {"kind": "modulate"})
    eager = {"overrides": ["modulate=eager"], "confirmed": True}
    m, agrees, why = kernel_proven(drifted, kernel, False, eager)
    assert (m.name, agrees, m.evidence["stable from step 0 with"]) == ("kernel", True, "modulate=eager")
    assert "built up in the weights before the bad steps" in why and "diverged at 390" in why
    assert kernel_proven(drifted, kernel, False, eager | {"confirmed": False}) is None
    assert kernel_proven(drifted, kernel, False, {"overrides": ["optim.lr=0.003"], "confirmed": True}) is None
    assert kernel_proven(drifted, kernel, True, eager) is None  # the table agreed already: nothing to add
    unexplained = Mechanism("unexplained", "no recorded signal explains it")
    assert kernel_proven(drifted, unexplained, False, eager) is None


def test_a_resumed_run_is_not_offered_qk_norm_which_its_checkpoint_cannot_load():
    """A logit-growth spike after a resume (the beta2 scenario at another seed): model.qk_norm=true adds weights
    the checkpoint lacks, so its fix run would stop at the load ('does not fit this model')."""
    from sweep.diagnose.fix import candidates

    grown = record("loss_spike", {"where": "optimizer"}, logit_rows(1.7, 168.0, 1.36, 0.09))
    assert candidates(grown, "attention_logit_growth", {}, None, [], None)[0] == ["model.qk_norm=true"]
    for loads in ("checkpoint.resume_from=/ckpt/step_000300", "model.init_from=/ckpt/step_000300"):
        resumed = record("loss_spike", {"where": "optimizer"}, logit_rows(1.7, 168.0, 1.36, 0.09), _overrides=[loads])
        tries = candidates(resumed, "attention_logit_growth", {}, None, [], None)
        assert tries and ["model.qk_norm=true"] not in tries and tries[0][0].startswith("optim.lr="), tries


def test_counterfactuals_start_where_the_trouble_began():
    """A spike's rows start at the lowest smoothed loss before it (the monitor's EMA, beta 0.9: 1, .98, .942,
    .898, .853, .818, .806, then .875 as the climb reaches it); a collapse's at its first skipped step in a
    row; a stall's at its window; a NaN's one step before it."""
    losses = [1.0, 0.8, 0.6, 0.5, 0.45, 0.5, 0.7, 1.5, 3.0, 9.0]
    spike = record("loss_spike", rows=[{"step": float(s), "loss": v} for s, v in enumerate(losses)])
    spike.result["first_bad_step"] = 9
    assert healthy_until(spike) == 6
    skips = [{"step": float(s), "loss": 1.0, "skipped": float(s >= 5)} for s in range(12)]
    collapse = record("scale_collapse", rows=skips)
    collapse.result["first_bad_step"] = 11
    assert healthy_until(collapse) == 5
    assert healthy_until(record("stalled")) == 1  # first bad 20, stall_window 20
    assert healthy_until(record("nonfinite_loss")) == 19


@pytest.mark.xdist_group("auto_sweep")  # the module's auto_sweep, run once: on one worker
def test_what_cannot_be_diagnosed_is_one_line_and_exit_2(auto_sweep, tmp_path, capsys):
    """The stable run and the sweep dir are auto_sweep's (read, never written: each case is refused before)."""
    root, (stable, _), _ = auto_sweep
    old = tmp_path / "old"
    (old / ".hydra").mkdir(parents=True)
    (old / ".hydra" / "config.yaml").write_text((stable["dir"] / ".hydra" / "config.yaml").read_text())
    (old / "result.json").write_text(json.dumps({"status": "diverged", "verdict": "loss_spike"}))
    confirmation = tmp_path / "confirm"  # a confirmation's own run: its record is trial.json, its config is there
    (confirmation / ".hydra").mkdir(parents=True)
    for name in (".hydra/config.yaml", "metrics.csv"):
        (confirmation / name).write_text((stable["dir"] / name).read_text())
    (confirmation / "trial.json").write_text((stable["dir"] / "result.json").read_text())
    cases = {
        confirmation: "the run is stable, not diverged: there is nothing to diagnose",
        tmp_path / "nowhere": "no such directory",
        root: "is not a run directory",
        stable["dir"]: "the run is stable, not diverged: there is nothing to diagnose",
        old: "written by an older version: result.json has no first_bad_step, cause, params, steps_run",
    }
    for path, message in cases.items():
        assert main([str(path)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert main([str(stable["dir"]), "--past", "-1"]) == 2
    from sweep.replay import main as replay

    assert replay([str(confirmation)]) == 0 and "nothing went non-finite" in capsys.readouterr().out


def test_bisection_finds_the_attention_that_must_stay_fp32_in_the_videochat2_case(tmp_path):
    """The VideoChat2 scenario's settings (conf/scenario/videochat2_fp16_overflow.yaml: fp16 AMP, eager
    attention, query/key weights scaled 100x) shrunk to 2 blocks, 8 steps and a loss scale that collapses at
    step 4. QK^T overflows fp16 in every block's attention, so the minimal fp32 set is both attentions, and
    no finer set (their projections alone) will do. Every trial is a real run to the end."""
    from sweep.diagnose.bisect import bisect_fp32
    from sweep.diagnose.record import load

    (r,) = sweep(
        tmp_path,
        "precision=fp16_amp",
        "attention=eager",
        "model.qk_gain=100",
        "model.depth=2",
        "steps=8",
        "precision.scaler.init_scale=16",
    )
    assert (r["verdict"], r["mechanism"]["name"]) == ("scale_collapse", "activation_overflow")
    b = bisect_fp32(load(r["dir"]), tmp_path / "bisect", quiet)
    assert b["minimal"] == ["blocks.0.attn", "blocks.1.attn"], b["summary"]
    assert b["trials"][0]["overrides"] == ["precision=fp32"] and b["trials"][0]["outcome"] == "healthy"
    last_healthy = [t for t in b["trials"] if t["fp32_modules"] == b["minimal"]]
    assert last_healthy and last_healthy[0]["outcome"] == "healthy"  # the set itself was run and was stable
    for name in b["minimal"]:  # 1-minimal: without either attention it collapses
        without = [t for t in b["trials"] if t["fp32_modules"] == [name]]
        assert without and without[0]["outcome"].startswith("scale_collapse")
    assert 0.2 < b["flop_share"] < 0.5 and b["forward_flops"] > 0
    assert sum(b["flop_shares"].values()) == pytest.approx(b["flop_share"])


def test_bisection_on_a_diffusers_model_finds_the_one_overflowing_attention(tmp_path):
    """PixArt (diffusers) whose first block's query weights were scaled 1e5x (as a bad pretrained file would
    hold them): its query projection overflows fp16. The bisection looks through the adapter to the
    transformer's blocks and finds that block's self-attention, which no finer subset (to_q alone: SDPA casts
    q back to fp16) replaces."""
    import torch
    from safetensors.torch import save_file

    from sweep.diagnose.bisect import bisect_fp32
    from sweep.diagnose.record import load
    from sweep.run.model import build_run_model

    image = ["model=pixart_tiny", "data=synthetic_image", "data.frames=1"]
    torch.manual_seed(0)
    state = {k: v.detach().clone().contiguous() for k, v in build_run_model(make_run(*image)).state_dict().items()}
    state["transformer.transformer_blocks.0.attn1.to_q.weight"] *= 1e5
    weights = tmp_path / "pixart_big_q.safetensors"
    save_file(state, weights)
    (r,) = sweep(
        tmp_path / "s",
        *image,
        "precision=fp16_amp",
        "steps=6",
        "precision.scaler.init_scale=4",
        f"model.init_from={weights}",
        "checkpoint.verify=false",
    )
    assert r["mechanism"]["name"] == "activation_overflow"
    b = bisect_fp32(load(r["dir"]), tmp_path / "bisect", quiet)
    assert b["minimal"] == ["transformer.transformer_blocks.0.attn1"], b["summary"]
    assert "transformer.transformer_blocks.1.attn1" in b["groups"] and 0 < b["flop_share"] < 0.3


@pytest.fixture(scope="module")
def auto_sweep(tmp_path_factory) -> tuple[Path, list[dict], str]:
    """A 2-run sweep, ledger on, whose spike at lr 3e-2 the end of the multirun diagnoses (monitor.diagnose=auto):
    (sweep dir, its runs' result.json as written after the diagnosis, what it printed)."""
    import contextlib
    import io

    root, printed = tmp_path_factory.mktemp("auto"), io.StringIO()
    with contextlib.redirect_stdout(printed):
        multirun_in_process(root, "steps=12", "optim.lr=1e-3,3e-2", "monitor.diagnose=auto")
    runs = [read_result(p.parent) | {"dir": p.parent} for p in sorted(root.glob("*/result.json"))]
    return root, runs, printed.getvalue()


@pytest.mark.xdist_group("auto_sweep")  # the module's auto_sweep, run once: on one worker
def test_a_sweep_diagnoses_its_distinct_failures_and_its_summary_cites_the_confirmed_fix(auto_sweep, capsys):
    """monitor.diagnose=auto at the end of a multirun: the spike at lr 3e-2 is diagnosed (progress printed),
    the summary counts the sweep's 2 runs, not the diagnosis's own, the root causes take the diagnosed
    mechanism, and the recommendation cites the confirmed fix."""
    root, runs, out = auto_sweep
    assert [r["status"] for r in runs] == ["stable", "diverged"]
    assert "Diagnosing 1 distinct failure(s) of 1 diverged run(s): the largest, then the others within" in out
    assert (runs[1]["dir"] / DIAGNOSIS_FILE).is_file() and not (runs[0]["dir"] / DIAGNOSIS_FILE).exists()
    summary = (root / "summary.md").read_text()
    assert "2 runs: 1 stable, 1 diverged" in summary
    assert "## Diagnoses" in summary and "| lr_too_high |" in summary
    assert "Confirmed fixes (runs from step 0 that stayed stable): optim.lr=0.003 for lr_too_high" in summary
    causes = (root / "summary_root_causes.csv").read_text()
    assert "lr_too_high" in causes and "unexplained" not in causes

    # One result.json per run: the diagnosis's own runs write trial.json, so `find SWEEP -name result.json`
    # counts the sweep's runs (it found 6 here: 2 runs and 4 of the diagnosis's).
    assert len(list(root.rglob("result.json"))) == len(runs) == 2
    trials = list((runs[1]["dir"] / "diagnosis").rglob("trial.json"))
    assert {t.parent.name for t in trials} >= {"cf_same_config", "cf_lr_10", "fix_1"}
    assert report_main([str(root), "--no-html"]) == 0
    report = capsys.readouterr().out
    for t in trials:  # the layout an older version wrote: the diagnosis's runs as result.json
        t.rename(t.with_name("result.json"))
    try:
        assert report_main([str(root), "--no-html"]) == 0
        assert capsys.readouterr().out == report
    finally:
        for t in trials:
            t.with_name("result.json").rename(t)


@pytest.mark.xdist_group("auto_sweep")  # the module's auto_sweep, run once: on one worker
def test_after_a_diagnosis_every_place_names_one_mechanism_and_the_study_the_summarys_answer(auto_sweep):
    """issue 44 (one answer everywhere): the spike's own signals said `unexplained`, its diagnosis `lr_too_high`.
    result.json, its trial, the study's `diagnosed`, the summary's diagnoses and both reports (from the run dirs
    and from the study) now say lr_too_high, the recorded one kept beside it; the study carries the summary's
    recommendation, line and settings, and the trials of the recommended setting."""
    import optuna
    import pandas as pd

    from sweep.report.runs import runs_from_dirs
    from sweep.report.study import runs_from_study
    from sweep.report.summary import summarize
    from sweep.report.text import md_escape

    root, runs, _ = auto_sweep
    mechanism = read_result(runs[1]["dir"])["mechanism"]
    assert (mechanism["name"], mechanism["source"], mechanism["recorded"]["name"]) == (
        "lr_too_high",
        "diagnosis",
        "unexplained",
    )
    assert mechanism["summary"] == json.loads((runs[1]["dir"] / DIAGNOSIS_FILE).read_text())["summary"]
    url = f"sqlite:///{root / 'ledger.db'}"
    study = optuna.load_study(study_name=str(root), storage=url)
    trial = {t.user_attrs["run_dir"]: t for t in study.trials}
    stable, spike = (trial[str(r["dir"].resolve())] for r in runs)
    assert (spike.user_attrs["mechanism"], spike.user_attrs["mechanism_recorded"]) == ("lr_too_high", "unexplained")
    assert study.user_attrs["diagnosed"] == {str(spike.number): "lr_too_high"}
    assert pd.read_csv(root / "summary_diagnoses.csv").mechanism.tolist() == ["lr_too_high"]
    from_dirs, (from_study, _) = runs_from_dirs(root), runs_from_study(url)
    assert from_dirs.mechanism.fillna("-").tolist() == from_study.mechanism.fillna("-").tolist() == ["-", "lr_too_high"]

    summary = summarize(from_dirs)
    line = study.user_attrs["recommendation"]
    assert line == summary.recommendation.line and line.startswith("Use optim.lr=0.001 (eval loss")
    assert f"## Recommendation\n\n{md_escape(line)}\n" in (root / "summary.md").read_text()
    assert study.user_attrs["recommended"] == summary.recommendation.settings == {"optim.lr": 0.001}
    assert study.user_attrs["recommended_trials"] == [stable.number] and stable.params["optim.lr"] == 0.001
    assert study.user_attrs["quality"] == "eval_loss" and stable.value == stable.user_attrs["eval_loss"]


def test_a_second_diagnosis_keeps_the_mechanism_the_run_recorded(tmp_path):
    from sweep.diagnose.record import write_mechanism

    recorded = {"name": "unexplained", "summary": "no recorded signal explains it"}
    (tmp_path / "result.json").write_text(json.dumps({"status": "diverged", "mechanism": recorded}))
    record = RunRecord(tmp_path, read_result(tmp_path), [], None, None)
    write_mechanism(record, "lr_too_high", "lr/10 gets past the bad steps")
    write_mechanism(record, "nondeterministic", "the replay did not reproduce it")
    assert read_result(tmp_path)["mechanism"] == {
        "name": "nondeterministic",
        "summary": "the replay did not reproduce it",
        "source": "diagnosis",
        "recorded": recorded,
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]  # written whole: no .tmp left


@pytest.mark.xdist_group("auto_sweep")  # the module's auto_sweep, run once: on one worker
def test_a_diagnosis_is_never_written_into_another_runs_directory(auto_sweep, capsys):
    """--out DIR of another run: its diagnosis.json was then read by the report as that run's own (the stable
    run's mechanism became the spike's lr_too_high). Refused before anything runs, nothing written."""
    _, runs, _ = auto_sweep
    stable, diverged = runs[0]["dir"], runs[1]["dir"]
    capsys.readouterr()
    assert main([str(diverged), "--no-fix", "--out", str(stable)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "(--out) is another run's directory (it holds result.json)" in err[0], err
    assert not (stable / DIAGNOSIS_FILE).exists() and not (stable / "diagnosis").exists()


@pytest.mark.xdist_group("auto_sweep")  # the module's auto_sweep, run once: on one worker
def test_a_diagnosis_by_hand_rewrites_the_summary_of_its_sweep(auto_sweep, tmp_path, capsys):
    """`python -m sweep.diagnose SWEEP/N` after the sweep's end: its summary.md, summary_diagnoses.csv and report.html
    gain the diagnosis (before, they kept what the sweep's end wrote until `sweep.report --write`)."""
    import shutil

    import yaml

    root, runs, _ = auto_sweep
    copy = tmp_path / "s"
    shutil.copytree(root, copy)
    saved = yaml.safe_load((copy / "multirun.yaml").read_text())
    saved["ledger"]["enabled"] = False  # the copy's study is not the fixture's
    (copy / "multirun.yaml").write_text(yaml.safe_dump(saved))
    spike = copy / runs[1]["dir"].name
    (spike / DIAGNOSIS_FILE).unlink()
    shutil.rmtree(spike / "diagnosis")
    assert report_main([str(copy), "--write"]) == 0  # the files of a sweep whose end diagnosed nothing
    capsys.readouterr()
    assert "## Diagnoses" not in (copy / "summary.md").read_text() and not (copy / "summary_diagnoses.csv").exists()
    assert main([str(spike), "--no-fix"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"Rewritten in {copy.resolve()}: summary.md, summary.csv" in out and "report.html" in out
    assert "## Diagnoses" in (copy / "summary.md").read_text()
    assert "lr_too_high" in (copy / "summary_diagnoses.csv").read_text()
    assert "<h2>Diagnoses" in (copy / "report.html").read_text()


@pytest.mark.parametrize("from_step, said", [(0, "from the initial weights"), (3, "from the state after step 2")])
def test_the_table_says_where_its_rows_start(from_step, said):
    """A run bad at its first step: its rows start from the initial weights (before: "the state after step -1")."""
    from sweep.diagnose.diagnosis import render

    row = {"name": "same config", "outcome": None, "not_applicable": "-", "overrides": []}
    d = {
        "run_dir": "r",
        "verdict": "loss_spike",
        "first_bad_step": from_step + 1,
        "mechanism": "unexplained",
        "summary": "-",
        "counterfactuals": {"from_step": from_step, "through_step": 11, "prefix": {"detail": "-"}, "rows": [row]},
        "agrees": True,
        "agreement": "-",
        "fix": {"overrides": [], "confirmed": False},
        "seconds": 0.1,
        "run_seconds": 0.1,
    }
    assert f"counterfactuals ({said}, through step 11;" in render(d)
