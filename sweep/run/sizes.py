"""What a run will allocate, estimated when its config is composed: an absurd size is refused before any run.

`data.channels=2147483648` or `model.width=1048576` would otherwise reach the run, try to allocate
terabytes and end as an out-of-memory `error` (or take the machine down with it). `check_sizes`
(called by sweep.config.validate) estimates, without allocating anything:

- one training batch and one evaluation batch: clips x channels x frames x height x width x 4 bytes;
- the synthetic data set, which is rendered whole (sweep/data/synthetic.py): data.num_samples clips;
- the model's parameters, counted on the meta device (no memory), as models/diffusers_config.py counts a
  released model's. A native model is counted at two depths and extrapolated (its blocks are identical),
  so `model.depth=10**9` costs two small builds, not a billion modules; up to width 512 those two are
  built on the CPU for real (REAL_BUILD_WIDTH says why; REAL_BUILD_TOKENS bounds the patches).

- the steps (`check_steps`): a run keeps one metrics row per step in memory until it ends (result.json's numbers
  come from them, metrics.csv is written whole at the end), ROW_BYTES each, so `steps` is at most
  ROWS_BYTES_LIMIT / ROW_BYTES = 7,158,278; and a model whose size is known (native and zoo models) must be able
  to run its steps within RUN_SECONDS_LIMIT (30 days) at an H100's dense bf16 peak, 6 x parameters x tokens per
  batch FLOPs a step (a lower bound on any real step's cost, so only a run that cannot end is refused). Before,
  nothing bounded it: `steps=1e11` hung building per-step tables before step 0 (those are now a window of steps at
  a time, sweep/data/step_table.py).

Each limit is far above anything a proxy sweep of a small model uses (the default run: a 0.8 MB data set,
a 24 KB batch and 1.3M parameters), so only sizes no run here could allocate are refused. The message says
the estimate, the limit and the keys to lower. A custom model (arch=custom) is held to PARAMS_LIMIT by its
probe (sweep.config.check_inputs, models/custom.py probe_factory: counted as its one build goes, the rest of the
build on the meta device once past the limit, whatever device the factory names); a released config
(arch=diffusers_config) has its own 100M budget.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Optional

BYTES_PER_VALUE = 4
"""float32: what data is rendered and batched in, before any cast to the run's precision."""

BATCH_BYTES_LIMIT = 2**30
"""One batch (training or evaluation): 1 GiB of input values (the activations are many times more)."""

DATA_BYTES_LIMIT = 4 * 2**30
"""The synthetic data set, rendered whole and cached per process: 4 GiB."""

REAL_BUILD_WIDTH = 512
"""The widest native model whose parameters are counted on a real CPU build (two blocks at width 512: 13M
parameters, 50 MB for a moment) rather than on the meta device."""

REAL_BUILD_TOKENS = 4096
"""And the most patches per frame it may have: its fixed sin-cos table is computed for real too (float64,
4096 x 512 values: 16 MB), where `data.height=65536` would ask for hundreds of GB."""

PARAMS_LIMIT = 1_000_000_000
"""Model parameters: 1,000M (16 GB of float32 weights, gradients and AdamW state; DiT-XL has 675M)."""

ROW_BYTES = 600
"""Memory of one step's metrics row while the run lasts: a dict of 11 values, 552 B measured with tracemalloc
(CPython 3.11, 100,000 rows as sweep.run.step.Steps.log makes them), rounded up."""

ROWS_BYTES_LIMIT = 4 * 2**30
"""A run's metrics rows in memory: 4 GiB, so steps <= 7,158,278 (metrics.csv is then ~0.7 GB)."""

STEPS_LIMIT = ROWS_BYTES_LIMIT // ROW_BYTES

RUN_SECONDS_LIMIT = 30 * 86400
"""The longest a run may take at the fastest any step of its size could run: 30 days."""

PEAK_FLOPS = 989e12
"""An H100 SXM's dense bf16 tensor-core peak: no step of a model runs faster than its matmul FLOPs at this rate."""

DATA_KEYS = "data.channels, data.frames, data.height or data.width"


class SizeError(ValueError):
    """A size over its limit: `key` is the config key the message starts with."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def check_sizes(run: Any) -> None:
    """Raise SizeError when a batch, the synthetic data set or the model (of `run`, a sweep.config.RunConfig,
    which imports this module: so no import of it here, and its enums compared by value) is over its limit."""

    d = run.data
    clip = d.channels * d.frames * d.height * d.width
    shape = f"{d.channels} x {d.frames} x {d.height} x {d.width}"
    batches = [("data.batch_size", d.batch_size, "one training batch")]
    if run.eval.enabled:
        batches.append(("eval.batch_size", min(run.eval.batch_size, run.eval.samples), "one evaluation batch"))
    for key, clips, what in batches:
        _check_bytes(what, clips * clip, f"{clips} x {shape}", BATCH_BYTES_LIMIT, f"lower {key}, {DATA_KEYS}")
    if d.source.value == "synthetic":
        _check_bytes(
            "the synthetic data set (rendered whole)",
            d.num_samples * clip,
            f"data.num_samples={d.num_samples} x {shape}",
            DATA_BYTES_LIMIT,
            f"lower data.num_samples, {DATA_KEYS}",
        )
    n, what, how, lower = _model_params(run)
    if n is not None and n > PARAMS_LIMIT:
        raise SizeError(
            "model",
            f"{what} would have ~{_count(n)} parameters ({how}), over the {PARAMS_LIMIT / 1e6:,.0f}M limit: {lower}",
        )
    check_steps(run, n)


def _model_params(run: Any) -> tuple[Optional[int], str, str, str]:
    """(parameters, what the model is, how they were counted, what to lower) of a native or zoo model; None
    parameters for another kind (a custom model is counted by its probe) or a model that does not build (validate
    says why)."""
    d, m = run.data, run.model
    if m.arch.value in ("dit", "video_dit"):
        n = native_params(
            m.arch.value, m.size, m.width, m.depth, m.patch_size, m.qk_norm, d.channels, d.frames, d.height
        )
        what = f"model.arch={m.arch.value} size {m.size}" + "".join(
            f" {k}={v}" for k, v in (("width", m.width), ("depth", m.depth)) if v is not None
        )
        lower = "lower model.width or model.depth (or pick a smaller model.size)"
        return n, what, "counted at depths 2 and 4 and extrapolated", lower
    if m.arch.value == "diffusers":
        n = _diffusers_params(m.name, d.channels, d.frames, d.height, d.width, m.patch_size)
        what = f"model.arch=diffusers {m.name} with data.channels={d.channels}"
        return n, what, "counted on the meta device", f"lower {DATA_KEYS}, or raise model.patch_size"
    return None, "", "", ""


def check_steps(run: Any, params: Optional[int]) -> None:
    """SizeError("steps", ...) when `run.steps` is over STEPS_LIMIT (its metrics rows) or, for a model of `params`
    parameters, over the steps it could run in RUN_SECONDS_LIMIT at PEAK_FLOPS (module docstring)."""
    steps = run.steps
    if steps > STEPS_LIMIT:
        raise SizeError(
            "steps",
            f"{steps:,} is over the {STEPS_LIMIT:,} steps a run may have: it keeps a metrics row per step in memory "
            f"until it ends (~{ROW_BYTES} B each, {_bytes(ROWS_BYTES_LIMIT)} at {STEPS_LIMIT:,}) and writes each to "
            "metrics.csv; lower steps (a proxy run that shows a divergence takes far fewer: the scenarios run <= 500)",
        )
    if params is None:
        return
    d, m = run.data, run.model
    patch = max(m.patch_size, 1)
    tokens = d.batch_size * (1 if m.is_image else d.frames) * max(d.height // patch, 1) * max(d.width // patch, 1)
    flops = 6 * params * tokens
    fit = int(RUN_SECONDS_LIMIT * PEAK_FLOPS // flops)
    if steps > fit:
        raise SizeError(
            "steps",
            f"{steps:,} steps of this model ({_count(params)} parameters, {tokens:,} tokens a batch: at least "
            f"6 x parameters x tokens = {flops:.2g} FLOPs a step) would take over {RUN_SECONDS_LIMIT // 86400} days "
            f"even at an H100's dense bf16 peak ({PEAK_FLOPS / 1e12:.0f} TFLOP/s): at most {fit:,} steps; lower "
            "steps, or the model's size",
        )


def _check_bytes(what: str, values: int, product: str, limit: int, lower: str) -> None:
    if values * BYTES_PER_VALUE > limit:
        raise SizeError(
            "data",
            f"{what} is {product} = {_count(values)} values ({_bytes(values * BYTES_PER_VALUE)} as float32), "
            f"over the {_bytes(limit)} limit: {lower}",
        )


@functools.lru_cache(maxsize=64)
def native_params(
    arch: str,
    size: str,
    width: Optional[int],
    depth: Optional[int],
    patch_size: int,
    qk_norm: bool,
    channels: int,
    frames: int,
    height: int,
) -> Optional[int]:
    """Parameters of a native DiT / VideoDiT: counted at two depths, then extrapolated linearly (every block
    has the same parameters). None when it cannot be built (validate names why).

    Up to REAL_BUILD_WIDTH and REAL_BUILD_TOKENS the two small models are built for real on the CPU
    (milliseconds); larger ones on the meta device. A meta build runs the init's normal_ and arange through
    torch's Python references, whose first call imports torch._dynamo: ~2 s of CPU in every process that
    composes a config, which every sweep, job and run process does (docs/overhead.md)."""
    import torch

    from models.registry import MODEL_SIZES, build_model, count_params

    hidden = width if width is not None else MODEL_SIZES[size]["hidden_size"]
    patches = (height // max(patch_size, 1)) ** 2
    on_meta = hidden > REAL_BUILD_WIDTH or patches > REAL_BUILD_TOKENS

    def at_depth(blocks: int) -> Optional[int]:
        try:
            with torch.device("meta") if on_meta else contextlib.nullcontext():
                model = build_model(
                    arch,
                    size,
                    input_size=height,
                    in_channels=channels,
                    num_frames=None if arch == "dit" else frames,
                    patch_size=patch_size,
                    qk_norm=qk_norm,
                    width=width,
                    depth=blocks,
                )
        except Exception:  # noqa: BLE001  (a shape the model refuses: validate() and the run say why)
            return None
        return count_params(model)

    blocks = depth if depth is not None else MODEL_SIZES[size]["depth"]
    counts = [at_depth(d) for d in (2, 4)]
    if None in counts:
        return None
    per_two = counts[1] - counts[0]
    return counts[0] + per_two * (blocks - 2) // 2


@functools.lru_cache(maxsize=64)
def _diffusers_params(
    name: Optional[str], channels: int, frames: int, height: int, width: int, patch_size: int
) -> Optional[int]:
    """Parameters of a tiny diffusers zoo model at this data shape (its embeddings grow with the channels)."""
    import torch

    from models.diffusers_zoo import ZOO
    from models.registry import count_params

    if name not in ZOO:
        return None
    import diffusers

    spec = ZOO[name]
    try:
        with torch.device("meta"):
            model = getattr(diffusers, spec.cls_name)(**spec.config(channels, frames, height, width, patch_size))
    except Exception:  # noqa: BLE001  (the run's own build reports it)
        return None
    return count_params(model)


def _count(n: int) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:,.1f}{unit}"
    return str(n)


def _bytes(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"
