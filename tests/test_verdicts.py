"""Each verdict, produced by a run built to trigger it; and a stable run that stays stable."""

from __future__ import annotations

import json
import re

import pytest

from sweep.config import Verdict
from sweep.data.batches import BatchOrder
from sweep.run.build import _ORDER_STREAM, resolve_device, stream_seed
from sweep.run.execute import execute

from .conftest import REPO, SMALL_MODEL, make_run, read_result


def run(tmp_path, *overrides: str):
    result = execute(make_run(*SMALL_MODEL, *overrides), tmp_path, params={})
    on_disk = read_result(tmp_path)
    assert on_disk["status"] == result.status and on_disk["verdict"] == result.verdict
    return result


def test_the_verdicts_are_the_design_tables_and_files_hold_their_words():
    section = (REPO / "docs" / "design.md").read_text().split("| verdict | decided by |", 1)[1].split("\n\n", 1)[0]
    assert [v.value for v in Verdict] == re.findall(r"^\| `(\w+)` \|", section, flags=re.M)  # in the table's order
    assert all(str(v) == f"{v}" == v.value == v.name for v in Verdict)
    assert json.dumps({"verdict": Verdict.loss_spike}) == '{"verdict": "loss_spike"}'
    read_back = json.loads('"stalled"')  # a plain str, as result.json, the ledger and the tables give it back
    assert read_back == Verdict.stalled and read_back in (Verdict.stalled,) and {Verdict.stalled: 1}[read_back] == 1


@pytest.mark.parametrize("precision", ["fp32", "bf16_amp", "fp16_amp"])
def test_small_lr_is_stable(tmp_path, precision):
    r = run(tmp_path, f"precision={precision}", "optim.lr=1e-4", "steps=20")
    assert r.status == "stable" and r.verdict is None and r.first_bad_step is None
    assert r.steps_run == 20 and r.final_loss < r.initial_loss * 1.5
    assert (tmp_path / "metrics.csv").read_text().count("\n") == 21


def test_nan_sample_is_bad_input_at_the_step_that_draws_it(tmp_path):
    order = BatchOrder(32, 4, stream_seed(0, _ORDER_STREAM))
    target = next(i for i in order.indices(3) if i not in order.indices(0) + order.indices(1) + order.indices(2))
    r = run(tmp_path, f"data.faults=[{{index:{target},kind:nan}}]", "steps=10")
    assert (r.status, r.verdict, r.first_bad_step) == ("diverged", "bad_input", 3)
    assert r.cause["where"] == "data" and f"sample {target}" in r.cause["detail"]
    assert r.verdict is Verdict.bad_input  # in memory the member; result.json its word (`run` compares them)


def test_out_of_range_sample_is_bad_input(tmp_path):
    order = BatchOrder(32, 4, stream_seed(0, _ORDER_STREAM))
    r = run(tmp_path, f"data.faults=[{{index:{order.indices(0)[2]},kind:range}}]", "steps=3")
    assert (r.verdict, r.first_bad_step) == ("bad_input", 0) and "outside" in r.cause["detail"]


def test_pure_fp16_adamw_goes_nonfinite_at_once(tmp_path):
    """AdamW's eps=1e-8 is 0 in fp16 and grad^2 underflows: the first update is 0/0."""
    r = run(tmp_path, "precision=fp16_pure", "optim.lr=1e-3", "steps=10")
    assert r.status == "diverged" and r.verdict in ("nonfinite_loss", "nonfinite_grad")
    assert r.first_bad_step <= 2
    assert r.cause["where"] == "optimizer" and r.cause["module"]


def test_fp16_without_scaling_at_a_tiny_loss_stalls(tmp_path):
    r = run(tmp_path, "precision=fp16_amp_noscale", "objective.loss_weight=1e-6", "steps=20", "monitor.stall_window=5")
    assert (r.status, r.verdict) == ("diverged", "stalled")
    assert r.cause["where"] == "backward" and "underflow" in r.cause["detail"]


def test_pure_bf16_at_small_lr_loses_its_updates(tmp_path):
    """Updates of ~lr are below half a bf16 ulp of most weights: the weights that carry the model freeze."""
    r = run(tmp_path, "precision=bf16_pure", "optim.lr=1e-5", "steps=10", "monitor.stall_window=5")
    assert (r.status, r.verdict) == ("diverged", "stalled") and r.cause["where"] == "optimizer"
    assert "updates lost" in r.cause["detail"]


def test_pure_bf16_at_a_large_enough_lr_moves(tmp_path):
    r = run(tmp_path, "precision=bf16_pure", "optim.lr=1e-3", "steps=10", "monitor.stall_window=5")
    assert r.status == "stable"


def test_huge_lr_is_a_loss_spike(tmp_path):
    r = run(tmp_path, "precision=fp32", "optim.lr=0.3", "steps=40")
    assert (r.status, r.verdict) == ("diverged", "loss_spike"), r
    assert r.first_bad_step > 0


def test_persistent_fp16_overflow_collapses_the_loss_scale(tmp_path):
    """A scale floor no overflow can get under: every step overflows, the scaler backs off to its minimum."""
    r = run(
        tmp_path, "precision=fp16_amp", "precision.scaler.init_scale=1e12", "precision.scaler.min_scale=1e9", "steps=30"
    )
    assert (r.status, r.verdict) == ("diverged", "scale_collapse")
    assert r.cause["where"] == "scaler" and "minimum" in r.cause["detail"]
    assert r.first_bad_step == 10  # 1e12 halves to the 1e9 floor in 10 skips, the 11th overflow collapses


def test_tf32_on_cpu_is_skipped_with_the_reason(tmp_path):
    r = run(tmp_path, "precision=tf32", "device=cpu")
    assert r.status == "skipped" and "CUDA" in r.reason


def test_efficient_attention_on_cpu_is_skipped_not_a_fallback(tmp_path):
    r = run(tmp_path, "attention=efficient", "device=cpu")
    assert r.status == "skipped" and r.reason


@pytest.mark.parametrize("attention", ["flash", "math", "eager"])
@pytest.mark.parametrize("modulate", ["eager", "fused"])
def test_records_the_kernels_that_ran(tmp_path, attention, modulate):
    # fp32 q/k/v reach CUDA's flash kernel never (it takes fp16/bf16): there flash runs in bf16 AMP
    precision = "bf16_amp" if attention == "flash" and resolve_device("auto").type == "cuda" else "fp32"
    r = run(tmp_path, f"precision={precision}", f"attention={attention}", f"modulate={modulate}", "steps=2")
    assert r.status == "stable", r.reason
    assert (
        r.kernels["attention"]
        == {"flash": "sdpa:FLASH_ATTENTION", "math": "sdpa:MATH", "eager": "eager:softmax(QK^T)"}[attention]
    )
    assert r.kernels["modulate"] == ("dit_sweep::modulate" if modulate == "fused" else "eager")


def test_a_crash_is_an_error_result_not_an_exception(tmp_path, monkeypatch):
    from sweep.run.train import Loop

    def boom(*a, **k):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(Loop, "run", boom)
    r = run(tmp_path, "steps=2")
    assert r.status == "error" and "simulated bug" in r.reason


@pytest.mark.cuda
def test_fp32_flash_on_cuda_is_skipped_and_bf16_flash_runs_it(tmp_path):
    """CUDA's flash kernel takes fp16/bf16 q/k/v only: fp32 is `skipped` with the reason, never a fallback."""
    r = run(tmp_path / "fp32", "device=cuda", "precision=fp32", "attention=flash", "steps=2")
    assert r.status == "skipped" and "flash" in r.reason, r.reason
    r = run(tmp_path / "bf16", "device=cuda", "precision=bf16_amp", "attention=flash", "steps=2")
    assert r.status == "stable" and r.kernels["attention"] == "sdpa:FLASH_ATTENTION", r.reason
