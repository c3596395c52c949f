"""Named model sizes and the one constructor the sweep calls."""

from __future__ import annotations

import torch.nn as nn

from models.dit import DiT, VideoDiT

# depth = number of transformer blocks. The video DiT spends them as depth // 2
# (spatial, temporal) pairs, so both archs of one size have the same block count and
# nearly the same parameter count.
MODEL_SIZES: dict[str, dict[str, int]] = {
    # ~1.3M parameters; a fwd+bwd step of the video DiT at batch 4, 8x16x16x3 runs in
    # well under 150 ms on 2 CPU cores.
    "tiny": dict(hidden_size=128, depth=4, num_heads=4),
    "S": dict(hidden_size=384, depth=12, num_heads=6),  # DiT-S
    "B": dict(hidden_size=768, depth=12, num_heads=12),  # DiT-B
}

ARCHS = ("dit", "video_dit")


def build_model(
    arch: str,
    size: str,
    *,
    input_size: int,
    in_channels: int,
    num_frames: int | None = None,
    patch_size: int = 2,
    qk_norm: bool = False,
    attention: str = "math",
    modulate: str = "eager",
    mlp_ratio: float = 4.0,
    width: int | None = None,
    depth: int | None = None,
    param: str = "sp",
    base_width: int | None = None,
) -> nn.Module:
    """Build a DiT ("dit") or VideoDiT ("video_dit") of a named size from MODEL_SIZES, or of that size
    with another `width` (hidden size; the head dim is kept, so heads = width / head dim) or `depth`
    (blocks): the steps of a size ladder (docs/ladder.md). `param="mup"` parametrizes it by µP relative to
    `base_width` (models/mup.py); the base model has the same head dim, so the attention scale stays SP's."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")
    dims = sized(size, width, depth)
    common = dict(
        input_size=input_size,
        in_channels=in_channels,
        patch_size=patch_size,
        hidden_size=dims["hidden_size"],
        num_heads=dims["num_heads"],
        mlp_ratio=mlp_ratio,
        qk_norm=qk_norm,
        attention=attention,
        modulate=modulate,
        param=param,
        base_width=base_width,
        base_head_dim=dims["hidden_size"] // dims["num_heads"] if param == "mup" else None,
    )
    if arch == "dit":
        if num_frames is not None:
            raise ValueError(f"arch 'dit' is an image model; num_frames must be None, got {num_frames}")
        return DiT(depth=dims["depth"], **common)
    if num_frames is None:
        raise ValueError("arch 'video_dit' needs num_frames")
    if dims["depth"] % 2:
        raise ValueError(f"size {size!r} has odd depth {dims['depth']}; video_dit needs (spatial, temporal) pairs")
    return VideoDiT(num_frames=num_frames, depth=dims["depth"] // 2, **common)


def head_dim(size: str) -> int:
    dims = MODEL_SIZES[size]
    return dims["hidden_size"] // dims["num_heads"]


def sized(size: str, width: int | None = None, depth: int | None = None) -> dict[str, int]:
    """The dims of a named size, with its hidden size and/or depth replaced; ValueError when they do not fit."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {tuple(MODEL_SIZES)}")
    dims = dict(MODEL_SIZES[size])
    if width is not None:
        hd = head_dim(size)
        if width <= 0 or width % hd:
            raise ValueError(f"must be a positive multiple of {hd} (the head dim of size {size}), got {width}")
        dims.update(hidden_size=width, num_heads=width // hd)
    if depth is not None:
        if depth <= 0:
            raise ValueError(f"must be > 0, got {depth}")
        dims["depth"] = depth
    return dims


def count_params(model: nn.Module) -> int:
    """Number of parameters (trainable or not; fixed sin-cos tables are buffers and not counted)."""
    return sum(p.numel() for p in model.parameters())
