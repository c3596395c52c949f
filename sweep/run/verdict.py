"""A run's first verdict, and what the loop can say about its cause from what is at hand on the bad path.

Both loops (sweep/run/train.py alone, sweep/run/packed.py packed) keep a run's first verdict with `first_of`
and sharpen its cause with `explain` before the gradients are dropped; forensics' full replay is separate
(sweep/run/forensics.py).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from sweep.config import RunConfig, Verdict
from sweep.data.checks import BatchIssue, check_batch
from sweep.run.adam_lag import lag_note
from sweep.run.checkpoint import IMPLAUSIBLE_WEIGHT, readable
from sweep.run.monitor import Cause, Divergence, DivergenceMonitor


def first_of(
    current: Divergence | None,
    verdict: Divergence | None,
    *,
    run: RunConfig,
    step: int,
    named_params: Callable[[], list[tuple[str, torch.Tensor]]],
    pred: torch.Tensor,
    x0: torch.Tensor,
    labels: Callable[[], list | None],
    monitor: DivergenceMonitor,
    second_moment: Callable[[], tuple[float, int, float]],
) -> Divergence | None:
    """The run's first verdict: `current` when there is one, else this step's `verdict` explained (None: none
    yet). What `explain` reads is the run's at this step, before its gradients are dropped: its (name, weight)
    pairs, the prediction, the batch `x0` (checked again with its `labels`), the monitor, and AdamW's
    `second_moment` (sum of v, update count, beta2: sweep.run.adam_lag)."""
    if current is not None or verdict is None:
        return current
    return explain(
        verdict,
        named_params(),
        pred,
        batch_issue=lambda: check_batch(x0, run.data.range_limit, labels()),
        updated=monitor.updates > 0,
        second_moment=lambda: lag_note(
            *second_moment(), monitor.recent_sq, verdict.step, step, run.optim.grad_clip, run.optim.update_clip
        ),
    )


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
    if verdict.verdict == Verdict.loss_spike:
        verdict.cause.detail += second_moment()
    elif verdict.verdict in (Verdict.nonfinite_loss, Verdict.scale_collapse):
        verdict.cause = _nonfinite_cause(verdict, named_params, pred, batch_issue, updated)
    elif verdict.verdict == Verdict.nonfinite_grad:
        # Backward runs the last layer first: the first non-finite gradient in that order is where it began.
        grads = [(n, p.grad) for n, p in named_params if p.grad is not None]
        name = first_nonfinite(reversed(grads))
        if name is not None:
            verdict.cause = Cause("backward", name.rsplit(".", 1)[0], f"non-finite gradient in {name}")
    return verdict


def _nonfinite_cause(verdict, named_params, pred, batch_issue, updated) -> Cause:
    """A non-finite loss or a collapsed scale: bad data, a weight made non-finite (by the checkpoint before
    any update, or by the last update), the forward, or the loss itself."""
    issue = batch_issue()
    name = first_nonfinite(named_params)
    if issue is not None:  # the batch was bad and nobody checked it
        return Cause("data", None, f"the batch held bad values: {issue.detail}")
    if name is not None and not updated:
        return Cause(
            "checkpoint",
            name.rsplit(".", 1)[0],
            f"weight {name} is non-finite before any update"
            + (f" ({verdict.cause.detail})" if verdict.verdict == Verdict.scale_collapse else ""),
        )
    huge = None if updated else first_implausible(named_params)
    if huge is not None:  # a flipped exponent bit: finite, so only its size gives it away
        name, amax = huge
        return Cause(
            "checkpoint",
            name.rsplit(".", 1)[0],
            f"weight {name} holds {amax:.3g} before any update, beyond any trained weight (|w| > "
            f"{IMPLAUSIBLE_WEIGHT:g})"
            + (f" ({verdict.cause.detail})" if verdict.verdict == Verdict.scale_collapse else ""),
        )
    if name is not None:
        return Cause(
            "optimizer",
            name.rsplit(".", 1)[0],
            f"weight {name} is non-finite after the update of step {verdict.step - 1}",
        )
    finite_output = bool(torch.isfinite(pred).all())
    if verdict.verdict == Verdict.scale_collapse:  # an overflowing forward: no scale can fix that
        if finite_output:
            return verdict.cause
        return Cause("forward", None, f"model output non-finite with finite weights; {verdict.cause.detail}")
    if finite_output:
        return Cause("loss", None, "model output finite, loss non-finite")
    return Cause("forward", None, "model output is non-finite with finite weights and inputs")


def first_implausible(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, float] | None:
    """The first (name, max |w|) whose finite weights exceed IMPLAUSIBLE_WEIGHT (a flipped exponent bit), in the
    given order."""
    for name, t in named:
        amax = float(readable(t).abs().max()) if t.numel() else 0.0
        if IMPLAUSIBLE_WEIGHT < amax < float("inf"):
            return name, amax
    return None


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The first name whose tensor holds a NaN/Inf, in the given order."""
    for name, t in named:
        if not bool(torch.isfinite(readable(t)).all()):
            return name
    return None
