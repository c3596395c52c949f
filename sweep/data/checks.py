"""The data checks: per sample (the data doctor, data.drop_bad) and per batch (every training step).

``check_sample(x)`` answers "would this sample poison a run?" for one tensor, with the same
semantics as ``check_batch`` below (the check the training loop runs on every batch, whose
``bad_input`` verdict the doctor predicts): NaN > Inf > out-of-range in [-limit, limit], limit
defaulting to ``DataConfig.range_limit``. It adds one thing a batch check cannot see: a constant
sample (an all-black clip, a zero latent) that trains nothing.

Cost: one ``torch.aminmax`` pass in the common case. NaN propagates through it and Inf is the
largest magnitude, so ``max(-min, max) <= limit`` passes only for finite, in-range samples, and
``max - min`` gives the constant check from the same reduction. Only a sample that fails goes
through ``check_batch`` to be described.

``check_batch`` costs one reduction per batch in the common case; ``amax`` propagates NaN
on torch's CPU kernels (and Inf is simply the largest magnitude), so a single
``x.abs().amax()`` flags NaN, Inf and out-of-range values at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

# Most severe first: a NaN poisons everything, an Inf usually becomes NaN a step later,
# out-of-range data only skews the loss.
_SEVERITY = ("nan", "inf", "range")

RANGE_LIMIT = 1.001
"""Same default as ``DataConfig.range_limit``: data is expected in [-1, 1]."""

CONSTANT_TOL = 0.02
"""A sample whose max - min is at most this is constant (1 uint8 level is 2/255 = 0.0078 in [-1, 1])."""

# Every kind of problem the doctor reports, most severe first (the order of the summary table).
PROBLEM_KINDS = (
    "unreadable",
    "truncated",
    "empty",
    "mode",
    "nan",
    "inf",
    "range",
    "shape",
    "frames",
    "size",
    "constant",
)


class DataError(ValueError):
    """The run's data cannot be used at all (no files of its kind, every sample refused): a user's mistake, so the
    run ends `error` with this one line as its reason and no traceback (sweep/run/execute.py `fail`)."""


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


@dataclass(frozen=True)
class BatchIssue:
    """What check_batch found wrong with a batch."""

    kind: str  # most severe kind present: "nan" > "inf" > "range"
    positions: list[int]  # every bad position within the batch, of any kind
    amax: float  # the batch's abs-max as reduced (NaN when a NaN is present)
    detail: str  # one human-readable line


def check_batch(
    x: Tensor, limit: float = 1.0 + 1e-3, indices: Sequence[int] | None = None, limit_key: str | None = None
) -> BatchIssue | None:
    """None when every value is finite with |x| <= limit, else a BatchIssue; indices only label detail, and
    `limit_key` (the config key that set `limit`) is named after it when values are out of range."""
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
    if limit_key and bool((out_of_range > 0).any()):
        more += f" ({limit_key}={limit:g}; VAE latents have about unit variance: raise it to what they reach)"
    return BatchIssue(kind=kind, positions=positions, amax=float(amax), detail="; ".join(shown) + more)
