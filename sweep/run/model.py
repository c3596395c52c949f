"""One run's model from its config: the native DiT / video DiT, a diffusers zoo model, a released config or a
user's factory (the weights' dtype, device, init_from and LoRA are sweep.run.build's business)."""

from __future__ import annotations

from typing import Any

import torch

from models import build_model
from models.custom import build_custom_model
from models.diffusers_config import build_from_config
from models.diffusers_zoo import build_diffusers_model


def build_run_model(run: Any) -> torch.nn.Module:
    """The RunConfig `run`'s model as its builder makes it: fp32, on the current default device (sweep.config builds
    it on `meta` to read its module names, so this module must not import sweep.config: `run` is typed Any)."""
    d, m = run.data, run.model
    if m.arch.value == "diffusers":
        return build_diffusers_model(m.name, **run.model_inputs)
    if m.arch.value == "diffusers_config":  # the file, its class and shrink checked before the sweep (sweep.config)
        return build_from_config(m.config, m.shrink, **run.model_inputs)
    if m.arch.value == "custom":  # the user's factory, checked before the sweep (sweep.config.check_inputs)
        return build_custom_model(m.target, m.kwargs, **run.model_inputs)
    return build_model(
        m.arch.value,
        m.size,
        input_size=d.height,
        in_channels=d.channels,
        num_frames=None if m.is_image else d.frames,
        patch_size=m.patch_size,
        qk_norm=m.qk_norm,
        attention=run.attention.backend.value,
        modulate=run.modulate.impl.value,
        width=m.width,
        depth=m.depth,
        param=m.param.value,
        base_width=m.base_width,
    )
