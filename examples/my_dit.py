"""A user's own video DiT, swept with `model=custom` (docs/models.md, "Your own model"):

    python -m sweep model=custom model.target=examples.my_dit:build
    python -m sweep -m +experiment=demo model=custom model.target=examples.my_dit:build

Written the way a research codebase would write it, independently of models/ (only the modulate seam
comes from there): a per-frame patch embedding, sin-cos space and time positions, blocks alternating
spatial and temporal self-attention through `F.scaled_dot_product_attention`, adaLN-Zero conditioning
on the timestep whose modulation calls `models.modulate.modulate` with the impl the sweep asks for, and
a zero-initialised adaLN output layer. `build` names the config inputs it wants in its signature
(channels, frames, height, width, patch_size, modulate); everything else is a `model.kwargs` key.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from models.modulate import modulate as modulate_op


def sincos(n: int, dim: int) -> Tensor:
    """(n, dim) sin-cos table of positions 0..n-1."""
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=1)


class TimestepEmbed(nn.Module):
    def __init__(self, dim: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        args = t.float()[:, None] * freqs[None]  # (B, half)
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (B, freq_dim)
        # The pure-precision contract (docs/models.md): the features are float32 whatever the weights are; under
        # bf16_pure/fp16_pure the weights are low precision, so cast to them before the Linear.
        return self.mlp(emb.to(self.mlp[0].weight.dtype))  # (B, dim)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)  # (b, heads, n, d/heads): the sweep forces the kernel
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    """adaLN-Zero transformer block over tokens (b, n, d); the caller arranges space or time as n."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, modulate: str):
        super().__init__()
        self.modulate = modulate
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = SelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(c).chunk(6, dim=1)  # 6 x (b, d)
        x = x + gate1[:, None] * self.attn(modulate_op(self.norm1(x), shift1, scale1, self.modulate))
        return x + gate2[:, None] * self.mlp(modulate_op(self.norm2(x), shift2, scale2, self.modulate))


class MyVideoDiT(nn.Module):
    def __init__(self, channels, frames, height, width, patch, dim, depth, heads, mlp_ratio, modulate):
        super().__init__()
        self.c, self.f, self.p = channels, frames, patch
        self.gh, self.gw = height // patch, width // patch
        self.embed = nn.Conv2d(channels, dim, patch, stride=patch)
        self.register_buffer("pos_space", sincos(self.gh * self.gw, dim)[None], persistent=False)  # (1, S, d)
        self.register_buffer("pos_time", sincos(frames, dim)[None], persistent=False)  # (1, F, d)
        self.t_embed = TimestepEmbed(dim)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio, modulate) for _ in range(depth))
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ada_out = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.out = nn.Linear(dim, patch * patch * channels)
        self.modulate = modulate
        self._init()

    def _init(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.t_embed.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embed.mlp[2].weight, std=0.02)
        for block in self.blocks:  # adaLN-Zero: every block starts as the identity
            nn.init.zeros_(block.ada[1].weight)
            nn.init.zeros_(block.ada[1].bias)
        for layer in (self.ada_out[1], self.out):  # and the model predicts 0
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        b, c, f, h, w = x.shape
        s = self.gh * self.gw
        tokens = self.embed(x.transpose(1, 2).reshape(b * f, c, h, w))  # (b*f, d, gh, gw)
        d = tokens.shape[1]
        tokens = tokens.flatten(2).transpose(1, 2) + self.pos_space  # (b*f, s, d)
        tokens = tokens.view(b, f, s, d).transpose(1, 2).reshape(b * s, f, d) + self.pos_time  # (b*s, f, d)
        tokens = tokens.view(b, s, f, d).transpose(1, 2).reshape(b * f, s, d)  # back to (b*f, s, d)
        cond = self.t_embed(t)  # (b, d)
        cond_frames, cond_pixels = cond.repeat_interleave(f, 0), cond.repeat_interleave(s, 0)
        for i, block in enumerate(self.blocks):
            if i % 2 == 0:  # spatial: tokens of one frame attend to each other
                tokens = block(tokens, cond_frames)
            else:  # temporal: one position across frames
                tokens = tokens.view(b, f, s, d).transpose(1, 2).reshape(b * s, f, d)
                tokens = block(tokens, cond_pixels)
                tokens = tokens.view(b, s, f, d).transpose(1, 2).reshape(b * f, s, d)
        shift, scale = self.ada_out(cond_frames).chunk(2, dim=1)
        y = self.out(modulate_op(self.norm_out(tokens), shift, scale, self.modulate))  # (b*f, s, p*p*c)
        p, gh, gw = self.p, self.gh, self.gw
        y = y.view(b, f, gh, gw, p, p, c).permute(0, 6, 1, 2, 4, 3, 5)  # (b, c, f, gh, p, gw, p)
        return y.reshape(b, c, f, h, w)


def build(
    channels: int,
    frames: int,
    height: int,
    width: int,
    patch_size: int = 2,
    modulate: str = "eager",
    dim: int = 128,
    depth: int = 4,
    heads: int = 4,
    mlp_ratio: float = 4.0,
) -> MyVideoDiT:
    """The factory: channels, frames, height, width, patch_size and modulate come from the sweep's config,
    dim/depth/heads/mlp_ratio from model.kwargs (e.g. 'model.kwargs={depth:2,dim:64}')."""
    if depth % 2:
        raise ValueError(f"depth must be even (spatial, temporal pairs), got {depth}")
    return MyVideoDiT(channels, frames, height, width, patch_size, dim, depth, heads, mlp_ratio, modulate)
