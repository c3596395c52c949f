"""The sweep's kernel axes inside diffusers transformers: a forced SDPA route and routed adaLN modulation.

Attention. Every diffusers attention processor of these models ends in
`torch.nn.functional.scaled_dot_product_attention` (directly, or through diffusers' dispatcher with
its default "native" backend). `SdpaRoute` (models/sdpa_route.py, torch only, shared with custom
models) is a `TorchFunctionMode` active during the adapter's forward only: it sees each of those
calls, counts them, and
  * flash / math: runs it inside `sdpa_kernel([that one backend])` (no fallback: a refusal is
    `KernelUnavailable`);
  * eager: computes softmax(QK^T)V itself, in the working dtype (no fp32 upcast), like
    models.attention's eager path.
diffusers' own attention-backend setting is not used: it reaches only the models that route
through its dispatcher (Wan, LTX, HunyuanVideo), silently does nothing for the others, and is
process-global. A TorchFunctionMode is scoped to the `with` block of one forward. Backward kernels
follow the forward's (autograd records the forward ops that ran).

Modulation. `route_modulation` swaps the class of diffusers' adaLN modules (AdaLayerNormZero,
AdaLayerNormZeroSingle, CogVideoXLayerNormZero, MochiRMSNormZero) for a subclass whose forward is
the same code with `x * (1 + scale) + shift` replaced by models.modulate. Same parameters, same
state_dict keys, so checkpoints load either way.
"""

from __future__ import annotations

import torch
from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle, CogVideoXLayerNormZero
from diffusers.models.transformers.transformer_mochi import MochiRMSNormZero

from models.modulate import modulate
from models.sdpa_route import SdpaRoute, eager_sdpa

__all__ = ["ROUTED", "SdpaRoute", "eager_sdpa", "route_modulation"]  # the route lives in models/sdpa_route.py


class RoutedAdaLayerNormZero(AdaLayerNormZero):
    """AdaLayerNormZero.forward with its modulation through models.modulate."""

    modulate_impl = "eager"

    def forward(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
        if self.emb is not None:
            emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        x = modulate(self.norm(x), shift_msa, scale_msa, self.modulate_impl)  # (B, N, D)
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class RoutedAdaLayerNormZeroSingle(AdaLayerNormZeroSingle):
    """AdaLayerNormZeroSingle.forward with its modulation through models.modulate."""

    modulate_impl = "eager"

    def forward(self, x, emb=None):
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
        return modulate(self.norm(x), shift_msa, scale_msa, self.modulate_impl), gate_msa


class RoutedCogVideoXLayerNormZero(CogVideoXLayerNormZero):
    """CogVideoXLayerNormZero.forward (video and text tokens) with its modulation through models.modulate."""

    modulate_impl = "eager"

    def forward(self, hidden_states, encoder_hidden_states, temb):
        shift, scale, gate, enc_shift, enc_scale, enc_gate = self.linear(self.silu(temb)).chunk(6, dim=1)
        hidden_states = modulate(self.norm(hidden_states), shift, scale, self.modulate_impl)  # (B, N, D)
        encoder_hidden_states = modulate(self.norm(encoder_hidden_states), enc_shift, enc_scale, self.modulate_impl)
        return hidden_states, encoder_hidden_states, gate[:, None, :], enc_gate[:, None, :]


class RoutedMochiRMSNormZero(MochiRMSNormZero):
    """MochiRMSNormZero.forward (scale only, in fp32 as Mochi does) with its modulation through models.modulate."""

    modulate_impl = "eager"

    def forward(self, hidden_states, emb):
        dtype = hidden_states.dtype
        emb = self.linear(self.silu(emb))
        scale_msa, gate_msa, scale_mlp, gate_mlp = emb.chunk(4, dim=1)
        scale = scale_msa.to(torch.float32)
        hidden_states = modulate(
            self.norm(hidden_states.to(torch.float32)), torch.zeros_like(scale), scale, self.modulate_impl
        )  # (B, N, D) in fp32, Mochi's upcast
        return hidden_states.to(dtype), gate_msa, scale_mlp, gate_mlp


ROUTED = {
    cls.__mro__[1]: cls
    for cls in (
        RoutedAdaLayerNormZero,
        RoutedAdaLayerNormZeroSingle,
        RoutedCogVideoXLayerNormZero,
        RoutedMochiRMSNormZero,
    )
}


def route_modulation(model: torch.nn.Module, class_names: tuple[str, ...], impl: str) -> int:
    """Swap every module whose class is named in `class_names` for its routed subclass; returns how many."""
    n = 0
    for module in model.modules():
        base = type(module)
        if base.__name__ in class_names and base in ROUTED:
            module.__class__ = ROUTED[base]
            module.modulate_impl = impl
            n += 1
    return n
