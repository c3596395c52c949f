"""Everything one run trains with, built from its RunConfig: device, model, optimizer, data, objective.

Multirun jobs share one Python process, so `reset_process_state` puts every piece of global state a
run depends on (seeds, deterministic mode, thread count, TF32 switches) back to what this run's
config says, before anything is built. That is what makes a run bit-reproducible however many jobs
ran before it in the same process.
"""

from __future__ import annotations

import logging
import math
import os
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from models import scale_query_key
from models.custom import CustomModelError
from sweep.config import DataSource, FinetuneMethod, OptimName, RunConfig, Schedule
from sweep.data.batches import BatchOrder, sample_labels
from sweep.data.checks import DataError, check_sample
from sweep.data.folder import FolderClips, FolderSplit, HeldOutFiles, read_held_out
from sweep.data.split import describe, how_many
from sweep.data.synthetic import Fault, SyntheticClips
from sweep.run import checkpoint, fp8, fp8_storage, fp32_modules
from sweep.run.adamw import DeviceAdamW
from sweep.run.diffusion import DiffusionObjective
from sweep.run.finetune import apply_finetune, param_groups
from sweep.run.graph import table_span
from sweep.run.model import build_run_model
from sweep.run.monitor import DivergenceMonitor
from sweep.run.once import say_once
from sweep.run.optimizers import LibraryOptimizer, build_optimizer
from sweep.run.precision import PrecisionPolicy
from sweep.run.scaler import DeviceLossScaler

log = logging.getLogger("sweep")

# Seed streams: independent generators for weights, data order and diffusion noise, so changing
# one (e.g. the batch size) does not shift the others.
_INIT_STREAM, _ORDER_STREAM, _NOISE_STREAM = 0, 1, 2
_DEFAULT_THREADS = torch.get_num_threads()


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


def set_deterministic(mode: bool, compiles: bool) -> None:
    """torch.use_deterministic_algorithms(mode). That function also sets inductor's `deterministic` config,
    and importing inductor's config imports torch._dynamo: ~2 s of CPU in every run process, where only a
    compiled run (or a process that has imported inductor already) reads it. The others set torch's flag
    alone, which is all the rest of torch.use_deterministic_algorithms does."""
    if compiles or "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(mode)
    else:
        torch._C._set_deterministic_algorithms(mode, warn_only=False)


def reset_process_state(run: RunConfig, policy: PrecisionPolicy) -> None:
    """Seeds, determinism, threads and TF32 flags for this run, whatever earlier jobs set."""
    torch.set_num_threads(run.threads or _DEFAULT_THREADS)  # 0: torch's default, not an earlier job's count
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS determinism
    set_deterministic(run.deterministic, compiles=run.compile)
    # Deterministic mode also NaN-fills every new allocation, a debugging aid for kernels that read memory
    # they never wrote. Ours do not (the reproducibility tests compare whole loss curves bit for bit), and
    # the fills were ~9% of an emulated bf16 CPU step (one `fill_` per widened GEMM input) and ~1,000
    # kernels per GPU step.
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.benchmark = False
    policy.apply_global_flags()
    random.seed(run.seed)
    np.random.seed(run.seed % 2**32)
    torch.manual_seed(stream_seed(run.seed, _INIT_STREAM))


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
    optimizer: DeviceAdamW | LibraryOptimizer
    scaler: DeviceLossScaler
    """This run's loss scaler (K=1), on its device."""
    dataset: torch.utils.data.Dataset  # SyntheticClips or FolderClips (training files), or a Subset without bad samples
    order: BatchOrder
    objective: DiffusionObjective
    noise_gen: torch.Generator
    lr_at: Callable[[int], float]
    monitor: DivergenceMonitor
    start_step: int = 0
    """The first step to run: 0, or a resumed checkpoint's step."""
    loaded: str | None = None
    """What weights were loaded (init_from or resume_from), for the result."""
    kernels: dict | None = None
    """compile=true: the kernels the profiled compiled graph ran (sweep/run/compiled.py); None = the forced ones."""
    fp8: dict | None = None
    """precision.fp8: what the conversion did (result.json's fp8, sweep/run/fp8.py); None without fp8."""
    base_storage: dict | None = None
    """finetune.base_dtype: how the frozen base was stored (result.json's base_storage); None without it."""
    held_out: HeldOutFiles | None = None
    """Folder data: the files held out of training (data.eval_files) and, with eval on, their samples; None for
    synthetic data, whose held-out clips the evaluator renders (sweep/run/evaluate.py)."""


def build_weights(
    run: RunConfig, device: torch.device, policy: PrecisionPolicy, init_from: str | None, warn: bool = True
) -> tuple[torch.nn.Module, dict | None, dict | None]:
    """The run's model as its first step sees it: built from its seed, `init_from`'s weights loaded (verified),
    LoRA's adapters, the frozen base's storage and fp8's matmuls applied. With it, what the last two did
    (result.json's base_storage and fp8). `warn=False` for a second build of the same run (its untrained eval
    loss): what the first said is not said again."""
    model = build_run_model(run)
    if run.model.qk_gain != 1.0:
        scale_query_key(model, run.model.qk_gain)
    model = model.to(device=device, dtype=policy.param_dtype)
    # before init_from: a pure run loads its fp32 modules' weights at full precision
    fp32_modules.apply(model, run.precision.fp32_modules, policy.param_dtype, policy.compute_dtype)
    if init_from:
        state = checkpoint.load_weights(Path(init_from), verify=run.checkpoint.verify)
        checkpoint.load_model_weights(model, state, init_from)
    model = apply_finetune(run, model, policy.param_dtype, warn)  # after init_from: adapters on the loaded base
    if run.finetune.method is not FinetuneMethod.none:  # LoRA cast the whole model and swapped modules in
        fp32_modules.apply(model, run.precision.fp32_modules, policy.param_dtype, policy.compute_dtype)
    base_storage = fp8_storage.apply(model, run.finetune.base_dtype, run.finetune.base_keep)  # the frozen base's bits
    # fp8 matmuls (precision.fp8): torchao's Float8Linear swapped in on the final model, before the optimizer
    fp8_record = fp8.convert(model, run.precision, device) if run.precision.fp8 is not None else None
    if not any(p.requires_grad for p in model.parameters()):  # AdamW's "empty parameter list", said plainly
        raise CustomModelError(
            f"model: no parameter to train ({sum(p.numel() for p in model.parameters())} parameters, none with "
            f"requires_grad=True after finetune={run.finetune.method.value}): AdamW would have nothing to update"
        )
    return model, base_storage, fp8_record


def build_parts(run: RunConfig, device: torch.device, policy: PrecisionPolicy, scratch: Path | None = None) -> RunParts:
    """Model (in the policy's param dtype), AdamW, data, objective, scaler and monitor for one run.

    Weights from `model.init_from` or a `checkpoint.resume_from` state are loaded (and verified) here,
    so a corrupt file raises checkpoint.CorruptCheckpoint before any step. `scratch` is where a
    fault-injected copy of that file goes (checkpoint.inject): the run's directory, where it stays beside the
    record. Without one (a replay, a diagnosis's look at the data), the copy is read here and removed after.
    """
    if scratch is None and run.checkpoint.inject is not None:
        with tempfile.TemporaryDirectory(prefix="dit-sweep-") as temporary:
            return build_parts(run, device, policy, Path(temporary))
    d, m = run.data, run.model
    init_from, resume_from = _maybe_corrupted(run, scratch)
    model, base_storage, fp8_record = build_weights(run, device, policy, init_from)
    o = run.optim
    # torch's single-tensor AdamW, bit for bit on the CPU, with its scalars on the device (sweep/run/adamw.py):
    # the state stays in the params' dtype (pure fp16/bf16 means exactly that) and nothing reads the host.
    # Another optim.name is its library's optimizer, run eagerly (sweep/run/optimizers.py).
    if o.name is not OptimName.adamw:
        optimizer = build_optimizer(o, param_groups(run, model), lr_schedule(run), device)
    else:
        optimizer = DeviceAdamW(
            param_groups(run, model),
            lr_schedule(run),
            run.steps,
            o.betas,
            o.eps,
            o.weight_decay,
            device,
            o.update_clip,
            table_span(run.monitor.sync_every),  # its lr table holds a window of steps at a time
        )
    if d.source is DataSource.synthetic:
        dataset = SyntheticClips(
            num_samples=d.num_samples,
            frames=d.frames,
            channels=d.channels,
            height=d.height,
            width=d.width,
            seed=d.seed,
            faults=[Fault(index=f.index, kind=f.kind) for f in d.faults],
            as_images=m.is_image,
        )
        held_out = None
    else:
        dataset, held_out = folder_data(run)
    if d.drop_bad:
        dataset = drop_bad_samples(dataset, d.range_limit)
    j = run.objective
    objective = DiffusionObjective(
        kind=j.kind.value,
        num_train_timesteps=j.num_train_timesteps,
        beta_schedule=j.beta_schedule.value,
        prediction=j.prediction.value,
        flow_shift=j.flow_shift,
    )
    noise_gen = torch.Generator(device=device).manual_seed(stream_seed(run.seed, _NOISE_STREAM))
    monitor = DivergenceMonitor(run.monitor)
    monitor.start([p for p in model.parameters() if p.requires_grad])
    parts = RunParts(
        device=device,
        policy=policy,
        model=model,
        optimizer=optimizer,
        scaler=DeviceLossScaler([run.precision.scaler], device),
        dataset=dataset,
        order=BatchOrder(len(dataset), d.batch_size, stream_seed(run.seed, _ORDER_STREAM), d.skip_samples),
        objective=objective,
        noise_gen=noise_gen,
        lr_at=lr_schedule(run),
        monitor=monitor,
        loaded=resume_from or init_from,
        fp8=fp8_record,
        base_storage=base_storage,
        held_out=held_out,
    )
    if resume_from:
        parts.start_step = checkpoint.resume(
            parts, Path(resume_from), verify=run.checkpoint.verify, optimizer=run.checkpoint.resume_optimizer
        )
        if parts.start_step >= run.steps:
            raise ValueError(
                f"checkpoint.resume_from is at step {parts.start_step}, steps={run.steps}: nothing left to run"
            )
    return parts


def folder_data(run: RunConfig) -> tuple[FolderClips, HeldOutFiles]:
    """A folder's training files as the dataset, and its held-out files (data.eval_files), read for the eval
    set when eval is on. The split is a pure function of the files' relative paths (sweep/data/split.py).
    Its log lines are the same for every run of a sweep: said once per sweep (sweep/run/once.py)."""
    d, as_images = run.data, run.model.is_image
    split = FolderSplit.of(Path(d.path), d.source.value, d.eval_files)
    dataset = FolderClips(
        split.root,
        d.source.value,
        d.frames,
        d.channels,
        d.height,
        d.width,
        as_images,
        files=split.train,
        resize=d.resize.value,
    )
    bad = sum(p is not None for p in dataset.problems)
    say_once(
        log,
        logging.INFO,
        "data: %d training files from %s%s, %d held out for the eval loss (data.eval_files=%s%s)",
        len(dataset),
        split.root,
        f" ({bad} unusable)" if bad else "",
        len(split.held_out),
        describe(d.eval_files),
        how_many(d.eval_files),
    )
    if split.note:
        say_once(log, logging.INFO, "data.eval_files: %s", split.note)
    if not run.eval.enabled:
        return dataset, HeldOutFiles(split.names(), split.note)
    shape = (d.frames, d.channels, d.height, d.width)
    held_out = read_held_out(split, d.source.value, *shape, as_images, d.range_limit, d.resize.value)
    if held_out.unusable:
        shown = "; ".join(f"{n}: {w}" for n, w in list(held_out.unusable.items())[:3])
        more = f"; +{len(held_out.unusable) - 3} more" if len(held_out.unusable) > 3 else ""
        say_once(
            log,
            logging.WARNING,
            "data.eval_files: %d of %d held-out files in %s are left out of the eval loss: %s%s",
            len(held_out.unusable),
            len(held_out.files),
            split.root,
            shown,
            more,
        )
    return dataset, held_out


def drop_bad_samples(dataset, limit: float) -> torch.utils.data.Dataset:
    """The dataset without the samples the data doctor's check rejects: a file the run cannot use (its problem:
    unreadable, wrong shape, ...) or values NaN/Inf/out of range/constant. Said once per sweep, with the
    reasons counted; a DataError with them when every sample fails."""
    reasons: dict[str, list[str]] = {}  # reason -> labels of the samples it rejects, in order
    kept = []
    problem = getattr(dataset, "problem", None)
    for i in range(len(dataset)):
        why = problem(i) if problem else None
        if why is None:
            found = check_sample(dataset[i], limit)[0]
            why = _VALUE_REASONS.get(found[0].kind, found[0].kind).format(limit) if found else None
        if why is None:
            kept.append(i)
        else:
            reasons.setdefault(why, []).append(sample_labels(dataset, [i])[0])
    dropped = len(dataset) - len(kept)
    if not kept:
        raise DataError(f"data.drop_bad: every sample failed the data check: {counted(reasons)}")
    if dropped:
        say_once(
            log,
            logging.WARNING,
            "data.drop_bad: left out %d of %d samples: %s",
            dropped,
            len(dataset),
            counted(reasons),
        )
    return torch.utils.data.Subset(dataset, kept) if dropped else dataset


_VALUE_REASONS = {
    "nan": "NaN values",
    "inf": "Inf values",
    "range": "values outside [-{0:.4g}, {0:.4g}] (data.range_limit)",
    "constant": "constant (every value the same)",
}
"""A value problem's reason in drop_bad's count: by kind, since its detail differs from sample to sample."""


def counted(reasons: dict[str, list[str]], shown: int = 3) -> str:
    """'96 x shape (4, 2, 8, 8), the run expects (4, 1, 8, 8) or (4, 8, 8) (e.g. 0 (a.safetensors)); ...':
    the most common reasons first, each with its count and its first sample."""
    ranked = sorted(reasons.items(), key=lambda item: -len(item[1]))
    parts = [f"{len(labels)} x {why} (e.g. sample {labels[0]})" for why, labels in ranked[:shown]]
    more = (
        f"; +{sum(len(v) for _, v in ranked[shown:])} more for {len(ranked) - shown} other reasons"
        if len(ranked) > shown
        else ""
    )
    return "; ".join(parts) + more


def _maybe_corrupted(run: RunConfig, scratch: Path | None) -> tuple[str | None, str | None]:
    """(init_from, resume_from), with the one being loaded replaced by a corrupted copy in `scratch` under
    checkpoint.inject (build_parts gives a scratch folder whenever it is set)."""
    init_from, resume_from, c = run.model.init_from, run.checkpoint.resume_from, run.checkpoint
    if c.inject is None:
        return init_from, resume_from
    dest = scratch / "injected_checkpoint"
    source = resume_from or init_from
    corrupted, _ = checkpoint.inject_fault(Path(source), dest, c.inject, c.inject_tensor)
    return (init_from, str(corrupted)) if resume_from else (str(corrupted), None)
