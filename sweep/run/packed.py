"""Trial packing: K runs of one architecture trained as one vectorised computation.

    python -m sweep -m hydra/launcher=packed hydra.launcher.pack=8 optim.lr=1e-4,3e-4,1e-3,3e-3,1e-2,3e-2

On tiny proxy models a training step is dominated by fixed per-op costs, so K runs one after another
waste most of the machine. Here the K models' weights are stacked and one vmapped forward and backward
runs all K at once (sweep/run/packed_model.py). The pack's steps go through the same driver as a lone
run's (sweep.run.window.drive: windows of steps with one sync, taken back when a step needs the host).

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

from sweep.config import RunConfig, Verdict
from sweep.data.batches import load_checked_batch, sample_labels
from sweep.data.device import DeviceBatches, PackBatches
from sweep.run.adamw import StackedAdamW
from sweep.run.build import RunParts
from sweep.run.evaluate import Evaluator
from sweep.run.graph import WARMUP, StepGraph, table_span, wanted
from sweep.run.monitor import Cause, Divergence
from sweep.run.packed_model import PackedModel
from sweep.run.progress import RunProgress
from sweep.run.results import MetricsLog
from sweep.run.scaler import DeviceLossScaler
from sweep.run.step import StackedGrads, Steps
from sweep.run.verdict import first_of
from sweep.run.window import Snapshot, Syncs, WindowResult, drive, window_end


def train_packed(
    runs: Sequence[RunConfig],
    parts: Sequence[RunParts],
    metrics: Sequence[MetricsLog],
    progress: RunProgress,
    evaluators: Sequence[Evaluator | None] | None = None,
    syncs: Sequence[Syncs] | None = None,
) -> list[Divergence | None]:
    """Train the runs together; each one's first divergence (None when stable), as sweep.run.train.train would.

    `evaluators[k]` measures run k's eval loss when due, as train does, on run k's weight slice forwarded
    alone (no vmap), so a packed run's eval loss is its weights' as a lone run would compute it. With
    monitor.sync_every > 1 the pack runs windows of steps with one sync, taken back as a lone run's are
    (sweep/run/window.py) when any of its runs has a step the host must decide. `syncs[k]` counts how run k's
    steps met the host (a window of the pack counts for each of its live runs)."""
    syncs = syncs if syncs is not None else [Syncs(r.monitor.sync_every) for r in runs]
    pack = Pack(runs, parts, metrics, progress, evaluators or [None] * len(runs), syncs)
    drive(pack, 0)
    return pack.first


class Pack:
    """The pack's steps, as sweep.run.window.drive runs them: `one` with a sync per step, `window` with one
    sync for several. `training` are the runs that still train, `packed` those in the stacked tensors."""

    def __init__(self, runs, parts, metrics, progress, evaluators, syncs=None):
        self.runs, self.parts, self.metrics, self.progress, self.evaluators = runs, parts, metrics, progress, evaluators
        self.syncs = syncs if syncs is not None else [Syncs(r.monitor.sync_every) for r in runs]
        self.device, self.policy = parts[0].device, parts[0].policy
        self.model = PackedModel([p.model for p in parts])
        self.opt = StackedAdamW(parts, self.model.params)
        self.clock = self.opt.clock
        self.steps = Steps(runs, [p.monitor for p in parts], DeviceLossScaler.stack([p.scaler for p in parts]))
        self.first: list[Divergence | None] = [None] * len(runs)
        self.training, self.packed = list(range(len(runs))), list(range(len(runs)))
        # Windows draw every run's synthetic batch with one gather on the device (sweep/data/device.py).
        self.device_batches = None
        if any(r.monitor.sync_every > 1 for r in runs):
            cpu, span = torch.device("cpu"), table_span(max(r.monitor.sync_every for r in runs))
            each = [
                DeviceBatches.of(p.dataset, p.order, r.steps, cpu, r.data.range_limit, span)
                for r, p in zip(runs, parts)
            ]
            self.device_batches = PackBatches.of(each, [r.data.check for r in runs], self.device)
        self.flagged = self.device_batches is not None  # each run's data flag is in its row
        self.loss_weights = torch.tensor([r.objective.loss_weight for r in runs], device=self.device)
        # graph=true on CUDA: window steps replay one capture of device_step (sweep/run/graph.py)
        graphed = self.device_batches is not None and wanted(runs[0].graph, self.device)  # graph is in pack_key
        self.graph = StepGraph(self, max(r.steps for r in runs)) if graphed else None

    # What sweep.run.window.drive asks
    def live(self, step: int) -> list[Syncs]:
        """The runs that train at `step` (not past their steps, not stopped by a verdict): compacted to them."""
        runs, first = self.runs, self.first
        self.training = [
            k for k in self.training if step < runs[k].steps and not (first[k] and runs[k].monitor.stop_on_divergence)
        ]
        self.compact(self.training)
        return [self.syncs[k] for k in self.training]

    def window_end(self, step: int) -> int:
        size = min(self.runs[k].monitor.sync_every for k in self.training)
        return min(window_end(self.runs[k], step, self.evaluators[k], size) for k in self.training)

    def at(self, start: int, stop: int) -> None:
        self.opt.at(start, stop + WARMUP)  # a graph's warm-up reads past the window
        if self.device_batches is not None:
            self.device_batches.cover(start, stop + WARMUP)

    def snapshot(self, reuse: Snapshot | None = None) -> Snapshot:
        parts = [self.parts[k] for k in self.packed]
        return Snapshot(
            list(self.model.params.values()),
            self.opt,
            [p.noise_gen for p in parts],
            self.steps.scaler,
            [p.monitor for p in parts],
            self.zero_grad,
            reuse,
        )

    # What sweep.run.graph.StepGraph asks
    def captured_step(self) -> tuple:
        return self.device_step(self.packed)

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for p in self.model.params.values() if p.requires_grad]

    @property
    def generators(self) -> list[torch.Generator]:
        return [self.parts[k].noise_gen for k in self.packed]

    def has_state(self) -> bool:
        return True  # the stacked moments exist from the start

    def zero_grad(self) -> None:
        self.model.zero_grad()

    # The steps
    def compact(self, live: list[int]) -> None:
        """Runs that left the pack stop costing: keep only `live` in the stacked tensors."""
        if live != self.packed:
            positions = [self.packed.index(k) for k in live]
            for part in (self.model, self.opt, self.steps, self.device_batches):
                if part is not None:
                    part.keep(positions)
            self.loss_weights = self.loss_weights[positions]
            if self.graph is not None:  # it captured the tensors just replaced
                self.graph.reset()
            self.packed = live

    def batches(self, step: int, live: list[int]) -> tuple[dict, dict]:
        """Each live run's own batch, data check and noise, in its own order: ({k: (x0, noisy, t, target)},
        {k: the BatchIssue of a run whose batch is bad})."""
        batches, issues = {}, {}
        for k in live:
            part, run = self.parts[k], self.runs[k]
            x0, issue = load_checked_batch(part.dataset, part.order.indices(step), run.data.range_limit, run.data.check)
            if issue is not None:
                issues[k] = issue
                continue
            batches[k] = (x0, *part.objective.sample(x0.to(self.device), part.noise_gen))
        return batches, issues

    def forward_backward(self, batches: dict, live: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One vmapped forward and the scaled backward of every live run: (loss (L,), pred (L, B, ...))."""
        policy, device = self.policy, self.device
        noisy, t, target = (torch.stack([batches[k][j] for k in live]) for j in (1, 2, 3))
        with policy.gemm_mode():
            with policy.autocast(device):
                pred = self.model(noisy.to(policy.param_dtype), t)  # (L, B, ...)
            loss = vmap(self.parts[0].objective.loss)(pred, target) * self.loss_weights  # (L,)
            self.steps.backward(loss)
        return loss.detach(), pred.detach()  # no autograd graph kept alive (sweep/run/train.py says why)

    def one(self, step: int) -> bool:
        """One step of the training runs, one sync; a run's verdict stops only that run (`live`)."""
        batches, issues = self.batches(step, self.training)
        for k, issue in issues.items():
            self.first[k] = Divergence(Verdict.bad_input, step, Cause("data", None, issue.detail))
        live = self.training = list(batches)
        if not live:
            return False
        self.compact(live)
        loss, pred = self.forward_backward(batches, live)
        grads = StackedGrads(self.model.grads())
        decisions = self.steps.decide(step, loss, grads)  # the one sync
        self.opt.at(step)
        self.opt.step(self.model.params, [d.stepping for d in decisions])
        self.finish(step, live, decisions, [self.parts[k].lr_at(step) for k in live], grads, pred, batches)
        self.zero_grad()
        return False

    def device_step(self, live: list[int], batches: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """One window step of the live runs from device state alone (sweep.run.train.Lone.device_step's
        counterpart, what a CUDA graph of the pack captures): every run's batch (unless `batches`, read from
        files, are given) and lr of the step the clock is at, each run's next noise, the vmapped forward and
        backward, AdamW for every run, and the clock moves on. Returns (rows (len(Row), L), or len(Row) + 1 with each
        run's data flag when the batches were drawn here; pred; {k: (x0, noisy, t, target)})."""
        flags = None
        if batches is None:
            x0 = self.device_batches.at(self.opt.clock)  # (L, B, ...)
            flags = self.device_batches.bad(x0)
            batches = {
                k: (x0[i], *self.parts[k].objective.sample(x0[i], self.parts[k].noise_gen)) for i, k in enumerate(live)
            }
        loss, pred = self.forward_backward(batches, live)
        row = self.steps.record(loss, StackedGrads(self.model.grads()))
        self.opt.step(self.model.params)  # a step the scaler or monitor would have stopped takes the window back
        self.opt.clock.add_(1)
        return (row if flags is None else torch.cat([row, flags.double().view(1, -1)])), pred, batches

    def graph_at(self, step: int) -> StepGraph | None:
        return self.graph  # packed runs record no attention statistics: one graph for every step

    def put_back(self) -> None:
        pass

    def eager_step(self, step: int) -> tuple | None:
        if self.flagged:  # batches drawn and checked on the device
            return self.device_step(self.training)
        batches, issues = self.batches(step, self.training)
        return None if issues else self.device_step(self.training, batches)

    def stand(self, start: int, decisions: list, pred: torch.Tensor, batches: dict) -> WindowResult:
        grads, live = StackedGrads(self.model.grads()), self.training
        for s, ds in enumerate(decisions, start):
            self.finish(s, live, ds, [self.parts[k].lr_at(s) for k in live], grads, pred, batches)
        self.zero_grad()
        return WindowResult()

    def stepped(self, step: int) -> None:
        pass  # packed runs record no attention statistics

    def drop(self) -> None:
        pass  # a pack's window leaves nothing besides its state

    def finish(self, step, live, decisions, lrs, grads, pred, batches) -> None:
        """After the optimizer, per run: stall check, explanation of a first verdict, eval loss, metrics row.
        `pred` and `batches` are this step's (a window's rows other than its last reach no verdict here)."""
        model, opt, parts, runs = self.model, self.opt, self.parts, self.runs
        for i, (k, d) in enumerate(zip(live, decisions)):
            run, monitor = runs[k], parts[k].monitor
            weights = lambda i=i: [p.detach()[i] for p in model.params.values() if p.requires_grad]  # noqa: E731
            verdict = self.steps.after_update(i, step, d, weights, grads)
            self.first[k] = first_of(  # before zero_grad: the explanation reads the gradients
                self.first[k],
                verdict,
                run=run,
                step=step,
                named_params=lambda: model.run_params(i),
                pred=pred[i],
                x0=batches[k][0],
                labels=lambda: sample_labels(parts[k].dataset, parts[k].order.indices(step)),
                monitor=monitor,
                second_moment=lambda: opt.second_moment(i, k),
            )
            ev = self.evaluators[k]
            due = ev is not None and self.first[k] is None and verdict is None and ev.due(step)
            eval_loss = ev(model.base, step, forward=model.forward_of(i)) if due else ""
            self.steps.log(i, self.metrics[k], step, d, lrs[i], eval_loss=eval_loss)
        self.progress.update(step, min(d.loss for d in decisions), None)
