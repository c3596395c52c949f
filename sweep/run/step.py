"""What happens after a backward, for K runs at once: one piece of code for a lone run and a pack.

The loop (sweep/run/train.py) trains one run (K=1, the lone layout) or K runs stacked (the pack's layout); from
their losses and gradients on, both go through `Steps`, in this order:

1. unscale each run's gradients by its own loss scale and take each run's global gradient norm;
2. the scaler decides on the device (sweep/run/scaler.py): step, skip, or collapse, per run; clipping
   is a multiply by a per-run device factor (1 where the norm is under the limit);
3. ONE device sync fetches every run's loss, norm, scale and decision together (`record` makes the
   row with no sync, so a window of steps can fetch many rows at once);
4. per run, on the host: the monitor's verdict (`judge`);
5. the loop applies its optimizer to the runs that step (DeviceAdamW alone: sweep/run/adamw.py; StackedAdamW packed:
   sweep/run/stacked_adamw.py);
6. per run: the stall check after an update, the explanation of a first verdict, the metrics row.

The layouts (sweep/run/lone.py, sweep/run/packed.py) keep only what differs between them: how the batch gets into
the model, the optimizer, and where the explanation finds a run's weights and prediction.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Callable, Protocol, Sequence, runtime_checkable

import torch

from sweep.config import RunConfig
from sweep.data.batches import BatchIssue, load_checked_batch
from sweep.run.monitor import Divergence, DivergenceMonitor
from sweep.run.precision import ScalerEvent
from sweep.run.results import MetricsLog
from sweep.run.scaler import EVENTS, DeviceLossScaler

if TYPE_CHECKING:
    from sweep.run.build import RunParts


def checked_batch(
    run: RunConfig, parts: RunParts, step: int, device: torch.device
) -> tuple[tuple | None, BatchIssue | None]:
    """A run's batch of `step` (a pure function of the step), checked before it reaches the model (no sync), and its
    noise from the run's generator: ((x0, noisy, t, target), None), or (None, the BatchIssue)."""
    x0, issue = load_checked_batch(parts.dataset, parts.order.indices(step), run.data.range_limit, run.data.check)
    if issue is not None:
        return None, issue
    return (x0, *parts.objective.sample(x0.to(device), parts.noise_gen)), None


def window_step(layout, batches: dict, live: list[int], logits: bool, flags: torch.Tensor | None) -> tuple:
    """The part of a layout's window step (sweep/run/lone.py, packed.py `device_step`) both layouts share: forward
    and scaled backward, the row (`Steps.record`), the optimizer's update (unconditional: a step the scaler or monitor
    would have stopped takes the window back), the clock moved on. (row (len(Row) [+ each run's data flag], L), pred,
    batches)."""
    loss, pred = layout.forward_backward(batches, live, logits)
    row = layout.steps.record(loss, layout.grads())
    layout.optimizer.step()
    layout.clock.add_(1)
    return (row if flags is None else torch.cat([row, flags.double().view(1, -1)])), pred, batches


class Grads(Protocol):
    """The gradients of K runs, however they are laid out."""

    def norms(self) -> torch.Tensor:
        """Each run's global L2 norm (K,), accumulated in fp32."""

    def scale_(self, factors: torch.Tensor) -> None:
        """Multiply run k's gradients by factors[k] (float64), in place, the factor rounded to the gradient's
        dtype first: bit for bit what torch._foreach_mul_ with it as a Python float does."""

    def of(self, i: int) -> list[torch.Tensor]:
        """Run i's gradients."""


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over all gradients, accumulated in fp32 (a fp16 norm of fp16 grads overflows first)."""
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))


class LoneGrads:
    """One run's gradients: a list of tensors, one per parameter."""

    def __init__(self, grads: list[torch.Tensor]):
        self.grads = grads

    def norms(self) -> torch.Tensor:
        return global_grad_norm(self.grads).reshape(1)

    def scale_(self, factors: torch.Tensor) -> None:
        for dtype in {g.dtype for g in self.grads}:  # one foreach op per dtype (there is one, in practice)
            torch._foreach_mul_([g for g in self.grads if g.dtype == dtype], factors[0].to(dtype))

    def of(self, i: int) -> list[torch.Tensor]:
        return self.grads


class StackedGrads:
    """The pack's gradients: one (K, ...) tensor per parameter, run k's in row k (sweep.run.step.Grads)."""

    def __init__(self, grads: list[torch.Tensor]):
        self.grads = grads

    def norms(self) -> torch.Tensor:
        """Each run's global L2 norm (K,), accumulated in fp32 like sweep.run.step.global_grad_norm."""
        per_tensor = [
            torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1, dtype=torch.float32) for g in self.grads
        ]
        return torch.linalg.vector_norm(torch.stack(per_tensor), dim=0)

    def scale_(self, factors: torch.Tensor) -> None:
        for g in self.grads:  # rounded to the gradient's dtype, as sweep.run.step.Grads says
            g.mul_(factors.to(g.dtype).view(-1, *[1] * (g.dim() - 1)))

    def of(self, i: int) -> list[torch.Tensor]:
        return [g[i] for g in self.grads]


class Row(IntEnum):
    """The rows of `Steps.record`'s (len(Row), K) float64 tensor, one step of K runs (a column each), by name."""

    loss = 0
    grad_norm = 1
    """The global gradient norm, unscaled, before clipping."""
    scale = 2
    """The loss scale the backward used."""
    code = 3
    """The scaler's decision (sweep.run.scaler.EVENTS: step, skip, collapse)."""
    skips = 4
    """Consecutive skipped steps after the decision."""
    scale_after = 5
    """The loss scale after the decision."""


@dataclass
class Decision:
    """One run's step as the host sees it after the sync."""

    loss: float
    grad_norm: float
    scale: float
    """The loss scale the backward used."""
    event: ScalerEvent
    verdict: Divergence | None

    @property
    def stepping(self) -> bool:
        """The optimizer updates this run at this step: the scaler says step and no verdict stops it."""
        return self.event is ScalerEvent.step and self.verdict is None


class Steps:
    """The scaler, monitors and metrics of K runs, and the after-backward sequence they share."""

    def __init__(
        self,
        monitors: Sequence[DivergenceMonitor],
        scaler: DeviceLossScaler,
        grad_clips: Sequence[float],
        steps: Sequence[int],
    ):
        """Run k's monitor, its row of the scaler, its optim.grad_clip (0: off) and its number of steps."""
        self.monitors, self.scaler, self.steps = list(monitors), scaler, list(steps)
        # On the scaler's device: a captured step cannot copy from the host
        self.clip = torch.tensor(list(grad_clips), dtype=torch.float64, device=scaler.scale.device)
        self.clipping = any(c > 0 for c in grad_clips)

    def keep(self, positions: list[int]) -> None:
        """Keep only the runs at these positions, in this order (a pack compacting)."""
        self.monitors = [self.monitors[i] for i in positions]
        self.steps = [self.steps[i] for i in positions]
        self.clip = self.clip[positions]
        self.clipping = bool((self.clip > 0).any())
        self.scaler.keep(positions)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward every run's loss (K,) times its own scale: runs are independent, so one sum does it."""
        self.scaler.scale_loss(loss).sum().backward()

    def record(self, loss: torch.Tensor, grads: Grads) -> torch.Tensor:
        """Steps 1-2 and clipping, on the device with no sync: this step's row of every run, (len(Row), K)
        float64, its rows named by `Row`. Clipping applies to every run whose gradients are finite and
        above its grad_clip; a run the monitor then stops takes no step, so its clipped gradients go unused."""
        scales = self.scaler.scale.clone()  # the scale this backward used (update changes it in place)
        if self.scaler.any_enabled:
            grads.scale_(self.scaler.inverse())
        norms = grads.norms().to(loss.device)
        loss = loss.detach().float()
        finite = torch.isfinite(loss) & torch.isfinite(norms)
        codes = self.scaler.update(~finite) if self.scaler.any_enabled else torch.zeros_like(scales)
        if self.clipping:
            clip = self.clip
            wide = norms.double()
            over = finite & (clip > 0) & (wide > clip)
            grads.scale_(torch.where(over, clip / (wide + 1e-6), 1.0))  # a true division: Python's clip / (n + 1e-6)
        rows = {
            Row.loss: loss.double(),
            Row.grad_norm: norms.double(),
            Row.scale: scales,
            Row.code: codes.double(),
            Row.skips: self.scaler.consecutive_skips.double(),
            Row.scale_after: self.scaler.scale.double(),
        }
        return torch.stack([rows[r] for r in Row])

    def judge(self, step: int, row: list[list[float]]) -> list[Decision]:
        """Step 4 on the host, from a fetched row (record's, as lists, indexed by `Row`): each run's scaler
        decision and monitor verdict, in pack order."""
        losses, norms, scales = row[Row.loss], row[Row.grad_norm], row[Row.scale]
        decisions = []
        for i, monitor in enumerate(self.monitors):
            code = int(row[Row.code][i])
            reason = self.scaler.collapse_reason(i, code, int(row[Row.skips][i]), row[Row.scale_after][i])
            verdict = monitor.observe(step, losses[i], norms[i], EVENTS[code], reason)
            decisions.append(Decision(losses[i], norms[i], scales[i], EVENTS[code], verdict))
        return decisions

    def decide(self, step: int, loss: torch.Tensor, grads: Grads) -> list[Decision]:
        """record, the step's one sync, judge."""
        return self.judge(step, self.record(loss, grads).tolist())

    def after_update(
        self, i: int, step: int, d: Decision, params: Callable[[], list[torch.Tensor]], grads: Grads
    ) -> Divergence | None:
        """Run i's verdict after the optimizer: the scaler's and monitor's, or the stall check's when it stepped.
        `params()` (run i's weights) is called on stall-check steps and the run's last step only: a pack slices them
        out of its stacks. The last step measures the rest of the weights' path (sweep/run/trend.py reads it)."""
        m, checked = self.monitors[i], False
        if d.stepping:
            checked = m.count_update(step)
            d.verdict = m.stall_check(step, params(), grads.of(i)) if checked else None
        if d.verdict is None and not checked and step == self.steps[i] - 1:
            m.measure_end(params())
        return d.verdict

    def log(
        self,
        i: int,
        metrics: MetricsLog,
        step: int,
        d: Decision,
        lr: float,
        logits: tuple = ("", ""),
        eval_loss: float | str = "",
    ) -> None:
        """Run i's metrics row for this step (docs/design.md, metrics.csv)."""
        monitor = self.monitors[i]
        checked = (step + 1) % monitor.cfg.stall_window == 0
        metrics.log(
            step=step,
            loss=d.loss,
            grad_norm=d.grad_norm,
            lr=lr,
            loss_scale=d.scale if self.scaler.enabled_runs[i] else "",
            skipped=int(d.event is not ScalerEvent.step),
            unchanged_fraction=monitor.last_unchanged_fraction if checked else "",  # stall statistics: check steps
            zero_grad_fraction=monitor.last_zero_grad_fraction if checked else "",
            attn_max_logit=logits[0],
            attn_min_entropy=logits[1],
            eval_loss=eval_loss,
        )


@runtime_checkable
class Stop(Protocol):
    """What a hook returns to stop its run with a status of its own, not a verdict: a pruner's
    (sweep.search.pruning.Pruned) or a signal's (sweep.run.interrupt.Interrupted)."""

    def record(self, result) -> None:
        """Write the run's status, reason and the step it stopped at into its RunResult."""


class StepHook(Protocol):
    """Something that acts after each step: saves a checkpoint, reports to a pruner, ...

    A hook whose class sets `window_safe = True` reads only what after_step is given, so it may be called
    for a window's steps once the window ran (sweep/run/window.py); any other hook turns windows off."""

    def after_step(self, step: int, loss: float, parts: RunParts) -> object:
        """Called once the step is logged. Something false: the run goes on. Something true stops the run after
        this step (not a divergence); a `Stop` also says the run's status (the loop's `stopped`, which
        sweep.run.execute.conclude reads); any other (True) leaves it stable."""
