"""The training loop of one run: forward under the precision policy, scaled backward, one sync, verdict.

Per step: draw the batch (a pure function of the step) and check it before it reaches the model;
noise it in fp32; forward under autocast; backward the scaled loss; unscale the gradients and take
their global norm with foreach ops; fetch loss and norm in ONE device sync; let the scaler and the
monitor decide; clip and step only when the step is good. Monitoring, data checks and recording are
other modules; this one only says the order things happen in.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Protocol, Sequence

import torch

from models import LogitStats, watching_logits
from sweep.config import RunConfig
from sweep.data.batches import load_checked_batch, sample_labels
from sweep.data.checks import BatchIssue, check_batch
from sweep.run.adam_lag import adamw_second_moment, lag_note
from sweep.run.build import RunParts
from sweep.run.evaluate import Evaluator
from sweep.run.monitor import Cause, Divergence
from sweep.run.precision import ScalerEvent
from sweep.run.progress import RunProgress
from sweep.run.results import MetricsLog


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over all gradients, accumulated in fp32 (a fp16 norm of fp16 grads overflows first)."""
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))


class StepHook(Protocol):
    """Something that acts after each step: saves a checkpoint, reports to a pruner, ..."""

    def after_step(self, step: int, loss: float, parts: RunParts) -> bool:
        """Called once the step is logged; True stops the run after this step (not a divergence)."""


def train(
    run: RunConfig,
    parts: RunParts,
    metrics: MetricsLog,
    progress: RunProgress,
    probe: tuple[int, contextlib.AbstractContextManager] | None = None,
    hooks: Sequence[StepHook] = (),
    evaluator: Evaluator | None = None,
) -> Divergence | None:
    """Train `run.steps` steps; return the first divergence (None when stable).

    `probe=(step, ctx)` runs that step's forward and backward inside `ctx` (forensics' module hooks);
    every other step runs hook-free. `hooks` run after every step, in order, all of them. `evaluator`
    measures the eval loss after the update of each step it says is due, until the first verdict
    (sweep/run/evaluate.py: no RNG draw, no grad, so the training curve is the same without it).
    """
    model, opt, scaler, device, policy = parts.model, parts.optimizer, parts.scaler, parts.device, parts.policy
    params = [p for p in model.parameters() if p.requires_grad]
    monitor, logits = parts.monitor, LogitStats()
    first: Divergence | None = None
    for step in range(parts.start_step, run.steps):
        indices = parts.order.indices(step)
        x0, issue = load_checked_batch(parts.dataset, indices, run.data.range_limit, run.data.check)  # no sync
        if issue is not None:
            return Divergence("bad_input", step, Cause("data", None, issue.detail))
        noisy, t, target = parts.objective.sample(x0.to(device), parts.noise_gen)
        lr = parts.lr_at(step)
        for group in opt.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        watch = step % run.monitor.logit_every == 0
        with (
            probe[1] if probe and probe[0] == step else contextlib.nullcontext(),
            watching_logits(model, logits, watch),
            policy.gemm_mode(),
        ):
            with policy.autocast(device):
                pred = model(noisy.to(policy.param_dtype), t)
            loss = parts.objective.loss(pred, target) * run.objective.loss_weight
            scale = scaler.scale
            scaler.scale_loss(loss).backward()
        grads = [p.grad for p in params if p.grad is not None]
        scaler.unscale_(grads)
        grad_norm = global_grad_norm(grads)
        loss_v, norm_v = torch.stack([loss.detach().float(), grad_norm.to(loss.device)]).tolist()  # the one sync
        max_logit, min_entropy = logits.collect() if watch else ("", "")  # a second sync, every logit_every steps
        event = scaler.update(math.isfinite(loss_v) and math.isfinite(norm_v))
        verdict = monitor.observe(step, loss_v, norm_v, event, scaler.collapse_reason)
        if event is ScalerEvent.step and verdict is None:
            if run.optim.grad_clip > 0 and norm_v > run.optim.grad_clip:
                torch._foreach_mul_(grads, run.optim.grad_clip / (norm_v + 1e-6))
            opt.step()
            verdict = monitor.after_update(step, params, grads)
        if verdict is not None:  # before zero_grad: the explanation reads the gradients
            first = first or explain(
                verdict,
                list(model.named_parameters()),
                pred,
                lambda: check_batch(x0, run.data.range_limit, sample_labels(parts.dataset, indices)),
                updated=monitor.updates > 0,
                second_moment=lambda: lag_note(
                    *adamw_second_moment(opt), monitor.recent_sq, verdict.step, step, run.optim.grad_clip
                ),
            )
        opt.zero_grad(set_to_none=True)
        checked = (step + 1) % run.monitor.stall_window == 0  # stall statistics exist on check steps only
        metrics.log(
            step=step,
            loss=loss_v,
            grad_norm=norm_v,
            lr=lr,
            loss_scale=scale if scaler.enabled else "",
            skipped=int(event is not ScalerEvent.step),
            unchanged_fraction=monitor.last_unchanged_fraction if checked else "",
            zero_grad_fraction=monitor.last_zero_grad_fraction if checked else "",
            attn_max_logit=max_logit,
            attn_min_entropy=min_entropy,
            eval_loss="",
        )
        progress.update(step, loss_v, scale if scaler.enabled else None)
        if verdict is not None and run.monitor.stop_on_divergence:
            break
        stop = any([hook.after_step(step, loss_v, parts) for hook in hooks])  # a list: every hook runs
        # After the hooks, which see the training step only (a profiler hook must not see the eval forward).
        if evaluator is not None and first is None and evaluator.due(step):
            metrics.rows[-1]["eval_loss"] = evaluator(model, step)
        if stop:
            break
    return first


def explain(
    verdict: Divergence,
    named_params: list[tuple[str, torch.Tensor]],
    pred: torch.Tensor,
    batch_issue: Callable[[], BatchIssue | None],
    updated: bool,
    second_moment: Callable[[], str] = lambda: "",
) -> Divergence:
    """Sharpen `cause` from what is at hand on the bad path only (full forensics replay is separate).

    `named_params` are the run's (name, weight) pairs, each weight with its `.grad`; `batch_issue`
    checks the batch again (it matters when data.check is off); `updated` says whether this run
    applied any update yet: a non-finite weight before any update came in with the weights;
    `second_moment` says whether AdamW's second moment kept up (sweep.run.adam_lag), for a loss spike.
    """
    if verdict.verdict == "loss_spike":
        verdict.cause.detail += second_moment()
    elif verdict.verdict in ("nonfinite_loss", "scale_collapse"):
        issue = batch_issue()
        name = _first_nonfinite(named_params)
        if issue is not None:  # the batch was bad and nobody checked it
            verdict.cause = Cause("data", None, f"the batch held bad values: {issue.detail}")
        elif name is not None and not updated:
            verdict.cause = Cause(
                "checkpoint",
                name.rsplit(".", 1)[0],
                f"weight {name} is non-finite before any update"
                + (f" ({verdict.cause.detail})" if verdict.verdict == "scale_collapse" else ""),
            )
        elif name is not None:
            verdict.cause = Cause(
                "optimizer",
                name.rsplit(".", 1)[0],
                f"weight {name} is non-finite after the update of step {verdict.step - 1}",
            )
        elif verdict.verdict == "scale_collapse":
            if not bool(torch.isfinite(pred).all()):  # overflowing forward: no scale can fix that
                verdict.cause = Cause(
                    "forward", None, f"model output non-finite with finite weights; {verdict.cause.detail}"
                )
        elif bool(torch.isfinite(pred).all()):
            verdict.cause = Cause("loss", None, "model output finite, loss non-finite")
        else:
            verdict.cause = Cause("forward", None, "model output is non-finite with finite weights and inputs")
    elif verdict.verdict == "nonfinite_grad":
        # Backward runs the last layer first: the first non-finite gradient in that order is where it began.
        grads = [(n, p.grad) for n, p in named_params if p.grad is not None]
        name = _first_nonfinite(reversed(grads))
        if name is not None:
            verdict.cause = Cause("backward", name.rsplit(".", 1)[0], f"non-finite gradient in {name}")
    return verdict


def _first_nonfinite(named) -> str | None:
    """The first name whose tensor holds a NaN/Inf, in the given order."""
    for name, t in named:
        if not bool(torch.isfinite(t).all()):
            return name
    return None
