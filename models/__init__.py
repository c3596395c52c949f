"""Tiny DiT / video-DiT models with switchable attention kernels and adaLN modulate impls."""

from models.attention import ATTENTION_BACKENDS, KernelUnavailable, attend, backend_unavailable_reason
from models.blocks import LogitStats, scale_query_key, watching_logits
from models.dit import DiT, VideoDiT
from models.modulate import MODULATE_IMPLS, modulate
from models.registry import MODEL_SIZES, build_model, count_params

__all__ = [
    "ATTENTION_BACKENDS",
    "MODEL_SIZES",
    "MODULATE_IMPLS",
    "DiT",
    "KernelUnavailable",
    "LogitStats",
    "VideoDiT",
    "attend",
    "backend_unavailable_reason",
    "build_model",
    "count_params",
    "modulate",
    "scale_query_key",
    "watching_logits",
]
