"""Deterministic synthetic video clips, replayable batch order, and a cheap batch check.

A precision sweep needs data that is (a) structured enough that a model has something to
learn, so a diverging run looks different from a converging one, (b) reproducible to the
bit, so a divergence at step 1234 can be replayed, and (c) able to carry deliberate faults,
so the divergence detector can be tested against the data bugs it is meant to catch.

Each clip is a drifting sinusoidal grating (the background) with 1-3 discs or squares that
move at constant velocity and wrap around the frame edges. Sample ``i`` is drawn from its own
``torch.Generator`` seeded with ``seed * 1_000_003 + i``, so it is a pure function of
``(seed, i)``: it does not depend on ``num_samples``, on which samples were generated before,
or on the global RNG. Rendering is vectorised over a (frame, row, column) grid and done one
sample at a time, on purpose: CPU kernels may compute an element differently depending on
where it falls in a tensor (vector body vs. scalar tail), and per-sample rendering keeps
every sample's arithmetic identical no matter how large the dataset is. Every value is a
convex mix of numbers in [-0.9, 0.9], so clean clips lie strictly inside [-1, 1].

The batch order is likewise a pure function of ``(seed, step)``: the sample stream is the
concatenation of per-epoch permutations, and batch ``step`` is the slice
``[step * B, (step + 1) * B)`` of it, so a run can resume at any step without replaying
the steps before it.

``check_batch`` costs one reduction per batch in the common case; ``amax`` propagates NaN
on torch's CPU kernels (and Inf is simply the largest magnitude), so a single
``x.abs().amax()`` flags NaN, Inf and out-of-range values at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor
from torch.utils.data import Dataset

FAULT_KINDS = ("nan", "inf", "range")
# Most severe first: a NaN poisons everything, an Inf usually becomes NaN a step later,
# out-of-range data only skews the loss.
_SEVERITY = ("nan", "inf", "range")

_MAX_SHAPES = 3
# Salts keep the data stream and the order stream from sharing generator seeds.
_ORDER_SALT = 0x5EED_0DE5


def _stream_seed(seed: int, index: int, salt: int = 0) -> int:
    """Mix (seed, index) into one 64-bit generator seed."""
    # manual_seed accepts [0, 2**64); the modulo keeps huge or negative seeds legal.
    return (seed * 1_000_003 + index + salt) % 2**64


def _generator(seed: int) -> torch.Generator:
    """A fresh CPU generator with the given seed."""
    g = torch.Generator()
    g.manual_seed(seed)
    return g


@dataclass(frozen=True)
class Fault:
    """A deliberate data bug injected into one sample."""

    index: int
    kind: str  # "nan": NaN patch, "inf": +Inf patch, "range": sample rescaled to [0, 255]

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; choose one of {FAULT_KINDS}")


def _fault_region(frames: int, height: int, width: int) -> tuple[int, slice, slice]:
    """The (frame, rows, cols) patch that NaN/Inf faults overwrite, in every channel."""
    h, w = max(1, height // 4), max(1, width // 4)
    r0, c0 = (height - h) // 2, (width - w) // 2
    return frames // 2, slice(r0, r0 + h), slice(c0, c0 + w)


def _render_clip(g: torch.Generator, channels: int, frames: int, height: int, width: int) -> Tensor:
    """Draw one clip's parameters from g and render it as (C, F, H, W) in [-0.9, 0.9]."""
    two_pi = 2 * math.pi
    # Pixel-centre coordinates in [0, 1); t counts frames. Shapes broadcast to (F, H, W).
    t = torch.arange(frames, dtype=torch.float32).view(frames, 1, 1)
    y = ((torch.arange(height, dtype=torch.float32) + 0.5) / height).view(1, height, 1)
    x = ((torch.arange(width, dtype=torch.float32) + 0.5) / width).view(1, 1, width)

    # A fixed number of draws in a fixed order, so the stream layout never depends on the
    # values drawn (e.g. on how many shapes this clip happens to have).
    angle, cycles, phase, drift = torch.rand(4, generator=g).tolist()
    base = (torch.rand(channels, generator=g) * 0.8 - 0.4).view(channels, 1, 1, 1)
    amp = (torch.rand(channels, generator=g) * 0.4 + 0.1).view(channels, 1, 1, 1)
    count_u = torch.rand(1, generator=g).item()
    shape_u = torch.rand(_MAX_SHAPES, 7, generator=g)
    colours = torch.rand(_MAX_SHAPES, channels, generator=g) * 1.8 - 0.9

    # Background: base + amp * sin(...) with |base| + amp <= 0.9.
    theta = angle * two_pi
    k = 1.0 + 2.0 * cycles  # 1-3 cycles across the frame
    omega = (drift - 0.5) * 1.2  # up to 0.6 rad per frame, either direction
    wave = torch.sin(two_pi * k * (x * math.cos(theta) + y * math.sin(theta)) - omega * t + phase * two_pi)
    clip = base + amp * wave.unsqueeze(0)

    # Soft 1-pixel edges keep the content band-limited, so tiny models can fit it.
    edge = float(min(height, width))
    for s in range(1 + min(int(count_u * _MAX_SHAPES), _MAX_SHAPES - 1)):
        is_disc, radius_u, px, py, speed_u, heading, _ = shape_u[s].tolist()
        radius = 0.12 + 0.18 * radius_u
        speed = 0.04 + 0.08 * speed_u  # image widths per frame: every shape visibly moves
        vx, vy = speed * math.cos(heading * two_pi), speed * math.sin(heading * two_pi)
        # Wrapped offsets in [-0.5, 0.5): shapes leave one edge and re-enter at the other.
        dx = torch.remainder(x - (px + vx * t) + 0.5, 1.0) - 0.5
        dy = torch.remainder(y - (py + vy * t) + 0.5, 1.0) - 0.5
        dist = torch.sqrt(dx * dx + dy * dy) if is_disc < 0.5 else torch.maximum(dx.abs(), dy.abs())
        alpha = ((radius - dist) * edge + 0.5).clamp(0.0, 1.0).unsqueeze(0)
        clip = clip + alpha * (colours[s].view(channels, 1, 1, 1) - clip)
    return clip.contiguous()


@lru_cache(maxsize=2)  # ~0.8 MB for the default data; a grid rarely sweeps more than one data config
def _render_all(seed: int, num_samples: int, channels: int, frames: int, height: int, width: int) -> Tensor:
    """Every clip, clean, as (N, C, F, H, W). Cached per process: the content is a pure function of these
    arguments, and multirun jobs share a process and mostly the same data; callers get copies only."""
    data = torch.empty(num_samples, channels, frames, height, width)
    for i in range(num_samples):
        data[i] = _render_clip(_generator(_stream_seed(seed, i)), channels, frames, height, width)
    return data


class SyntheticClips(Dataset):
    """Map-style dataset of synthetic clips (C, F, H, W), or images (C, H, W) with as_images."""

    def __init__(
        self,
        num_samples: int,
        frames: int,
        channels: int,
        height: int,
        width: int,
        seed: int,
        faults: Sequence[Fault] = (),
        as_images: bool = False,
    ) -> None:
        if min(num_samples, frames, channels, height, width) < 1:
            raise ValueError("num_samples, frames, channels, height and width must all be >= 1")
        if as_images and frames != 1:
            raise ValueError(f"as_images needs frames=1, got frames={frames}")
        for fault in faults:
            if not 0 <= fault.index < num_samples:
                raise ValueError(f"fault index {fault.index} outside [0, {num_samples})")
        self.num_samples, self.frames, self.channels = num_samples, frames, channels
        self.height, self.width, self.seed = height, width, seed
        self.faults = tuple(faults)
        self.as_images = as_images
        self._data: Tensor | None = None

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one item: (C, H, W) with as_images, else (C, F, H, W)."""
        if self.as_images:
            return (self.channels, self.height, self.width)
        return (self.channels, self.frames, self.height, self.width)

    def _cache(self) -> Tensor:
        """All clips as one (N, C, F, H, W) tensor, made on first use: a copy of the process's rendering."""
        if self._data is None:
            data = _render_all(self.seed, self.num_samples, self.channels, self.frames, self.height, self.width).clone()
            frame, rows, cols = _fault_region(self.frames, self.height, self.width)
            for fault in self.faults:
                if fault.kind == "range":
                    # The classic bug: uint8 pixels fed where [-1, 1] was expected.
                    data[fault.index] = (data[fault.index] + 1.0) * 127.5
                else:
                    value = math.nan if fault.kind == "nan" else math.inf
                    data[fault.index, :, frame, rows, cols] = value
            self._data = data
        return self._data

    def clip(self, i: int) -> Tensor:
        """Sample i as (C, F, H, W) float32, a copy safe to modify."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} outside [0, {self.num_samples})")
        return self._cache()[i].clone()

    def image(self, i: int) -> Tensor:
        """Sample i as (C, H, W); only for frames=1."""
        if self.frames != 1:
            raise ValueError(f"image() needs frames=1, this dataset has frames={self.frames}")
        return self.clip(i)[:, 0]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> Tensor:
        return self.image(i) if self.as_images else self.clip(i)


@lru_cache(maxsize=4)
def _epoch_permutation(num_samples: int, seed: int, epoch: int) -> tuple[int, ...]:
    """The sample order of one epoch; cached because consecutive steps share an epoch."""
    g = _generator(_stream_seed(seed, epoch, _ORDER_SALT))
    return tuple(torch.randperm(num_samples, generator=g).tolist())


class BatchOrder:
    """Replayable batch order: indices(step) is a pure function of (seed, step)."""

    def __init__(self, num_samples: int, batch_size: int, seed: int) -> None:
        if num_samples < 1 or batch_size < 1:
            raise ValueError("num_samples and batch_size must be >= 1")
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed

    def epoch(self, step: int) -> int:
        """The epoch in which batch `step` starts."""
        return step * self.batch_size // self.num_samples

    def indices(self, step: int) -> list[int]:
        """Slice [step*B, (step+1)*B) of the concatenated per-epoch permutations."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n, start = self.num_samples, step * self.batch_size
        stop = start + self.batch_size
        out: list[int] = []
        # A batch may straddle epochs (or span several when batch_size > num_samples).
        for epoch in range(start // n, (stop - 1) // n + 1):
            lo, hi = max(start, epoch * n), min(stop, (epoch + 1) * n)
            out.extend(_epoch_permutation(n, self.seed, epoch)[lo - epoch * n : hi - epoch * n])
        return out


def load_batch(dataset: Dataset, indices: Sequence[int]) -> Tensor:
    """Stack dataset[i] for i in indices into one (B, ...) tensor."""
    return torch.stack([dataset[i] for i in indices])


@dataclass(frozen=True)
class BatchIssue:
    """What check_batch found wrong with a batch."""

    kind: str  # most severe kind present: "nan" > "inf" > "range"
    positions: list[int]  # every bad position within the batch, of any kind
    amax: float  # the batch's abs-max as reduced (NaN when a NaN is present)
    detail: str  # one human-readable line


def check_batch(x: Tensor, limit: float = 1.0 + 1e-3, indices: Sequence[int] | None = None) -> BatchIssue | None:
    """None when every value is finite with |x| <= limit, else a BatchIssue; indices only label detail."""
    if x.numel() == 0:
        return None
    # The common case: one reduction. NaN propagates through amax and NaN <= limit is False,
    # so this comparison passes only for fully finite, in-range batches.
    amax = x.detach().abs().amax()
    if bool(amax <= limit):
        return None

    flat = x.detach().reshape(x.shape[0], -1)
    nan = flat.isnan().sum(1)
    inf = flat.isinf().sum(1)
    big = flat.abs() > limit  # False for NaN, True for Inf
    out_of_range = (big & ~flat.isinf()).sum(1)
    finite_max = flat.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).abs().amax(1)
    counts = {"nan": nan, "inf": inf, "range": out_of_range}

    kind = next(k for k in _SEVERITY if bool((counts[k] > 0).any()))
    positions = ((nan + inf + out_of_range) > 0).nonzero().flatten().tolist()

    def describe(p: int) -> str:
        name = f"sample {indices[p]}" if indices is not None else f"position {p}"
        parts = []
        if nan[p]:
            parts.append(f"{int(nan[p])} NaN values")
        if inf[p]:
            parts.append(f"{int(inf[p])} Inf values")
        if out_of_range[p]:
            parts.append(f"values up to {float(finite_max[p]):.4g} outside [-{limit:.3g}, {limit:.3g}]")
        return f"{name}: {', '.join(parts)}"

    shown = [describe(p) for p in positions[:3]]
    more = f"; +{len(positions) - 3} more" if len(positions) > 3 else ""
    return BatchIssue(kind=kind, positions=positions, amax=float(amax), detail="; ".join(shown) + more)


def sample_labels(dataset: Dataset, indices: Sequence[int]) -> list:
    """How each sample is named in a verdict: the dataset's label (a folder's file) or its index."""
    label = getattr(dataset, "label", None)
    return [label(i) for i in indices] if label else list(indices)


def load_checked_batch(dataset: Dataset, indices: Sequence[int], limit: float,
                       check: bool = True) -> tuple[Tensor, BatchIssue | None]:
    """The batch, and what makes it bad input: a sample the dataset could not read (always), or
    NaN/Inf/out-of-range values (when check; one reduction in the common case)."""
    x = load_batch(dataset, indices)
    problem = getattr(dataset, "problem", None)
    unusable = [(p, problem(i)) for p, i in enumerate(indices) if problem and problem(i)] if problem else []
    if unusable:
        labels = sample_labels(dataset, [indices[p] for p, _ in unusable])
        detail = "; ".join(f"sample {name}: {why}" for name, (_, why) in zip(labels[:3], unusable[:3]))
        more = f"; +{len(unusable) - 3} more" if len(unusable) > 3 else ""
        return x, BatchIssue(kind="unreadable", positions=[p for p, _ in unusable], amax=math.nan, detail=detail + more)
    return x, check_batch(x, limit, sample_labels(dataset, indices)) if check else None
