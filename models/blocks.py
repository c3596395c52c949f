"""Transformer pieces of the DiT family: attention, MLP, adaLN-Zero block, adaLN final layer."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
from torch import Tensor

from models.attention import ATTENTION_BACKENDS, attend
from models.modulate import MODULATE_IMPLS, modulate

BLOCK_KINDS = ("spatial", "temporal")


def check_kernel_names(attention: str | None = None, modulate_impl: str | None = None) -> None:
    """Raise ValueError for an attention backend or modulate impl name that does not exist."""
    if attention is not None and attention not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {attention!r}; choose one of {ATTENTION_BACKENDS}")
    if modulate_impl is not None and modulate_impl not in MODULATE_IMPLS:
        raise ValueError(f"unknown modulate impl {modulate_impl!r}; choose one of {MODULATE_IMPLS}")


class LogitStats:
    """Max attention logit and lowest mean attention entropy over the attention layers it watches.

    Logit growth (and the entropy collapse that follows it) is the classic instability of small
    transformers at high lr (Wortsman et al. 2023). Flash kernels never materialise the logits, so
    this recomputes QK^T in fp32 from the detached q/k: one extra matmul per layer, on the steps the
    caller switches it on for only.
    """

    def __init__(self) -> None:
        self.max_logit = -math.inf
        self.min_entropy = math.inf
        self._max: list[Tensor] = []
        self._entropy: list[Tensor] = []

    @torch.no_grad()
    def observe(self, q: Tensor, k: Tensor, scale: float | None = None) -> None:
        scale = q.shape[-1] ** -0.5 if scale is None else scale  # the softmax scale the layer runs with
        with torch.autocast(q.device.type, enabled=False):  # true fp32 logits, even inside an fp16 forward
            logits = (q.float() @ k.float().transpose(-2, -1)) * scale  # (B, heads, N, N)
            p = logits.softmax(-1)
        entropy = torch.nanmean(-(p * p.clamp_min(1e-30).log()).sum(-1))  # nats, mean over rows and heads
        # NaN-blind: once an earlier layer went non-finite, later layers' NaN must not hide this one's value.
        self._max.append(logits.nan_to_num(nan=-math.inf).amax())
        self._entropy.append(entropy)

    def take(self) -> tuple[list[Tensor], list[Tensor]]:
        """What observe recorded since the last collect, unread, and forget it (a CUDA graph's outputs, see
        sweep/run/train.py LogitStep)."""
        taken, (self._max, self._entropy) = (self._max, self._entropy), ([], [])
        return taken

    def put(self, taken: tuple[list[Tensor], list[Tensor]]) -> None:
        """Record `taken` (from take) as what observe saw since the last collect."""
        self._max, self._entropy = list(taken[0]), list(taken[1])

    def collect(self) -> tuple[float, float]:
        """(max logit, min entropy) since the last collect, fetched in one sync; NaN when nothing ran."""
        if not self._max:
            return math.nan, math.nan
        max_logit, min_entropy = torch.stack(
            [torch.stack(self._max).amax(), torch.stack(self._entropy).nan_to_num(nan=math.inf).amin()]
        ).tolist()
        max_logit = max_logit if max_logit > -math.inf else math.nan
        min_entropy = min_entropy if min_entropy < math.inf else math.nan
        self._max, self._entropy = [], []
        self.max_logit, self.min_entropy = max(self.max_logit, max_logit), min(self.min_entropy, min_entropy)
        return max_logit, min_entropy


def scale_query_key(model: nn.Module, gain: float) -> None:
    """Multiply every attention layer's query and key weights by gain (logits grow by gain**2)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Attention):
                d = m.qkv.out_features // 3
                m.qkv.weight[: 2 * d].mul_(gain)
                m.qkv.bias[: 2 * d].mul_(gain)


@contextlib.contextmanager
def watching_logits(model: nn.Module, stats: LogitStats, on: bool = True):
    """Every attention layer of model reports its logits to stats inside the block (when on)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)] if on else []
    for m in layers:
        m.logit_stats = stats
    try:
        yield stats
    finally:
        for m in layers:
            m.logit_stats = None


class Attention(nn.Module):
    """Multi-head self-attention with optional qk-LayerNorm, dispatched through `attend`."""

    def __init__(
        self, dim: int, num_heads: int, qk_norm: bool = False, backend: str = "math", scale: float | None = None
    ):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} is not divisible by num_heads {num_heads}")
        check_kernel_names(attention=backend)
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.backend = backend
        self.scale = scale
        """The logits' multiplier; None = 1/sqrt(head_dim) (SP). µP: sqrt(base_head_dim) / head_dim (models/mup.py)."""
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        # qk-LayerNorm bounds the attention logits: the standard fix for attention-logit
        # growth (ViT-22B, SD3), normalising each head's q and k over head_dim.
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=True)
        self.logit_stats: LogitStats | None = None  # set by watch_logits on the steps that record them

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim)  # (B, N, 3, heads, head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, heads, N, head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.logit_stats is not None:
            self.logit_stats.observe(q, k, self.scale)
        x = attend(q, k, v, self.backend, self.scale)  # (B, heads, N, head_dim)
        x = x.transpose(1, 2).reshape(B, N, C)  # (B, N, D)
        return self.proj(x)  # (B, N, D)


class Mlp(nn.Module):
    """Two-layer feed-forward with tanh-GELU, as timm's Mlp is used in DiT."""

    def __init__(self, in_features: int, hidden_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))  # (B, N, D)


class DiTBlock(nn.Module):
    """DiT block with adaLN-Zero conditioning; `kind` says which axis its attention mixes."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qk_norm: bool = False,
        attention: str = "math",
        modulate: str = "eager",
        kind: str = "spatial",
        attn_scale: float | None = None,
    ):
        super().__init__()
        check_kernel_names(attention, modulate)
        if kind not in BLOCK_KINDS:
            raise ValueError(f"unknown block kind {kind!r}; choose one of {BLOCK_KINDS}")
        self.kind = kind
        self.modulate_impl = modulate
        # No affine in the norms: adaLN supplies the per-sample shift and scale.
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads, qk_norm=qk_norm, backend=attention, scale=attn_scale)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size, bias=True))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(
            6, dim=1
        )  # 6 x (B, D)
        x = x + gate_msa[:, None] * self.attn(
            modulate(self.norm1(x), shift_msa, scale_msa, self.modulate_impl)
        )  # (B, N, D)
        x = x + gate_mlp[:, None] * self.mlp(
            modulate(self.norm2(x), shift_mlp, scale_mlp, self.modulate_impl)
        )  # (B, N, D)
        return x


class FinalLayer(nn.Module):
    """adaLN-modulated LayerNorm and linear projection from tokens to patch pixels."""

    def __init__(
        self, hidden_size: int, patch_size: int, out_channels: int, modulate: str = "eager", readout_mult: float = 1.0
    ):
        super().__init__()
        check_kernel_names(modulate_impl=modulate)
        self.modulate_impl = modulate
        self.readout_mult = readout_mult
        """Multiplies the projection's input: 1 (SP), 1/m under µP (mup's MuReadout, models/mup.py)."""
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)  # 2 x (B, D)
        x = modulate(self.norm_final(x), shift, scale, self.modulate_impl)  # (B, N, D)
        if self.readout_mult != 1.0:
            x = x * self.readout_mult  # (B, N, D)
        return self.linear(x)  # (B, N, p*p*C)
