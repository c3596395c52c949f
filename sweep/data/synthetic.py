"""Deterministic synthetic video clips, with deliberate faults on request.

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

_MAX_SHAPES = 3


def sample_seed(seed: int, index: int, salt: int = 0) -> int:
    """Mix (seed, index) into one 64-bit generator seed."""
    # manual_seed accepts [0, 2**64); the modulo keeps huge or negative seeds legal.
    return (seed * 1_000_003 + index + salt) % 2**64


def generator(seed: int) -> torch.Generator:
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
        data[i] = _render_clip(generator(sample_seed(seed, i)), channels, frames, height, width)
    return data


@lru_cache(maxsize=2)  # a sweep evaluates every run on the same held-out clips
def _render_range(seed: int, start: int, count: int, channels: int, frames: int, height: int, width: int) -> Tensor:
    """Clips start .. start+count-1 as (count, C, F, H, W), each rendered alone exactly as _render_all renders it.
    A separate cache from _render_all's: rendering held-out clips never evicts or touches the training clips."""
    data = torch.empty(count, channels, frames, height, width)
    for j in range(count):
        data[j] = _render_clip(generator(sample_seed(seed, start + j)), channels, frames, height, width)
    return data


def held_out_clips(
    seed: int, num_samples: int, count: int, channels: int, frames: int, height: int, width: int, as_images: bool
) -> Tensor:
    """The `count` clips right after the training set, indices [num_samples, num_samples + count): the batch
    order draws from range(num_samples) only, so no training step ever sees them. Clean (faults index the
    training set only), float32, (count, C, F, H, W) or (count, C, H, W) with as_images; a copy."""
    clips = _render_range(seed, num_samples, count, channels, frames, height, width).clone()
    return clips[:, :, 0] if as_images else clips


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
