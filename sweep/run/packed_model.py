"""K models of one architecture as stacked weights and one vmapped forward (sweep/run/packed.py trains them).

The K models' weights are stacked along a new leading dimension (`torch.func.stack_module_state`) and one
`vmap(functional_call(...))` runs the forward of all K at once: every linear layer becomes one batched
matmul, every attention call one SDPA call (vmap folds the pack into the batch, so the forced backend is
the one that runs; the fused modulate op has its own vmap rule in models/modulate.py). Under AMP every
module outputs the dtype it outputs alone: linear and conv layers cast their operands themselves, since
autocast misses them under vmap (_cast_like_autocast), and SDPA is cast as a whole (_SdpaLikeAutocast).
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch.func import functional_call, stack_module_state, vmap

from sweep.run.fp8 import float8_layers


def _cast_like_autocast(m: torch.nn.Module):
    """m.forward with autocast's cast of a whole linear/conv made explicit: input, weight and bias.

    Under vmap a linear with batched weights decomposes into matmul + bias add and autocast casts only
    the matmul, so an fp32 bias lifts the activations back to fp32 (pytorch/pytorch#192617), and a conv
    with batched weights reaches no autocast rule at all. Packed AMP activations would then be fp32
    where the lone run's are fp16: no overflow where the lone run has one.
    """

    def forward(x: torch.Tensor) -> torch.Tensor:
        w, b = m.weight, m.bias
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w, b = x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)
        if isinstance(m, torch.nn.Linear):
            return torch.nn.functional.linear(x, w, b)
        return m._conv_forward(x, w, b)

    return forward


class _SdpaLikeAutocast(torch.overrides.TorchFunctionMode):
    """Autocast's cast of a whole scaled_dot_product_attention call made explicit: q/k/v (and a float mask) to
    the autocast dtype, the call itself with autocast off.

    Under vmap autocast reaches the ops inside SDPA's math kernel instead of the SDPA call: the kernel's
    upcast q/k/v are cast back by autocast's matmul, so the packed softmax runs in bf16/fp16 where the lone
    run's runs in fp32, and the output comes out fp32. On CUDA autocast also runs softmax in fp32, so
    _safe_softmax gets a bf16 input and an fp32 result, and its backward is refused ("expected input and grad
    types to match, or input to be at::Half and grad to be at::Float"; fp16 passes that check).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            device = args[0].device.type
            if torch.is_autocast_enabled(device):
                dtype = torch.get_autocast_dtype(device)
                args = tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
                with torch.autocast(device, enabled=False):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


class PackedModel:
    """K models of one architecture as stacked weights and one vmapped forward."""

    def __init__(self, models: Sequence[torch.nn.Module]):
        fp8_layers = float8_layers(models[0])
        if fp8_layers:  # each linear's forward is replaced below: the pack would silently run them as bf16 linears
            raise ValueError(
                f"PackedModel cannot pack fp8 matmuls ({len(fp8_layers)} torchao Float8Linear layers, e.g. "
                f"{fp8_layers[0]}): vmap cannot run them; train fp8 runs alone (sweep/run/packing.py refuses them)"
            )
        self.params, self.buffers = stack_module_state(list(models))  # {name: (K, ...)} leaves
        self.base = copy.deepcopy(models[0]).to("meta")  # the module structure, no storage
        self.device = next(iter(self.params.values())).device
        for m in self.base.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
                m.forward = _cast_like_autocast(m)

    def __call__(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x (K, B, ...), t (K, B) -> prediction (K, B, ...), run k with weights k."""

        def one(params, buffers, x, t):
            return functional_call(self.base, (params, buffers), (x, t))

        with _SdpaLikeAutocast():
            return vmap(one)(self.params, self.buffers, x, t)

    def keep(self, positions: list[int]) -> None:
        """Keep only the runs at these positions (in this order): runs that left the pack stop costing."""
        index = torch.tensor(positions, dtype=torch.long, device=self.device)
        self.params = {n: p.detach()[index].requires_grad_(p.requires_grad) for n, p in self.params.items()}
        self.buffers = {n: b[index] for n, b in self.buffers.items()}

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params.values() if p.grad is not None]

    def run_params(self, i: int) -> list[tuple[str, torch.Tensor]]:
        """Run i's (name, weight) slices, each with its gradient slice as `.grad` (for sweep.run.train.explain)."""
        named = []
        for name, p in self.params.items():
            w = p.detach()[i]
            w.grad = p.grad[i] if p.grad is not None else None
            named.append((name, w))
        return named

    def forward_of(self, i: int):
        """Run i's forward alone (no vmap): the prediction its weights give, as the lone run computes it."""
        params = {n: p.detach()[i] for n, p in self.params.items()}
        buffers = {n: b[i] for n, b in self.buffers.items()}
        return lambda x, t: functional_call(self.base, (params, buffers), (x, t))

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None
