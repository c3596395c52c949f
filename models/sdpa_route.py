"""Force the attention axis on any module that calls `torch.nn.functional.scaled_dot_product_attention`.

`SdpaRoute` is a `TorchFunctionMode` active during one forward (the `with` block): it sees each SDPA
call made inside, counts them, and
  * flash / math / efficient / cudnn: runs it inside `sdpa_kernel([that one backend])` (no fallback:
    a refusal is `KernelUnavailable`);
  * eager: computes softmax(QK^T)V itself (`eager_sdpa`), in the working dtype (no fp32 upcast), like
    models.attention's eager path.
Backward kernels follow the forward's (autograd records the forward ops that ran). Torch only (no
diffusers): the diffusers adapters (models/diffusers_zoo.py) and the custom-model adapter
(models/custom.py) both wrap their forward in it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from models.attention import ATTENTION_KERNELS, NO_KERNEL_MESSAGES, KernelUnavailable

_SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "math": SDPBackend.MATH,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def eager_sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """F.scaled_dot_product_attention's contract, written out in the working dtype (fp16 logits can overflow)."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale  # (B, heads, Nq, Nk)
    if is_causal:
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    attn = scores.softmax(dim=-1)
    if dropout_p > 0:
        attn = F.dropout(attn, dropout_p)
    return attn @ value  # (B, heads, Nq, head_dim)


class SdpaRoute(TorchFunctionMode):
    """`with route:` around a forward: every SDPA call in it runs the chosen backend, and is counted."""

    def __init__(self, backend: str):
        super().__init__()
        if backend not in ATTENTION_KERNELS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {tuple(ATTENTION_KERNELS)}")
        self.backend = backend
        self.calls = 0
        self.calls_last_forward = 0
        self._stack: contextlib.ExitStack | None = None

    @property
    def kernel_name(self) -> str:
        return ATTENTION_KERNELS[self.backend]

    def __enter__(self):
        self.calls = 0
        self._stack = contextlib.ExitStack()
        if self.backend != "eager":
            self._stack.enter_context(sdpa_kernel([_SDPA_BACKENDS[self.backend]]))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.calls_last_forward = self.calls
            self._stack.close()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        if self.backend == "eager":
            return eager_sdpa(*args, **kwargs)
        try:
            return func(*args, **kwargs)
        except RuntimeError as err:
            if any(m in str(err) for m in NO_KERNEL_MESSAGES):
                q = args[0] if args else kwargs["query"]
                raise KernelUnavailable(
                    f"SDPA {self.backend} attention refused q{tuple(q.shape)} {q.dtype} on "
                    f"{q.device}: {str(err).strip().splitlines()[0]}"
                ) from err
            raise
