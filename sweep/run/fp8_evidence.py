"""Per-layer fp8 statistics of a run's converted layers (result.json `fp8.layers`, `fp8.flagged`; issue #46 item 4).

What Transformer Engine's debug tools log per GEMM (nvdlfw-inspect's LogFp8TensorStats), for torchao's layers:
per converted layer and per operand (the forward GEMM's `input` and `weight`, the input-gradient GEMM's
`grad_output`), quantised exactly as the layer's recipe quantises it (torchao's own `hp_tensor_to_float8_dynamic`,
same dtype, granularity, axis and power-of-2 rounding):
- `amax`: max |x| of the high-precision operand;
- `scale_min`, `scale_max`: torchao's scale (fp8 = x * scale, from the current amax: max_fp8 / amax), one per
  tensor (min = max) or one per row under rowwise;
- `underflow_pct`: TE's `underflows%`, 100 * (values of x that are non-zero and quantise to zero) / numel (the
  denominator is every element, as TE's code divides: transformer_engine/debug/features/utils/stats_computation.py
  `add_underflows_stats`, and AutoswitchGemm._compute_metrics);
- `mse`: TE's `mse`, mean((x - dequantize(quantize(x)))^2), an absolute error: e4m3's 3-bit mantissa alone gives an
  operand of RMS ~1 an MSE of ~1e-3, so TE's 1e-4 flags the inputs of a healthy run too (docs/fp8.md).
- `output` (per layer): the layer's fp8 output against the same linear in the compute dtype (bf16) on the same input:
  `mse` and `rel` (relative L2), the error of the whole fp8 GEMM as the issue asks ("MSE against the bf16 result").
A layer is `flagged` when an operand passes TE AutoswitchGemm's thresholds (underflow > 5 %, MSE > 1e-4), the
ones at which TE moves that GEMM back to high precision.

When: once, at the end of the run, on the weights it ended with and the batch of its last step (its first bad step
when it diverged: a monitor verdict stops before that step's update), noised from a generator of its own
(seed stream 3), one forward under the run's precision and one backward through torch.autograd.grad. Nothing is
left in .grad and no run generator is drawn from, so the training curve is the one the run had. It costs one
emulated forward and backward (~3x a bf16 step on a CPU).

    python -m sweep precision=fp8_tensorwise   # then: jq .fp8.flagged <run dir>/result.json
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from sweep.config import RunConfig
from sweep.data.batches import load_checked_batch
from sweep.run.build import RunParts, stream_seed
from sweep.run.fp8 import float8_layers

log = logging.getLogger("sweep")

UNDERFLOW_LIMIT = 5.0
"""TE AutoswitchGemm's threshold: more than 5 % of an operand flushed to zero sends the GEMM back to high precision."""
MSE_LIMIT = 1e-4
"""TE AutoswitchGemm's threshold on an operand's quantisation MSE."""
MAX_LAYERS = 32
"""fp8.layers holds at most this many layers, those with the largest underflow first (`layers_measured` says how
many were measured)."""
EVIDENCE_STREAM = 3
"""Seed stream of the evidence batch's noise (sweep/run/build.py's streams 0-2 are the run's own generators)."""
OPERANDS = ("input", "weight", "grad_output")


def measure(run: RunConfig, parts: RunParts, step: int) -> dict:
    """{"layers": {name: {operand: stats}}, "flagged": {name: why}, "evidence_step": step} for the run's Float8Linear
    layers on the batch of `step`; {} when none was converted. Never raises: a failure is recorded in one line."""
    names = float8_layers(parts.model)
    if not names:
        return {}
    try:
        tensors = _one_step(run, parts, step, names)
        if isinstance(tensors, str):
            return {"evidence_error": tensors}
        layers = {}
        for name in names:
            module, seen = parts.model.get_submodule(name), tensors[name]
            layers[name] = {op: operand_stats(module, op, seen[op]) for op in OPERANDS if op in seen}
            if "output" in seen:
                layers[name]["output"] = output_error(module, seen["input"], seen["output"], parts.policy.compute_dtype)
    except Exception as e:  # noqa: BLE001 - evidence must not turn a finished run into an error
        log.warning("fp8 evidence not measured: %s: %s", type(e).__name__, e)
        return {"evidence_error": f"{type(e).__name__}: {e}"}
    ranked = sorted(layers, key=lambda n: -max(layers[n][op]["underflow_pct"] for op in OPERANDS if op in layers[n]))
    flagged = {n: why for n in ranked if (why := over_limits(layers[n]))}
    return {
        "evidence_step": step,
        "layers_measured": len(layers),
        "layers": {n: layers[n] for n in ranked[:MAX_LAYERS]},
        "flagged": flagged,
    }


def _one_step(run: RunConfig, parts: RunParts, step: int, names: list[str]) -> dict | str:
    """{layer: {"input", "weight", "grad_output"}} high-precision operands of one forward + backward, or why not."""
    device, policy, model = parts.device, parts.policy, parts.model
    x0, issue = load_checked_batch(parts.dataset, parts.order.indices(step), run.data.range_limit, run.data.check)
    if issue is not None:
        return f"the batch of step {step} is bad input ({issue.detail})"
    seen: dict[str, dict[str, torch.Tensor]] = {n: {} for n in names}
    handles = []
    for name in names:
        module = model.get_submodule(name)
        # registered after fp8.convert's cast hook, so it sees the input torchao quantises
        handles.append(module.register_forward_pre_hook(_keep_input(seen[name])))
        handles.append(module.register_forward_hook(_keep_grad_output(seen[name])))
    try:
        generator = torch.Generator(device=device).manual_seed(stream_seed(run.seed, EVIDENCE_STREAM))
        noisy, t, target = parts.objective.sample(x0.to(device), generator)
        with policy.gemm_mode():
            with policy.autocast(device):
                pred = model(noisy.to(policy.param_dtype), t)
            loss = parts.objective.loss(pred, target) * run.objective.loss_weight
            params = [p for p in model.parameters() if p.requires_grad]
            torch.autograd.grad(loss, params, allow_unused=True)  # returned, never accumulated into .grad
    finally:
        for h in handles:
            h.remove()
    for name in names:
        seen[name]["weight"] = model.get_submodule(name).weight.detach()
    return {n: {op: seen[n][op] for op in (*OPERANDS, "output") if op in seen[n]} for n in names}


def _keep_input(into: dict):
    def hook(module, args):
        into.setdefault("input", args[0].detach())

    return hook


def _keep_grad_output(into: dict):
    def keep(grad: torch.Tensor) -> None:
        into.setdefault("grad_output", grad.detach())

    def hook(module, args, output):
        into.setdefault("output", output.detach())
        if output.requires_grad:
            output.register_hook(keep)

    return hook


def operand_stats(module: nn.Module, operand: str, x: torch.Tensor) -> dict:
    """amax, scale range, TE's underflow % and MSE of `x` quantised as `module` (a Float8Linear) quantises `operand`."""
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    c = module.config
    if operand == "weight":  # the forward quantises weight.t(), per output feature under rowwise
        cast, role, hp, axis = c.cast_config_weight, GemmInputRole.WEIGHT, x.t(), 0
    elif operand == "input":
        cast, role, hp, axis = c.cast_config_input, GemmInputRole.INPUT, x, -1
    else:  # the input-gradient GEMM's, on the 2-d view the backward makes
        cast, role, hp, axis = c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, x.reshape(-1, x.shape[-1]), -1
    with torch.no_grad():
        q = hp_tensor_to_float8_dynamic(
            hp,
            cast.target_dtype,
            module.linear_mm_config,
            gemm_input_role=role,
            scaling_granularity=cast.scaling_granularity,
            axiswise_dim=get_maybe_axiswise_dim(axis, cast.scaling_granularity),
            round_scales_to_power_of_2=c.round_scales_to_power_of_2,
        )
        hp = hp.float()
        dequantized = q._data.float() / q._scale
        flushed = int(((hp != 0) & (dequantized == 0)).sum())  # as AutoswitchGemm._compute_metrics counts them
        return {
            "dtype": str(cast.target_dtype).removeprefix("torch.float8_"),
            "amax": _short(hp.abs().max()),
            "scale_min": _short(q._scale.min()),
            "scale_max": _short(q._scale.max()),
            "underflow_pct": _short(100.0 * flushed / hp.numel()),
            "mse": _short((hp - dequantized).pow(2).mean()),
        }


def output_error(module: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> dict:
    """The layer's fp8 output `y` against the same layer in the compute dtype (bf16 under bf16 autocast) on the same
    input `x`: `mse` = mean((y - y_ref)^2) and `rel` = ||y - y_ref|| / ||y_ref||, in fp32. The quantisation error
    of the whole GEMM (its two operands and the rescale), where `mse` of an operand is one side's."""
    with torch.no_grad():
        bias = None if module.bias is None else module.bias.to(dtype)
        ref = torch.nn.functional.linear(x.to(dtype), module.weight.to(dtype), bias).float()
        diff = y.float() - ref
        norm = float(ref.norm())
        return {"mse": _short(diff.pow(2).mean()), "rel": _short(float(diff.norm()) / norm) if norm else None}


def over_limits(stats: dict[str, dict]) -> str | None:
    """'grad_output underflow 7.2% > 5%; input MSE 2.1e-04 > 1e-04', or None within TE AutoswitchGemm's limits (the
    operands': the `output` error is no TE threshold)."""
    found = []
    for op, s in ((op, stats[op]) for op in OPERANDS if op in stats):
        if s["underflow_pct"] > UNDERFLOW_LIMIT:
            found.append(f"{op} underflow {s['underflow_pct']:.3g}% > {UNDERFLOW_LIMIT:g}%")
        if s["mse"] > MSE_LIMIT:
            found.append(f"{op} MSE {s['mse']:.2e} > {MSE_LIMIT:.0e}")
    return "; ".join(found) or None


def _short(v) -> float:
    """Four significant digits: result.json holds a few floats per layer, not their last bits."""
    return float(f"{float(v):.4g}")
