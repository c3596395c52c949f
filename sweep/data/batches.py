"""Which samples make batch `step`, and loading them with the check the training loop runs.

The batch order is a pure function of ``(seed, step)``, like the synthetic data: the sample stream
is the concatenation of per-epoch permutations, and batch ``step`` is the slice
``[step * B, (step + 1) * B)`` of it, so a run can resume at any step without replaying the steps
before it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import torch
from torch import Tensor
from torch.utils.data import Dataset

from sweep.data.checks import BatchIssue, check_batch
from sweep.data.synthetic import generator, sample_seed

# Salts keep the data stream and the order stream from sharing generator seeds.
_ORDER_SALT = 0x5EED_0DE5


@lru_cache(maxsize=4)
def _epoch_permutation(num_samples: int, seed: int, epoch: int) -> tuple[int, ...]:
    """The sample order of one epoch; cached because consecutive steps share an epoch."""
    g = generator(sample_seed(seed, epoch, _ORDER_SALT))
    return tuple(torch.randperm(num_samples, generator=g).tolist())


class BatchOrder:
    """Replayable batch order: indices(step) is a pure function of (seed, step)."""

    def __init__(self, num_samples: int, batch_size: int, seed: int, skip: Sequence[int] = ()) -> None:
        if num_samples < 1 or batch_size < 1:
            raise ValueError("num_samples and batch_size must be >= 1")
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.skip = frozenset(skip)
        """Samples left out of the batches that draw them (data.skip_samples); the others keep their steps."""

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
        if self.skip:
            kept = [i for i in out if i not in self.skip]
            if not kept:
                raise ValueError(f"data.skip_samples leaves batch {step} empty (it draws only {sorted(out)})")
            return kept
        return out


def load_batch(dataset: Dataset, indices: Sequence[int]) -> Tensor:
    """Stack dataset[i] for i in indices into one (B, ...) tensor."""
    return torch.stack([dataset[i] for i in indices])


def sample_labels(dataset: Dataset, indices: Sequence[int]) -> list:
    """How each sample is named in a verdict: the dataset's label (a folder's file) or its index."""
    label = getattr(dataset, "label", None)
    return [label(i) for i in indices] if label else list(indices)


def load_checked_batch(
    dataset: Dataset, indices: Sequence[int], limit: float, check: bool = True
) -> tuple[Tensor, BatchIssue | None]:
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
    return x, check_batch(x, limit, sample_labels(dataset, indices), "data.range_limit") if check else None
