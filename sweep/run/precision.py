"""Precision policies, and the decisions a loss scaler makes (ScalerEvent).

How the precisions differ (conf/precision/*.yaml spell out every knob):
- *AMP* (bf16_amp, fp16_amp): the weights and AdamW state stay fp32 ("master weights"); only the
  forward runs in low precision under torch.autocast. bf16 has fp32's exponent range, so it needs no
  loss scaling; fp16 tops out at 65504 and flushes below 6e-8, so its small gradients underflow unless
  the loss is multiplied up before backward (and the gradients divided back before the step).
- *Pure* (bf16_pure, fp16_pure): the weights and optimizer state themselves are low precision. An
  update smaller than half a unit in the last place of a weight is lost (bf16 stalls at small lr),
  and in fp16 AdamW's eps=1e-8 rounds to 0, so the first update is 0/0.
- tf32 lets fp32 matmuls use TF32 tensor cores (CUDA Ampere+ only); fp32 turns that off explicitly.

The loss scaler that runs is sweep/run/scaler.py's DeviceLossScaler.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from enum import Enum

import torch

from sweep.config import PrecisionConfig
from sweep.run import gemm

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype holds the weights, which one the forward computes in, and whether TF32 is allowed."""

    name: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    tf32: bool
    gemm: str = "native"
    """How bf16/fp16 GEMMs run: "native" kernels or "emulated" in fp32, rounded once (sweep/run/gemm.py)."""

    @classmethod
    def from_config(
        cls, cfg: PrecisionConfig, device: torch.device | None = None, compiled: bool = False
    ) -> "PrecisionPolicy":
        """The policy of `cfg` for a run on `device` (None: no device yet, GEMMs native)."""
        autocast = DTYPES[cfg.autocast_dtype.value] if cfg.autocast_dtype is not None else None
        policy = cls(cfg.name, DTYPES[cfg.param_dtype.value], autocast, cfg.tf32)
        if device is None or compiled:  # inductor picks its own kernels: nothing to emulate under
            return policy
        return dataclasses.replace(policy, gemm=gemm.resolve(cfg.cpu_gemm.value, device, policy.compute_dtype))

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the matmuls run in."""
        return self.autocast_dtype or self.param_dtype

    def unsupported_reason(self, device: torch.device) -> str | None:
        """Why this policy cannot run as asked on `device` (None when it can)."""
        if self.tf32:
            if device.type != "cuda":
                return f"tf32 needs a CUDA GPU (Ampere or newer); this run is on {device.type}"
            if torch.cuda.get_device_capability(device)[0] < 8:
                return f"tf32 needs compute capability >= 8.0, {torch.cuda.get_device_name(device)} has less"
        if device.type == "cuda" and torch.bfloat16 in (self.param_dtype, self.autocast_dtype):
            if not torch.cuda.is_bf16_supported(including_emulation=False):
                return f"{torch.cuda.get_device_name(device)} has no native bf16"
        return None

    def apply_global_flags(self) -> None:
        """Set the process-wide TF32 switches for this run (jobs share a process, so always set both ways)."""
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        torch.backends.cudnn.allow_tf32 = self.tf32
        torch.set_float32_matmul_precision("high" if self.tf32 else "highest")

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The forward's autocast context (a no-op for fp32 and pure policies)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    def gemm_mode(self) -> contextlib.AbstractContextManager:
        """The context the forward and backward run in: emulated low-precision GEMMs, or a no-op."""
        return gemm.mode(self.gemm, self.compute_dtype)


class ScalerEvent(str, Enum):
    """What the scaler decided about one step."""

    step = "step"  # gradients finite: take the optimizer step
    skip = "skip"  # overflow: skip the step (and maybe back off)
    collapse = "collapse"  # overflow at the minimum scale, or too many skips in a row: the run is over
