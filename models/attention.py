"""One attention dispatch: forced SDPA kernels plus the hand-written "eager" formula.

Every backend except "eager" pins exactly one SDPA kernel with `sdpa_kernel([...])`, so a
sweep cell that asks for "flash" either runs flash or raises `KernelUnavailable`; torch
never gets to fall back to another kernel behind the sweep's back.

Measured on torch 2.13 CPU (see tests/test_kernels.py):
  * FLASH_ATTENTION and MATH run for fp32/bf16/fp16; the profiler names them
    `aten::_scaled_dot_product_flash_attention_for_cpu` (+ `..._backward`) and
    `aten::_scaled_dot_product_attention_math` (its backward is plain autograd, no named op).
  * EFFICIENT_ATTENTION and CUDNN_ATTENTION do not exist on CPU; forcing them makes torch
    raise "No viable backend for scaled_dot_product_attention was found" (the CUDA wording
    is "No available kernel").
  * MATH upcasts fp16/bf16 q/k/v to fp32 internally (visible as `aten::_to_copy` inside it)
    unless `torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)` was set, and the
    CPU flash kernel accumulates in fp32, so neither overflows on fp16 logits > 65504.
    "eager" keeps the working dtype and does overflow: that is the behaviour it exists to
    reproduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

ATTENTION_BACKENDS = ("flash", "math", "eager", "efficient", "cudnn")

ATTENTION_KERNELS = {
    "flash": "sdpa:FLASH_ATTENTION",
    "math": "sdpa:MATH",
    "efficient": "sdpa:EFFICIENT_ATTENTION",
    "cudnn": "sdpa:CUDNN_ATTENTION",
    "eager": "eager:softmax(QK^T)",
}
"""The kernel each backend forces, as result.json's `kernels.attention` names it."""

# Profiler op names (dispatcher events, recorded on any device) of the SDPA kernels: how a profiled
# compiled graph shows which attention kernel it runs (sweep/run/compiled.py). The forward's; the
# backward's is the same name + "_backward". CPU names measured on torch 2.13; the CUDA ones are
# aten's op names for those kernels, not yet seen in a profile of a compiled CUDA graph (issue #15).
FUSED_OPS = {
    "cpu": {"flash": "aten::_scaled_dot_product_flash_attention_for_cpu"},
    "cuda": {
        "flash": "aten::_scaled_dot_product_flash_attention",
        "efficient": "aten::_scaled_dot_product_efficient_attention",
        "cudnn": "aten::_scaled_dot_product_cudnn_attention",
    },
}
FLASH_OPS = {device: ops["flash"] for device, ops in FUSED_OPS.items()}
MATH_OP = "aten::_scaled_dot_product_attention_math"
SDPA_OPS = (
    MATH_OP,
    *(name + suffix for ops in FUSED_OPS.values() for name in ops.values() for suffix in ("", "_backward")),
)

_SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "math": SDPBackend.MATH,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}

# Substrings of torch's RuntimeError when the forced kernel cannot take the inputs
# (CUDA wording, then the CPU wording seen on torch 2.13).
NO_KERNEL_MESSAGES = ("No available kernel", "No viable backend")

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_CPU_SDPA_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


class KernelUnavailable(RuntimeError):
    """The requested attention kernel cannot run for this device/dtype/shape."""


def _check_backend(backend: str) -> None:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")


def backend_unavailable_reason(backend: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """One-line reason why `backend` cannot run q/k/v of `dtype` on `device`, or None if it can.

    `dtype` is the dtype q/k/v will have when they reach `attend`: the autocast dtype under
    autocast, the parameter dtype for a pure low-precision model.
    """
    _check_backend(backend)
    device = torch.device(device)
    if backend in ("eager", "math"):
        return None  # plain tensor ops: run wherever matmul and softmax run
    if device.type == "cpu":
        if backend in ("efficient", "cudnn"):
            return f"SDPA {backend} attention has no CPU kernel (CUDA only)"
        if dtype not in _CPU_SDPA_DTYPES:
            return f"SDPA flash attention on CPU was only validated for fp64/fp32/bf16/fp16, got {dtype}"
        return None
    if device.type == "cuda":
        if backend == "flash":
            if not torch.backends.cuda.is_flash_attention_available():
                return "this torch build has no CUDA flash attention"
            if dtype not in _HALF_DTYPES:
                return f"SDPA flash attention on CUDA needs fp16/bf16 inputs, got {dtype}"
        if backend == "cudnn":
            if not torch.backends.cudnn.is_available():
                return "cuDNN is not available in this torch build"
            if dtype not in _HALF_DTYPES:
                return f"SDPA cuDNN attention needs fp16/bf16 inputs, got {dtype}"
        # Remaining shape/arch constraints are checked by torch at call time and surface
        # as KernelUnavailable from attend().
        return None
    if backend in ("efficient", "cudnn"):
        return f"SDPA {backend} attention is CUDA only, got device {device.type}"
    return None


def _eager_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    # Deliberately no fp32 upcast: fp16 QK^T logits above 65504 become inf here, like in
    # the many research codebases that write attention this way.
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, heads, N, N)
    attn = scores.softmax(dim=-1)  # (B, heads, N, N)
    return attn @ v  # (B, heads, N, head_dim)


def _sdpa_input_dtype(q: Tensor) -> torch.dtype:
    # SDPA is on autocast's lower-precision list, so under autocast the kernel sees the
    # autocast dtype even when q arrives in fp32.
    if torch.is_autocast_enabled(q.device.type):
        return torch.get_autocast_dtype(q.device.type)
    return q.dtype


def attend(q: Tensor, k: Tensor, v: Tensor, backend: str, scale: float | None = None) -> Tensor:
    """Attention of q/k/v (B, heads, N, head_dim) -> (B, heads, N, head_dim) with one forced kernel.

    `scale` multiplies the logits; None is SDPA's default 1/sqrt(head_dim) (µP passes its own, models/mup.py)."""
    _check_backend(backend)
    if backend == "eager":
        return _eager_attention(q, k, v, scale)
    reason = backend_unavailable_reason(backend, q.device, _sdpa_input_dtype(q))
    if reason is not None:
        raise KernelUnavailable(reason)
    try:
        with sdpa_kernel([_SDPA_BACKENDS[backend]]):
            if scale is None:  # the call exactly as before µP existed
                return F.scaled_dot_product_attention(q, k, v)  # (B, heads, N, head_dim)
            return F.scaled_dot_product_attention(q, k, v, scale=scale)  # (B, heads, N, head_dim)
    except RuntimeError as err:
        message = str(err)
        if any(m in message for m in NO_KERNEL_MESSAGES):
            first_line = message.strip().splitlines()[0]
            raise KernelUnavailable(
                f"SDPA {backend} attention refused q{tuple(q.shape)} {q.dtype} on {q.device}: {first_line}"
            ) from err
        raise
