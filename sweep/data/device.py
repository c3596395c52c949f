"""The synthetic training set on the run's device, and every step's batch drawn there.

Synthetic clips are a pure function of (seed, index) (sweep/data/synthetic.py) and the batch order a
pure function of (seed, step) (sweep/data/batches.py), so both can live on the device from the start:
the clips copied there once, the order of the steps as an index table, a window of steps at a time
(sweep/data/step_table.py: the loop moves it on, `cover`, before the steps it runs). A step's batch is then one
gather on the device: no host work, and no copy from pageable host memory, which on a GPU waits for
the work queued before it. The data check becomes one device reduction, a flag the window of steps
fetches with its rows (sweep/run/window.py): a flagged step takes its window back, and the host's
check (sweep.data.batches.load_checked_batch) decides that step exactly as it always does.

The batches are today's, bit for bit: the same clips (faults included), the same order, a gather
instead of a stack (tests/test_data.py). A pack (sweep/run/packed.py) draws every run's batch of a step
with one gather (`PackBatches`): runs with the same clips share one copy of them on the device.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import Dataset, Subset

from sweep.data.batches import BatchOrder
from sweep.data.step_table import SPAN, Rows, StepTable
from sweep.data.synthetic import SyntheticClips


def _synthetic(dataset: Dataset) -> tuple[SyntheticClips, list[int] | None] | None:
    """(the synthetic set, the Subset's indices into it or None) when `dataset` is one; else None."""
    if isinstance(dataset, Subset) and isinstance(dataset.dataset, SyntheticClips):
        return dataset.dataset, list(dataset.indices)
    if isinstance(dataset, SyntheticClips):
        return dataset, None
    return None


class DeviceBatches:
    """Every batch of `steps` steps of a synthetic set, as gathers from its clips on `device`."""

    def __init__(self, clips: Tensor, table: StepTable, limit: float):
        self.clips, self.table, self.limit = clips, table, limit

    @classmethod
    def of(cls, dataset: Dataset, order: BatchOrder, steps: int, device: torch.device, limit: float, span: int = SPAN):
        """The device batches of `dataset` in `order`, `span` steps' indices at a time; None for data read from files
        (checked on the host)."""
        found = _synthetic(dataset)
        if found is None:
            return None
        base, subset = found
        clips = base._cache()  # (N, C, F, H, W): the clips, faults applied, as dataset[i] copies them
        if base.as_images:
            clips = clips[:, :, 0]
        to_base = subset if subset is not None else range(len(base))

        def rows(start: int, stop: int) -> Tensor:  # (stop - start, B): the steps' samples, as indices of the clips
            return torch.tensor([[to_base[i] for i in order.indices(s)] for s in range(start, stop)], dtype=torch.long)

        return cls(clips.to(device, copy=True), StepTable.of(rows, steps, device, span), limit)

    def cover(self, start: int, stop: int) -> None:
        """Steps [start, stop) are about to run from the device (sweep.data.step_table.StepTable.cover)."""
        self.table.cover(start, stop)

    def at(self, clock: Tensor) -> Tensor:
        """The batch (B, ...) of the step a device index (1,) holds: what load_batch(dataset, order.indices(step))
        stacks, with the step read on the device (a CUDA graph replays it for whatever step the clock is at)."""
        return self.clips.index_select(0, self.table.at(clock).view(-1))

    def bad(self, x: Tensor) -> Tensor:
        """A 0-dim bool on the device: the batch holds a NaN, an Inf or a value beyond the limit
        (check_batch's one reduction: NaN propagates through amax and fails the comparison)."""
        return ~(x.abs().amax() <= self.limit)


def _shifted(rows: Rows, offset: int) -> Rows:
    """A run's index rows into its own clips, as indices into the pack's concatenated clips."""
    return lambda start, stop: rows(start, stop) + offset


def _same_bytes(a: Tensor, b: Tensor) -> bool:
    """Bit for bit the same tensor (a clip's NaN equals itself here)."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


class PackBatches:
    """Every packed run's batch of a step as one gather: the runs' distinct clips concatenated on the device,
    each run's order an index table into them (a run's rows offset to its clips)."""

    def __init__(self, clips: Tensor, table: StepTable, limits: Tensor, checked: Tensor):
        self.clips, self.table, self.limits, self.checked = clips, table, limits, checked

    @classmethod
    def of(
        cls, each: list[DeviceBatches | None], checked: list[bool], device: torch.device | None = None
    ) -> "PackBatches | None":
        """From each run's DeviceBatches (made on the host's CPU: only the packed clips are copied to `device`);
        None when a run reads files. `checked[k]`: run k checks its data (data.check)."""
        if any(b is None for b in each):
            return None
        device = device or torch.device("cpu")
        distinct: list[Tensor] = []
        rows = []
        for b in each:
            at = next((i for i, c in enumerate(distinct) if _same_bytes(c, b.clips)), None)
            if at is None:
                at = len(distinct)
                distinct.append(b.clips)
            rows.append(_shifted(b.table.parts[0], sum(len(c) for c in distinct[:at])))
        # (span, K, B): a shorter run's last rows repeat, it has left the pack by then
        steps = [b.table.steps[0] for b in each]
        table = StepTable(rows, steps, device, max(b.table.span for b in each), stacked=True)
        limits = torch.tensor([b.limit for b in each], dtype=torch.float32, device=device)
        return cls(torch.cat(distinct).to(device), table, limits, torch.tensor(checked, device=device))

    def cover(self, start: int, stop: int) -> None:
        """Steps [start, stop) are about to run from the device (sweep.data.step_table.StepTable.cover)."""
        self.table.cover(start, stop)

    def keep(self, positions: list[int]) -> None:
        """Keep only the runs at these positions (a pack compacting)."""
        index = torch.tensor(positions, dtype=torch.long, device=self.limits.device)
        self.table.keep(positions)
        self.limits, self.checked = self.limits[index], self.checked[index]

    def at(self, clock: Tensor) -> Tensor:
        """Every packed run's batch (K, B, ...) of the step a device index (1,) holds, each bit for bit its
        DeviceBatches.at (a CUDA graph replays it for whatever step that is)."""
        rows = self.table.at(clock)  # (1, K, B)
        return self.clips.index_select(0, rows.reshape(-1)).view(rows.shape[1], rows.shape[2], *self.clips.shape[1:])

    def bad(self, x: Tensor) -> Tensor:
        """(K,) bool on the device: run k checks its data and its batch x[k] holds a NaN, an Inf or a value beyond
        its limit (DeviceBatches.bad per run)."""
        return self.checked & ~(x.abs().flatten(1).amax(1) <= self.limits)
