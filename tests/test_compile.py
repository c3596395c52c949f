"""compile=true: a compiled run records the attention kernel that really ran, or is skipped with its reason.

The slow tests compile the tiny video DiT with inductor (tens of seconds cold; seconds from inductor's
FX graph cache on a second run of the same shapes) and check result.json's claims against the
profiler on the training loop's own compiled steps.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hydra.errors import ConfigCompositionException
from torch._dynamo.utils import counters

from sweep.run import compiled
from sweep.run.execute import execute

from .conftest import make_run, read_result

# compile=true proves its kernels by profiler op names (sweep/run/compiled.py): these tests pin device=cpu, but the
# `cuda` one.
FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"
FLASH_BACKWARD = FLASH + "_backward"
MATH = "aten::_scaled_dot_product_attention_math"
MODULATE = "dit_sweep::modulate"

SMALL = ["device=cpu", "threads=1", "steps=3", "data.batch_size=2", "ledger.enabled=false", "model.depth=2"]
"""One spatial+temporal pair of blocks: the same kernels as the default four blocks, a smaller graph to compile."""

ONE_BLOCK = ["model=dit_tiny", "data=synthetic_image", "data.frames=1", "model.depth=1"]
"""The image DiT with one block, for the second compiled graph (math attention, fused modulate): the same
kernels, ~25% less to compile cold than the video DiT's pair (the first graph, flash and eager modulate, is the
video DiT's)."""

# With pytest -n: the compiling tests on one worker, one after another, so each graph compiles once and the
# others take it from inductor's caches (a cold compile is tens of seconds on a 2-core CI machine).
pytestmark = pytest.mark.xdist_group("inductor")


class ProfileSteps:
    """A step hook that profiles the training loop's steps after `start` up to `stop` (compiled ones)."""

    def __init__(self, start: int, stop: int):
        self.start, self.stop, self.ops = start, stop, set()
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def after_step(self, step, loss, parts) -> bool:
        if step == self.start:
            self.prof.start()
        elif step == self.stop:
            self.prof.stop()
            self.ops = {e.key for e in self.prof.key_averages()}
        return False


def test_compile_is_off_by_default_and_off_is_unchanged(tmp_path):
    run = make_run(*SMALL, "steps=2")
    assert run.compile is False
    result = execute(run, tmp_path, {})
    assert result.status == "stable"
    assert result.kernels == {"attention": "sdpa:MATH", "modulate": "eager"}


def test_compile_must_be_a_bool():
    with pytest.raises(ConfigCompositionException, match="compile"):
        make_run("compile=maybe")


def test_diffusers_models_are_skipped_compiled_with_a_reason(tmp_path):
    small = [o for o in SMALL if not o.startswith("model.depth")]  # a diffusers model has no model.depth
    run = make_run(*small, "model=diffusers_dit_tiny", "data=synthetic_image", "data.frames=1", "compile=true")
    result = execute(run, tmp_path, {})
    assert result.status == "skipped"
    assert "compile=true" in result.reason and "model.arch=diffusers" in result.reason
    assert read_result(tmp_path)["status"] == "skipped"


@pytest.mark.parametrize("attention", ["math", "eager"])
def test_a_combination_rewritten_into_flash_is_skipped(tmp_path, monkeypatch, attention):
    """What the profiler of a compiled graph that ran flash for math/eager gives: skipped, never a claim."""
    monkeypatch.setattr(compiled, "_compile_forward", lambda model: lambda: None)
    monkeypatch.setattr(compiled, "_profile_step", lambda run, parts: {FLASH, FLASH_BACKWARD})
    result = execute(make_run(*SMALL, f"attention={attention}", "compile=true"), tmp_path, {})
    assert result.status == "skipped"
    assert result.reason == (
        f"compile=true rewrites attention={attention} into the flash kernel ({FLASH} in the "
        f"compiled graph); run it uncompiled"
    )
    assert result.kernels == {} and result.steps_run == 0


def test_a_lost_flash_or_fused_modulate_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(compiled, "_compile_forward", lambda model: lambda: None)
    monkeypatch.setattr(compiled, "_profile_step", lambda run, parts: {MATH})
    flash = execute(make_run(*SMALL, "attention=flash", "compile=true"), tmp_path / "a", {})
    assert flash.status == "skipped" and "attention=flash did not run" in flash.reason
    fused = execute(make_run(*SMALL, "modulate=fused", "compile=true"), tmp_path / "b", {})
    assert fused.status == "skipped" and f"lost the {MODULATE} op for modulate=fused" in fused.reason


def test_compile_is_refused_on_a_device_whose_op_names_it_does_not_know():
    run = make_run(*SMALL, "compile=true")
    assert compiled.compile_unsupported_reason(run, torch.device("cuda")) is None
    assert compiled.compile_unsupported_reason(run, torch.device("mps")) == (
        "compile=true proves its attention kernel by the profiler op names of CPU and CUDA only (not mps); "
        "run it uncompiled"
    )


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["cpu_names", "cuda_names"])  # a `cuda` id would skip it
def test_the_kernel_check_reads_each_devices_op_names(device):
    """The forced fused kernel's forward and backward ops, and no other SDPA op; math and eager run none of them."""
    from models.attention import FUSED_OPS

    dev, fused = torch.device(device), FUSED_OPS[device]
    for attention, op in fused.items():
        assert compiled._attention_mismatch(attention, {op, op + "_backward", "aten::mm"}, dev) is None
        assert "did not run" in compiled._attention_mismatch(attention, {op}, dev)
        for other in set(fused.values()) - {op}:
            assert "runs" in compiled._attention_mismatch(attention, {op, op + "_backward", other}, dev)
    flash = fused["flash"]
    assert "rewrites attention=math" in compiled._attention_mismatch("math", {MATH, flash, flash + "_backward"}, dev)
    assert compiled._attention_mismatch("math", {MATH}, dev) is None
    assert "runs" in compiled._attention_mismatch("eager", {MATH}, dev)  # eager runs no SDPA op at all
    if device == "cuda":  # a CPU kernel's name is not the CUDA one
        assert "did not run" in compiled._attention_mismatch("flash", set(FUSED_OPS["cpu"].values()), dev)


@pytest.mark.cuda
def test_a_compiled_cuda_run_records_the_flash_kernel_it_ran(tmp_path):
    r = execute(
        make_run("device=cuda", "steps=4", "compile=true", "attention=flash", "precision=bf16_amp"), tmp_path, {}
    )
    assert r.status == "stable", r.reason
    assert r.kernels["attention"] == "sdpa:FLASH_ATTENTION (compiled)"


@pytest.mark.slow
def test_inductor_rewrites_eager_attention_unless_the_pattern_matcher_is_off():
    """The fact the kernel check exists for: inductor turns a plain softmax(QK^T)V into the flash op."""

    def attention(q, k, v):
        return ((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5).softmax(-1) @ v

    q, k, v = (torch.randn(2, 4, 16, 32, requires_grad=True) for _ in range(3))
    seen = {}
    for matcher in (True, False):
        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(attention, options={"pattern_matcher": matcher})
        fn(q, k, v).sum().backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = fn(q, k, v)
            out.sum().backward()
        seen[matcher] = {e.key for e in prof.key_averages()}
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)
    assert {FLASH, FLASH_BACKWARD} <= seen[True]
    assert FLASH not in seen[False] and FLASH_BACKWARD not in seen[False]
    torch._dynamo.reset()


def compiled_run(tmp_path, attention: str, modulate: str) -> tuple:
    """A compiled run of 4 steps whose steps 1 and 2 (compiled; step 0 watches logits, eager) are profiled: its
    result and the ops that ran."""
    model = ONE_BLOCK if attention == "math" else []
    run = make_run(*SMALL, *model, "steps=4", f"attention={attention}", f"modulate={modulate}", "compile=true")
    profile = ProfileSteps(start=0, stop=2)
    return execute(run, tmp_path, {}, hooks=[profile]), profile.ops


@pytest.fixture(scope="module")
def math_fused(tmp_path_factory) -> tuple:
    """The image DiT's compiled math + fused-modulate run: read for its kernels, and the first of the two runs
    the determinism test compares (one compile fewer)."""
    out = tmp_path_factory.mktemp("math_fused")
    return out, *compiled_run(out, "math", "fused")


@pytest.mark.slow
@pytest.mark.parametrize(
    "attention, modulate, claim",
    [
        ("flash", "eager", {"attention": "sdpa:FLASH_ATTENTION (compiled)", "modulate": "eager (compiled)"}),
        (
            "math",
            "fused",
            {"attention": "sdpa:MATH (compiled: inductor bmm+softmax)", "modulate": "dit_sweep::modulate (compiled)"},
        ),
    ],
)
def test_compiled_run_records_the_kernels_that_ran(tmp_path, request, attention, modulate, claim):
    if attention == "math":
        tmp_path, result, ran = request.getfixturevalue("math_fused")
    else:
        result, ran = compiled_run(tmp_path, attention, modulate)
    assert result.status == "stable", result.reason
    assert read_result(tmp_path)["kernels"] == claim
    # its eval (16 held-out clips at the end) ran the eager forward: through the sealed graph it was a run error
    assert result.eval_loss is not None and math.isfinite(result.eval_loss)
    if attention == "flash":
        assert {FLASH, FLASH_BACKWARD} <= ran
    else:  # inductor's own bmm + softmax: no SDPA op at all, flash least of all
        assert not {FLASH, FLASH_BACKWARD, MATH} & ran and "aten::bmm" in ran
    assert (MODULATE in ran) == (modulate == "fused")


@pytest.mark.slow
def test_compiled_run_is_deterministic_in_one_process(tmp_path, math_fused):
    """Same config twice in one process (the second compile comes from inductor's cache): same loss curve. The
    first is the module's profiled run (the profiler reads the ops, it changes no number)."""
    first, _, _ = math_fused
    result, _ = compiled_run(tmp_path, "math", "fused")
    assert result.status == "stable", result.reason
    curves = [(d / "metrics.csv").read_text().splitlines() for d in (first, tmp_path)]
    assert len(curves[0]) == 5 and curves[0] == curves[1]  # a header and 4 steps
