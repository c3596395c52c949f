"""Which runs can share a pack, and one pack from configs to files (the training itself: sweep/run/packed.py).

Runs share a pack when they build the same computation: same model, precision policy, kernels, data
shapes, device and process settings. What may differ is everything that is per run anyway: seed,
steps, the whole `optim` node (lr, schedule, warmup, clipping, betas, eps, weight decay), the
`monitor`, the loss scaler's knobs, the objective, the data's content (seed, faults, size, checks)
and init weights. Runs that need a per-step hook (checkpointing, pruning), a resume, LoRA (and so an fp8
base), fp8 matmuls, an optimizer other than our AdamW, or torch.compile are never packed: they run alone, as they
would without packing. So are, on CUDA, the two SDPA kernels whose vmap fails there (cuda_vmap_failure).

Each packed run ends exactly like a lone run: its own result.json and metrics.csv in its own job
directory, and its own trial (sweep.job.finish_job).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Sequence

import torch

from sweep.config import Arch, FinetuneMethod, OptimName, PrunerName, RunConfig
from sweep.run.build import resolve_device
from sweep.run.execute import execute_runs
from sweep.run.precision import PrecisionPolicy
from sweep.run.results import RESULT_FILE, MetricSink, RunResult

log = logging.getLogger("sweep")

# Top-level RunConfig keys that may differ inside a pack (each run has its own copy of these anyway).
PER_RUN_KEYS = (
    "seed",
    "steps",
    "optim",
    "monitor",
    "objective",
    "ledger",
    "logger",
    "scenario",
    "progress",
    "log_every",
)
PER_RUN_SUBKEYS = {
    "precision": ("scaler",),
    "data": ("seed", "faults", "num_samples", "drop_bad", "check", "range_limit"),
    "model": ("init_from", "qk_gain"),
}


def refusal(run: RunConfig, device: torch.device | None = None) -> str | None:
    """Why this run must train alone (None when it can be packed); `device` defaults to the run's own."""
    if run.model.arch in (Arch.diffusers, Arch.diffusers_config):
        which = run.model.name or run.model.config
        return f"model {which} is a diffusers model: packing supports the native dit/video_dit models"
    if run.model.arch is Arch.custom:
        return (
            f"model {run.model.target} is a custom model: packing (vmap over K runs) supports the native "
            "dit/video_dit models"
        )
    if run.finetune.method is not FinetuneMethod.none:
        return "finetune=lora freezes part of the weights: not packed"
    if run.optim.name is not OptimName.adamw:  # StackedAdamW is the pack's only optimizer
        return f"optim={run.optim.name.value} runs eagerly with its library's optimizer: not packed"
    if run.precision.fp8 is not None:  # vmap cannot take torchao's float8 matmul (no setup_context)
        return f"precision={run.precision.name}: torchao's fp8 linears do not run under vmap: not packed"
    if run.compile:
        return "compile=true: a compiled run trains alone"
    if run.data.skip_samples:
        return "data.skip_samples makes some batches smaller: not packed"
    c = run.checkpoint
    if c.every or c.resume_from or c.inject:
        return "checkpointing or resuming: not packed"
    if run.ledger.enabled and run.ledger.pruner.name is not PrunerName.none:
        return "a pruned run reports every few steps to its own trial: not packed"
    return cuda_vmap_failure(run, device or resolve_device(run.device))


def alone_lines(runs: Sequence[RunConfig]) -> list[str]:
    """What a packed sweep says of its runs that must train alone: a line per reason (`refusal`), with how many."""
    reasons: dict[str, int] = {}
    for run in runs:
        if (why := refusal(run)) is not None:
            reasons[why] = reasons.get(why, 0) + 1
    return [f"{n} of {len(runs)} runs train alone: {why}" for why, n in reasons.items()]


def cuda_vmap_failure(run: RunConfig, device: torch.device) -> str | None:
    """SDPA kernels that train alone on CUDA but fail under vmap (seen on an H100 with torch 2.11)."""
    if device.type != "cuda":
        return None
    backend = run.attention.backend.value
    if backend == "efficient":
        return (
            "attention=efficient: torch's vmap of SDPA's memory-efficient kernel fails on CUDA "
            "(LSE is not correctly aligned)"
        )
    if backend == "math" and PrecisionPolicy.from_config(run.precision).compute_dtype == torch.bfloat16:
        return (
            "attention=math in bf16 on CUDA: torch's vmap of SDPA's math kernel fails in the softmax backward "
            "(bf16 input with an fp32 gradient)"
        )
    return None


def pack_key(run: RunConfig) -> str:
    """Equal for runs that build the same computation (and so may share a pack)."""
    d = dataclasses.asdict(run)
    for key in PER_RUN_KEYS:
        d.pop(key, None)
    for node, keys in PER_RUN_SUBKEYS.items():
        for key in keys:
            d[node].pop(key, None)
    return json.dumps(d, sort_keys=True, default=str)


def plan(runs: Sequence[RunConfig], pack: int) -> list[list[int]]:
    """Indices of `runs` grouped into packs of at most `pack` (in sweep order); a run that cannot be packed is alone."""
    groups: dict[str, list[int]] = {}
    alone: list[list[int]] = []
    for i, run in enumerate(runs):
        if pack <= 1 or refusal(run) is not None:
            alone.append([i])
        else:
            groups.setdefault(pack_key(run), []).append(i)
    packs = [members[j : j + pack] for members in groups.values() for j in range(0, len(members), pack)]
    return sorted(packs + alone, key=lambda p: p[0])


def execute_pack(
    runs: Sequence[RunConfig],
    out_dirs: Sequence[Path],
    params: Sequence[dict],
    labels: Sequence[str],
    sinks: Sequence[Sequence[MetricSink]] | None = None,
    record: str = RESULT_FILE,
) -> list[RunResult]:
    """Train the runs as one pack and write each run's files (sweep.run.execute.execute_runs, stacked); a pack of
    one is a lone run. `sinks[i]` are run i's trackers: each packed run logs as a run of its own, with its own
    curves. `record` names each run's result file (execute's: TRIAL_FILE for a confirmation's runs)."""
    return execute_runs(runs, out_dirs, params, labels, sinks=sinks, record=record, stacked=len(runs) > 1)
