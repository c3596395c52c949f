"""Trial packing: K runs of one architecture trained as one vectorised computation.

    python -m sweep -m hydra/launcher=packed hydra.launcher.pack=8 optim.lr=1e-4,3e-4,1e-3,3e-3,1e-2,3e-2

On tiny proxy models a training step is dominated by fixed per-op costs, so K runs one after another
waste most of the machine. Here the K models' weights are stacked along a new leading dimension
(`torch.func.stack_module_state`) and one `vmap(functional_call(...))` runs the forward and the
backward of all K at once: every linear layer becomes one batched matmul, every attention call one
SDPA call (vmap folds the pack into the batch, so the forced backend is the one that runs; the fused
modulate op has its own vmap rule in models/modulate.py).

What stays per run is everything that decides its verdict: its own initial weights, data order and
noise (its own seed), its own loss scale (a per-run LossScaler: an overflow in one run neither skips
the step nor halves the scale of the others), its own gradient norm and clipping, its own AdamW
(torch's single-tensor AdamW, bit for bit, on its slice of the stacked weights, with its own lr
schedule, betas, eps and weight decay: sweep/run/adamw.py), its own DivergenceMonitor, and it
leaves the pack at its own first bad step (the stacked tensors are compacted) while the others go on.
Runs are independent inside vmap, so a NaN in one never reaches another.

What differs from running alone: the batched matmuls may round differently from the unbatched
ones, so loss curves agree to a tolerance, not bit for bit (tests/test_packing.py measures it), and
packed runs record no attention-logit statistics (the logit hooks cannot see inside vmap). Under
AMP every module outputs the dtype it outputs alone: linear and conv layers cast their operands
themselves, since autocast misses them under vmap (_cast_like_autocast).
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch.func import functional_call, stack_module_state, vmap

from sweep.config import RunConfig
from sweep.data.batches import load_checked_batch, sample_labels
from sweep.data.checks import check_batch
from sweep.data.device import DeviceBatches, PackBatches
from sweep.run.adam_lag import lag_note
from sweep.run.adamw import Hyper, scalars, update_
from sweep.run.build import RunParts
from sweep.run.evaluate import Evaluator
from sweep.run.graph import StepGraph, wanted
from sweep.run.monitor import Cause, Divergence
from sweep.run.progress import RunProgress
from sweep.run.results import MetricsLog
from sweep.run.scaler import DeviceLossScaler
from sweep.run.step import Steps, first_of
from sweep.run.train import explain
from sweep.run.window import Syncs, window_end


def _cast_like_autocast(m: torch.nn.Module):
    """m.forward with autocast's cast of a whole linear/conv made explicit: input, weight and bias.

    Under vmap a linear with batched weights decomposes into matmul + bias add and autocast casts only
    the matmul, so an fp32 bias lifts the activations back to fp32 (pytorch/pytorch#192617), and a conv
    with batched weights reaches no autocast rule at all. Packed AMP activations would then be fp32
    where the lone run's are fp16: no overflow where the lone run has one.
    """

    def forward(x: torch.Tensor) -> torch.Tensor:
        w, b = m.weight, m.bias
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w, b = x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)
        if isinstance(m, torch.nn.Linear):
            return torch.nn.functional.linear(x, w, b)
        return m._conv_forward(x, w, b)

    return forward


class _SdpaLikeAutocast(torch.overrides.TorchFunctionMode):
    """Autocast's cast of a whole scaled_dot_product_attention call made explicit: q/k/v (and a float mask) to
    the autocast dtype, the call itself with autocast off.

    Under vmap autocast reaches the ops inside SDPA's math kernel instead of the SDPA call: the kernel's
    upcast q/k/v are cast back by autocast's matmul, so the packed softmax runs in bf16/fp16 where the lone
    run's runs in fp32, and the output comes out fp32. On CUDA autocast also runs softmax in fp32, so
    _safe_softmax gets a bf16 input and an fp32 result, and its backward is refused ("expected input and grad
    types to match, or input to be at::Half and grad to be at::Float"; fp16 passes that check).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            device = args[0].device.type
            if torch.is_autocast_enabled(device):
                dtype = torch.get_autocast_dtype(device)
                args = tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
                with torch.autocast(device, enabled=False):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


class PackedModel:
    """K models of one architecture as stacked weights and one vmapped forward."""

    def __init__(self, models: Sequence[torch.nn.Module]):
        self.params, self.buffers = stack_module_state(list(models))  # {name: (K, ...)} leaves
        self.base = copy.deepcopy(models[0]).to("meta")  # the module structure, no storage
        self.device = next(iter(self.params.values())).device
        for m in self.base.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
                m.forward = _cast_like_autocast(m)

    def __call__(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x (K, B, ...), t (K, B) -> prediction (K, B, ...), run k with weights k."""

        def one(params, buffers, x, t):
            return functional_call(self.base, (params, buffers), (x, t))

        with _SdpaLikeAutocast():
            return vmap(one)(self.params, self.buffers, x, t)

    def keep(self, positions: list[int]) -> None:
        """Keep only the runs at these positions (in this order): runs that left the pack stop costing."""
        index = torch.tensor(positions, dtype=torch.long, device=self.device)
        self.params = {n: p.detach()[index].requires_grad_(p.requires_grad) for n, p in self.params.items()}
        self.buffers = {n: b[index] for n, b in self.buffers.items()}

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params.values() if p.grad is not None]

    def run_params(self, i: int) -> list[tuple[str, torch.Tensor]]:
        """Run i's (name, weight) slices, each with its gradient slice as `.grad` (for sweep.run.train.explain)."""
        named = []
        for name, p in self.params.items():
            w = p.detach()[i]
            w.grad = p.grad[i] if p.grad is not None else None
            named.append((name, w))
        return named

    def forward_of(self, i: int):
        """Run i's forward alone (no vmap): the prediction its weights give, as the lone run computes it."""
        params = {n: p.detach()[i] for n, p in self.params.items()}
        buffers = {n: b[i] for n, b in self.buffers.items()}
        return lambda x, t: functional_call(self.base, (params, buffers), (x, t))

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None


class StackedAdamW:
    """Every run's AdamW as one update of the stacked weights: sweep.run.adamw.update_, run k with the scalars
    of its own optimizer (its lr table, betas, eps and weight decay: sweep.run.adamw.DeviceAdamW) and its
    own update count. So each run's update is the one it takes alone, bit for bit, and pure fp16 still turns
    eps=1e-8 into 0 and divides 0 by 0. A run whose step is skipped (overflow, verdict) keeps its weights,
    moments and count untouched."""

    def __init__(self, parts: Sequence[RunParts], params: dict[str, torch.Tensor]):
        # packable runs have one group (sweep.run.packing.refusal)
        self.hyper = Hyper.stack([p.optimizer.hyper[0] for p in parts])
        self.beta2 = [p.optimizer.param_groups[0]["betas"][1] for p in parts]
        self.decays = any(p.optimizer.param_groups[0]["weight_decay"] != 0 for p in parts)
        self.moments = {n: (torch.zeros_like(w), torch.zeros_like(w)) for n, w in params.items() if w.requires_grad}
        self.device = next(iter(params.values())).device
        self.counts = torch.zeros(len(parts), dtype=torch.long, device=self.device)
        """Each packed run's update count, in pack order."""
        self.clock = torch.zeros(1, dtype=torch.long, device=self.device)

    def keep(self, positions: list[int]) -> None:
        index = torch.tensor(positions, dtype=torch.long, device=self.device)
        self.moments = {n: (m[index], v[index]) for n, (m, v) in self.moments.items()}
        self.hyper, self.counts = self.hyper.keep(index), self.counts[index]

    def second_moment(self, position: int, run: int) -> tuple[float, int, float]:
        """Run `run`'s (at `position` in the pack) sum of v, update count and beta2, as
        sweep.run.adam_lag.adamw_second_moment."""
        return (
            sum(float(v[position].float().sum()) for _, v in self.moments.values()),
            int(self.counts[position]),
            self.beta2[run],
        )

    def at(self, step: int) -> None:
        """The next update is step `step`'s (each run's lr of that step)."""
        self.clock.fill_(step)

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], stepping: list[bool] | None = None) -> None:
        """Update the packed runs whose `stepping` is True (in pack order; None: every run, with nothing from
        the host, as a window's step does) with their lr of the step the clock is at."""
        keep = [i for i, go in enumerate(stepping) if not go] if stepping is not None else []
        self.counts += torch.tensor(stepping, device=self.device) if keep else 1
        lr = self.hyper.lr.index_select(1, self.clock).view(-1)
        cols = scalars(lr, self.hyper, self.counts.clamp(min=1))  # (ROWS, K); a skipped run's are unused
        for name, (m, v) in self.moments.items():
            w, g = params[name].detach(), params[name].grad
            if g is None:
                continue
            saved = [t[keep].clone() for t in (w, m, v)] if keep else None
            update_(w, g, m, v, cols, self.hyper.consts, self.decays, self.hyper.update_clip)
            if saved:
                for t, old in zip((w, m, v), saved):
                    t[keep] = old


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
    pack = _Pack(runs, parts, metrics, progress, evaluators or [None] * len(runs))
    syncs = syncs if syncs is not None else [Syncs(r.monitor.sync_every) for r in runs]
    step, host_until, last = 0, -1, max(r.steps for r in runs)
    while step < last:
        live = pack.live_at(step)
        if not live:
            break
        end = step + 1
        if step > host_until:
            size = min(runs[k].monitor.sync_every for k in live)
            end = min(min(window_end(runs[k], step, pack.evaluators[k], size), runs[k].steps) for k in live)
        if end - step == 1:
            for k in live:
                syncs[k].one()
            pack.one(step, live)
            step += 1
            continue
        pack.compact(live)
        snapshot = PackSnapshot(pack, live)
        stood, at = pack.window(step, end, live)
        for k in live:
            syncs[k].window(pack.ran_to, stood, at)
            syncs[k].replayed += pack.replayed
        if stood:
            step = end
        else:
            snapshot.restore()
            host_until = at
    return pack.first


class _Pack:
    """The pack's steps: `one` with a sync per step, `window` with one sync for several."""

    def __init__(self, runs, parts, metrics, progress, evaluators):
        self.runs, self.parts, self.metrics, self.progress, self.evaluators = runs, parts, metrics, progress, evaluators
        self.device, self.policy = parts[0].device, parts[0].policy
        self.model = PackedModel([p.model for p in parts])
        self.opt = StackedAdamW(parts, self.model.params)
        self.steps = Steps(runs, [p.monitor for p in parts], DeviceLossScaler.stack([p.scaler for p in parts]))
        self.first: list[Divergence | None] = [None] * len(runs)
        self.live, self.packed = list(range(len(runs))), list(range(len(runs)))  # training; in the tensors
        # Windows draw every run's synthetic batch with one gather on the device (sweep/data/device.py).
        pack = None
        if any(r.monitor.sync_every > 1 for r in runs):
            cpu = torch.device("cpu")
            each = [DeviceBatches.of(p.dataset, p.order, r.steps, cpu, r.data.range_limit) for r, p in zip(runs, parts)]
            pack = PackBatches.of(each, [r.data.check for r in runs])
        self.device_batches = pack.to(self.device) if pack is not None else None
        self.loss_weights = torch.tensor([r.objective.loss_weight for r in runs], device=self.device)
        # graph=true on CUDA: window steps replay one capture of device_step (sweep/run/graph.py)
        graphed = self.device_batches is not None and wanted(runs[0].graph, self.device)  # graph is in pack_key
        self.graph = (
            StepGraph(
                lambda: self.device_step(self.packed),
                clock=self.opt.clock,
                params=lambda: [p for p in self.model.params.values() if p.requires_grad],
                generators=lambda: [parts[k].noise_gen for k in self.packed],
                snapshot=lambda: PackSnapshot(self, self.packed),
                zero_grad=self.model.zero_grad,
                has_state=lambda: True,  # the stacked moments exist from the start
                steps=max(r.steps for r in runs),
            )
            if graphed
            else None
        )
        self.replayed = 0  # the last window's steps replayed from the graph

    def live_at(self, step: int) -> list[int]:
        """The runs that train at `step`: not past their steps, not stopped by a verdict."""
        runs, first = self.runs, self.first
        self.live = [
            k for k in self.live if step < runs[k].steps and not (first[k] and runs[k].monitor.stop_on_divergence)
        ]
        return self.live

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
        return loss, pred

    def one(self, step: int, live: list[int]) -> None:
        """One step of the live runs, one sync."""
        batches, issues = self.batches(step, live)
        for k, issue in issues.items():
            self.first[k] = Divergence("bad_input", step, Cause("data", None, issue.detail))
        live = self.live = list(batches)
        if not live:
            return
        self.compact(live)
        loss, pred = self.forward_backward(batches, live)
        grads = StackedGrads(self.model.grads())
        decisions = self.steps.decide(step, loss, grads)  # the one sync
        lrs = [self.parts[k].lr_at(step) for k in live]
        self.opt.at(step)
        self.opt.step(self.model.params, [d.stepping for d in decisions])
        self.finish(step, live, decisions, lrs, grads, pred, batches)
        self.model.zero_grad()

    def device_step(self, live: list[int], batches: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """One window step of the live runs from device state alone (sweep.run.train._Loop.device_step's
        counterpart, what a CUDA graph of the pack captures): every run's batch (unless `batches`, read from
        files, are given) and lr of the step the clock is at, each run's next noise, the vmapped forward and
        backward, AdamW for every run, and the clock moves on. Returns (rows (ROWS, L), or ROWS + 1 with each
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

    def window(self, start: int, end: int, live: list[int]) -> tuple[bool, int | None]:
        """Steps start..end-1 of the live runs with one sync: (True, None) when they stood, (False, s) when
        some run's step s needs the host (take the window back)."""
        rows, flagged = [], self.device_batches is not None  # drawn and checked on the device: flags in the rows
        self.ran_to, self.replayed = start, 0  # the first step of the window not run (yet)
        self.opt.at(start)  # the clock: each step moves it on
        for step in range(start, end):
            if step > start:  # the last step's gradients stay for the stall checks
                self.model.zero_grad()
            if flagged and self.graph is not None and self.graph.ready(step):
                row, pred, batches = self.graph()
                self.replayed += self.graph.graph is not None  # not when the capture failed
            elif flagged:
                row, pred, batches = self.device_step(live)
            else:
                batches, issues = self.batches(step, live)
                if issues:
                    return False, step
                row, pred, batches = self.device_step(live, batches)
            rows.append(row)
            self.ran_to = step + 1
        lrs = [[self.parts[k].lr_at(s) for k in live] for s in range(start, end)]
        fetched = torch.stack(rows).tolist()  # (steps, ROWS [+ the flags], L): the window's one sync
        bad = next((s for s, row in zip(range(start, end), fetched) if flagged and any(row[-1])), None)
        if bad is not None:  # a bad batch: the host's check decides it, with the steps before it one by one
            return False, bad
        decisions = [self.steps.judge(s, row[: Steps.ROWS]) for s, row in zip(range(start, end), fetched)]
        bad = next((s for s, ds in zip(range(start, end), decisions) if not all(d.stepping for d in ds)), None)
        if bad is not None:
            return False, bad
        grads = StackedGrads(self.model.grads())
        for s, ds, step_lrs in zip(range(start, end), decisions, lrs):
            self.finish(s, live, ds, step_lrs, grads, pred, batches)
        self.model.zero_grad()
        return True, None

    def finish(self, step, live, decisions, lrs, grads, pred, batches) -> None:
        """After the optimizer, per run: stall check, explanation of a first verdict, eval loss, metrics row.
        `pred` and `batches` are this step's (a window's rows other than its last reach no verdict here)."""
        model, opt, parts, runs = self.model, self.opt, self.parts, self.runs
        for i, (k, d) in enumerate(zip(live, decisions)):
            run, monitor = runs[k], parts[k].monitor
            verdict = self.steps.after_update(
                i, step, d, [p.detach()[i] for p in model.params.values() if p.requires_grad], grads
            )
            x0, indices = batches[k][0], parts[k].order.indices(step)
            self.first[k] = first_of(  # before zero_grad: the explanation reads the gradients
                self.first[k],
                verdict,
                lambda: explain(
                    verdict,
                    model.run_params(i),
                    pred[i],
                    updated=monitor.updates > 0,
                    batch_issue=lambda: check_batch(x0, run.data.range_limit, sample_labels(parts[k].dataset, indices)),
                    second_moment=lambda: lag_note(
                        *opt.second_moment(i, k), monitor.recent_sq, verdict.step, step, run.optim.grad_clip
                    ),
                ),
            )
            ev = self.evaluators[k]
            due = ev is not None and self.first[k] is None and verdict is None and ev.due(step)
            eval_loss = ev(model.base, step, forward=model.forward_of(i)) if due else ""
            self.steps.log(i, self.metrics[k], step, d, lrs[i], eval_loss=eval_loss)
        self.progress.update(step, min(d.loss for d in decisions), None)


class PackSnapshot:
    """Everything a pack's window changes, as it was at the window's start (sweep.run.window.Snapshot's
    counterpart: stacked weights and moments, each live run's noise generator and monitor, the scalers)."""

    def __init__(self, pack: _Pack, live: list[int]):
        self.pack, self.live = pack, live
        self.weights = {n: p.detach().clone() for n, p in pack.model.params.items()}
        self.moments = {n: (m.clone(), v.clone()) for n, (m, v) in pack.opt.moments.items()}
        self.opt_counts = pack.opt.counts.clone()
        self.noise = [pack.parts[k].noise_gen.get_state() for k in live]
        self.rng = torch.get_rng_state()
        self.scaler = pack.steps.scaler.state()
        self.monitors = []
        for k in live:
            numbers, tensors = pack.parts[k].monitor.state_dict()
            self.monitors.append((copy.deepcopy(numbers), dict(tensors), pack.parts[k].monitor.updates))

    def restore(self) -> None:
        pack = self.pack
        with torch.no_grad():
            for n, p in pack.model.params.items():
                p.copy_(self.weights[n])
            for n, (m, v) in pack.opt.moments.items():  # in place, as sweep.run.window.Snapshot
                m.copy_(self.moments[n][0])
                v.copy_(self.moments[n][1])
            pack.opt.counts.copy_(self.opt_counts)
        for k, state in zip(self.live, self.noise):
            pack.parts[k].noise_gen.set_state(state)
        torch.set_rng_state(self.rng)
        pack.steps.scaler.restore(self.scaler)
        for k, (numbers, tensors, updates) in zip(self.live, self.monitors):
            pack.parts[k].monitor.load_state_dict(numbers, tensors)
            pack.parts[k].monitor.updates = updates
        pack.model.zero_grad()
