"""The lone layout: one run's model, forwarded as it is, and its own optimizer (sweep.run.train.Loop runs it).

A lone run is not a pack of one: its plain forward is bit for bit what torch computes for the model alone
(tests/test_reproducibility.py), where a vmapped pack of one rounds its batched matmuls differently. What it
owns that a pack does not: the forensics probe (module hooks on one step), the attention-logit statistics
(the hooks cannot see inside vmap), and an optimizer of any kind (DeviceAdamW, or a library's,
sweep/run/optimizers.py). Every method takes the pack's arguments (`live`, per-run dicts) so that the loop
reads the same for both layouts; here `live` is [0] and each dict has one entry.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from models import LogitStats, watching_logits
from sweep.config import RunConfig
from sweep.data.device import DeviceBatches
from sweep.run.adam_lag import adamw_second_moment
from sweep.run.build import RunParts
from sweep.run.evaluate import Evaluator
from sweep.run.graph import table_span
from sweep.run.step import LoneGrads, Steps, checked_batch, window_step


class Lone:
    """One run: `parts.model` forwarded under the precision policy, `parts.optimizer` its AdamW (or a library's)."""

    def __init__(self, runs: Sequence[RunConfig], parts: Sequence[RunParts], windows: bool = False):
        (run,), (parts,) = runs, parts
        self.run, self.parts, self.device, self.packed = run, parts, parts.device, [0]
        self.optimizer, self.clock = parts.optimizer, parts.optimizer.clock
        self.params = [p for p in parts.model.parameters() if p.requires_grad]
        self.generators = [parts.noise_gen]
        self.steps = Steps([parts.monitor], parts.scaler, [run.optim.grad_clip], [run.steps])
        self.logit_stats = LogitStats()
        # Windows draw synthetic batches on the device and check them there (sweep/data/device.py).
        self.device_batches = None
        if windows:
            span = table_span(run.monitor.sync_every)
            self.device_batches = DeviceBatches.of(
                parts.dataset, parts.order, run.steps, parts.device, run.data.range_limit, span
            )
        self.flagged = self.device_batches is not None and run.data.check  # a window row carries the batch's flag

    def batches(self, step: int, live: list[int]) -> tuple[dict, dict]:
        """The run's batch of `step` (sweep.run.step.checked_batch): ({0: (x0, noisy, t, target)}, {}) or
        ({}, {0: the BatchIssue})."""
        batch, issue = checked_batch(self.run, self.parts, step, self.device)
        return ({0: batch}, {}) if issue is None else ({}, {0: issue})

    def forward_backward(
        self, batches: dict, live: list[int], logits: bool = False, probe=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward under the policy, scaled backward: (loss (1,), pred (1, B, ...)). Nothing here reads the host's
        step number: the noise came from the run's generator, the lr comes from the optimizer's clock."""
        parts, policy = self.parts, self.parts.policy
        _, noisy, t, target = batches[0]
        with probe or contextlib.nullcontext(), watching_logits(parts.model, self.logit_stats, logits):
            with policy.gemm_mode():
                with policy.autocast(self.device):
                    pred = parts.model(noisy.to(policy.param_dtype), t)
                loss = (parts.objective.loss(pred, target) * self.run.objective.loss_weight).reshape(1)
                self.steps.backward(loss)
        # Detached: a kept autograd graph keeps the weights' AccumulateGrad nodes, made on the stream of the step
        # that built it, and a CUDA graph captured on a side stream then fails (sweep/run/graph.py).
        return loss.detach(), pred.detach()[None]

    def grads(self) -> LoneGrads:
        return LoneGrads([p.grad for p in self.params if p.grad is not None])

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def keep(self, live: list[int]) -> bool:
        """A lone run has nothing to compact (the loop ends when it stops): nothing changed."""
        return False

    def has_state(self) -> bool:
        return all(p in self.optimizer.state for p in self.params)  # the first update made it

    # What a first verdict's explanation (sweep.run.verdict.first_of) and the eval loss read of the run
    def weights(self, i: int) -> list[torch.Tensor]:
        return self.params

    def named(self, i: int) -> list[tuple[str, torch.Tensor]]:
        return list(self.parts.model.named_parameters())

    def second_moment(self, i: int, k: int):
        return adamw_second_moment(self.optimizer)

    def eval_loss(self, i: int, evaluator: Evaluator, step: int) -> float:
        return evaluator(self.parts.model, step)

    # A window's step (sweep/run/window.py), from device state alone: what a CUDA graph captures
    def device_step(self, live: list[int], batches: dict | None = None, logits: bool = False):
        """The batch (unless `batches`, read from files, are given) and lr of the step the clock is at, the run
        generator's next noise; forward, backward, row, AdamW, and the clock moves on.
        (row (len(Row) [+ the batch's flag], 1), pred, batches)."""
        flag = None
        if batches is None:
            x0 = self.device_batches.at(self.clock)
            flag = self.device_batches.bad(x0) if self.run.data.check else None
            batches = {0: (x0, *self.parts.objective.sample(x0, self.parts.noise_gen))}
        return window_step(self, batches, live, logits, flag)
