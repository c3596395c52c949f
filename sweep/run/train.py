"""The training loop of one run: forward under the precision policy, scaled backward, one sync, verdict.

Per step (`Lone.one`): draw the batch (a pure function of the step) and check it before it reaches the model;
noise it in fp32; forward under autocast; backward the scaled loss. From there the run goes through
sweep/run/step.py, the same code the pack uses: unscale, gradient norm, the scaler's decision on the device,
ONE sync, the monitor's verdict, clipping; then AdamW steps when the step is good, and the stall check,
explanation and metrics row follow (`finish`). sweep.run.window.drive runs the steps, alone or in windows.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from models import LogitStats, watching_logits
from sweep.config import RunConfig, Verdict
from sweep.data.batches import load_checked_batch, sample_labels
from sweep.data.device import DeviceBatches
from sweep.run.adam_lag import adamw_second_moment
from sweep.run.build import RunParts
from sweep.run.evaluate import Evaluator
from sweep.run.graph import WARMUP, StepGraph, table_span, wanted
from sweep.run.monitor import Cause, Divergence
from sweep.run.progress import RunProgress
from sweep.run.results import MetricsLog
from sweep.run.step import LoneGrads, StepHook, Steps
from sweep.run.verdict import first_of
from sweep.run.window import Snapshot, Syncs, WindowResult, drive, window_end


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
    windows = probe is None and all(getattr(h, "window_safe", False) for h in hooks)
    syncs.every = run.monitor.sync_every if windows else 1
    lone = Lone(run, parts, metrics, progress, hooks, evaluator, syncs, probe)
    drive(lone, parts.start_step)  # sweep/run/window.py: windows of steps, or one sync per step
    return lone.first


class Lone:
    """The steps of one run, as sweep.run.window.drive runs them: `one` with a sync per step; `eager_step` (or
    its graph's replay) and `stand` in a window of steps with one sync."""

    def __init__(self, run, parts, metrics, progress, hooks=(), evaluator=None, syncs=None, probe=None):
        self.run, self.parts, self.metrics, self.progress = run, parts, metrics, progress
        self.hooks, self.evaluator, self.probe = hooks, evaluator, probe
        self.syncs = syncs if syncs is not None else Syncs()
        self.params = [p for p in parts.model.parameters() if p.requires_grad]
        self.generators = [parts.noise_gen]
        self.steps, self.logits = Steps([run], [parts.monitor], parts.scaler), LogitStats()
        self.parked: dict[int, tuple] = {}  # a window's logit steps' statistics, on the device until its end
        self.first: Divergence | None = None
        # Windows draw synthetic batches on the device and check them there (sweep/data/device.py).
        self.batches = None
        if run.monitor.sync_every > 1:
            span = table_span(run.monitor.sync_every)
            self.batches = DeviceBatches.of(
                parts.dataset, parts.order, run.steps, parts.device, run.data.range_limit, span
            )
        self.clock, self.flagged = parts.optimizer.clock, self.batches is not None and run.data.check
        # graph=true on CUDA: window steps replay one capture of device_step (sweep/run/graph.py)
        graphed = self.batches is not None and wanted(run.graph, parts.device)
        self.graphs = (StepGraph(self, run.steps), StepGraph(LogitStep(self), run.steps)) if graphed else None

    # What sweep.run.window.drive asks
    def live(self, step: int) -> list[Syncs]:
        return [self.syncs] if step < self.run.steps else []

    def window_end(self, step: int) -> int:
        return window_end(self.run, step, self.evaluator, self.syncs.every)

    def at(self, start: int, stop: int) -> None:
        self.parts.optimizer.at(start, stop + WARMUP)  # a graph's warm-up reads past the window
        if self.batches is not None:
            self.batches.cover(start, stop + WARMUP)

    def snapshot(self, reuse: Snapshot | None = None) -> Snapshot:
        parts, monitors = self.parts, [self.parts.monitor]
        return Snapshot(self.params, parts.optimizer, self.generators, parts.scaler, monitors, self.zero_grad, reuse)

    # What sweep.run.graph.StepGraph asks
    def captured_step(self) -> tuple:
        return self.device_step(None)

    def has_state(self) -> bool:
        return all(p in self.parts.optimizer.state for p in self.params)  # the first update made it

    def zero_grad(self) -> None:
        self.parts.optimizer.zero_grad(set_to_none=True)

    def put_back(self) -> None:
        pass

    # The steps
    def forward_backward(self, x0: torch.Tensor, logits: bool, probe=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Noise the batch, forward under the policy, scaled backward: (loss (1,), pred). Nothing here reads the
        host's step number: the noise comes from the run's generator, the lr from the optimizer's clock."""
        run, parts, policy = self.run, self.parts, self.parts.policy
        noisy, t, target = parts.objective.sample(x0.to(parts.device), parts.noise_gen)
        with probe or contextlib.nullcontext(), watching_logits(parts.model, self.logits, logits), policy.gemm_mode():
            with policy.autocast(parts.device):
                pred = parts.model(noisy.to(policy.param_dtype), t)
            loss = (parts.objective.loss(pred, target) * run.objective.loss_weight).reshape(1)
            self.steps.backward(loss)
        # Detached: a kept autograd graph keeps the weights' AccumulateGrad nodes, made on the stream of the step
        # that built it, and a CUDA graph captured on a side stream then fails (sweep/run/graph.py).
        return loss.detach(), pred.detach()

    def one(self, step: int) -> bool:
        """One step, one sync; True stops the run."""
        run, parts = self.run, self.parts
        indices = parts.order.indices(step)
        x0, issue = load_checked_batch(parts.dataset, indices, run.data.range_limit, run.data.check)  # no sync
        if issue is not None:
            self.first = Divergence(Verdict.bad_input, step, Cause("data", None, issue.detail))
            return True
        parts.optimizer.at(step)  # the update's lr comes from the optimizer's device table (sweep/run/adamw.py)
        probe = self.probe[1] if self.probe and self.probe[0] == step else None
        loss, pred = self.forward_backward(x0, step % run.monitor.logit_every == 0, probe)
        grads = LoneGrads([p.grad for p in self.params if p.grad is not None])
        (d,) = self.steps.decide(step, loss, grads)  # the one sync
        if d.stepping:
            parts.optimizer.step()
        stop = self.finish(step, d, parts.lr_at(step), grads, pred, x0, indices)
        self.zero_grad()
        return stop

    def device_step(self, x0: torch.Tensor | None, logits: bool = False):
        """A window's step from device state alone, so a CUDA graph of it replays as the next step: batch (unless
        `x0`, read from files, is given) and lr of the step the clock is at, the run generator's next noise;
        forward, backward, row, AdamW, and the clock moves on. (row (len(Row) [+ the batch's flag], 1), pred, x0)."""
        flag = None
        if x0 is None:
            x0 = self.batches.at(self.clock)
            flag = self.batches.bad(x0) if self.run.data.check else None
        loss, pred = self.forward_backward(x0, logits)
        row = self.steps.record(loss, LoneGrads([p.grad for p in self.params if p.grad is not None]))
        self.parts.optimizer.step()  # a step the scaler or monitor would have stopped takes the window back
        self.clock.add_(1)
        return (row if flag is None else torch.cat([row, flag.double().view(1, 1)])), pred, x0

    def graph_at(self, step: int) -> StepGraph | None:
        if self.graphs is None:
            return None
        window, logit = self.graphs
        if step % self.run.monitor.logit_every != 0:
            return window
        return None if window.failed else logit  # a logit step is its own capture, not tried after the step's failed

    def eager_step(self, step: int) -> tuple | None:
        x0 = None  # drawn and checked on the device
        if self.batches is None:
            parts, data = self.parts, self.run.data
            x0, issue = load_checked_batch(parts.dataset, parts.order.indices(step), data.range_limit, data.check)
            if issue is not None:
                return None
        return self.device_step(x0, logits=step % self.run.monitor.logit_every == 0)

    def stepped(self, step: int) -> None:
        if step % self.run.monitor.logit_every == 0:  # copies: the next replay of a logit graph rewrites its outputs
            maxes, entropies = self.logits.take()
            self.parked[step] = ([t.clone() for t in maxes], [t.clone() for t in entropies])

    def stand(self, start: int, decisions: list, pred: torch.Tensor, x0: torch.Tensor) -> WindowResult:
        grads, last = LoneGrads([p.grad for p in self.params if p.grad is not None]), start + len(decisions) - 1
        for s, (d,) in enumerate(decisions, start):
            at = ("", "")
            if s in self.parked:  # a logit step: its statistics, read now that the window has synced
                self.logits.put(self.parked.pop(s))
                at = self.logits.collect()
            if self.finish(s, d, self.parts.lr_at(s), grads, pred, x0, self.parts.order.indices(last), at):
                return WindowResult(stopped_at=s)
        self.zero_grad()
        return WindowResult()

    def drop(self) -> None:
        self.parked.clear()  # the taken-back steps run again one sync each, with their statistics
        self.logits.take()

    def finish(self, step, d, lr, grads, pred, x0, indices, logits=None) -> bool:
        """After the optimizer: stall check, explanation of a first verdict, metrics row, progress, hooks,
        eval loss. `pred`, `x0`, `indices` are this step's (a window's rows other than its last never
        reach a verdict here: only the last can be a stall check). True stops the run."""
        run, parts = self.run, self.parts
        if logits is None:  # a second sync, every logit_every steps
            logits = self.logits.collect() if step % run.monitor.logit_every == 0 else ("", "")
        verdict = self.steps.after_update(0, step, d, lambda: self.params, grads)
        self.first = first_of(  # before zero_grad: the explanation reads the gradients
            self.first,
            verdict,
            run=run,
            step=step,
            named_params=lambda: list(parts.model.named_parameters()),
            pred=pred,
            x0=x0,
            labels=lambda: sample_labels(parts.dataset, indices),
            monitor=parts.monitor,
            second_moment=lambda: adamw_second_moment(parts.optimizer),
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


class LogitStep:
    """A lone run's window step on an attention-logit step, as StepGraph captures it: the statistics it appends
    to the run's LogitStats are the capture's outputs, which each replay rewrites, put back after each replay
    (and copied aside by Lone.stepped) for the window's end to collect."""

    def __init__(self, lone: Lone):
        self.lone, self.clock, self.params, self.generators = lone, lone.clock, lone.params, lone.generators
        self.stats: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])

    def captured_step(self) -> tuple:
        self.lone.logits.take()  # nothing before it is this step's
        out = self.lone.device_step(None, logits=True)
        self.stats = self.lone.logits.take()  # a warm-up step's statistics are not the run's
        return out

    def put_back(self) -> None:
        self.lone.logits.put(self.stats)

    def snapshot(self) -> Snapshot:
        return self.lone.snapshot()

    def zero_grad(self) -> None:
        self.lone.zero_grad()

    def has_state(self) -> bool:
        return self.lone.has_state()
