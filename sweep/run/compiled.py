"""compile=true: the model's forward compiled by inductor, and proof of which attention kernel it runs.

    python -m sweep compile=true attention=flash precision=bf16_amp

Measured on torch 2.13 CPU (docs/compile.md; tests/test_compile.py); on CUDA the same check reads aten's CUDA
op names (models/attention.py FUSED_OPS), not yet seen in a compiled CUDA profile (issue #15):
  * Dynamo keeps the SDPA backend `sdpa_kernel` forced: attention=flash compiles to
    `aten::_scaled_dot_product_flash_attention_for_cpu` (+ `_backward`), attention=math to inductor's
    own bmm + softmax (the MATH formula, decomposed; no SDPA op left).
  * Inductor's pattern matcher (fx_passes/fuse_attention.py) rewrites a hand-written
    softmax(QK^T)V into the flash op when the graph has exactly its shape: a standalone eager
    attention is rewritten, forward and backward; our blocks' eager attention (q/k/v are views of
    one qkv projection) was not, at every precision. Whether it matches depends on the model code,
    so nothing is assumed: every compiled run is profiled once before training.
  * `options={"pattern_matcher": False}` turns that rewrite off for one compile; we compile every
    backend that way, so compiled runs differ in the attention kernel only.
  * The custom op dit_sweep::modulate (it has a fake impl) survives compilation as an opaque call,
    forward and backward.

So a compiled run records the kernels the profiler saw, marked "(compiled)", or is `skipped` with
the combination named when the profile shows another attention kernel. The steps on which the
monitor watches attention logits (every monitor.logit_every) run uncompiled: the extra QK^T
observation would otherwise need a second graph, doubling compile time; those steps run the same
forced kernel in eager mode.

Jobs of a multirun share one process: each compiled run starts from `torch._dynamo.reset()` (no
recompile count or guard carried from an earlier run, so Dynamo's recompile limit never silently
falls back to eager), and a recompile-limit hit raises instead of falling back. The same
architecture and shapes compile again from inductor's FX graph cache and AOTAutograd's cache
(on disk, on by default), which is what makes the second run of a shape cheap.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from models import KernelUnavailable, LogitStats, watching_logits
from models.attention import ATTENTION_KERNELS, FUSED_OPS, MATH_OP, SDPA_OPS
from models.modulate import MODULATE_KERNELS, MODULATE_OP
from sweep.config import Arch, RunConfig
from sweep.run.build import RunParts

log = logging.getLogger("sweep")

# Inductor options of every compiled run: no pattern-matcher rewrites (attention fusion among them).
INDUCTOR_OPTIONS = {"pattern_matcher": False}


def compile_unsupported_reason(run: RunConfig, device: torch.device) -> str | None:
    """Why compile=true cannot apply to this run (a `skipped` run), or None."""
    if not run.compile:
        return None
    if run.model.arch in (Arch.diffusers, Arch.diffusers_config):
        return (
            f"compile=true is not wired for model.arch={run.model.arch.value}: its attention axis is a "
            "TorchFunctionMode around each forward, unproven under torch.compile; run it uncompiled"
        )
    if run.model.arch is Arch.custom:
        return (
            "compile=true is not wired for model=custom: its attention axis is a TorchFunctionMode around each "
            "forward, unproven under torch.compile; run it uncompiled"
        )
    if device.type not in FUSED_OPS:
        return (
            f"compile=true proves its attention kernel by the profiler op names of CPU and CUDA only (not "
            f"{device.type}); run it uncompiled"
        )
    return None


def compile_run(run: RunConfig, parts: RunParts) -> None:
    """Compile parts.model's forward in place, profile one forward+backward, and set parts.kernels to
    what ran; raise KernelUnavailable (a `skipped` run) when that is not the requested kernel.

    Nothing of the run changes: the probe batch is zeros (no RNG drawn), its gradients are cleared,
    no optimizer step is taken; parameters and state_dict keys stay the model's own (checkpoints are
    the same files as uncompiled).
    """
    start = time.perf_counter()
    torch._dynamo.reset()  # a fresh cache per run: nothing from an earlier job's compiles counts here
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # an error, never a silent eager fallback
    seal = _compile_forward(parts.model)
    ops = _profile_step(run, parts)
    seal()
    attention, modulate = run.attention.backend.value, run.modulate.impl.value
    reason = _attention_mismatch(attention, ops, parts.device) or _modulate_mismatch(modulate, ops)
    if reason is not None:
        raise KernelUnavailable(reason)
    how = " (compiled: inductor bmm+softmax)" if attention in ("math", "eager") else " (compiled)"
    parts.kernels = {
        "attention": ATTENTION_KERNELS[attention] + how,
        "modulate": MODULATE_KERNELS[modulate] + " (compiled)",
    }
    log.info(
        "compile=true: compiled and profiled in %.1f s: %s",
        time.perf_counter() - start,
        ", ".join(sorted(op for op in ops if op in SDPA_OPS or op.startswith("dit_sweep::"))) or "no SDPA op",
    )


def _compile_forward(model: torch.nn.Module) -> Callable[[], None]:
    """model.forward becomes the compiled forward, except on logit-watching steps (eager, same kernels).

    Returns `seal`: after it, a call that would compile another graph (new shapes, dtypes, global
    state) raises instead, so training runs exactly the graph that was profiled.
    """
    eager_forward = model.forward
    compiled_forward = torch.compile(eager_forward, dynamic=False, options=dict(INDUCTOR_OPTIONS))
    watched = [m for m in model.modules() if hasattr(m, "logit_stats")]
    stance = ["default"]

    def forward(*args, **kwargs):
        if any(m.logit_stats is not None for m in watched):
            return eager_forward(*args, **kwargs)
        with torch.compiler.set_stance(stance[0]):
            return compiled_forward(*args, **kwargs)

    model.forward = forward
    model.eager_forward = eager_forward  # the eval loss (sweep/run/evaluate.py): no_grad would be another graph
    return lambda: stance.__setitem__(0, "fail_on_recompile")


def _profile_step(run: RunConfig, parts: RunParts) -> set[str]:
    """Compile (first call), then profile a second forward+backward on a zeros batch of the run's shape."""
    d, policy, model = run.data, parts.policy, parts.model
    frames = () if run.model.is_image else (d.frames,)
    x = torch.zeros(d.batch_size, d.channels, *frames, d.height, d.width, device=parts.device, dtype=policy.param_dtype)
    t = torch.zeros(d.batch_size, dtype=torch.float32, device=parts.device)  # as DiffusionObjective.sample draws them

    def step() -> None:
        with watching_logits(model, LogitStats(), False), policy.autocast(parts.device):
            out = model(x, t)
        out.float().sum().backward()

    step()  # compiles; profiling this call would also record ops run on fake tensors while tracing
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    parts.optimizer.zero_grad(set_to_none=True)
    return {event.key for event in prof.key_averages()}


def _attention_mismatch(attention: str, ops: set[str], device: torch.device) -> str | None:
    fused = FUSED_OPS[device.type]
    if attention in fused:  # the forced kernel's forward and backward ops, and no other SDPA op
        op = fused[attention]
        missing = [o for o in (op, op + "_backward") if o not in ops]
        if missing:
            return (
                f"compile=true: attention={attention} did not run {', '.join(missing)} in the compiled graph; "
                "run it uncompiled"
            )
        other = sorted(o for o in ops if o in SDPA_OPS and o not in (op, op + "_backward"))
        return f"compile=true runs {', '.join(other)} for attention={attention}; run it uncompiled" if other else None
    flash = fused["flash"]
    if flash in ops or flash + "_backward" in ops:
        return (
            f"compile=true rewrites attention={attention} into the flash kernel ({flash} in the compiled "
            f"graph); run it uncompiled"
        )
    allowed = (MATH_OP,) if attention == "math" else ()  # eager: no SDPA op at all (math upcasts fp16, eager does not)
    other = sorted(op for op in ops if op in SDPA_OPS and op not in allowed)
    if other:
        return f"compile=true runs {', '.join(other)} for attention={attention}; run it uncompiled"
    return None


def _modulate_mismatch(modulate: str, ops: set[str]) -> str | None:
    if (modulate == "fused") != (MODULATE_OP in ops):
        state = "lost" if modulate == "fused" else "gained"
        return f"compile=true {state} the {MODULATE_OP} op for modulate={modulate}; run it uncompiled"
    return None
