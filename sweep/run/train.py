"""The training loop of one run: forward under the precision policy, scaled backward, one sync, verdict.

Per step: draw the batch (a pure function of the step) and check it before it reaches the model;
noise it in fp32; forward under autocast; backward the scaled loss. From there the run goes through
sweep/run/step.py, the same code the pack uses: unscale, gradient norm, the scaler's decision on the
device, ONE sync, the monitor's verdict, clipping; then AdamW steps when the step is good, and the
stall check, explanation and metrics row follow. Monitoring, data checks and recording are other
modules; this one only says the order things happen in.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Protocol, Sequence

import torch

from models import LogitStats, watching_logits
from sweep.config import RunConfig
from sweep.data.batches import load_checked_batch, sample_labels
from sweep.data.checks import BatchIssue, check_batch
from sweep.data.device import DeviceBatches
from sweep.run.adam_lag import adamw_second_moment, lag_note
from sweep.run.build import RunParts
from sweep.run.evaluate import Evaluator
from sweep.run.graph import StepGraph, wanted
from sweep.run.monitor import Cause, Divergence
from sweep.run.progress import RunProgress
from sweep.run.results import MetricsLog
from sweep.run.step import LoneGrads, Steps, first_of
from sweep.run.window import Snapshot, Syncs, window_end


class StepHook(Protocol):
    """Something that acts after each step: saves a checkpoint, reports to a pruner, ...

    A hook whose class sets `window_safe = True` reads only what after_step is given, so it may be called
    for a window's steps once the window ran (sweep/run/window.py); any other hook turns windows off."""

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
    syncs: Syncs | None = None,
) -> Divergence | None:
    """Train `run.steps` steps; return the first divergence (None when stable).

    `probe=(step, ctx)` runs that step's forward and backward inside `ctx` (forensics' module hooks);
    every other step runs hook-free. `hooks` run after every step, in order, all of them. `evaluator`
    measures the eval loss after the update of each step it says is due, until the first verdict
    (sweep/run/evaluate.py: no RNG draw, no grad, so the training curve is the same without it).
    `syncs` counts how the steps met the host (sweep.run.window.Syncs; its `every` is set here).
    """
    syncs = syncs if syncs is not None else Syncs()
    loop = _Loop(run, parts, metrics, progress, hooks, evaluator, syncs)
    size = run.monitor.sync_every if probe is None and all(getattr(h, "window_safe", False) for h in hooks) else 1
    syncs.every = size
    step, host_until = parts.start_step, -1  # steps up to host_until run one sync each (a window taken back)
    while step < run.steps:
        end = window_end(run, step, evaluator, size) if step > host_until else step + 1
        if end - step == 1:
            syncs.one()
            if loop.one(step, probe):
                break
            step += 1
            continue
        snapshot = Snapshot(parts, loop.params)
        stood, at = loop.window(step, end)
        syncs.window(loop.ran_to, stood, at)
        if stood and at is None:
            step = end
        elif stood:  # a hook or a verdict of the window's last step stopped the run
            break
        else:  # a step the host must decide: back to the window's start, one sync per step up to it
            snapshot.restore()
            loop.logits.collect()  # drop the taken-back steps' attention statistics
            host_until = at
    return loop.first


class _Loop:
    """The steps of one run: `one` with a sync per step, `window` with one sync for several (sweep/run/window.py)."""

    def __init__(self, run, parts, metrics, progress, hooks, evaluator, syncs: Syncs | None = None):
        self.run, self.parts, self.metrics, self.progress, self.hooks, self.evaluator = (
            run,
            parts,
            metrics,
            progress,
            hooks,
            evaluator,
        )
        self.syncs = syncs if syncs is not None else Syncs()
        self.params = [p for p in parts.model.parameters() if p.requires_grad]
        self.steps, self.logits = Steps([run], [parts.monitor], parts.scaler), LogitStats()
        self.first: Divergence | None = None
        # Windows draw synthetic batches on the device and check them there (sweep/data/device.py).
        many = run.monitor.sync_every > 1
        self.batches = (
            DeviceBatches.of(parts.dataset, parts.order, run.steps, parts.device, run.data.range_limit)
            if many
            else None
        )
        # graph=true on CUDA: window steps replay one capture of device_step (sweep/run/graph.py)
        graphed = self.batches is not None and wanted(run.graph, parts.device)
        self.graph = (
            StepGraph(
                lambda: self.device_step(None),
                clock=parts.optimizer.clock,
                params=lambda: self.params,
                generators=lambda: [parts.noise_gen],
                snapshot=lambda: Snapshot(parts, self.params),
                zero_grad=lambda: parts.optimizer.zero_grad(set_to_none=True),
                has_state=lambda: all(p in parts.optimizer.state for p in self.params),  # the first update made it
                steps=run.steps,
            )
            if graphed
            else None
        )

    def forward_backward(self, step: int, x0: torch.Tensor, probe=None) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Set the clock to `step`, then `forward_backward_at`: (loss (1,), pred, the step's lr)."""
        self.parts.optimizer.at(step)  # the update's lr comes from the optimizer's device table (sweep/run/adamw.py)
        logits = step % self.run.monitor.logit_every == 0
        loss, pred = self.forward_backward_at(x0, logits, probe[1] if probe and probe[0] == step else None)
        return loss, pred, self.parts.lr_at(step)

    def forward_backward_at(self, x0: torch.Tensor, logits: bool, probe=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Noise the batch, forward under the policy, scaled backward: (loss (1,), pred). Nothing here reads the
        host's step number: the noise comes from the run's generator, the lr from the optimizer's clock."""
        run, parts, policy = self.run, self.parts, self.parts.policy
        noisy, t, target = parts.objective.sample(x0.to(parts.device), parts.noise_gen)
        with (
            probe if probe is not None else contextlib.nullcontext(),
            watching_logits(parts.model, self.logits, logits),
            policy.gemm_mode(),
        ):
            with policy.autocast(parts.device):
                pred = parts.model(noisy.to(policy.param_dtype), t)
            loss = (parts.objective.loss(pred, target) * run.objective.loss_weight).reshape(1)
            self.steps.backward(loss)
        return loss, pred

    def device_step(self, x0: torch.Tensor | None, logits: bool = False):
        """One step of a window from device state alone, so that a CUDA graph of it replays as the next step:
        the batch (unless `x0`, read from files, is given) and the lr are those of the step the optimizer's
        clock is at, the noise the run generator's next; forward, backward, the step's row, AdamW's update,
        and the clock moves on. Returns (row (ROWS, 1), or ROWS + 1 with the batch's device flag when the
        batch was drawn here and data.check is on; pred; x0)."""
        parts, clock = self.parts, self.parts.optimizer.clock
        flag = None
        if x0 is None:
            x0 = self.batches.at(clock)
            flag = self.batches.bad(x0) if self.run.data.check else None
        loss, pred = self.forward_backward_at(x0, logits)
        row = self.steps.record(loss, self.grads())
        parts.optimizer.step()  # a step the scaler or monitor would have stopped takes the window back
        clock.add_(1)
        if flag is not None:
            row = torch.cat([row, flag.double().view(1, 1)])
        return row, pred, x0

    def grads(self) -> LoneGrads:
        return LoneGrads([p.grad for p in self.params if p.grad is not None])

    def one(self, step: int, probe=None) -> bool:
        """One step, one sync; True stops the run."""
        run, parts = self.run, self.parts
        indices = parts.order.indices(step)
        x0, issue = load_checked_batch(parts.dataset, indices, run.data.range_limit, run.data.check)  # no sync
        if issue is not None:
            self.first = Divergence("bad_input", step, Cause("data", None, issue.detail))
            return True
        loss, pred, lr = self.forward_backward(step, x0, probe)
        grads = self.grads()
        (d,) = self.steps.decide(step, loss, grads)  # the one sync
        if d.stepping:
            parts.optimizer.step()
        stop = self.finish(step, d, lr, grads, pred, x0, indices)
        parts.optimizer.zero_grad(set_to_none=True)
        return stop

    def window(self, start: int, end: int) -> tuple[bool, int | None]:
        """Steps start..end-1 with one sync. (True, None): they stood and ran on; (True, s): they stood and
        step s stopped the run; (False, s): step s needs the host, take the window back."""
        run, parts = self.run, self.parts
        rows = []
        flagged = self.batches is not None and run.data.check  # no flags when unchecked: no step is then bad input
        self.ran_to = start  # the first step of the window not run (yet)
        parts.optimizer.at(start)  # the clock: each step moves it on
        for step in range(start, end):
            indices, x0 = parts.order.indices(step), None  # None: drawn and checked on the device
            if self.batches is None:
                x0, issue = load_checked_batch(parts.dataset, indices, run.data.range_limit, run.data.check)
                if issue is not None:
                    return False, step
            if step > start:  # the last step's gradients stay for the stall check
                parts.optimizer.zero_grad(set_to_none=True)
            logits = step % run.monitor.logit_every == 0  # only at `start`: a logit step starts its window
            if self.graph is not None and not logits and self.graph.ready(step):
                row, pred, x0 = self.graph()
                self.syncs.replayed += self.graph.graph is not None  # not when the capture failed
            else:
                row, pred, x0 = self.device_step(x0, logits)
            rows.append(row)
            self.ran_to = step + 1
        lrs = [parts.lr_at(s) for s in range(start, end)]
        fetched = torch.stack(rows).tolist()  # (steps, ROWS [+ the flag], 1): the window's one sync
        bad = next((s for s, row in zip(range(start, end), fetched) if flagged and row[-1][0]), None)
        if bad is not None:  # a bad batch: the host's check decides it, with the steps before it one by one
            return False, bad
        decisions = [self.steps.judge(s, row[: Steps.ROWS])[0] for s, row in zip(range(start, end), fetched)]
        bad = next((s for s, d in zip(range(start, end), decisions) if not d.stepping), None)
        if bad is not None:
            return False, bad
        logits = self.logits.collect() if start % run.monitor.logit_every == 0 else ("", "")
        grads = self.grads()
        for s, d, lr in zip(range(start, end), decisions, lrs):
            if self.finish(s, d, lr, grads, pred, x0, indices, logits if s == start else ("", "")):
                return True, s
        parts.optimizer.zero_grad(set_to_none=True)
        return True, None

    def finish(self, step, d, lr, grads, pred, x0, indices, logits=None) -> bool:
        """After the optimizer: stall check, explanation of a first verdict, metrics row, progress, hooks,
        eval loss. `pred`, `x0`, `indices` are this step's (a window's rows other than its last never
        reach a verdict here: only the last can be a stall check). True stops the run."""
        run, parts = self.run, self.parts
        if logits is None:  # a second sync, every logit_every steps
            logits = self.logits.collect() if step % run.monitor.logit_every == 0 else ("", "")
        verdict = self.steps.after_update(0, step, d, self.params, grads)
        self.first = first_of(  # before zero_grad: the explanation reads the gradients
            self.first,
            verdict,
            lambda: explain(
                verdict,
                list(parts.model.named_parameters()),
                pred,
                lambda: check_batch(x0, run.data.range_limit, sample_labels(parts.dataset, indices)),
                updated=parts.monitor.updates > 0,
                second_moment=lambda: lag_note(
                    *adamw_second_moment(parts.optimizer),
                    parts.monitor.recent_sq,
                    verdict.step,
                    step,
                    run.optim.grad_clip,
                ),
            ),
        )
        self.steps.log(0, self.metrics, step, d, lr, logits)
        self.progress.update(step, d.loss, d.scale if parts.scaler.any_enabled else None)
        if verdict is not None and run.monitor.stop_on_divergence:
            return True
        stop = any([hook.after_step(step, d.loss, parts) for hook in self.hooks])  # a list: every hook runs
        # After the hooks, which see the training step only (a profiler hook must not see the eval forward).
        if self.evaluator is not None and self.first is None and self.evaluator.due(step):
            self.metrics.rows[-1]["eval_loss"] = self.evaluator(parts.model, step)
        return stop


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
