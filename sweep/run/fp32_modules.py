"""Chosen modules computed in fp32 inside a low-precision model (`precision.fp32_modules`, issue #29).

    python -m sweep -m precision=bf16_amp '+precision.fp32_modules=[],[blocks.*.attn]'

Differential diagnosis asks "does the run stay stable when only these modules compute in fp32?", the way
Transformer Engine's debug tools let a user run chosen layers in higher precision by hand. Each entry of
`precision.fp32_modules` is an fnmatch glob over `model.named_modules()` names (`blocks.*.attn`,
`final_layer`, `x_embedder`); of a matched module and a matched descendant only the outermost is wrapped.
A wrapped module:

- under autocast (bf16_amp, fp16_amp, ...) runs its forward with autocast off and its floating inputs cast
  to fp32 (its weights are the fp32 master weights already); its outputs stay fp32, and the autocast ops
  after it cast them as they cast any fp32 tensor;
- under a pure policy (bf16_pure, fp16_pure) keeps its weights, and so its AdamW state, in fp32, casts its
  floating inputs to fp32 on entry and its floating outputs back to the policy's param dtype on exit, so
  the rest of the model gets what it expects;
- under fp32 (and tf32) is left alone: there is nothing to do.

The wrapping is a forward pre-hook and a forward hook (always called, so an exception cannot leave autocast
off), not a replaced `forward`: module names, state-dict keys and checkpoints stay the model's own, the hooks
survive the deepcopy of a pack's base module and run inside its vmap, and they read nothing from the device
(a window's step or a CUDA graph is unaffected). A glob matching no module is a config error before any run
(sweep.config.check_inputs).
"""

from __future__ import annotations

import contextlib
import fnmatch
from typing import Sequence

import torch
from torch.utils._pytree import tree_map

_AUTOCAST_DEVICES = ("cpu", "cuda")
_HOOKED = "_fp32_module_hooks"
"""Attribute marking a module already wrapped (apply may be called again after LoRA swaps modules in)."""


def matching(names: Sequence[str], globs: Sequence[str]) -> list[str]:
    """The names any glob matches, outermost only: a name under an already matched one is left out."""
    hits = [n for n in names if n and any(fnmatch.fnmatchcase(n, g) for g in globs)]
    return [n for n in hits if not any(n.startswith(h + ".") for h in hits)]


def first_match(name: str, globs: Sequence[str]) -> str | None:
    """The first glob that names `name` (a keep list's record says which kept a module), or None."""
    return next((g for g in globs if fnmatch.fnmatchcase(name, g)), None)


def unmatched(names: Sequence[str], globs: Sequence[str]) -> list[str]:
    """The globs that match no name."""
    return [g for g in globs if not any(n and fnmatch.fnmatchcase(n, g) for n in names)]


def example_names(names: Sequence[str], count: int = 10) -> list[str]:
    """A few module names to show in an error: shallow ones, the first of each repeated block only."""
    shallow = [n for n in names if n and n.count(".") <= 2]
    first = [n for n in shallow if all(not p.isdigit() or p == "0" for p in n.split("."))]
    return first[:count]


class _Fp32Forward:
    """The hooks of one wrapped module: autocast off and fp32 inputs on entry, outputs to `out_dtype` on exit."""

    def __init__(self, out_dtype: torch.dtype | None):
        self.out_dtype = out_dtype
        """The policy's param dtype under a pure policy (outputs cast back to it); None under autocast."""
        self.open: list[contextlib.ExitStack] = []  # one per forward in progress (a module may be re-entered)

    def before(self, module, args, kwargs):
        stack = contextlib.ExitStack()
        for device in _AUTOCAST_DEVICES:
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        self.open.append(stack)
        return tree_map(_to(torch.float32), args), tree_map(_to(torch.float32), kwargs)

    def after(self, module, args, kwargs, output):
        self.open.pop().close()
        return tree_map(_to(self.out_dtype), output) if self.out_dtype is not None else output


def _to(dtype: torch.dtype):
    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x

    return cast


def apply(
    model: torch.nn.Module, globs: Sequence[str], param_dtype: torch.dtype, compute_dtype: torch.dtype
) -> list[str]:
    """Wrap the modules of `model` the globs match (outermost only), for a policy whose weights are `param_dtype`
    and whose forward computes in `compute_dtype` (PrecisionPolicy's), keeping their weights fp32 under a pure
    policy; returns the wrapped names. A no-op returning [] when the policy computes in fp32 or with no globs.
    Safe to call again (after LoRA replaced modules): a wrapped module is not wrapped twice. (Plain dtypes, not
    the policy: sweep.config imports this module, and sweep.run.precision imports sweep.config.)"""
    if not globs or compute_dtype == torch.float32:
        return []
    modules = dict(model.named_modules())
    names = matching(list(modules), globs)
    pure = param_dtype != torch.float32
    for name in names:
        module = modules[name]
        if pure:
            module.float()  # its weights and buffers; AdamW's state follows the weights' dtype
        if getattr(module, _HOOKED, None) is None:
            hooks = _Fp32Forward(param_dtype if pure else None)
            module.register_forward_pre_hook(hooks.before, with_kwargs=True)
            module.register_forward_hook(hooks.after, with_kwargs=True, always_call=True)
            setattr(module, _HOOKED, hooks)
    return names
