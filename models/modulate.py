"""The adaLN "modulate" seam: x * (1 + scale) + shift, as the eager reference or as one fused op.

"fused" is the custom op `dit_sweep::modulate` (backward: `dit_sweep::modulate_backward`).
Being a registered op, it appears by name in the torch profiler, which is how a run proves
the toggle is live. Its forward is a single `torch.addcmul` pass over x; its backward
computes grad_x in the working dtype and accumulates the (B, D) reductions for shift and
scale in fp32 before casting back, the way a hand-written fused kernel would.

The same addcmul body serves CPU and CUDA (on CUDA it is one fused elementwise kernel).
There is deliberately no Triton kernel: none could be tested on the CPU-only machines this
project is developed on, and an untested kernel is exactly the kind of seam that hides the
per-row shift/scale indexing bug (OpenDiT's Triton modulate) this sweep looks for.
"""

from __future__ import annotations

import torch
from torch import Tensor

MODULATE_IMPLS = ("eager", "fused", "fused_buggy")

MODULATE_OP = "dit_sweep::modulate"
"""The fused impl's op: its name in the profiler and in result.json."""

MODULATE_KERNELS = {"eager": "eager", "fused": MODULATE_OP, "fused_buggy": "fused_buggy:opendit-row-index"}
"""What runs for each impl, as result.json's `kernels.modulate` names it."""


@torch.library.custom_op("dit_sweep::modulate", mutates_args=())
def _fused_modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    # Contiguous output so the real and fake implementations agree on strides.
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # (B, N, D)
    return torch.addcmul(shift[:, None], x, (1 + scale)[:, None], out=out)  # (B, N, D)


@_fused_modulate.register_fake
def _fused_modulate_fake(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("dit_sweep::modulate_backward", mutates_args=())
def _fused_modulate_backward(grad: Tensor, x: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    grad_x = grad * (1 + scale)[:, None]  # (B, N, D)
    grad32 = grad.float()
    grad_shift = grad32.sum(1).to(scale.dtype)  # (B, D)
    grad_scale = (grad32 * x.float()).sum(1).to(scale.dtype)  # (B, D)
    return grad_x, grad_shift, grad_scale


@_fused_modulate_backward.register_fake
def _fused_modulate_backward_fake(grad: Tensor, x: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(grad), scale.new_empty(scale.shape), scale.new_empty(scale.shape)


def _setup_context(ctx, inputs, output) -> None:
    x, _shift, scale = inputs
    ctx.save_for_backward(x, scale)


def _backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    x, scale = ctx.saved_tensors
    grad_x, grad_shift, grad_scale = torch.ops.dit_sweep.modulate_backward(grad, x, scale)
    return grad_x, grad_shift, grad_scale


_fused_modulate.register_autograd(_backward, setup_context=_setup_context)


def _rows_read(x: Tensor) -> Tensor:
    """(B, N): the shift/scale row each token row of x (B, N, D) reads in OpenDiT's kernel, r // D (fault 1 below),
    the rows past the last sample reading the last sample's."""
    b, n, d = x.shape
    return (torch.arange(b * n, device=x.device) // d).clamp(max=b - 1).view(b, n)


class _OpenDiTModulate(torch.autograd.Function):
    """OpenDiT's Triton modulate (its kernels/fused_modulate.py), the two faults of the kernel as it was written.

    1. Token row r (of the B*N rows of x) reads shift/scale row r // D: the kernel divides by `y.stride(1)`,
       which is D, where it meant N. Right when N == D or B == 1; otherwise samples take other samples' rows.
    2. The backward gives each sample's own shift/scale row the gradient of its own tokens
       (d_scale = sum over the sample's rows of dy * x), whatever row its forward read.

    So the adaLN weights get a gradient that is not the loss's: they move along directions that the forward
    cannot see, at AdamW's full step and without bound (weight_decay 0), until the modulated activations
    blow up. In conf/scenario/opendit_fused_modulate_fp16.yaml that takes a few hundred steps; a kernel
    whose backward matched its own wrong forward would only cost quality (docs/scenarios.md).

    Where r // D passes the last sample (N > D: the long token sequences of video), the Triton kernel reads
    past the end of the tensor, memory whose contents nothing defines; here those rows read the last
    sample's row instead, a stand-in that keeps runs reproducible.
    """

    generate_vmap_rule = True  # a pack (sweep/run/packed.py) vmaps the model over its runs

    @staticmethod
    def forward(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        rows = _rows_read(x)  # (B, N): fault 1
        # the kernel loads x as fp32 and computes x * (1 + scale) + shift there, then stores x's dtype
        return (x.float() * (1 + scale[rows].float()) + shift[rows].float()).to(x.dtype)  # (B, N, D)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, _shift, scale = inputs
        ctx.save_for_backward(x, scale)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x, scale = ctx.saved_tensors
        rows = _rows_read(x)  # (B, N)
        dx = dy * (1 + scale[rows].to(dy.dtype))  # (B, N, D): the rows the forward read
        d_shift = dy.sum(1).to(scale.dtype)  # (B, D): fault 2, each sample's own row
        d_scale = (dy * x.to(dy.dtype)).sum(1).to(scale.dtype)  # (B, D)
        return dx, d_shift, d_scale


class ModulateCount:
    """`with counter:` around a forward counts the `modulate` calls made inside, per impl, and gives
    `modulate(..., impl=None)` its impl: how a custom model's adapter (models/custom.py) knows whether
    the modulate axis reached the model at all. Nested counters each count; the innermost sets the impl."""

    _active: list[ModulateCount] = []

    def __init__(self, impl: str = "eager"):
        if impl not in MODULATE_IMPLS:
            raise ValueError(f"unknown modulate impl {impl!r}; choose one of {MODULATE_IMPLS}")
        self.impl = impl
        self.calls: dict[str, int] = {}

    def __enter__(self) -> ModulateCount:
        self.calls = {}
        ModulateCount._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        ModulateCount._active.remove(self)


def modulate(x: Tensor, shift: Tensor, scale: Tensor, impl: str | None = None) -> Tensor:
    """x (B, N, D) * (1 + scale (B, D)) + shift (B, D), per batch row, with the chosen implementation.

    impl None: the innermost active `ModulateCount`'s impl (a custom model's adapter), else eager."""
    if impl is None:
        impl = ModulateCount._active[-1].impl if ModulateCount._active else "eager"
    for counter in ModulateCount._active:
        counter.calls[impl] = counter.calls.get(impl, 0) + 1
    if impl not in MODULATE_IMPLS:
        raise ValueError(f"unknown modulate impl {impl!r}; choose one of {MODULATE_IMPLS}")
    # Both impls take exactly one shift/scale row per batch row; a silent broadcast of a
    # (1, D) row is the bug class the fused-vs-eager parity test guards against.
    expected = (x.shape[0], x.shape[-1])
    if x.dim() != 3 or tuple(shift.shape) != expected or tuple(scale.shape) != expected:
        raise ValueError(
            f"modulate expects x (B, N, D) and shift/scale (B, D); got x {tuple(x.shape)}, "
            f"shift {tuple(shift.shape)}, scale {tuple(scale.shape)}"
        )
    if impl == "eager":
        return x * (1 + scale[:, None]) + shift[:, None]  # (B, N, D)
    if impl == "fused_buggy":
        return _OpenDiTModulate.apply(x, shift, scale)  # (B, N, D)
    # Autocast does not touch custom ops, so align dtypes here: x is the tensor being
    # modulated and sets the working precision.
    return torch.ops.dit_sweep.modulate(x, shift.to(x.dtype), scale.to(x.dtype))  # (B, N, D)


def _fold(info, in_dims, *tensors: Tensor) -> list[Tensor]:
    """Move each vmapped dim to the front (broadcasting unbatched inputs) and fold it into the batch dim."""
    out = []
    for t, d in zip(tensors, in_dims):
        t = t.movedim(d, 0) if d is not None else t.expand(info.batch_size, *t.shape)
        out.append(t.reshape(-1, *t.shape[2:]))
    return out


def _unfold(t: Tensor, size: int) -> Tensor:
    return t.reshape(size, -1, *t.shape[1:])


# Trial packing (sweep/run/packed.py) vmaps the model over K stacked runs. Without these rules torch would
# call the fused op once per run (its slow "batched fallback"); with them the pack is one call whose
# batch is K*B rows, each with its own shift/scale row, so per-row semantics are unchanged.
@torch.library.register_vmap("dit_sweep::modulate")
def _fused_modulate_vmap(info, in_dims, x: Tensor, shift: Tensor, scale: Tensor):
    out = torch.ops.dit_sweep.modulate(*_fold(info, in_dims, x, shift, scale))
    return _unfold(out, info.batch_size), 0


@torch.library.register_vmap("dit_sweep::modulate_backward")
def _fused_modulate_backward_vmap(info, in_dims, grad: Tensor, x: Tensor, scale: Tensor):
    outs = torch.ops.dit_sweep.modulate_backward(*_fold(info, in_dims, grad, x, scale))
    return tuple(_unfold(o, info.batch_size) for o in outs), (0, 0, 0)
