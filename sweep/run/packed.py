"""Trial packing: K runs of one architecture trained as one vectorised computation.

    python -m sweep -m hydra/launcher=packed hydra.launcher.pack=8 optim.lr=1e-4,3e-4,1e-3,3e-3,1e-2,3e-2

On tiny proxy models a training step is dominated by fixed per-op costs, so K runs one after another
waste most of the machine. Here the K models' weights are stacked and one vmapped forward and backward
runs all K at once (sweep/run/packed_model.py). This module is the stacked layout of the one training loop
(sweep.run.train.Loop, whose lone layout is sweep/run/lone.py): the loop's steps, windows and per-run finish are
the lone run's, and what differs lives here.

What stays per run is everything that decides its verdict: its own initial weights, data order and
noise (its own seed), its own loss scale (a per-run row of DeviceLossScaler: an overflow in one run neither skips
the step nor halves the scale of the others), its own gradient norm and clipping, its own AdamW
(torch's single-tensor AdamW, bit for bit, on its slice of the stacked weights, with its own lr
schedule, betas, eps and weight decay: sweep/run/adamw.py), its own DivergenceMonitor, and it
leaves the pack at its own first bad step (the stacked tensors are compacted) while the others go on.
Runs are independent inside vmap, so a NaN in one never reaches another.

What differs from running alone: the batched matmuls may round differently from the unbatched
ones, so loss curves agree to a tolerance, not bit for bit (tests/test_packing.py measures it), and
packed runs record no attention-logit statistics (the logit hooks cannot see inside vmap).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.func import vmap

from sweep.config import RunConfig
from sweep.data.device import DeviceBatches, PackBatches
from sweep.run.build import RunParts
from sweep.run.evaluate import Evaluator
from sweep.run.graph import table_span
from sweep.run.packed_model import PackedModel
from sweep.run.scaler import DeviceLossScaler
from sweep.run.stacked_adamw import StackedAdamW, group_of
from sweep.run.step import StackedGrads, Steps, checked_batch, window_step


class Stacked:
    """K runs' weights stacked (PackedModel), one vmapped forward and backward, StackedAdamW; compacted to the runs
    still training (`keep`). `packed` are the runs (indices into `runs`) in the stacked tensors, in order."""

    def __init__(self, runs: Sequence[RunConfig], parts: Sequence[RunParts], windows: bool = False):
        self.runs, self.parts = runs, parts
        self.device, self.policy = parts[0].device, parts[0].policy
        self.model = PackedModel([p.model for p in parts])
        self.optimizer = StackedAdamW(parts, self.model.params, group_of(parts[0].model, parts[0].optimizer))
        self.clock = self.optimizer.clock
        scaler = DeviceLossScaler.stack([p.scaler for p in parts])
        self.steps = Steps(
            [p.monitor for p in parts], scaler, [r.optim.grad_clip for r in runs], [r.steps for r in runs]
        )
        self.packed = list(range(len(runs)))
        self.logit_stats = None
        # Windows draw every run's synthetic batch with one gather on the device (sweep/data/device.py).
        self.device_batches = None
        if windows:
            cpu, span = torch.device("cpu"), table_span(max(r.monitor.sync_every for r in runs))
            each = [
                DeviceBatches.of(p.dataset, p.order, r.steps, cpu, r.data.range_limit, span)
                for r, p in zip(runs, parts)
            ]
            self.device_batches = PackBatches.of(each, [r.data.check for r in runs], self.device)
        self.flagged = self.device_batches is not None  # each run's data flag is in its row
        self.loss_weights = torch.tensor([r.objective.loss_weight for r in runs], device=self.device)

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for p in self.model.params.values() if p.requires_grad]

    @property
    def generators(self) -> list[torch.Generator]:
        return [self.parts[k].noise_gen for k in self.packed]

    def keep(self, live: list[int]) -> bool:
        """Runs that left the pack stop costing: keep only `live` in the stacked tensors. True when they changed
        (a CUDA graph of the step captured the tensors just replaced)."""
        if live == self.packed:
            return False
        positions = [self.packed.index(k) for k in live]
        for part in (self.model, self.optimizer, self.steps, self.device_batches):
            if part is not None:
                part.keep(positions)
        self.optimizer.params = self.model.params
        self.loss_weights = self.loss_weights[positions]
        self.packed = live
        return True

    def batches(self, step: int, live: list[int]) -> tuple[dict, dict]:
        """Each live run's own batch, data check and noise, in its own order (sweep.run.step.checked_batch):
        ({k: (x0, noisy, t, target)}, {k: the BatchIssue of a run whose batch is bad})."""
        batches, issues = {}, {}
        for k in live:
            batch, issue = checked_batch(self.runs[k], self.parts[k], step, self.device)
            if issue is None:
                batches[k] = batch
            else:
                issues[k] = issue
        return batches, issues

    def forward_backward(
        self, batches: dict, live: list[int], logits: bool = False, probe=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One vmapped forward and the scaled backward of every live run: (loss (L,), pred (L, B, ...))."""
        policy, device = self.policy, self.device
        noisy, t, target = (torch.stack([batches[k][j] for k in live]) for j in (1, 2, 3))
        with policy.gemm_mode():
            with policy.autocast(device):
                pred = self.model(noisy.to(policy.param_dtype), t)  # (L, B, ...)
            loss = vmap(self.parts[0].objective.loss)(pred, target) * self.loss_weights  # (L,)
            self.steps.backward(loss)
        return loss.detach(), pred.detach()  # no autograd graph kept alive (sweep/run/lone.py says why)

    def grads(self) -> StackedGrads:
        return StackedGrads(self.model.grads())

    def zero_grad(self) -> None:
        self.model.zero_grad()

    def has_state(self) -> bool:
        return True  # the stacked moments exist from the start

    # What a first verdict's explanation (sweep.run.verdict.first_of) and the eval loss read of run k at position i
    def weights(self, i: int) -> list[torch.Tensor]:
        return [p.detach()[i] for p in self.model.params.values() if p.requires_grad]

    def named(self, i: int) -> list[tuple[str, torch.Tensor]]:
        return self.model.run_params(i)

    def second_moment(self, i: int, k: int):
        return self.optimizer.second_moment(i, k)

    def eval_loss(self, i: int, evaluator: Evaluator, step: int) -> float:
        """Run i's weight slice forwarded alone (no vmap): its eval loss as a lone run would compute it."""
        return evaluator(self.model.base, step, forward=self.model.forward_of(i))

    # A window's step (sweep/run/window.py), from device state alone: what a CUDA graph captures
    def device_step(self, live: list[int], batches: dict | None = None, logits: bool = False):
        """Every live run's batch (unless `batches`, read from files, are given) and lr of the step the clock is
        at, each run's next noise, the vmapped forward and backward, AdamW for every run, and the clock moves on.
        (rows (len(Row), L), or len(Row) + 1 with each run's data flag when the batches were drawn here; pred;
        {k: (x0, noisy, t, target)})."""
        flags = None
        if batches is None:
            x0 = self.device_batches.at(self.clock)  # (L, B, ...)
            flags = self.device_batches.bad(x0)
            batches = {
                k: (x0[i], *self.parts[k].objective.sample(x0[i], self.parts[k].noise_gen)) for i, k in enumerate(live)
            }
        return window_step(self, batches, live, logits, flags)
