"""Emulated bf16/fp16 GEMMs (sweep/run/gemm.py) against torch's native kernels: same numbers, same overflow.

The bound: both paths accumulate exact products in fp32 and round once, so they may differ by the
fp32 summation-order error (n * 2**-24 * sum|a||b| per output) plus one ulp of the output dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sweep.run.build import build_parts, resolve_device
from sweep.run.execute import execute
from sweep.run.gemm import (
    GEMM_OPS,
    TOLERANCE,
    EmulatedGemm,
    cell_outcomes,
    has_native_gemm,
    resolve,
    step_tolerance,
    verdict_differences,
)
from sweep.run.precision import PrecisionPolicy

from .conftest import make_run, run_cli

DTYPES = [torch.bfloat16, torch.float16]


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` at |x| (subnormal spacing near zero)."""
    x = x.abs().to(dtype)
    return torch.nextafter(x, torch.full_like(x, float("inf"))).float() - x.float()


def assert_gemm_close(native: torch.Tensor, emulated: torch.Tensor, bound: torch.Tensor):
    """|native - emulated| <= one output ulp + the fp32 summation-order error `bound`, same inf/NaN places."""
    assert native.dtype == emulated.dtype
    finite = torch.isfinite(native)
    assert torch.equal(finite, torch.isfinite(emulated))
    assert torch.equal(torch.isnan(native), torch.isnan(emulated))
    assert torch.equal(native[~finite & ~torch.isnan(native)], emulated[~finite & ~torch.isnan(emulated)])  # inf signs
    n, e = native[finite].float(), emulated[finite].float()
    allowed = ulp(torch.maximum(n.abs(), e.abs()), native.dtype) + bound[finite]
    worst = ((n - e).abs() - allowed).max() if n.numel() else torch.tensor(-1.0)
    assert worst <= 0, f"emulated differs from native by {worst.item():.3g} beyond the bound"


def summation_bound(a: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    """fp32 summation-order error of a k-term dot product, for each output of a @ b (both paths)."""
    return 2 * k * 2.0**-24 * (a.float().abs() @ b.float().abs())


def run_both(fn, *tensors):
    """fn on tensors natively and under EmulatedGemm; each: (output, grads of the inputs)."""
    dtype = tensors[0].dtype
    results = []
    for mode in (None, EmulatedGemm(dtype)):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        with mode or contextlib.nullcontext():
            out = fn(*leaves)
            out.backward(torch.ones_like(out))
        results.append((out.detach(), [t.grad for t in leaves]))
    return results


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_and_matmul_forward_and_backward_match_native(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 96, 160, generator=g).to(dtype)
    w = torch.randn(192, 160, generator=g).to(dtype)
    b = torch.randn(192, generator=g).to(dtype)
    (out_n, (gx_n, gw_n, gb_n)), (out_e, (gx_e, gw_e, gb_e)) = run_both(F.linear, x, w, b)
    assert_gemm_close(
        out_n, out_e, summation_bound(x.reshape(-1, 160), w.T, 160).reshape(out_n.shape) + ulp(b.float(), dtype)
    )
    ones = torch.ones(4 * 96, 192)
    assert_gemm_close(gx_n, gx_e, summation_bound(ones, w, 192).reshape(gx_n.shape))
    assert_gemm_close(gw_n, gw_e, summation_bound(ones.T, x.reshape(-1, 160), 4 * 96))
    assert gb_n.dtype == gb_e.dtype == dtype
    q = torch.randn(8, 64, 32, generator=g).to(dtype)
    k = torch.randn(8, 32, 64, generator=g).to(dtype)
    (out_n, grads_n), (out_e, grads_e) = run_both(torch.matmul, q, k)  # attention's eager QK^T: bmm
    assert_gemm_close(out_n, out_e, torch.stack([summation_bound(q[i], k[i], 32) for i in range(8)]))
    assert [t.dtype for t in grads_n] == [t.dtype for t in grads_e] == [dtype, dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("conv", ["conv2d", "conv3d"])
def test_patch_embedding_convolution_matches_native(dtype, conv):
    g = torch.Generator().manual_seed(1)
    shape = (2, 3, 16, 16) if conv == "conv2d" else (2, 3, 4, 16, 16)
    x = torch.randn(*shape, generator=g).to(dtype)
    w = torch.randn(64, 3, *(2,) * (len(shape) - 2), generator=g).to(dtype)
    b = torch.randn(64, generator=g).to(dtype)
    fn = lambda x, w, b: getattr(F, conv)(x, w, b, stride=2)  # noqa: E731
    (out_n, grads_n), (out_e, grads_e) = run_both(fn, x, w, b)
    k = w[0].numel()
    bias_ulp = ulp(b.float(), dtype).view(-1, *[1] * (len(shape) - 2))
    bound = 2 * k * 2.0**-24 * fn(x.float().abs(), w.float().abs(), b.float().abs()) + bias_ulp
    assert_gemm_close(out_n, out_e, bound)
    for gn, ge in zip(grads_n, grads_e):
        assert gn.dtype == ge.dtype == dtype
        torch.testing.assert_close(ge.float(), gn.float(), rtol=2**-6 if dtype is torch.bfloat16 else 2**-9, atol=0.05)


def test_a_product_that_overflows_fp16_is_inf_in_the_same_places():
    a = torch.full((4, 8), 100.0, dtype=torch.float16)
    a[0] = 1.0  # row 0 fits: 8 * 100 = 800
    a[1, 0] = float("inf")  # inf * 100 -> inf; inf * 0 -> NaN below
    b = torch.full((8, 3), 100.0, dtype=torch.float16)  # rows 1-3: 8 * 1e4 = 8e4 > 65504
    b[:, 2] = -100.0
    b[0, 1] = 0.0
    native = a @ b
    with EmulatedGemm(torch.float16):
        emulated = a @ b
    assert torch.isinf(native[2:]).all() and torch.isnan(native[1, 1]) and torch.isfinite(native[0]).all()
    assert_gemm_close(native, emulated, summation_bound(a.nan_to_num(), b, 8))
    # Just above fp16's max but rounding to it (65504 + 8 < 65520) stays finite both ways.
    a, b = torch.tensor([[65504.0, 8.0]], dtype=torch.float16), torch.tensor([[1.0], [1.0]], dtype=torch.float16)
    with EmulatedGemm(torch.float16):
        emulated = a @ b
    assert emulated.item() == (a @ b).item() == 65504.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_only_gemms_of_the_mode_dtype_are_emulated(dtype):
    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((func, tuple(a.dtype for a in args if isinstance(a, torch.Tensor))))
            return func(*args, **(kwargs or {}))

    a32, other = torch.randn(8, 8), torch.randn(8, 8).to(torch.float16 if dtype is torch.bfloat16 else torch.bfloat16)
    a = a32.to(dtype)
    with Spy(), EmulatedGemm(dtype):  # Spy sees what EmulatedGemm sends down
        a32 @ a32
        other @ other
        a @ a
        a + a
    mm = torch.ops.aten.mm.default
    f32 = (torch.float32, torch.float32)
    assert [d for op, d in seen if op == mm] == [f32, (other.dtype, other.dtype), f32]  # only this dtype widened
    last_mm = max(i for i, (op, _) in enumerate(seen) if op == mm)
    rounding = seen[last_mm + 1]
    assert rounding[0].overloadpacket in (torch.ops.aten.to, torch.ops.aten._to_copy) and rounding[1] == (
        torch.float32,
    )
    assert len(seen) == last_mm + 3  # ... rounded back once, then the add
    assert seen[-1] == (torch.ops.aten.add.Tensor, (dtype, dtype))  # not a GEMM: untouched


def test_resolve_emulates_only_low_precision_cpu_gemms(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for dtype in DTYPES:
        assert resolve("emulated", cpu, dtype) == "emulated"
        assert resolve("native", cpu, dtype) == "native"
        assert resolve("emulated", cuda, dtype) == "native"  # a GPU has tensor cores
        assert resolve("auto", cpu, dtype) == ("native" if has_native_gemm(dtype) else "emulated")
    assert resolve("emulated", cpu, torch.float32) == "native"
    monkeypatch.setattr("sweep.run.gemm.onednn_takes", lambda dtype: True)
    monkeypatch.setattr("sweep.run.gemm.cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert (resolve("auto", cpu, torch.bfloat16), resolve("auto", cpu, torch.float16)) == ("native", "emulated")
    monkeypatch.setattr("sweep.run.gemm.cpu_flags", lambda: frozenset({"avx2", "amx_bf16", "avx512_fp16"}))
    assert (resolve("auto", cpu, torch.bfloat16), resolve("auto", cpu, torch.float16)) == ("native", "native")
    monkeypatch.setattr("sweep.run.gemm.onednn_takes", lambda dtype: dtype is torch.float16)  # oneDNN capped
    assert (resolve("auto", cpu, torch.bfloat16), resolve("auto", cpu, torch.float16)) == ("emulated", "native")
    monkeypatch.setattr("sweep.run.gemm.cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert (resolve("auto", cpu, torch.bfloat16), resolve("auto", cpu, torch.float16)) == ("emulated", "emulated")


def test_onednn_capped_below_the_cpus_bf16_instructions_emulates():
    """ONEDNN_MAX_CPU_ISA=AVX2 (read once, at torch's import: a process of its own) sends bf16 GEMMs to torch's
    reference loops on any CPU, ~60x slower than oneDNN's (a 256x256 matmul, AVX512-BF16 EPYC): auto emulates."""
    probe = "import torch; from sweep.run.gemm import has_native_gemm as h; print(h(torch.bfloat16), h(torch.float16))"
    proc = run_cli("-c", probe, env={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert proc.returncode == 0 and proc.stdout.split() == ["False", "False"], proc.stderr[-2000:]


def test_the_op_list_covers_a_training_step():
    """Every GEMM-like op a bf16 step of the video DiT (eager attention, conv patch embedding) dispatches."""
    run = make_run("precision=bf16_amp", "attention=eager", "steps=1", "threads=1")
    policy = PrecisionPolicy.from_config(run.precision, resolve_device("cpu"))
    parts = build_parts(run, resolve_device("cpu"), policy)
    ops = set()

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
                ops.add(func)
            return func(*args, **(kwargs or {}))

    x0 = torch.stack([parts.dataset[i] for i in range(2)])
    noisy, t, target = parts.objective.sample(x0, parts.noise_gen)
    with Spy(), policy.autocast(torch.device("cpu")):
        loss = F.mse_loss(parts.model(noisy, t).float(), target)
    with Spy():
        loss.backward()
    gemm_like = {
        op
        for op in ops
        if op.overloadpacket.__name__
        in ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward", "matmul", "linear")
    }
    assert gemm_like and gemm_like <= GEMM_OPS


def test_verdict_differences_names_every_disagreement():
    native = {"a": ["stable", None, None], "b": ["diverged", "loss_spike", 4], "c": ["diverged", "nonfinite_loss", 1]}
    assert verdict_differences(native, {**native, "b": ["diverged", "loss_spike", 4 + TOLERANCE]}) == []
    assert len(verdict_differences(native, {**native, "b": ["diverged", "loss_spike", 5 + TOLERANCE]})) == 1
    assert len(verdict_differences(native, {**native, "c": ["diverged", "nonfinite_grad", 1]})) == 1
    assert len(verdict_differences(native, {**native, "a": ["diverged", "loss_spike", 29]})) == 1
    assert verdict_differences(native, {"a": native["a"], "b": native["b"]}) == ["c: only in native"]


def test_a_long_runs_first_bad_step_gets_a_window_across_machines_only():
    """The adamw_beta2_loss_spike case: 313 on an AVX2 EPYC, 321 on an AMX Xeon (fp32 GEMMs differ)."""
    native = {"spike": ["diverged", "loss_spike", 313], "early": ["diverged", "scale_collapse", 52]}
    there = {"spike": ["diverged", "loss_spike", 321], "early": native["early"]}
    assert verdict_differences(native, there, across_machines=True) == []
    assert len(verdict_differences(native, there)) == 1  # on one machine the window stays TOLERANCE
    assert step_tolerance(313, across_machines=True) == 32 and step_tolerance(99, across_machines=True) == TOLERANCE
    far = {"spike": ["diverged", "loss_spike", 313 + 33], "early": native["early"]}
    assert len(verdict_differences(native, far, across_machines=True)) == 1
    late = {"spike": native["spike"], "early": ["diverged", "scale_collapse", 52 + TOLERANCE + 1]}
    assert len(verdict_differences(native, late, across_machines=True)) == 1  # short runs: no window
    other_verdict = {"spike": ["diverged", "nonfinite_loss", 313], "early": native["early"]}
    assert len(verdict_differences(native, other_verdict, across_machines=True)) == 1


DEMO_GRID_KEY = "demo grid at test size (low-precision cells, steps=12, threads=1)"


def demo_grid_outcomes(out_dir, gemm: str) -> dict[str, list]:
    """The demo's low-precision cells (precision x lr x attention) at test size, run with `gemm`. One config is
    composed per precision and attention and its lr set on the RunConfig (optim.lr is a plain value, derived from
    nothing and deriving nothing): a Hydra composition per cell cost ~0.15 s of CPU for the same config."""
    for precision, attention in itertools.product(("bf16_amp", "fp16_amp", "fp16_pure"), ("flash", "math")):
        base = make_run(
            f"precision={precision}",
            f"attention={attention}",
            "model=video_dit_tiny",
            "steps=12",
            "threads=1",
            f"precision.cpu_gemm={gemm}",
            "device=cpu",  # emulated GEMMs are a CPU mode, and the native record is the CPU's
        )
        for lr in ("1e-4", "1e-3", "3e-2"):
            params = {"precision": precision, "optim.lr": float(lr), "attention": attention}
            run = dataclasses.replace(base, optim=dataclasses.replace(base.optim, lr=float(lr)))
            r = execute(run, out_dir / f"{precision}-{lr}-{attention}", params)
            assert r.kernels["gemm"] == gemm
    return cell_outcomes(out_dir)


@pytest.mark.slow
def test_the_demo_grid_gets_the_same_verdicts_emulated_as_native(tmp_path):
    """Stable, spiking and NaN runs alike, with the same first bad steps as torch's native kernels gave.

    The native outcomes are recorded in tests/data/native_verdicts.json (native bf16/fp16 GEMMs take ~4x
    the emulated time on CPUs without the instructions); `RECORD_NATIVE=1 pytest tests/test_gemm.py -k
    demo_grid` runs the native cells too, compares them live and rewrites that record. Every scenario is
    held to its recorded native outcomes in test_scenarios.py; bench/gemm_verdicts.py compares the
    full-size demo and every scenario live."""
    record_file = Path(__file__).parent / "data" / "native_verdicts.json"
    record = json.loads(record_file.read_text())
    if os.environ.get("RECORD_NATIVE"):
        record[DEMO_GRID_KEY] = demo_grid_outcomes(tmp_path / "native", "native")
        record_file.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    native = record[DEMO_GRID_KEY]
    verdicts = {tuple(o[:2]) for o in native.values()}
    assert verdicts == {("stable", None), ("diverged", "loss_spike"), ("diverged", "nonfinite_loss")}  # all kinds met
    live = demo_grid_outcomes(tmp_path / "emulated", "emulated")
    assert verdict_differences(native, live, across_machines=not os.environ.get("RECORD_NATIVE")) == []
