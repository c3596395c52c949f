"""fp8 matmuls through torchao's float8 training (`precision.fp8`: tensorwise | rowwise | rowwise_gw_hp, issue #46).

    python -m sweep -m precision=bf16_amp,fp8_tensorwise,fp8_rowwise optim.lr=1e-4,1e-3

How fp8 training works here. torchao's `convert_to_float8_training` swaps chosen `nn.Linear` layers for its
`Float8Linear`: the fp32 master weights and AdamW state stay as they are, and each of a layer's three GEMMs
(output = input @ W^T, grad_input = grad_output @ W, grad_weight = grad_output^T @ input) quantises its two
operands to fp8 with a scale computed from the operand's *current* amax (dynamic scaling: torchao 0.18 has no
delayed scaling), multiplies, and rescales the result:
- tensorwise: one scale per tensor; input and weight in e4m3, grad_output in e5m2 (more range, less precision);
- rowwise: one scale per row (per column of the right operand), every operand e4m3, scales rounded to powers of 2;
- rowwise_gw_hp: rowwise, except that the weight-gradient GEMM runs in high precision (its operands unquantised).

On a CUDA GPU of compute capability >= 8.9 the GEMMs are torch._scaled_mm's fp8 kernels; on the CPU they are
emulated (`emulated: true` in result.json): each operand is quantised to fp8 and dequantised exactly as on the GPU,
and the product is an fp32 `torch.mm`. Emulation therefore shows the rounding, range and scaling of fp8, but not the
fast-accumulation error of `_scaled_mm(use_fast_accum=True)` (torchao's default for the forward GEMM) nor the
kernels' own bugs: those need the GPU. Older GPUs and other devices are `skipped` (`unsupported_reason`).

Which layers convert (`plan`). Every nn.Linear lands in exactly one place of the record, checked in this order:
1. `fp32_modules`: inside a `precision.fp32_modules` match; those compute in fp32 (sweep/run/fp32_modules.py);
2. `refused`: in or out features not a multiple of 16, the rule of `_scaled_mm`; applied on every device, since
   emulation would take a 128 -> 12 layer the GPU refuses, and a CPU run would then claim what an H100 cannot run;
3. `kept_high`: matches a `precision.fp8_keep` glob (the glob is recorded); it computes in the autocast dtype;
4. `converted`: everything else.
torchao's own filter (`_auto_filter_for_recipe`) is not used: its size thresholds are H100 speed heuristics and keep
no layer of a tiny model (docs/fp8_groundwork.md). A run whose filter converts nothing says so (once per sweep).

CPU autocast. `Float8Linear.forward` repeats autocast's input cast only for CUDA autocast, so under CPU autocast the
input reaches torchao in fp32, the layer outputs fp32 where an autocast linear outputs bf16, and rowwise_gw_hp's
high-precision weight-gradient GEMM mixes a bf16 grad_output with the fp32 input and raises ("expected m1 and m2
to have the same dtype"). A forward pre-hook on each converted layer casts the input to the CPU autocast dtype, for
every recipe: the CPU run then quantises the bf16 input a CUDA run quantises and outputs bf16 as it does. For
tensorwise and rowwise the hook moves the errors against fp32 by < 4e-3 (docs/fp8_groundwork.md, section b).

The evidence of what fp8 did to each converted layer (amax, scale, underflow %, quantisation MSE) is measured at
the end of the run by sweep/run/fp8_evidence.py.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from sweep.config import ConfigError, Fp8Recipe, PrecisionConfig, RunConfig
from sweep.config.enums import LOWPREC_INSTALL
from sweep.run import fp32_modules
from sweep.run.once import say_once

log = logging.getLogger("sweep")

MULTIPLE = 16
"""torch._scaled_mm needs both dims of each operand to be multiples of 16."""
MIN_CAPABILITY = (8, 9)
"""fp8 tensor cores: Ada (8.9) and Hopper (9.0) or newer."""
RECIPES = {
    Fp8Recipe.tensorwise: "tensorwise",
    Fp8Recipe.rowwise: "rowwise",
    Fp8Recipe.rowwise_gw_hp: "rowwise_with_gw_hp",
}
"""Our recipe names -> torchao's Float8LinearRecipeName values."""


def unsupported_reason(run: RunConfig, device: torch.device) -> str | None:
    """Why this run's fp8 matmuls cannot run on `device` (a `skipped` run), or None."""
    if run.precision.fp8 is None or device.type == "cpu":
        return None
    if device.type != "cuda":
        return (
            f"precision.fp8 runs on a CPU (emulated) or a CUDA GPU of capability >= 8.9; this run is on {device.type}"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (
            f"precision={run.precision.name}: fp8 matmuls need CUDA compute capability >= 8.9 (H100, L4, RTX 40xx); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}"
        )
    return None


@dataclass
class Plan:
    """What the filter decided for each nn.Linear of a model (the record's lists, before torchao runs)."""

    converted: list[str] = field(default_factory=list)
    kept_high: dict[str, str] = field(default_factory=dict)
    """name -> the fp8_keep glob that kept it."""
    refused: dict[str, str] = field(default_factory=dict)
    """name -> why torchao cannot take it ("128 -> 12: out_features not a multiple of 16")."""
    fp32_modules: list[str] = field(default_factory=list)
    """Linears inside a precision.fp32_modules match: they compute in fp32."""


def plan(model: nn.Module, keep: Sequence[str], fp32_globs: Sequence[str]) -> Plan:
    """Sort every nn.Linear of `model` into the record's four lists (module docstring, in that order)."""
    names = [n for n, _ in model.named_modules()]
    in_fp32 = fp32_modules.matching(names, fp32_globs)
    out = Plan()
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        glob = fp32_modules.first_match(name, keep)
        if any(name == m or name.startswith(m + ".") for m in in_fp32):
            out.fp32_modules.append(name)
        elif why := refusal(module):
            out.refused[name] = why
        elif glob is not None:
            out.kept_high[name] = glob
        else:
            out.converted.append(name)
    return out


def refusal(module: nn.Linear) -> str | None:
    """Why torch._scaled_mm cannot take this linear ("128 -> 12: out_features not a multiple of 16"), or None."""
    bad = [k for k in ("in_features", "out_features") if getattr(module, k) % MULTIPLE]
    if not bad:
        return None
    return f"{module.in_features} -> {module.out_features}: {' and '.join(bad)} not a multiple of {MULTIPLE}"


def float8_config(recipe: Fp8Recipe, emulate: bool):
    """torchao's Float8LinearConfig of `recipe`, emulated or not."""
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(RECIPES[recipe]), emulate=emulate)


def convert(model: nn.Module, precision: PrecisionConfig, device: torch.device) -> dict:
    """Swap the layers `plan` converts for torchao's Float8Linear (in place) and return the record that goes into
    result.json's `fp8`. Call it on the built model (after fp32_modules and finetune), before the optimizer."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as e:
        raise ConfigError(f"precision.fp8: torchao is not installed ({e}): {LOWPREC_INSTALL}") from None
    chosen = plan(model, precision.fp8_keep, precision.fp32_modules)
    emulate = device.type != "cuda"
    record = {"recipe": precision.fp8.value, "emulated": emulate}
    if device.type == "cuda":
        record["device_capability"] = "{}.{}".format(*torch.cuda.get_device_capability(device))
    wanted = set(chosen.converted)
    convert_to_float8_training(
        model, config=float8_config(precision.fp8, emulate), module_filter_fn=lambda m, name: name in wanted
    )
    if device.type == "cpu":  # Float8Linear casts its input only under CUDA autocast (module docstring)
        for name in chosen.converted:
            model.get_submodule(name).register_forward_pre_hook(cast_like_cpu_autocast)
    record.update(dataclasses.asdict(chosen))
    if not chosen.converted:
        say_once(
            log,
            logging.WARNING,
            "precision=%s converts no layer to fp8 (%d kept high by precision.fp8_keep, %d refused by dimension, "
            "%d in precision.fp32_modules): the run trains in %s",
            precision.name,
            len(chosen.kept_high),
            len(chosen.refused),
            len(chosen.fp32_modules),
            precision.autocast_dtype.value if precision.autocast_dtype else precision.param_dtype.value,
        )
    return record


def cast_like_cpu_autocast(module: nn.Module, args: tuple) -> tuple | None:
    """A Float8Linear's forward pre-hook: its input cast to the CPU autocast dtype, the cast torchao repeats only
    under CUDA autocast (module docstring)."""
    if torch.is_autocast_enabled("cpu"):
        return (args[0].to(torch.get_autocast_dtype("cpu")), *args[1:])
    return None


def float8_layers(model: nn.Module) -> list[str]:
    """The names of the torchao Float8Linear layers in `model` (none unless torchao's float8 was imported)."""
    if "torchao.float8.float8_linear" not in sys.modules:
        return []
    from torchao.float8.float8_linear import Float8Linear

    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
