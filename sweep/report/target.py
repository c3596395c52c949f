"""The machine a recommendation is for: what it cannot run, and what costs least on it.

    python -m sweep.report SWEEP_DIR --target cpu     # report.target=cpu for the sweep's own summary

A sweep directory's own report.target (its multirun.yaml, `recorded_target`) is what `python -m sweep.report` and
`python -m sweep.confirm` on that directory default to, so they recommend what its summary.md does.

A sweep on the CPU is a proxy for the GPU its model trains on, so the default target is `cuda`, the device
the sweep ran on when that was a GPU (result.json `device`). For the target the recommendation
- leaves out the combinations it cannot run (`unrunnable`): on CUDA, flash or cuDNN attention under a precision
  that computes in fp32 (fp32, tf32: CUDA's flash SDPA needs fp16/bf16 inputs); on the CPU, efficient or cuDNN
  attention and tf32 (the run's own checks answer for the CPU: models/attention.py `backend_unavailable_reason`,
  sweep/run/precision.py `PrecisionPolicy.unsupported_reason`);
- breaks ties within noise by the steps/s the runs measured when they ran on the target's kind of device, else
  by the target's cost (`COST`): on CUDA bf16 before fp16 (AMP or pure; the same speed, but fp16 needs a loss
  scaler) before tf32 before fp32, and flash before efficient/cuDNN before math before eager.
A run that does not name its precision or attention (an override) used the config's default (DEFAULTS).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pandas as pd
import yaml

from sweep.config.validate import REPORT_TARGETS as TARGETS  # report.target's values

DEFAULTS = {"precision": "fp32", "attention": "math", "optim": "adamw"}
"""The choices of conf/config.yaml's defaults list: what a run that does not name one used."""
PRECISION_DIR = Path(__file__).resolve().parents[2] / "conf" / "precision"
FLASH_LIKE = ("flash", "cudnn")
"""CUDA SDPA backends that take fp16/bf16 inputs only."""

COST = {
    "cuda": {
        "precision": {"bfloat16": 0, "fp8": 1, "float16": 2, "tf32": 3, "float32": 4},
        "attention": {"flash": 0, "efficient": 1, "cudnn": 1, "math": 2, "eager": 3},
    },
    "cpu": {
        "precision": {"float32": 0, "bfloat16": 1, "float16": 2, "fp8": 3},
        "attention": {"math": 0, "flash": 1, "eager": 2},
    },
}
"""Cheapest first, per target. CUDA: tensor cores run bf16/fp16 at twice tf32's rate and many times fp32's,
and the fused SDPA kernels beat the math backend and an explicit softmax(QK^T); bf16 ranks before fp16 at the
same speed, as it needs no loss scaler and has fp32's range (a tie between them must not fall to a 4th digit).
fp8 matmuls (precision.fp8) rank after bf16 on CUDA: they pay off only for large GEMMs and need capability 8.9+,
so a tie keeps the precision every recent GPU runs at full speed. CPU (docs/design.md facts, and the README demo's
steps/s on a 2-core AVX-512-BF16 EPYC): at these sizes fp32 is faster than bf16 or fp16 autocast, SDPA math than
flash, and emulated fp8 is ~3x bf16 (docs/fp8_groundwork.md). On both, our AdamW ranks before a library optimizer
(OPTIM_COST): its update is one multi-tensor pass with no host sync, theirs run eagerly."""
OPTIM_COST = {"adamw": 0}
"""Optimizers' rank in a tie, cheapest 0; every other optimizer ranks 1."""
COST_TEXT = {
    "cuda": "bf16 before fp16 (no loss scaler) before tf32 before fp32, flash before efficient/cudnn before math"
    " before eager",
    "cpu": "fp32 before bf16 before fp16, math before flash before eager",
}
FP8_TEXT = {"cuda": ("bf16 before", "bf16 before fp8 before"), "cpu": ("before fp16,", "before fp16 before fp8,")}
"""Where fp8 goes in COST_TEXT (old, new), said only when a tied setting has fp8 matmuls."""


def cost_text(target: str, fp8: bool = False, optimizers: bool = False) -> str:
    """COST_TEXT[target], with fp8's place when fp8 matmuls tie and the optimizers' when optimizers do."""
    text = COST_TEXT[target]
    if fp8:
        text = text.replace(*FP8_TEXT[target], 1)
    return text + (", our AdamW before a library optimizer" if optimizers else "")


def device_kind(device) -> str | None:
    """ "cuda" for "cuda:0", "cpu" for "cpu"; None when not recorded."""
    if device is None or (isinstance(device, float) and pd.isna(device)) or not str(device):
        return None
    return str(device).split(":", 1)[0]


def ran_on(runs: pd.DataFrame) -> set[str]:
    """The kinds of device the runs recorded (result.json `device`)."""
    if "device" not in runs:
        return set()
    return {k for k in runs.device.map(device_kind) if k}


def recorded_target(sweep_dir) -> str | None:
    """The report.target a sweep ran with, from its multirun.yaml: None where it set none, or where the file is
    missing, unreadable or names no known target (the report's own default then)."""
    try:
        node = (yaml.safe_load((Path(sweep_dir) / "multirun.yaml").read_text()) or {}).get("report") or {}
        target = node.get("target")
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return None
    return target if target in TARGETS else None


def resolve_target(runs: pd.DataFrame, target: str | None) -> tuple[str, str]:
    """(target, why): the one asked for, else the default (module docstring)."""
    kinds = ran_on(runs)
    if target is not None:
        if target not in TARGETS:
            raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
        return target, "as asked"
    if kinds == {"cuda"}:
        return "cuda", "the device the sweep ran on"
    if "cpu" in kinds:
        return (
            "cuda",
            "the default: the sweep ran on the CPU, a proxy for the GPU the model trains on; --target cpu for the CPU",
        )
    return "cuda", "the default: the runs recorded no device; --target cpu for the CPU"


def measured_on(runs: pd.DataFrame, target: str) -> str | None:
    """The device the runs' steps/s were measured on ("cuda:0") when every run that recorded one ran on the
    target's kind of device, else None (they say nothing about the target's speed)."""
    if "device" not in runs:
        return None
    devices = sorted({str(d) for d in runs.device if device_kind(d)})
    if not devices or any(device_kind(d) != target for d in devices):
        return None
    return ", ".join(devices)


@functools.lru_cache(maxsize=None)
def precision_dtypes(name: str) -> tuple[str | None, bool, bool]:
    """(the dtype a precision computes in, its tf32 switch, whether its matmuls are fp8) from
    conf/precision/<name>.yaml; (None, False, False) for a name that has no file there."""
    try:
        spec = yaml.safe_load((PRECISION_DIR / f"{name}.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError, TypeError):
        return None, False, False
    return spec.get("autocast_dtype") or spec.get("param_dtype"), bool(spec.get("tf32")), bool(spec.get("fp8"))


def unrunnable(target: str, precision: str, attention: str) -> str | None:
    """Why `target` cannot run this precision with this attention backend; None when it can (or cannot tell)."""
    dtype, tf32, _ = precision_dtypes(str(precision))
    attention = str(attention)
    if target == "cuda":
        if attention in FLASH_LIKE and dtype == "float32":
            return f"CUDA's {attention} SDPA needs fp16/bf16 inputs, and {precision} computes in fp32"
        return None
    import torch  # the run's own checks for the CPU: they answer without a GPU

    from models.attention import ATTENTION_BACKENDS, backend_unavailable_reason
    from sweep.run.precision import DTYPES, PrecisionPolicy

    if tf32:
        reason = PrecisionPolicy(str(precision), torch.float32, None, True).unsupported_reason(torch.device("cpu"))
        if reason:
            return reason.replace("this run is on", "the target is")
    if dtype in DTYPES and attention in ATTENTION_BACKENDS:
        return backend_unavailable_reason(attention, torch.device("cpu"), DTYPES[dtype])
    return None


def cost(target: str, precision: str, attention: str, optim: str = "adamw") -> tuple[int, int, int]:
    """(precision rank, attention rank, optimizer rank) on `target`, cheapest 0 (COST, OPTIM_COST); an unknown
    value ranks last."""
    dtype, tf32, fp8 = precision_dtypes(str(precision))
    ranks = COST[target]
    kind = "tf32" if tf32 else "fp8" if fp8 else dtype
    unknown = len(ranks["precision"]), len(ranks["attention"])
    return (
        ranks["precision"].get(kind, unknown[0]),
        ranks["attention"].get(str(attention), unknown[1]),
        OPTIM_COST.get(str(optim), 1),
    )
