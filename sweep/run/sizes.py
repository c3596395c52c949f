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
    m = run.model
    if m.arch.value in ("dit", "video_dit"):
        n = _native_params(
            m.arch.value, m.size, m.width, m.depth, m.patch_size, m.qk_norm, d.channels, d.frames, d.height
        )
        lower = "lower model.width or model.depth (or pick a smaller model.size)"
        how = "counted at depths 2 and 4 and extrapolated"
        what = f"model.arch={m.arch.value} size {m.size}" + "".join(
            f" {k}={v}" for k, v in (("width", m.width), ("depth", m.depth)) if v is not None
        )
    elif m.arch.value == "diffusers":
        n = _diffusers_params(m.name, d.channels, d.frames, d.height, d.width, m.patch_size)
        lower = f"lower {DATA_KEYS}, or raise model.patch_size"
        how = "counted on the meta device"
        what = f"model.arch=diffusers {m.name} with data.channels={d.channels}"
    else:
        return
    if n is not None and n > PARAMS_LIMIT:
        raise SizeError(
            "model",
            f"{what} would have ~{_count(n)} parameters ({how}), over the {PARAMS_LIMIT / 1e6:,.0f}M limit: {lower}",
        )


def _check_bytes(what: str, values: int, product: str, limit: int, lower: str) -> None:
    if values * BYTES_PER_VALUE > limit:
        raise SizeError(
            "data",
            f"{what} is {product} = {_count(values)} values ({_bytes(values * BYTES_PER_VALUE)} as float32), "
            f"over the {_bytes(limit)} limit: {lower}",
        )


@functools.lru_cache(maxsize=64)
def _native_params(
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
