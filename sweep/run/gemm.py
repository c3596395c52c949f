"""Low-precision GEMMs at fp32 speed on CPUs without bf16/fp16 matrix instructions.

    python -m sweep -m +experiment=demo precision.cpu_gemm=emulated   # (auto picks it where it pays)

How it works. On a CPU without AVX512-BF16/AMX (bf16) or AVX512-FP16/AMX-FP16 (fp16), torch's native
bf16/fp16 GEMM crawls: a 512x512 matmul runs at ~1.2 GFLOP/s against ~35 in fp32 (2-core AMD EPYC,
AVX2, torch 2.13). Every AMP or pure low-precision run then spends >90% of its step in mm/addmm.

`EmulatedGemm` is a TorchDispatchMode: it sits below autograd and autocast, so it sees each GEMM-like
op (mm, addmm, bmm, baddbmm, mv, addmv, dot, convolution and their backward) with the dtypes autocast
or the pure policy already chose. For an op whose inputs are all bf16 (or all fp16) it computes the
same op on the inputs widened to fp32 and rounds the result once to the input dtype. Inputs and
outputs keep their low-precision dtype, so everything around the GEMM (autocast's choices, the loss
scaler, fp16 overflow, the monitor) sees what it sees natively.

Why that is faithful: the product of two bf16 numbers (8-bit significands) or two fp16 numbers
(11-bit) is exact in fp32's 24 bits, so an fp32-accumulating GEMM on the rounded inputs, rounded once
at the end, is what the native kernels and a GPU's tensor cores compute (fp32 accumulation), up to
summation order. A product too large for fp16 becomes inf at that same final rounding. The parity
tests (tests/test_gemm.py) hold it to the native kernel: within one ulp of the output dtype plus
fp32 summation-order error, with identical inf/NaN positions.

What it does not touch: SDPA's CPU flash kernel (it keeps its own bf16/fp16 internals and is not
slow: 12 forward+backward calls took 0.3 s of a 10-s bf16 step budget, measured with a dispatch
log), SDPA's math path on CPU (torch already computes it in fp32 there), and fp32 ops.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

LOW_PRECISION = (torch.bfloat16, torch.float16)

_aten = torch.ops.aten
GEMM_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten.mv.default,
        _aten.addmv.default,
        _aten.dot.default,
        _aten.addbmm.default,
        _aten.convolution.default,
        _aten.convolution_backward.default,
    }
)
"""The ops autocast or a pure low-precision model sends to a bf16/fp16 GEMM on the CPU (a dispatch log
of a training step shows linear as mm/addmm, attention's matmuls as bmm, patch embedding as
convolution)."""

# The CPU flags that give torch's native kernels a fast path (oneDNN picks them at run time).
_NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.cache
def onednn_takes(dtype: torch.dtype) -> bool:
    """Whether torch sends `dtype` GEMMs to oneDNN in this process. Where it does not (ONEDNN_MAX_CPU_ISA set below
    the CPU's bf16/fp16 instructions, or a torch built without oneDNN), they run in torch's reference loops, which
    crawl whatever the CPU has. True where torch cannot be asked: the CPU's flags then decide alone."""
    query = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    try:
        return bool(getattr(torch.ops.mkldnn, query)())
    except (AttributeError, RuntimeError):
        return True


def has_native_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU has matrix instructions for `dtype` and torch uses them (fp32 always has)."""
    return dtype not in LOW_PRECISION or (_has_instructions(dtype) and onednn_takes(dtype))


def _has_instructions(dtype: torch.dtype) -> bool:
    flags = cpu_flags()
    if flags:
        return any(f in flags for f in _NATIVE_FLAGS[dtype])
    # No /proc/cpuinfo: ask torch's cpuinfo (no AVX512-FP16 query there, so fp16 counts as AMX-FP16 only).
    if dtype is torch.bfloat16:
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.cpu._is_amx_fp16_supported()


def resolve(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """`precision.cpu_gemm` (auto|native|emulated) for a run computing in `dtype` on `device`.

    Only CPU bf16/fp16 runs can emulate; everything else runs "native" whatever was asked.
    """
    if device.type != "cpu" or dtype not in LOW_PRECISION:
        return "native"
    if choice == "auto":
        return "native" if has_native_gemm(dtype) else "emulated"
    return choice


def mode(gemm: str, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """The context a step's forward and backward run in for a resolved `gemm` ("native" or "emulated", `resolve`):
    EmulatedGemm for `dtype`, or a no-op."""
    return EmulatedGemm(dtype) if gemm == "emulated" else contextlib.nullcontext()


class EmulatedGemm(TorchDispatchMode):
    """bf16/fp16 GEMM-like ops computed in fp32 on the same inputs and rounded once to their dtype."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No torch._disable_dynamo around __torch_dispatch__ (torch's opt-out for a mode's subclass): its
        first call imported torch._dynamo (~2 s of CPU) in every process that ran a bf16/fp16 step emulated
        (tests/test_startup.py). Dynamo never traces this mode: compile=true runs never emulate
        (PrecisionPolicy.from_config, and validate refuses cpu_gemm=emulated with compile=true)."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GEMM_OPS and _all_floats_are(args, self.dtype):
            out = func(*_widen(args, self.dtype), **kwargs)
            return _narrow(out, self.dtype)
        return func(*args, **kwargs)


def _all_floats_are(args, dtype: torch.dtype) -> bool:
    """True when every floating tensor among `args` has `dtype` (mixed dtypes keep the native op's error) and none
    is a tensor subclass: torchao's fp8 tensors (precision.fp8, sweep/run/fp8.py) report their high-precision dtype
    but hold fp8 data, and their own GEMM rule (an fp32 mm when emulated) must see them, not a widening cast."""
    tensors = list(_tensors(args))
    floats = [a.dtype for a in tensors if a.is_floating_point()]
    subclass = any(is_traceable_wrapper_subclass(a) for a in tensors)
    return bool(floats) and not subclass and all(d == dtype for d in floats)


def _tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _tensors(a)


def _widen(args, dtype: torch.dtype):
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.dtype == dtype else a for a in args)


def _narrow(out, dtype: torch.dtype):
    if isinstance(out, torch.Tensor):
        return out.to(dtype)
    if isinstance(out, (tuple, list)):  # convolution_backward: (grad_input, grad_weight, grad_bias), some None
        return type(out)(_narrow(o, dtype) for o in out)
    return out


# Verdict agreement: what "emulation gives the same verdicts" means, for bench/gemm_verdicts.py and the tests.
TOLERANCE = 2
"""Steps by which an emulated run's first bad step may differ from the native one's on the same machine.
Summation order differs, so a loss that crosses a spike threshold at the edge could cross one step apart;
every scenario and the demo grid measured here agreed exactly (docs/cpu_gemm.md)."""

CHAOTIC_AFTER = 100
"""A first bad step this late is the end of a chaotic trajectory: compared across machines, it is held to
CHAOTIC_WINDOW, not to TOLERANCE. fp32 GEMM kernels differ between CPUs (AVX2 against AVX-512/AMX: other
blockings, other summation orders), a last-bit difference grows over hundreds of steps, and the
adamw_beta2_loss_spike scenario's spike came at step 313 on a 2-core AMD EPYC (AVX2) and at 321 on an
AMX Xeon. Every other recorded first bad step is under 60 and agreed exactly on both kinds."""

CHAOTIC_WINDOW = 0.1
"""Across machines, a first bad step at or past CHAOTIC_AFTER may differ by this fraction of itself: the
verdict still has to be the same and the spike in the same phase of the run (313 +- 31 is 15-35 steps
after that scenario's resume at 300 either way)."""


def step_tolerance(step: int, across_machines: bool) -> int:
    """How far a first bad step at `step` may move: TOLERANCE on one machine and early in a run;
    CHAOTIC_WINDOW of the step for a long run compared with a record made on another CPU."""
    if across_machines and step >= CHAOTIC_AFTER:
        return max(TOLERANCE, math.ceil(CHAOTIC_WINDOW * step))
    return TOLERANCE


def cell_outcomes(sweep_dir: Path) -> dict[str, list]:
    """{cell: [status, verdict, first_bad_step]} of a sweep directory; a cell is its swept params as JSON,
    precision.cpu_gemm left out."""
    out = {}
    for path in sorted(Path(sweep_dir).glob("*/result.json")):
        r = json.loads(path.read_text())
        params = {k: v for k, v in r["params"].items() if k != "precision.cpu_gemm"}
        out[json.dumps(params, sort_keys=True)] = [r["status"], r.get("verdict"), r.get("first_bad_step")]
    return out


def verdict_differences(native: dict[str, list], other: dict[str, list], across_machines: bool = False) -> list[str]:
    """One line per cell whose outcome in `other` is not the native one's (status, verdict, first bad step
    within step_tolerance); empty when they agree. `across_machines`: `native` is a record made on another
    CPU (tests/data/native_verdicts.json), so long runs get CHAOTIC_WINDOW."""
    diffs = [f"{cell}: only in {'native' if cell in native else 'other'}" for cell in native.keys() ^ other.keys()]
    for cell in native.keys() & other.keys():
        (s1, v1, b1), (s2, v2, b2) = native[cell], other[cell]
        moved = b1 is not None and b2 is not None and abs(b1 - b2) > step_tolerance(b1, across_machines)
        if (s1, v1) != (s2, v2) or (b1 is None) != (b2 is None) or moved:
            diffs.append(f"{cell}: native {s1} {v1} @{b1}, other {s2} {v2} @{b2}")
    return sorted(diffs)
