"""Everything one run trains with, built from its RunConfig: device, model, optimizer, data, objective.

Multirun jobs share one Python process, so `reset_process_state` puts every piece of global state a
run depends on (seeds, deterministic mode, thread count, TF32 switches) back to what this run's
config says, before anything is built. That is what makes a run bit-reproducible however many jobs
ran before it in the same process.
"""
from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from models import backend_unavailable_reason, build_model

from .config import RunConfig, Schedule
from .data import BatchOrder, Fault, SyntheticClips
from .diffusion import DiffusionObjective
from .precision import LossScaler, PrecisionPolicy

# Seed streams: independent generators for weights, data order and diffusion noise, so changing
# one (e.g. the batch size) does not shift the others.
_INIT_STREAM, _ORDER_STREAM, _NOISE_STREAM = 0, 1, 2


def resolve_device(name: str) -> torch.device:
    """auto picks CUDA when there is one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={name} asked for, but torch sees no CUDA device")
    return device


def stream_seed(seed: int, stream: int) -> int:
    return (seed * 1_000_003 + stream * 7919) % (2**63)


def reset_process_state(run: RunConfig, policy: PrecisionPolicy) -> None:
    """Seeds, determinism, threads and TF32 flags for this run, whatever earlier jobs set."""
    if run.threads:
        torch.set_num_threads(run.threads)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS determinism
    torch.use_deterministic_algorithms(run.deterministic)
    torch.backends.cudnn.benchmark = False
    policy.apply_global_flags()
    random.seed(run.seed)
    np.random.seed(run.seed % 2**32)
    torch.manual_seed(stream_seed(run.seed, _INIT_STREAM))


def unsupported_reason(run: RunConfig, device: torch.device, policy: PrecisionPolicy) -> str | None:
    """Why this combination cannot run here as asked (a `skipped` run), or None."""
    return (policy.unsupported_reason(device)
            or backend_unavailable_reason(run.attention.backend.value, device, policy.compute_dtype))


def lr_schedule(run: RunConfig) -> Callable[[int], float]:
    """Linear warmup, then constant or cosine to zero at the last step."""
    o, steps = run.optim, run.steps

    def lr_at(step: int) -> float:
        if step < o.warmup_steps:
            return o.lr * (step + 1) / o.warmup_steps
        if o.schedule is Schedule.cosine:
            progress = (step - o.warmup_steps) / max(1, steps - o.warmup_steps)
            return o.lr * 0.5 * (1 + math.cos(math.pi * progress))
        return o.lr

    return lr_at


@dataclass
class RunParts:
    """The built pieces of one run."""

    device: torch.device
    policy: PrecisionPolicy
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    dataset: SyntheticClips
    order: BatchOrder
    objective: DiffusionObjective
    noise_gen: torch.Generator
    lr_at: Callable[[int], float]


def build_parts(run: RunConfig, device: torch.device, policy: PrecisionPolicy) -> RunParts:
    """Model (in the policy's param dtype), AdamW, data, objective and scaler for one run."""
    d, m = run.data, run.model
    model = build_model(
        m.arch.value, m.size, input_size=d.height, in_channels=d.channels,
        num_frames=d.frames if m.arch.value == "video_dit" else None, patch_size=m.patch_size,
        qk_norm=m.qk_norm, attention=run.attention.backend.value, modulate=run.modulate.impl.value,
    ).to(device=device, dtype=policy.param_dtype)
    o = run.optim
    # foreach=False: the single-tensor AdamW path is bit-stable across torch builds on CPU, and
    # keeps the optimizer state in the params' dtype (pure fp16/bf16 means exactly that).
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                  weight_decay=o.weight_decay, foreach=False)
    faults = [Fault(index=f.index, kind=f.kind) for f in d.faults]
    dataset = SyntheticClips(num_samples=d.num_samples, frames=d.frames, channels=d.channels,
                             height=d.height, width=d.width, seed=d.seed, faults=faults,
                             as_images=m.arch.value == "dit")
    j = run.objective
    objective = DiffusionObjective(kind=j.kind.value, num_train_timesteps=j.num_train_timesteps,
                                   beta_schedule=j.beta_schedule, prediction=j.prediction, flow_shift=j.flow_shift)
    noise_gen = torch.Generator(device=device).manual_seed(stream_seed(run.seed, _NOISE_STREAM))
    return RunParts(device=device, policy=policy, model=model, optimizer=optimizer,
                    scaler=LossScaler(run.precision.scaler), dataset=dataset,
                    order=BatchOrder(d.num_samples, d.batch_size, stream_seed(run.seed, _ORDER_STREAM)),
                    objective=objective, noise_gen=noise_gen, lr_at=lr_schedule(run))
