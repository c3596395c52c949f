"""Tiny DiT / video-DiT models with switchable attention kernels and adaLN modulate impls.

The names below load their module on first use (PEP 562), so importing a torch-free part of the package
(models.sizes, for config validation) does not import torch.
"""

import importlib

_HOMES = {
    "ATTENTION_BACKENDS": "models.attention",
    "KernelUnavailable": "models.attention",
    "attend": "models.attention",
    "backend_unavailable_reason": "models.attention",
    "LogitStats": "models.blocks",
    "scale_query_key": "models.blocks",
    "watching_logits": "models.blocks",
    "DiT": "models.dit",
    "VideoDiT": "models.dit",
    "MODULATE_IMPLS": "models.modulate",
    "modulate": "models.modulate",
    "MODEL_SIZES": "models.sizes",
    "build_model": "models.registry",
    "count_params": "models.registry",
}

__all__ = [
    "ATTENTION_BACKENDS",
    "DiT",
    "KernelUnavailable",
    "LogitStats",
    "MODEL_SIZES",
    "MODULATE_IMPLS",
    "VideoDiT",
    "attend",
    "backend_unavailable_reason",
    "build_model",
    "count_params",
    "modulate",
    "scale_query_key",
    "watching_logits",
]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
