"""Low-precision storage of a frozen base's linear weights (`finetune.base_dtype`), upcast per layer in the forward.

    python -m sweep finetune=lora model.init_from=<run dir>/checkpoints/step_000200 \
        -m finetune.base_dtype=null,bf16,fp8_e4m3,fp8_e4m3_block,fp8_e5m2

A LoRA fine-tune trains small adapters on a frozen base; the base's weights are most of the memory, so trainers
store them in fewer bits: kohya's sd-scripts `--fp8_base` (a plain cast) and `--fp8_scaled`, musubi-tuner's
fp8_scaled (block-scaled since its PR #575), finetrainers' layerwise upcasting. Each frozen `nn.Linear` whose
name matches no `finetune.base_keep` glob keeps its weight in the storage dtype (under peft: the `base_layer` of
each LoRA layer, and every other frozen Linear) and dequantises it in its forward:

- `bf16`: the weight rounded to bfloat16, no scale. Under bf16 autocast the forward is bit for bit the unstored
  run's (autocast rounds the fp32 weight to the same bf16 value); under fp32 it is the bf16 weight, computed in fp32.
- `fp8_e4m3` / `fp8_e5m2`: one fp32 scale per tensor, scale = amax / the format's max (448 for float8_e4m3fn,
  57344 for float8_e5m2), the weight divided by it, clamped to +-max and cast (kohya's `--fp8_scaled` per tensor).
- `fp8_e4m3_block`: one fp32 scale per BLOCK (128) consecutive input features of each output row, scale = the
  block's amax / 448; a row whose input width is not a multiple of 128 ends in a narrower block.

Dequantised weight = the stored values in fp32 times their scale, then cast to the compute dtype: autocast's
dtype where autocast is on (bf16_amp, fp16_amp), else the dtype the weight had (fp32; bf16 under bf16_pure; fp32
inside a `precision.fp32_modules` module, which runs with autocast off). The bias is untouched. Autograd keeps each
layer's dequantised weight until the backward (the gradient of its input needs it), as musubi-tuner's patched
forward does: the saving is in the resident weights, not in the activations' peak.

What musubi-tuner does (kohya-ss/musubi-tuner `src/musubi_tuner/modules/fp8_optimization_utils.py`, read at
d66334f, its PR #575 of 2025-09-20, and at 3647b20, 2026-06): `quantize_weight` scales per block of `block_size`
input features of each row (default **64**, not 128), scale = block amax / fp8 max clamped below at 1e-8, divides
in fp32, `nan_to_num`, clamps to +-max and casts (`quantize_fp8`); a layer whose input width is not a multiple of
the block falls back to per-channel (PR #575) or per-tensor (2026) scaling; the scale is kept as `scale_weight`
(shape [out, blocks, 1]; in the weight's original dtype at PR #575, fp32 in 2026, which also splits it into a
tensor scale times block scales for `scaled_mm`), and `fp8_linear_forward_patch` dequantises `weight.to(dtype) *
scale_weight` and calls `F.linear`. We match its quantiser (amax / max, the 1e-8 floor, fp32 division, clamp,
cast), its state-dict layout (`<layer>.weight` in fp8 plus `<layer>.scale_weight`) and its dequantise-then-F.linear
forward, with these differences: 128-wide blocks (the width of Transformer Engine's and DeepSeek's 1x128 scaling,
and what finetune.base_dtype's documentation promises), a narrower last block instead of a fallback, and the scale
in fp32 (shape [out, blocks]) multiplied in fp32 before one cast to the compute dtype.

Why our own code and not torchao: torchao 0.18's float8 weight storage is its inference quantisation API
(`quantize_(model, Float8WeightOnlyConfig())`, and `Float8DynamicActivationFloat8WeightConfig`): it swaps each
weight for a `Float8Tensor` subclass with a per-row (or per-tensor) scale, made for inference. It has no 128-wide
block granularity for weights-only, no e5m2 weights, no bf16 storage, its subclass is not a plain tensor in
`state_dict()` (our checkpoints are safetensors of plain tensors, verified tensor by tensor), and peft's LoRA
layers wrap an `nn.Linear` base whose weight they expect to be a plain parameter. What we need is a cast, a scale
and a dequantise in the forward: a few lines we can test exactly against a reference (tests/test_fp8_storage.py).

The stored layer stays the same module (its class is swapped to StoredLinear, so hooks registered on it, e.g.
precision.fp32_modules', survive), with the same names: `state_dict()` holds `weight` in the storage dtype and
`scale_weight` (fp8 only), so a checkpoint saves and resumes the stored bytes exactly, and a `.to(dtype)` /
`.float()` of the model later changes the compute dtype, never the stored values.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from sweep.config import BaseDtype
from sweep.run import fp32_modules

BLOCK = 128
"""Input features per scale in fp8_e4m3_block."""

SCALE_FLOOR = 1e-8
"""The smallest scale (musubi-tuner's): an all-zero tensor or block dequantises to zeros."""

STORAGE: dict[BaseDtype, tuple[torch.dtype, int | None, bool]] = {
    BaseDtype.bf16: (torch.bfloat16, None, False),
    BaseDtype.fp8_e4m3: (torch.float8_e4m3fn, None, True),
    BaseDtype.fp8_e4m3_block: (torch.float8_e4m3fn, BLOCK, True),
    BaseDtype.fp8_e5m2: (torch.float8_e5m2, None, True),
}
"""Each base_dtype's (storage dtype, block width or None for one scale per tensor, scaled)."""


def quantise(weight: torch.Tensor, dtype: torch.dtype, block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, fp32 scale) of a 2-D weight: one scale per tensor (shape []) or per `block` input features of
    each row (shape [out, ceil(in / block)]); scale = amax / the dtype's max, floored at SCALE_FLOOR."""
    w = weight.detach().float()
    top = torch.finfo(dtype).max
    if block is None:
        scale = (w.abs().max() / top).clamp(min=SCALE_FLOOR)
        return (w / scale).clamp(-top, top).to(dtype), scale
    blocks = _blocks(w, block)  # (out, blocks, block), zero-padded: padding does not change an amax
    scale = (blocks.abs().amax(dim=2) / top).clamp(min=SCALE_FLOOR)
    q = (blocks / scale.unsqueeze(2)).clamp(-top, top).to(dtype)
    return q.view(w.shape[0], -1)[:, : w.shape[1]].contiguous(), scale


def dequantise(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, block: int | None) -> torch.Tensor:
    """The weight in `dtype`: the stored values in fp32 times their scale (none for bf16 storage; one per tensor,
    or per `block` input features of a row), cast once."""
    w = stored.float()
    if scale is None:
        return w.to(dtype)
    if block is None:
        return (w * scale).to(dtype)
    full = (_blocks(w, block) * scale.unsqueeze(2)).view(w.shape[0], -1)
    return full[:, : w.shape[1]].to(dtype)


def _blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    """(out, in) -> (out, ceil(in / block), block), the last block zero-padded."""
    pad = -w.shape[1] % block
    return F.pad(w, (0, pad)).view(w.shape[0], -1, block)


class StoredLinear(torch.nn.Linear):
    """An nn.Linear whose frozen weight is stored in a low-precision dtype (fp8 with `scale_weight`, or bf16) and
    dequantised to the compute dtype in each forward. Made by `store` (a class swap of an existing nn.Linear)."""

    param_dtype: torch.dtype
    """The dtype the weight had (and the forward computes in without autocast); follows `.to(dtype)` / `.float()`."""
    block: int | None
    """Input features per scale; None: one scale per tensor (or none, bf16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.param_dtype
        return F.linear(x, dequantise(self.weight, self.scale_weight, dtype, self.block), self.bias)

    def _apply(self, fn, recurse=True):
        """A dtype cast of the module changes the compute dtype; the stored values only follow a device move."""
        stored, scale = self.weight, self.scale_weight
        self._parameters["weight"], self._buffers["scale_weight"] = None, None  # nn.Module._apply skips None
        try:
            super()._apply(fn, recurse)
        finally:
            self._parameters["weight"], self._buffers["scale_weight"] = stored, scale
        probe = fn(torch.empty(0, dtype=self.param_dtype, device=stored.device))
        self.param_dtype = probe.dtype
        if probe.device != stored.device:
            self.weight = torch.nn.Parameter(stored.to(probe.device), requires_grad=False)
            if scale is not None:
                self.scale_weight = scale.to(probe.device)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected, errors):
        """Stored values load only from the same storage: copying float32 or another fp8 format into them would
        reinterpret the numbers without their scale."""
        given = state_dict.get(prefix + "weight")
        if given is not None and given.dtype != self.weight.dtype:
            errors.append(
                f"{prefix}weight is stored as {self.weight.dtype} (finetune.base_dtype) and the state holds"
                f" {given.dtype}: resume with the base_dtype that saved it"
            )
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected, errors)

    def extra_repr(self) -> str:
        scale = "" if self.scale_weight is None else f", scale={list(self.scale_weight.shape)}"
        return f"{super().extra_repr()}, stored={self.weight.dtype}{scale}, compute={self.param_dtype}"


def store(layer: torch.nn.Linear, base_dtype: BaseDtype) -> dict:
    """Store `layer`'s weight as `base_dtype` in place (its class becomes StoredLinear); returns the weight's
    quantisation error: relative RMS and max |error| of the dequantised fp32 weight against the original."""
    dtype, block, scaled = STORAGE[base_dtype]
    original = layer.weight.detach()
    if scaled:
        stored, scale = quantise(original, dtype, block)
    else:
        stored, scale = original.to(dtype), None
    param_dtype = original.dtype
    layer.__class__ = StoredLinear
    layer.param_dtype, layer.block = param_dtype, block
    layer.weight = torch.nn.Parameter(stored, requires_grad=False)
    layer.register_buffer("scale_weight", scale)
    diff = dequantise(stored, scale, torch.float32, block) - original.float()
    norm = float(original.float().norm())
    return {
        "rel_rms": float(diff.norm()) / norm if norm > 0 else 0.0,
        "max_abs": float(diff.abs().max()) if diff.numel() else 0.0,
    }


def model_bytes(model: torch.nn.Module) -> int:
    """What the model's parameters and buffers hold, in bytes."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def frozen_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every (name, module) that is an nn.Linear (or subclass) with a frozen weight: the LoRA adapters train."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not isinstance(m, StoredLinear) and not m.weight.requires_grad
    ]


def apply(model: torch.nn.Module, base_dtype: BaseDtype | None, keep: Sequence[str]) -> dict | None:
    """Store every frozen linear weight of `model` that no `keep` glob names as `base_dtype`; returns result.json's
    `base_storage` record (None when base_dtype is None): every frozen Linear is in exactly one of `stored` (with
    its weight's `error`) and `kept` (with the glob that kept it, or why it could not be stored)."""
    if base_dtype is None:
        return None
    before = model_bytes(model)
    stored, kept, errors = [], {}, {}
    for name, module in frozen_linears(model):
        glob = fp32_modules.first_match(name, keep)
        if glob is not None:
            kept[name] = glob
        elif type(module) is not torch.nn.Linear:  # a subclass has its own forward, which a swap would lose
            kept[name] = f"<{type(module).__name__}: not a plain nn.Linear>"
        else:
            errors[name] = store(module, base_dtype)
            stored.append(name)
    _, block, _ = STORAGE[base_dtype]
    return {
        "dtype": base_dtype.value,
        "block": block,
        "stored": stored,
        "kept": kept,
        "bytes": {"before": before, "after": model_bytes(model)},
        "error": errors,
    }
