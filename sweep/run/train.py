"""The training loop of K runs: one run alone, or a pack of runs trained as one vectorised computation.

Per step (`Loop.run`): each run's batch (a pure function of the step), checked before it reaches the model, and
its noise; the forward under the precision policy and the scaled backward; then sweep/run/step.py's sequence:
unscale, gradient norm, the scaler's decision on the device, ONE sync, the monitor's verdict, clipping; the
optimizer updates the runs that step; and per run (`finish`): the stall check, the explanation of a first
verdict, the metrics row, the hooks, the eval loss. What differs between one run and a pack is the layout
(sweep/run/lone.py: the model forwarded as it is; sweep/run/packed.py: K stacked runs under vmap), never the
loop. With monitor.sync_every > 1 (the GPU's path) steps run in windows of one sync (sweep/run/window.py).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

from sweep.config import RunConfig, Verdict
from sweep.data.batches import sample_labels
from sweep.run.build import RunParts
from sweep.run.evaluate import Evaluator
from sweep.run.lone import Lone
from sweep.run.monitor import Cause, Divergence
from sweep.run.packed import Stacked
from sweep.run.progress import RunProgress
from sweep.run.results import MetricsLog
from sweep.run.step import Decision, Grads, StepHook
from sweep.run.verdict import first_of
from sweep.run.window import Syncs, Windows


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
    """Train one run from its start step; its first divergence (None when stable). See `Loop`."""
    loop = Loop([run], [parts], [metrics], progress, hooks, [evaluator], [syncs or Syncs()], probe)
    loop.run(parts.start_step)
    return loop.first[0]


class Loop:
    """The steps of K runs, in the lone layout (K=1, the default) or stacked (`stacked=True`, a pack).

    `probe=(step, ctx)` runs that step's forward and backward inside `ctx` (forensics' module hooks). `hooks` run
    after every step of every run, in order, all of them; one that returns something true stops that run, and
    what it returned is `stopped[k]` (sweep.run.step.StepHook). `evaluators[k]` measures run k's eval loss after
    the update of each step it says is due, until its first verdict (no RNG draw, no grad: the training curve is
    the same without it). `syncs[k]` counts how run k's steps met the host; its `every` is set here: 1 when a
    probe or a hook that must see every step's state turns windows off."""

    def __init__(
        self,
        runs: Sequence[RunConfig],
        parts: Sequence[RunParts],
        metrics: Sequence[MetricsLog],
        progress: RunProgress,
        hooks: Sequence[StepHook] = (),
        evaluators: Sequence[Evaluator | None] | None = None,
        syncs: Sequence[Syncs] | None = None,
        probe: tuple[int, contextlib.AbstractContextManager] | None = None,
        stacked: bool = False,
    ):
        self.runs, self.parts, self.metrics, self.progress = runs, parts, metrics, progress
        self.hooks, self.probe = hooks, probe
        self.evaluators = list(evaluators or [None] * len(runs))
        self.syncs = list(syncs or [Syncs() for _ in runs])
        windowed = probe is None and all(getattr(h, "window_safe", False) for h in hooks)
        windowed = windowed and any(r.monitor.sync_every > 1 for r in runs)
        for s, r in zip(self.syncs, runs):
            s.every = r.monitor.sync_every if windowed else 1
        self.layout = Stacked(runs, parts, windowed) if stacked else Lone(runs, parts, windowed)
        self.steps, self.optimizer = self.layout.steps, self.layout.optimizer
        self.first: list[Divergence | None] = [None] * len(runs)
        """Each run's first divergence (None: none yet)."""
        self.stopped: list[object] = [None] * len(runs)
        """What a hook returned that stopped run k (sweep.search.pruning.Pruned, sweep.run.interrupt.Interrupted,
        True), or None."""
        self.training = list(range(len(runs)))
        """The runs that still train (indices into `runs`), in the layout's order."""
        self.windows = Windows(self) if windowed else None

    def run(self, step: int) -> None:
        """Train from `step` until no run is left to train."""
        layout, steps = self.layout, self.steps
        while self.live(step):
            if self.windows is not None and (end := self.windows.end(step)) > step + 1:
                step = self.windows.run(step, end)  # several steps, one sync (sweep/run/window.py)
                continue
            for k in self.training:
                self.syncs[k].one()
            batches, issues = layout.batches(step, self.training)
            for k, issue in issues.items():
                self.first[k] = Divergence(Verdict.bad_input, step, Cause("data", None, issue.detail))
            if issues and not self.live(step, list(batches)):
                break
            self.optimizer.at(step)  # the update's lr comes from the optimizer's table (sweep/run/adamw.py)
            probe = self.probe[1] if self.probe and self.probe[0] == step else None
            loss, pred = layout.forward_backward(batches, self.training, self.logit_step(step), probe)
            grads = layout.grads()
            decisions = steps.decide(step, loss, grads)  # the one sync
            self.optimizer.step([d.stepping for d in decisions])
            self.finish(step, decisions, grads, pred, batches)
            layout.zero_grad()
            step += 1

    def live(self, step: int, among: list[int] | None = None) -> bool:
        """Whether any run trains at `step` (`among` those, default those still training): not past its steps,
        not stopped by a verdict (monitor.stop_on_divergence) or a hook. A pack is compacted to them."""
        runs, first = self.runs, self.first
        self.training = [
            k
            for k in (self.training if among is None else among)
            if step < runs[k].steps and not self.stopped[k] and not (first[k] and runs[k].monitor.stop_on_divergence)
        ]
        if self.layout.keep(self.training) and self.windows is not None:
            self.windows.recapture()  # a CUDA graph captured the tensors the pack just replaced
        return bool(self.training)

    def logit_step(self, step: int) -> bool:
        """Whether `step` records attention-logit statistics (every monitor.logit_every; a lone run only)."""
        return self.layout.logit_stats is not None and step % self.runs[0].monitor.logit_every == 0

    def finish(
        self,
        step: int,
        decisions: list[Decision],
        grads: Grads,
        pred,
        batches: dict,
        logits: tuple | None = None,
        batch_step: int | None = None,
    ) -> list[int]:
        """After the optimizer, per training run: stall check, explanation of a first verdict (before zero_grad:
        it reads the gradients), metrics row, hooks, eval loss; then progress. `pred` and `batches` are those of
        step `batch_step` (default `step`; a window's rows other than its last never reach a verdict here).
        Returns the runs this step stopped."""
        layout, stopped, at = self.layout, [], step if batch_step is None else batch_step
        if logits is None:  # a second sync, every logit_every steps
            logits = layout.logit_stats.collect() if self.logit_step(step) else ("", "")
        for i, (k, d) in enumerate(zip(self.training, decisions)):
            run, part, evaluator = self.runs[k], self.parts[k], self.evaluators[k]
            verdict = self.steps.after_update(i, step, d, lambda i=i: layout.weights(i), grads)
            self.first[k] = first_of(
                self.first[k],
                verdict,
                run=run,
                step=step,
                named_params=lambda i=i: layout.named(i),
                pred=pred[i],
                x0=batches[k][0],
                labels=lambda part=part: sample_labels(part.dataset, part.order.indices(at)),
                monitor=part.monitor,
                second_moment=lambda i=i, k=k: layout.second_moment(i, k),
            )
            self.steps.log(i, self.metrics[k], step, d, part.lr_at(step), logits)
            if verdict is not None and run.monitor.stop_on_divergence:
                stopped.append(k)
                continue
            said = [hook.after_step(step, d.loss, part) for hook in self.hooks]  # a list: every hook runs
            if any(said):
                self.stopped[k] = next(s for s in said if s)
                stopped.append(k)
            # After the hooks, which see the training step only (a profiler hook must not see the eval forward).
            if evaluator is not None and self.first[k] is None and evaluator.due(step):
                self.metrics[k].rows[-1]["eval_loss"] = layout.eval_loss(i, evaluator, step)
        scale = decisions[0].scale if len(decisions) == 1 and self.steps.scaler.any_enabled else None
        self.progress.update(step, min(d.loss for d in decisions), scale)
        return stopped
