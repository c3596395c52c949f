"""The per-sample data check shared by the data doctor and any training loader.

``check_sample(x)`` answers "would this sample poison a run?" for one tensor, with the same
semantics as ``sweep.data.check_batch`` (the check the training loop runs on every batch, whose
``bad_input`` verdict the doctor predicts): NaN > Inf > out-of-range in [-limit, limit], limit
defaulting to ``DataConfig.range_limit``. It adds one thing a batch check cannot see: a constant
sample (an all-black clip, a zero latent) that trains nothing.

Cost: one ``torch.aminmax`` pass in the common case. NaN propagates through it and Inf is the
largest magnitude, so ``max(-min, max) <= limit`` passes only for finite, in-range samples, and
``max - min`` gives the constant check from the same reduction. Only a sample that fails goes
through ``check_batch`` to be described.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from .data import check_batch

RANGE_LIMIT = 1.001
"""Same default as ``DataConfig.range_limit``: data is expected in [-1, 1]."""

CONSTANT_TOL = 0.02
"""A sample whose max - min is at most this is constant (1 uint8 level is 2/255 = 0.0078 in [-1, 1])."""

# Every kind of problem the doctor reports, most severe first (the order of the summary table).
PROBLEM_KINDS = ("unreadable", "truncated", "empty", "nan", "inf", "range", "shape", "frames", "constant")


@dataclass(frozen=True)
class SampleProblem:
    """One thing wrong with one sample."""

    kind: str  # one of PROBLEM_KINDS
    detail: str  # one human-readable line

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SampleStats:
    """What one reduction tells about a sample (NaN min/max when it holds a NaN)."""

    min: float
    max: float


def check_sample(
    x: Tensor, limit: float = RANGE_LIMIT, constant_tol: float = CONSTANT_TOL
) -> tuple[list[SampleProblem], SampleStats | None]:
    """Problems of one sample's values (nan/inf/range as check_batch decides them, or constant), and its stats."""
    if x.numel() == 0:
        return [SampleProblem("empty", "the tensor has no elements")], None
    x = x.detach()
    if not x.is_floating_point():
        x = x.float()  # integer/bool data: compare values as they would reach the model
    lo, hi = (float(v) for v in torch.aminmax(x))  # the one reduction of the common case
    stats = SampleStats(lo, hi)
    if max(-lo, hi) <= limit:  # False for NaN
        if hi - lo <= constant_tol:
            return [SampleProblem("constant", f"every value is {_constant_name(lo, hi)}")], stats
        return [], stats

    issue = check_batch(x.unsqueeze(0), limit)
    assert issue is not None  # aminmax and check_batch agree on what is out of range
    detail = issue.detail.removeprefix("position 0: ")
    if issue.kind == "range" and lo >= 0 and hi <= 255:
        detail += " (looks like [0, 255] pixel data fed as [-1, 1])"
    return [SampleProblem(issue.kind, detail)], stats


def _constant_name(lo: float, hi: float) -> str:
    """'-1 (all black)' for decoded black video, else the value (or the tiny range)."""
    value = f"{lo:.4g}" if lo == hi else f"within [{lo:.4g}, {hi:.4g}]"
    return value + (" (all black)" if hi <= -1 + CONSTANT_TOL else "")
