"""Named model sizes of the native DiT / video DiT: a plain dict (no torch), so a config can be validated cheaply."""

from __future__ import annotations

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
