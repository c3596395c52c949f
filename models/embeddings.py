"""Input embeddings of the DiT family: patch tokens, timestep vectors, fixed sin-cos positions."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch import Tensor


def sincos_1d(embed_dim: int, positions: Tensor) -> Tensor:
    """Fixed 1D sin-cos embedding (M, embed_dim) of M positions (MAE/DiT layout: sin half, then cos half)."""
    if embed_dim % 2:
        raise ValueError(f"sin-cos embedding needs an even dimension, got {embed_dim}")
    # float64 so the table is identical on every machine before the final cast.
    omega = torch.arange(embed_dim // 2, dtype=torch.float64) / (embed_dim / 2.0)
    omega = 1.0 / 10000**omega  # (D/2,)
    out = positions.reshape(-1).to(torch.float64)[:, None] * omega[None]  # (M, D/2)
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1)  # (M, D)


def sincos_2d(embed_dim: int, grid_size: int) -> Tensor:
    """Fixed 2D sin-cos embedding (grid_size**2, embed_dim), row-major over the patch grid, as in DiT."""
    if embed_dim % 4:
        raise ValueError(f"2D sin-cos embedding needs a dimension divisible by 4, got {embed_dim}")
    coords = torch.arange(grid_size, dtype=torch.float64)
    # "xy" indexing reproduces DiT's np.meshgrid(grid_w, grid_h): the first half of the
    # channels encodes the column, the second half the row.
    grid_x, grid_y = torch.meshgrid(coords, coords, indexing="xy")  # 2 x (G, G)
    emb_x = sincos_1d(embed_dim // 2, grid_x)  # (G*G, D/2)
    emb_y = sincos_1d(embed_dim // 2, grid_y)  # (G*G, D/2)
    return torch.cat([emb_x, emb_y], dim=1)  # (G*G, D)


class PatchEmbed(nn.Module):
    """Image to patch tokens with a strided Conv2d (timm PatchEmbed without the extras)."""

    def __init__(self, img_size: int, patch_size: int, in_channels: int, embed_dim: int):
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"input_size {img_size} is not divisible by patch_size {patch_size}")
        self.img_size = img_size
        self.patch_size = patch_size
        self.grid_size = img_size // patch_size
        self.num_patches = self.grid_size**2
        self.proj = nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-2:] != (self.img_size, self.img_size):
            raise ValueError(f"expected {self.img_size}x{self.img_size} inputs, got {tuple(x.shape[-2:])}")
        x = self.proj(x)  # (B, D, H/p, W/p)
        return x.flatten(2).transpose(1, 2)  # (B, S, D), S = (H/p) * (W/p)


class TimestepEmbedder(nn.Module):
    """Embeds scalar diffusion timesteps into vectors: sinusoidal frequencies, then an MLP."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.frequency_embedding_size = frequency_embedding_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size, bias=True),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size, bias=True),
        )

    @staticmethod
    def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
        """Sinusoidal embedding (B, dim) of timesteps t (B,), always in fp32."""
        # fp32 even inside autocast or a pure-fp16 model: an fp16 argument near t=1000 has a
        # spacing of 0.5 rad, so the fast channels' sin/cos would be mostly rounding noise.
        with torch.autocast(device_type=t.device.type, enabled=False):
            half = dim // 2
            freqs = torch.exp(
                -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half
            )  # (half,)
            args = t.float()[:, None] * freqs[None]  # (B, half)
            embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (B, 2*half)
            if dim % 2:
                embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)  # (B, dim)
        return embedding

    def forward(self, t: Tensor) -> Tensor:
        t_freq = self.timestep_embedding(t, self.frequency_embedding_size)  # (B, F) fp32
        # Cast to the parameter dtype so a model converted with .to(fp16/bf16) still runs.
        return self.mlp(t_freq.to(self.mlp[0].weight.dtype))  # (B, D)
