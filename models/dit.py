"""Tiny DiT (images) and Latte-style video DiT, following facebookresearch/DiT models.py.

Both predict noise only (no learned sigma) and are unconditional: the adaLN conditioning
is the timestep embedding alone. Every block takes its attention kernel and modulate
implementation from the constructor.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch import Tensor

from models.attention import ATTENTION_KERNELS
from models.blocks import DiTBlock, FinalLayer, check_kernel_names
from models.embeddings import PatchEmbed, TimestepEmbedder, sincos_1d, sincos_2d
from models.modulate import MODULATE_KERNELS
from models.mup import attention_scale, check_param


class _DiTBackbone(nn.Module):
    """Shared body of DiT and VideoDiT: patch/time embedders, a block stack, the final layer."""

    def __init__(
        self,
        *,
        input_size: int,
        in_channels: int,
        patch_size: int,
        hidden_size: int,
        num_heads: int,
        mlp_ratio: float,
        qk_norm: bool,
        attention: str,
        modulate: str,
        block_kinds: list[str],
        param: str = "sp",
        base_width: int | None = None,
        base_head_dim: int | None = None,
    ):
        super().__init__()
        check_kernel_names(attention, modulate)
        # µP (models/mup.py): m = hidden_size / base_width; base_head_dim defaults to the head dim at the base
        # width with this head count (a fixed head count: the head dim grows with the width).
        self.param = param
        self.width_mult = check_param(param, hidden_size, base_width)
        self.base_width = base_width if param == "mup" else hidden_size
        if param == "mup" and base_head_dim is None:
            if base_width % num_heads:
                raise ValueError(f"base_width {base_width} is not divisible by num_heads {num_heads}")
            base_head_dim = base_width // num_heads
        head_dim = hidden_size // num_heads
        attn_scale = attention_scale(head_dim, base_head_dim) if param == "mup" else None
        self.in_channels = in_channels
        self.out_channels = in_channels  # noise prediction only, no learned sigma
        self.patch_size = patch_size
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.attention_backend = attention
        self.modulate_impl = modulate

        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        # Fixed, not learned, and a non-persistent buffer: rebuilt identically on every
        # construction, and cast along with the model by .to(dtype).
        pos_embed = sincos_2d(hidden_size, self.x_embedder.grid_size).float()[None]  # (1, S, D)
        self.register_buffer("pos_embed", pos_embed, persistent=False)
        self.blocks = nn.ModuleList(
            DiTBlock(hidden_size, num_heads, mlp_ratio, qk_norm, attention, modulate, kind=kind, attn_scale=attn_scale)
            for kind in block_kinds
        )
        self.final_layer = FinalLayer(
            hidden_size, patch_size, self.out_channels, modulate, readout_mult=1.0 / self.width_mult
        )

    def kernels(self) -> dict[str, str]:
        """The kernels every block runs, as result.json names them (the backend is forced: no fallback)."""
        return {
            "attention": ATTENTION_KERNELS[self.attention_backend],
            "modulate": MODULATE_KERNELS[self.modulate_impl],
        }

    def initialize_weights(self) -> None:
        """DiT init: xavier linears, zeroed adaLN and output layer, so the model outputs 0 at init."""

        def _basic_init(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.constant_(module.bias, 0)

        self.apply(_basic_init)

        # Initialise the patch embedding like a linear layer over the flattened patch.
        w = self.x_embedder.proj.weight.data
        if self.param == "sp":
            nn.init.xavier_uniform_(w.view([w.shape[0], -1]))
        else:  # µP input weight: the base width's xavier bound (torch's formula, with fan_out = base_width)
            fan_in = w[0].numel()
            bound = math.sqrt(3.0) * (1.0 * math.sqrt(2.0 / float(fan_in + self.base_width)))
            with torch.no_grad():
                w.uniform_(-bound, bound)
        nn.init.constant_(self.x_embedder.proj.bias, 0)

        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)  # an input weight: the same under µP
        # A hidden weight (width -> width): µP divides its std by sqrt(m); xavier's hidden ones already are.
        std = 0.02 if self.param == "sp" else 0.02 / math.sqrt(self.width_mult)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=std)

        # adaLN-Zero: every block starts as the identity (gates are 0) ...
        for block in self.blocks:
            nn.init.constant_(block.adaLN_modulation[-1].weight, 0)
            nn.init.constant_(block.adaLN_modulation[-1].bias, 0)
        # ... and the output projection is zero, so the initial prediction is exactly 0.
        nn.init.constant_(self.final_layer.adaLN_modulation[-1].weight, 0)
        nn.init.constant_(self.final_layer.adaLN_modulation[-1].bias, 0)
        nn.init.constant_(self.final_layer.linear.weight, 0)
        nn.init.constant_(self.final_layer.linear.bias, 0)

    def mup_roles(self) -> dict[str, str] | None:
        """Each parameter's µP role (models/mup.py: input, hidden, readout, vector) by name; None under SP."""
        if self.param != "mup":
            return None
        inputs = {"x_embedder.proj.weight", "t_embedder.mlp.0.weight"}
        roles = {}
        for name, p in self.named_parameters():
            if name in inputs:
                roles[name] = "input"
            elif name == "final_layer.linear.weight":
                roles[name] = "readout"
            elif p.dim() >= 2:  # every other matrix maps the width to a multiple of the width
                roles[name] = "hidden"
            else:
                roles[name] = "vector"
        return roles

    def unpatchify(self, x: Tensor) -> Tensor:
        """Patch tokens (N, S, p*p*C) back to images (N, C, H, W)."""
        c = self.out_channels
        p = self.patch_size
        h = w = self.x_embedder.grid_size
        x = x.reshape(x.shape[0], h, w, p, p, c)  # (N, h, w, p, p, C)
        x = torch.einsum("nhwpqc->nchpwq", x)  # (N, C, h, p, w, p)
        return x.reshape(x.shape[0], c, h * p, w * p)  # (N, C, H, W)


class DiT(_DiTBackbone):
    """Unconditional image DiT predicting noise: (B, C, H, W), t (B,) -> (B, C, H, W)."""

    def __init__(
        self,
        input_size: int = 16,
        in_channels: int = 3,
        patch_size: int = 2,
        hidden_size: int = 384,
        depth: int = 12,
        num_heads: int = 6,
        mlp_ratio: float = 4.0,
        qk_norm: bool = False,
        attention: str = "math",
        modulate: str = "eager",
        param: str = "sp",
        base_width: int | None = None,
        base_head_dim: int | None = None,
    ):
        super().__init__(
            input_size=input_size,
            in_channels=in_channels,
            patch_size=patch_size,
            hidden_size=hidden_size,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            qk_norm=qk_norm,
            attention=attention,
            modulate=modulate,
            block_kinds=["spatial"] * depth,
            param=param,
            base_width=base_width,
            base_head_dim=base_head_dim,
        )
        self.depth = depth
        self.initialize_weights()

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        x = self.x_embedder(x) + self.pos_embed  # (B, S, D), S = H * W / p ** 2
        c = self.t_embedder(t)  # (B, D)
        for block in self.blocks:
            x = block(x, c)  # (B, S, D)
        x = self.final_layer(x, c)  # (B, S, p*p*C)
        return self.unpatchify(x)  # (B, C, H, W)


class VideoDiT(_DiTBackbone):
    """Latte-style video DiT: alternating spatial/temporal blocks, (B, C, F, H, W) -> same shape."""

    def __init__(
        self,
        input_size: int = 16,
        num_frames: int = 8,
        in_channels: int = 3,
        patch_size: int = 2,
        hidden_size: int = 384,
        depth: int = 6,
        num_heads: int = 6,
        mlp_ratio: float = 4.0,
        qk_norm: bool = False,
        attention: str = "math",
        modulate: str = "eager",
        param: str = "sp",
        base_width: int | None = None,
        base_head_dim: int | None = None,
    ):
        # depth counts (spatial, temporal) pairs: blocks[2i] mixes the S tokens of one
        # frame, blocks[2i + 1] mixes the F frames at one spatial location.
        super().__init__(
            input_size=input_size,
            in_channels=in_channels,
            patch_size=patch_size,
            hidden_size=hidden_size,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            qk_norm=qk_norm,
            attention=attention,
            modulate=modulate,
            block_kinds=["spatial", "temporal"] * depth,
            param=param,
            base_width=base_width,
            base_head_dim=base_head_dim,
        )
        self.depth = depth
        self.num_frames = num_frames
        temp_embed = sincos_1d(hidden_size, torch.arange(num_frames)).float()[None]  # (1, F, D)
        self.register_buffer("temp_embed", temp_embed, persistent=False)
        self.initialize_weights()

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        B, C, F, H, W = x.shape
        if F > self.num_frames:
            raise ValueError(f"got {F} frames, the temporal embedding covers {self.num_frames}")
        x = x.permute(0, 2, 1, 3, 4).reshape(B * F, C, H, W)  # (B*F, C, H, W)
        x = self.x_embedder(x) + self.pos_embed  # (B*F, S, D)
        S, D = x.shape[1], x.shape[2]
        x = x.reshape(B, F, S, D) + self.temp_embed[:, :F, None]  # (B, F, S, D)
        c = self.t_embedder(t)  # (B, D)
        # One conditioning row per flattened sequence, matching each block's batch layout.
        c_spatial = c.repeat_interleave(F, dim=0)  # (B*F, D)
        c_temporal = c.repeat_interleave(S, dim=0)  # (B*S, D)
        for block in self.blocks:
            if block.kind == "spatial":
                x = block(x.reshape(B * F, S, D), c_spatial)  # (B*F, S, D)
                x = x.reshape(B, F, S, D)  # (B, F, S, D)
            else:
                x = x.transpose(1, 2).reshape(B * S, F, D)  # (B*S, F, D)
                x = block(x, c_temporal)  # (B*S, F, D)
                x = x.reshape(B, S, F, D).transpose(1, 2)  # (B, F, S, D)
        x = self.final_layer(x.reshape(B * F, S, D), c_spatial)  # (B*F, S, p*p*C)
        x = self.unpatchify(x)  # (B*F, C, H, W)
        return x.reshape(B, F, C, H, W).permute(0, 2, 1, 3, 4)  # (B, C, F, H, W)
