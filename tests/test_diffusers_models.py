"""The ten tiny diffusers transformers behind the sweep: they build, train a step in every precision, and
the attention and modulate axes really change what runs inside them (profiler op names, call counts).

Shapes are the smallest real ones: batch 2, 3 channels, 8x8 pixels, 1 frame (image models) or 4 (video).
"""

from __future__ import annotations

import math

import optuna
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from models.diffusers_zoo import DIFFUSERS_MODELS, ZOO, build_diffusers_model
from sweep.run.execute import execute

from .conftest import make_run, multirun_in_process, read_result, read_results

CONF = {name: ("diffusers_dit_tiny" if name == "dit" else f"{name}_tiny") for name in DIFFUSERS_MODELS}
FLASH_OP, MATH_OP = "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math"
ROUTED = [n for n in DIFFUSERS_MODELS if ZOO[n].routed]
INLINE = [n for n in DIFFUSERS_MODELS if not ZOO[n].routed]


def overrides(name: str, *extra: str) -> list[str]:
    data = ["data=synthetic_image", "data.frames=1"] if ZOO[name].is_image else []
    return [f"model={CONF[name]}", *data, "data.batch_size=2", "threads=1", *extra]


def build(name: str, attention: str = "math", modulate: str = "eager") -> torch.nn.Module:
    torch.manual_seed(0)
    frames = 1 if ZOO[name].is_image else 4
    return build_diffusers_model(
        name, channels=3, frames=frames, height=8, width=8, patch_size=2, attention=attention, modulate=modulate
    ).eval()  # eval: DiT's label dropout off


def inputs(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shape = (2, 3, 8, 8) if ZOO[name].is_image else (2, 3, 4, 8, 8)
    return torch.randn(shape, generator=g), torch.tensor([10.0, 900.0])


def op_names(fn) -> dict[str, int]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


@pytest.mark.parametrize("name", DIFFUSERS_MODELS)
def test_builds_tiny_with_the_native_interface(name):
    model = build(name)
    n = sum(p.numel() for p in model.parameters())
    assert 100_000 <= n <= 2_000_000, n
    assert type(model.transformer).__name__ == ZOO[name].cls_name
    x, t = inputs(name)
    assert model(x, t).shape == x.shape  # prediction in x's layout, whatever the model's own layout is


@pytest.mark.parametrize("precision", ["fp32", "bf16_amp", "fp16_amp"])
@pytest.mark.parametrize("name", DIFFUSERS_MODELS)
def test_one_training_step_is_finite(name, precision, tmp_path):
    run = make_run(*overrides(name, f"precision={precision}", "steps=1"))
    r = execute(run, tmp_path, {})
    assert r.status == "stable", (r.status, r.reason, r.verdict)
    assert math.isfinite(r.final_loss) and math.isfinite(r.max_grad_norm)
    assert r.kernels["sdpa_calls_per_forward"] > 0 and r.kernels["attention"].endswith("sdpa:MATH")


@pytest.mark.parametrize("name", DIFFUSERS_MODELS)
def test_attention_axis_changes_the_kernel_that_runs(name):
    x, t = inputs(name)
    outs = {}
    for backend in ("flash", "math", "eager"):
        model = build(name, attention=backend)
        ops = op_names(lambda: outs.__setitem__(backend, model(x, t).detach()))  # noqa: B023  (called now)
        calls = model.route.calls_last_forward
        assert calls > 0
        if backend == "flash":
            assert ops.get(FLASH_OP) == calls and MATH_OP not in ops
        elif backend == "math":
            assert ops.get(MATH_OP) == calls and FLASH_OP not in ops
        else:  # softmax(QK^T) written out: no SDPA kernel at all
            assert FLASH_OP not in ops and MATH_OP not in ops and ops.get("aten::softmax", 0) >= calls
    # Same weights, three kernels, one function (the eager path honours the models' masks and scales).
    torch.testing.assert_close(outs["flash"], outs["math"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(outs["eager"], outs["math"], atol=1e-5, rtol=1e-4)


def test_sana_records_that_its_self_attention_is_linear(tmp_path):
    # device=cpu: fp32 flash attention runs on the CPU only (CUDA's flash needs fp16/bf16: skipped there)
    r = execute(make_run(*overrides("sana", "attention=flash", "steps=1", "device=cpu")), tmp_path, {})
    assert r.kernels["attention"] == (
        "self: linear attention (SanaLinearAttnProcessor2_0, no SDPA); cross: sdpa:FLASH_ATTENTION"
    )
    assert r.kernels["sdpa_calls_per_forward"] == 2  # the two blocks' cross-attention, nothing else


@pytest.mark.parametrize("name", ROUTED)
def test_fused_modulate_is_routed_and_matches_diffusers_own_code(name):
    """Parity: diffusers' modulation vs models.modulate fused, forward and backward, batch 2, fp32 and bf16."""
    x, t = inputs(name)
    reference, fused = build(name, modulate="eager"), build(name, modulate="fused")
    for dtype, tol in ((None, 1e-5), (torch.bfloat16, 2e-2)):
        outs = []
        for model in (reference, fused):
            model.zero_grad()
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                out = model(x, t)
            out.float().square().mean().backward()
            outs.append((out.float(), [p.grad.float() for p in model.parameters() if p.grad is not None]))
        torch.testing.assert_close(outs[1][0], outs[0][0], atol=tol, rtol=tol)
        for g_fused, g_ref in zip(outs[1][1], outs[0][1]):
            torch.testing.assert_close(g_fused, g_ref, atol=tol, rtol=tol)
    ops = op_names(lambda: fused(x, t))
    routed = sum(1 for m in fused.modules() if type(m).__name__.startswith("Routed"))
    assert routed > 0 and ops.get("dit_sweep::modulate", 0) >= routed
    assert "dit_sweep::modulate" not in op_names(lambda: reference(x, t))
    # The bug the parity test exists for: OpenDiT's modulate (other samples' shift/scale rows) changes the output.
    buggy = build(name, modulate="fused_buggy")
    assert not torch.allclose(buggy(x, t), reference(x, t), atol=1e-4)


@pytest.mark.parametrize("name", INLINE)
def test_fused_modulate_on_inline_modulation_is_skipped_with_the_reason(name, tmp_path):
    r = execute(make_run(*overrides(name, "modulate=fused", "steps=1")), tmp_path, {})
    assert r.status == "skipped" and "inline" in r.reason and ZOO[name].cls_name in r.reason
    assert read_result(tmp_path)["status"] == "skipped"


def test_config_errors_name_the_key():
    from sweep.config import ConfigError

    with pytest.raises(ConfigError, match=r"^data.frames: model.name=pixart trains on images"):
        make_run("model=pixart_tiny")
    with pytest.raises(ConfigError, match=r"^model.name: unknown diffusers model 'sdxl'"):
        make_run("model=cogvideox_tiny", "model.name=sdxl")
    with pytest.raises(ConfigError, match=r"^model.name: names a diffusers model"):
        make_run("model.name=wan")


@pytest.mark.slow
def test_a_2x2_grid_on_a_video_model_fills_the_ledger(tmp_path):
    """The grid in this process (multirun_in_process: the configured sweeper and launcher, no interpreter start-up;
    diffusers is already imported here)."""
    sweep_dir = tmp_path / "sweep"
    multirun_in_process(
        sweep_dir,
        "model=cogvideox_tiny",
        "precision=fp32,bf16_amp",
        "attention=flash,eager",
        "device=cpu",  # every cell runs: fp32 flash is a CPU kernel (skipped on CUDA, which needs fp16/bf16)
        "steps=2",
        "data.batch_size=2",
    )
    results = read_results(sweep_dir)
    assert len(results) == 4 and all(r["status"] == "stable" for r in results)
    assert {r["kernels"]["attention"] for r in results} == {"sdpa:FLASH_ATTENTION", "eager:softmax(QK^T)"}
    url = f"sqlite:///{sweep_dir / 'ledger.db'}"
    (summary,) = optuna.get_all_study_summaries(url)
    trials = optuna.load_study(study_name=summary.study_name, storage=url).trials
    assert len(trials) == 4
    cells = {(t.params["precision"], t.params["attention"]) for t in trials}
    assert cells == {(p, a) for p in ("fp32", "bf16_amp") for a in ("flash", "eager")}
    for t in trials:
        assert t.state == optuna.trial.TrialState.COMPLETE and t.user_attrs["status"] == "stable"
        assert t.user_attrs["steps_run"] == 2 and math.isfinite(t.value)
