"""Kernel seams: fused vs eager modulate, the forced attention backends, and that each toggle is live."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import (
    ATTENTION_BACKENDS,
    MODULATE_IMPLS,
    KernelUnavailable,
    attend,
    backend_unavailable_reason,
    modulate,
)
from models import attention as attention_module

CPU = torch.device("cpu")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Modulate inputs are randn, so |x * (1 + scale)| reaches ~16. One ulp at that magnitude is
# 9.5e-7 (fp32), 7.8e-3 (fp16), 6.25e-2 (bf16). Eager rounds twice (mul, then add) and the
# fused addcmul once; grad_scale differs by the rounding of g*x before the sum. The measured
# worst case over 100 seeded draws was exactly one ulp, so atol is one ulp plus a little.
MODULATE_TOL = {
    torch.float32: dict(atol=2e-6, rtol=1.3e-6),
    torch.bfloat16: dict(atol=7e-2, rtol=1.6e-2),
    torch.float16: dict(atol=1e-2, rtol=1e-3),
}

# Attention on randn q/k/v (N=32, head_dim=16): outputs and grads are O(1). Measured worst
# differences to math over 20 seeds: fp32 8e-7 (eager is bit-equal to math), bf16 1.6e-2,
# fp16 2e-3; the low-precision tolerances allow twice that, fp32 a flat 1e-5.
ATTENTION_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=3e-2, rtol=1.6e-2),
    torch.float16: dict(atol=4e-3, rtol=1e-3),
}

# Profiler names emitted by torch 2.13 on CPU (checked, not guessed).
FLASH_CPU_OP = "aten::_scaled_dot_product_flash_attention_for_cpu"
FLASH_CPU_BACKWARD_OP = "aten::_scaled_dot_product_flash_attention_for_cpu_backward"
MATH_OP = "aten::_scaled_dot_product_attention_math"
SDPA_OP = "aten::scaled_dot_product_attention"


def profiled_op_names(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key for event in prof.key_averages()}


# ---------------------------------------------------------------- modulate


def modulate_row0_bug(x, shift, scale):
    """A per-row indexing bug of OpenDiT's kind: one shift/scale row (row 0) applied to every batch row."""
    return x * (1 + scale[0])[None, None] + shift[0][None, None]


def modulate_inputs(batch: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 16, 32, generator=gen)
    shift = torch.randn(batch, 32, generator=gen)
    scale = torch.randn(batch, 32, generator=gen)
    grad_out = torch.randn(batch, 16, 32, generator=gen)
    return [t.to(dtype) for t in (x, shift, scale, grad_out)]


def run_modulate(fn, x, shift, scale, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in (x, shift, scale)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return [out, *grads]


def assert_modulate_parity(candidate, batch: int, dtype: torch.dtype) -> None:
    """candidate(x, shift, scale) matches the eager reference in output and all three grads."""
    x, shift, scale, grad_out = modulate_inputs(batch, dtype)
    expected = run_modulate(lambda *a: modulate(*a, impl="eager"), x, shift, scale, grad_out)
    actual = run_modulate(candidate, x, shift, scale, grad_out)
    for name, got, want in zip(("out", "grad_x", "grad_shift", "grad_scale"), actual, expected):
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, **MODULATE_TOL[dtype], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", [2, 3])
def test_fused_modulate_matches_eager_forward_and_backward(batch, dtype):
    assert_modulate_parity(lambda x, s, c: modulate(x, s, c, impl="fused"), batch, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_check_catches_row0_shift_scale_bug_at_batch_2(dtype):
    with pytest.raises(AssertionError):
        assert_modulate_parity(modulate_row0_bug, 2, dtype)


def test_row0_bug_is_invisible_at_batch_1():
    # Why the parity tests run at batch >= 2: at batch 1 the buggy kernel is correct.
    assert_modulate_parity(modulate_row0_bug, 1, torch.float32)


def opendit_reference(x, shift, scale):
    """What OpenDiT's Triton modulate computes forward: token row r of the B*N rows reads shift/scale row r // D."""
    b, n, d = x.shape
    rows = (torch.arange(b * n) // d).view(b, n)
    return x * (1 + scale[rows]) + shift[rows]


def test_fused_buggy_is_opendits_kernel_wrong_rows_forward_and_own_rows_backward():
    """modulate=fused_buggy reproduces both faults of the kernel it models: the forward's r // D row, and a backward
    that gives each sample's own row its tokens' gradient (not the gradient of the forward it ran), which is what
    lets the adaLN weights drift (docs/scenarios.md). N == D, or batch 1, makes it right."""
    x, shift, scale, grad_out = modulate_inputs(4, torch.float32)  # N 16, D 32: samples (0,1) read row 0, (2,3) row 1
    buggy = run_modulate(lambda *a: modulate(*a, impl="fused_buggy"), x, shift, scale, grad_out)
    torch.testing.assert_close(buggy[0], opendit_reference(x, shift, scale))
    as_ran = run_modulate(opendit_reference, x, shift, scale, grad_out)  # the true gradient of that forward
    own = run_modulate(lambda *a: modulate(*a, impl="eager"), x, shift, scale, grad_out)  # each sample's own row
    torch.testing.assert_close(buggy[1], as_ran[1])  # grad_x: through the rows it read
    for got, true, its_own in zip(buggy[2:], as_ran[2:], own[2:]):  # grad_shift, grad_scale
        torch.testing.assert_close(got, its_own)
        assert (got - true).abs().max() > 1  # not the gradient of the forward that ran
    for b, n in ((1, 16), (4, 32)):  # one sample, or N == D: every row is its own sample's
        gen = torch.Generator().manual_seed(b)
        args = [torch.randn(b, n, 32, generator=gen), torch.randn(b, 32, generator=gen)]
        args += [torch.randn(b, 32, generator=gen), torch.randn(b, n, 32, generator=gen)]
        for got, want in zip(
            run_modulate(lambda *a: modulate(*a, impl="fused_buggy"), *args),
            run_modulate(lambda *a: modulate(*a, impl="eager"), *args),
        ):
            torch.testing.assert_close(got, want, **MODULATE_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_modulate_under_autocast_matches_eager(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 3 * 32)
    inp = torch.randn(3, 16, 32)
    cond = torch.randn(3, 32)
    results = {}
    for impl in MODULATE_IMPLS:
        linear.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            x = linear(inp)[..., :32]  # low-precision activations, as after an autocast Linear
            shift, scale = linear(cond)[:, 32:].chunk(2, dim=1)
            out = modulate(x, shift, scale, impl=impl)
        out.float().square().sum().backward()
        results[impl] = (out, linear.weight.grad.clone())
    assert results["fused"][0].dtype == dtype
    torch.testing.assert_close(results["fused"][0], results["eager"][0], **MODULATE_TOL[dtype])
    # The weight grad is a low-precision matmul over 3*16 rows with entries up to ~160;
    # measured differences stay below eps * max|grad| (0.49x bf16, 0.39x fp16); allow 2x.
    want = results["eager"][1]
    atol = 2 * torch.finfo(dtype).eps * want.abs().max().item()
    torch.testing.assert_close(results["fused"][1], want, rtol=0, atol=atol)


def test_fused_modulate_casts_shift_and_scale_to_x_dtype():
    x, shift, scale, _ = modulate_inputs(2, torch.float16)
    out = modulate(x, shift.float(), scale.float(), impl="fused")
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, modulate(x, shift, scale, impl="eager"), **MODULATE_TOL[torch.float16])


def test_fused_modulate_custom_op_passes_opcheck():
    # Schema, fake (meta) implementation and autograd registration, checked by torch itself.
    x, shift, scale, grad_out = modulate_inputs(2, torch.float32)
    torch.library.opcheck(torch.ops.dit_sweep.modulate, (x.requires_grad_(), shift, scale.requires_grad_()))
    torch.library.opcheck(torch.ops.dit_sweep.modulate_backward, (grad_out, x.detach(), scale.detach()))


def test_profiler_shows_fused_modulate_op_only_when_fused():
    x, shift, scale, grad_out = modulate_inputs(2, torch.float32)

    def step(impl):
        def run():
            run_modulate(lambda *a: modulate(*a, impl=impl), x, shift, scale, grad_out)

        return run

    fused = profiled_op_names(step("fused"))
    eager = profiled_op_names(step("eager"))
    assert "dit_sweep::modulate" in fused
    assert "dit_sweep::modulate_backward" in fused
    assert not any(name.startswith("dit_sweep::") for name in eager)


def test_modulate_rejects_unknown_impl_and_bad_shapes():
    x, shift, scale, _ = modulate_inputs(2, torch.float32)
    with pytest.raises(ValueError, match="unknown modulate impl"):
        modulate(x, shift, scale, impl="triton")
    for impl in MODULATE_IMPLS:
        with pytest.raises(ValueError, match=r"shift/scale \(B, D\)"):
            modulate(x, shift[:1], scale[:1], impl=impl)  # one row broadcast over the batch


# ---------------------------------------------------------------- attention


def attention_inputs(seed: int = 0, scale: float = 1.0):
    """fp32 q, k, v, grad_out of shape (B=2, heads=4, N=32, head_dim=16); q and k times `scale`."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, grad_out = (torch.randn(2, 4, 32, 16, generator=gen) for _ in range(4))
    return q * scale, k * scale, v, grad_out


def run_attention(backend, q, k, v, grad_out, dtype):
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = attend(*leaves, backend)
    grads = torch.autograd.grad(out, leaves, grad_out.to(dtype))
    return [out, *grads]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["flash", "eager"])
def test_attention_backends_agree_with_math(backend, dtype):
    inputs = attention_inputs()
    expected = run_attention("math", *inputs, dtype)
    actual = run_attention(backend, *inputs, dtype)
    for name, got, want in zip(("out", "grad_q", "grad_k", "grad_v"), actual, expected):
        assert got.dtype == dtype, name
        torch.testing.assert_close(got, want, **ATTENTION_TOL[dtype], msg=lambda m, n=name: f"{n}: {m}")


def test_math_attention_matches_fp64_reference():
    # Anchors the parity tests above to ground truth, not just to each other.
    q, k, v, _ = attention_inputs()
    reference = torch.softmax(q.double() @ k.double().transpose(-2, -1) / 4.0, dim=-1) @ v.double()
    torch.testing.assert_close(attend(q, k, v, "math").double(), reference, atol=1e-5, rtol=1e-5)


def test_profiler_op_names_prove_the_attention_toggle_is_live():
    q, k, v, grad_out = attention_inputs()

    def step(backend):
        return lambda: run_attention(backend, q, k, v, grad_out, torch.float32)

    flash = profiled_op_names(step("flash"))
    math = profiled_op_names(step("math"))
    eager = profiled_op_names(step("eager"))
    assert FLASH_CPU_OP in flash and FLASH_CPU_BACKWARD_OP in flash
    assert MATH_OP not in flash
    assert MATH_OP in math and FLASH_CPU_OP not in math
    assert SDPA_OP not in eager and MATH_OP not in eager and FLASH_CPU_OP not in eager


@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_cuda_only_backends_are_reported_and_refused_on_cpu(backend):
    reason = backend_unavailable_reason(backend, CPU, torch.float32)
    assert isinstance(reason, str) and "CPU" in reason and "\n" not in reason
    q, k, v, _ = attention_inputs()
    with pytest.raises(KernelUnavailable, match="no CPU kernel"):
        attend(q, k, v, backend)


def test_torch_no_kernel_error_becomes_kernel_unavailable(monkeypatch):
    # Bypass the up-front check to prove the wrapper also recognises torch's own refusal
    # message (on CPU: "No viable backend for scaled_dot_product_attention was found").
    monkeypatch.setattr(attention_module, "backend_unavailable_reason", lambda *a: None)
    q, k, v, _ = attention_inputs()
    with pytest.raises(KernelUnavailable, match="No viable backend") as excinfo:
        attend(q, k, v, "efficient")
    assert isinstance(excinfo.value.__cause__, RuntimeError)
    assert "\n" not in str(excinfo.value)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["flash", "math", "eager"])
def test_cpu_backends_report_available(backend, dtype):
    assert backend_unavailable_reason(backend, CPU, dtype) is None


def test_unknown_backend_raises_value_error():
    q, k, v, _ = attention_inputs()
    with pytest.raises(ValueError, match="unknown attention backend"):
        attend(q, k, v, "xformers")
    with pytest.raises(ValueError, match="unknown attention backend"):
        backend_unavailable_reason("xformers", CPU, torch.float32)
    assert set(ATTENTION_BACKENDS) == {"flash", "math", "eager", "efficient", "cudnn"}


def test_fp16_eager_attention_overflows_where_sdpa_does_not():
    # q.k reaches ~1e6 here: far above fp16's max (65504) even after the 1/sqrt(d) scale.
    assert not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    q, k, v, _ = attention_inputs(scale=200.0)
    assert (q @ k.transpose(-2, -1)).abs().max() > 65504 * 16**0.5
    q16, k16, v16 = (t.half() for t in (q, k, v))
    # eager keeps fp16 logits -> inf -> softmax of inf - inf = NaN.
    assert not torch.isfinite(attend(q16, k16, v16, "eager")).all()
    # math upcasts fp16 q/k/v to fp32 internally and the CPU flash kernel accumulates in
    # fp32, so both stay finite and close to the fp32 answer.
    reference = attend(q, k, v, "math")
    for backend in ("math", "flash"):
        out = attend(q16, k16, v16, backend)
        assert torch.isfinite(out).all(), backend
        torch.testing.assert_close(out.float(), reference, atol=4e-3, rtol=1e-3)
    # bf16 has fp32's exponent range: the same eager logits do not overflow there.
    assert torch.isfinite(attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), "eager")).all()


def test_math_attention_overflows_in_fp16_once_low_precision_reduction_is_allowed():
    # The math backend's fp32 upcast is a torch default, not a property of the formula:
    # with the reduced-precision flag on, it overflows like eager.
    q, k, v, _ = attention_inputs(scale=200.0)
    q16, k16, v16 = (t.half() for t in (q, k, v))
    previous = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        out = attend(q16, k16, v16, "math")
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(previous)
    assert not torch.isfinite(out).all()


def test_attention_under_autocast_runs_in_autocast_dtype():
    q, k, v, _ = attention_inputs()
    for backend in ("flash", "math", "eager"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = attend(q, k, v, backend)
        assert out.dtype == torch.bfloat16, backend
        torch.testing.assert_close(out.float(), attend(q, k, v, "math"), **ATTENTION_TOL[torch.bfloat16])


def test_sdpa_is_called_with_the_forced_backend_only():
    # attend("math") must not let torch pick flash even though flash is available on CPU.
    q, k, v, _ = attention_inputs()
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]):
        names = profiled_op_names(lambda: attend(q, k, v, "math"))
    assert MATH_OP in names and FLASH_CPU_OP not in names
    torch.testing.assert_close(attend(q, k, v, "math"), F.scaled_dot_product_attention(q, k, v))
