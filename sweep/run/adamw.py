"""AdamW with every per-step scalar on the device: torch's single-tensor AdamW, op for op, alone or packed.

torch's single-tensor AdamW (`torch.optim.AdamW(foreach=False)`, what runs trained with before this module)
computes its scalars on the host each step: the bias corrections from a step count it reads back with
`.item()`, the step size from the group's lr, a Python float the loop sets. A CUDA graph of the step
would freeze both at the captured step. torch's graph-safe forms change the numbers instead: the
capturable single-tensor path computes `sqrt(v) / (bias_correction2_sqrt * step_size_neg) + eps / step_size_neg`
(its names, which this module's are) and the fused kernel works in fp32, so pure fp16's eps=1e-8 no longer
rounds to 0 and the Sana case (fp16 weights, AdamW's 0/0 at the first update) would not diverge at all. Here
the update is torch's CPU single-tensor one, op for op and rounding for rounding, with its scalars computed on
the device:

- the lr of every step comes from a table made on the host (sweep.run.build.lr_schedule, in double, times the
  group's lr_scale) a window of steps at a time (sweep/data/step_table.py: `at` moves it on before the steps
  run), read at the optimizer's `clock`, a device step index;
- each weight's update count stays in its state's "step" tensor, on the weight's device, and indexes
  tables of 1 - beta1**n and (1 - beta2**n) ** 0.5, computed in double by Python as torch does, up to the count
  where 1 - beta**n is 1.0 in double (`bias_table`: 357 entries for beta 0.9, 37,413 for 0.999), which every
  later count reads: a run of any length builds them in milliseconds;
- the step size lr / (1 - beta1**n) and the decay 1 - lr * weight_decay are IEEE double operations
  on the device: the same numbers torch computes in Python, then rounded to fp32 as its kernels take
  Python scalars.

Every update is therefore bit for bit torch's on the CPU (tests/test_adamw.py, fp32, bf16 and fp16
weights, weight decay, warmup and cosine, skipped steps, two groups), and nothing in `step` reads a
value back to the host (tests/test_graph_ready.py). On CUDA torch's own kernels differ from its CPU ones (addcdiv
computes `w + value * (m / denom)`, add keeps its scalar in fp32); this module keeps the CPU's operand order
on both devices, so a CUDA run may differ from torch's CUDA AdamW in a last bit, and is deterministic either
way. (On CUDA the multi-tensor kernels of `update_all_` may also round differently from the per-tensor ones,
e.g. addcmul as `v + value * (g * g)`, and nvcc may fuse a multiply-add: no CUDA run is bit for bit the CPU's.
A captured step and an eager one take the same path, so graph == eager still holds.)

`update_` takes K runs stacked along a leading dimension; a lone run's weight is a stack of one. DeviceAdamW
is one run's optimizer (sweep/run/train.py), StackedAdamW (sweep/run/stacked_adamw.py) every packed run's
(sweep/run/packed.py).

`update_all_` is `update_` for many fp32 weights at one set of scalars, as torch's multi-tensor (`_foreach_`)
ops: on a GPU about ten kernels for a whole group instead of about eight per weight, which a CUDA graph of a
small model's step is bound by (bench/step_ops.py: 414 of a tiny step's 816 ops were AdamW's). On the CPU torch
runs each foreach op as the per-tensor op `update_` runs, so the numbers are the same bit for bit. DeviceAdamW
takes it for a group's fp32 weights when the host knows their update counts are equal (`KnownCounts`); pure
bf16 and fp16 weights stay per weight (a foreach op would round its tensor scalar to the weights' dtype on a
GPU, where torch's single-tensor kernels compute with it in fp32), as does update clipping (a factor per
tensor).

Update clipping (`optim.update_clip`, off at 0): StableAdamW's (Wortsman et al. 2023b, arXiv 2304.13013,
Algorithm 2, as the authors' reference StableAdamWUnfused does it). Loss spikes there follow steps where
AdamW's second moment under-estimates the squared gradients, so the update of a tensor whose gradients jumped
is far larger than lr. Per weight tensor (per run and tensor in a pack), after this step's v update,
RMS = sqrt(mean(g**2 / max(v_hat, eps**2))) with v_hat = v / (1 - beta2**n), and the step size
lr / (1 - beta1**n) is multiplied by 1 / max(1, RMS / update_clip); the decoupled weight decay keeps the
scheduled lr, as in the reference. The RMS is computed in fp32 on the device (nothing read back), and with
clipping off `update_` runs exactly the ops it ran before.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Callable, NamedTuple, Sequence

import torch

from sweep.data.step_table import SPAN, StepTable


def copies(tensors: Sequence[torch.Tensor], into: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Exact copies of `tensors` made by one multi-tensor copy (a window's snapshot, sweep/run/window.py): on a
    GPU a handful of kernel launches for the whole list instead of one clone each. `into`: an earlier call's
    copies no longer needed (the last window's snapshot), written over when each matches its tensor in shape,
    dtype and device, so that a window's snapshot allocates nothing (some 200 tensors for the tiny model)."""
    tensors = list(tensors)
    if into is None or len(into) != len(tensors) or not all(map(_fits, into, tensors)):
        into = [torch.empty_like(t) for t in tensors]
    out = list(into)
    if out:
        torch._foreach_copy_(out, tensors)
    return out


def _fits(buffer: torch.Tensor, t: torch.Tensor) -> bool:
    return buffer.shape == t.shape and buffer.dtype == t.dtype and buffer.device == t.device


def copy_back(tensors: Sequence[torch.Tensor], saved: Sequence[torch.Tensor]) -> None:
    """Put `saved` (from copies) back into `tensors`, in place."""
    if tensors:
        torch._foreach_copy_(list(tensors), list(saved))


class Saved:
    """An optimizer's state as it was (`saved()`): calling it puts it back in place; `copies` are the buffers that
    hold it, which the next window's snapshot may write over (`copies(..., into=)`)."""

    def __init__(self, copies: list[torch.Tensor], restore: Callable[[], None]):
        self.copies, self._restore = copies, restore

    def __call__(self) -> None:
        self._restore()


class PerStep(IntEnum):
    """The rows of the (len(PerStep), R) fp32 scalars `per_step_scalars` makes and `update_` takes, one column per
    update (torch's names: its `_single_tensor_adamw` computes them in Python)."""

    decay = 0
    """1 - lr * weight_decay: the decoupled weight decay's factor."""
    bias_correction2_sqrt = 1
    """(1 - beta2**n) ** 0.5."""
    step_size_neg = 2
    """-(lr / (1 - beta1**n)): minus the step size."""


class Consts(NamedTuple):
    """An AdamW's constants over the run: Python floats, or (K,) fp32 tensors for a pack whose runs differ."""

    one_minus_beta1: float | torch.Tensor
    beta2: float | torch.Tensor
    one_minus_beta2: float | torch.Tensor
    eps: float | torch.Tensor


@dataclass
class Hyper:
    """One optimizer group's (or one packed run's) hyperparameters, as the device computes with them."""

    lr: StepTable
    """float64: the lr of each step (the schedule times the group's lr_scale), a window of steps at a time
    (sweep/data/step_table.py); stacked, a column per packed run."""
    bias_correction1: torch.Tensor
    """(n,) float64: 1 - beta1**k for update counts k < n (`bias_table`); a count past them reads the last."""
    bias_correction2_sqrt: torch.Tensor
    """(n,) float64: (1 - beta2**k) ** 0.5 for update counts k < n (`bias_table`); a count past them reads the last."""
    consts: Consts
    """Constant over the run, so Python floats the kernels take as torch's do (a CUDA graph keeps them as they
    are); a pack whose runs differ in them has (K,) fp32 tensors."""
    weight_decay: torch.Tensor
    """() float64."""
    update_clip: float | torch.Tensor = 0.0
    """StableAdamW's update-clipping threshold (0 = off): a Python float, or a (K,) fp32 tensor for a pack whose
    runs differ in it (0 in a row: that run unclipped)."""

    @classmethod
    def of(
        cls,
        lr_at: Callable[[int], float],
        steps: int,
        betas: Sequence[float],
        eps: float,
        weight_decay: float,
        device: torch.device,
        lr_scale: float = 1.0,
        update_clip: float = 0.0,
        span: int = SPAN,
    ) -> "Hyper":
        """Tables for a run of `steps` steps (an update count never exceeds the steps run); the lr's holds `span`
        steps at a time."""
        beta1, beta2 = betas
        f64 = dict(dtype=torch.float64, device=device)

        def lr_rows(start: int, stop: int) -> torch.Tensor:
            return torch.tensor([lr_at(s) * lr_scale for s in range(start, stop)], dtype=torch.float64)

        return cls(
            lr=StepTable.of(lr_rows, steps, device, span),
            bias_correction1=torch.tensor(bias_table(beta1, steps), **f64),
            bias_correction2_sqrt=torch.tensor([c**0.5 for c in bias_table(beta2, steps)], **f64),
            consts=Consts(1 - beta1, beta2, 1 - beta2, eps),
            weight_decay=torch.tensor(weight_decay, **f64),
            update_clip=float(update_clip),
        )

    @staticmethod
    def stack(hypers: Sequence["Hyper"]) -> "Hyper":
        """K runs' hyperparameters, one row each (bias tables padded to the longest with their last value, which
        every later count reads)."""
        width = max(h.bias_correction1.shape[0] for h in hypers)
        width2 = max(h.bias_correction2_sqrt.shape[0] for h in hypers)
        device = hypers[0].weight_decay.device

        def pad(t: torch.Tensor, size: int) -> torch.Tensor:
            return torch.cat([t, t[-1:].expand(size - t.shape[0])]) if t.shape[0] < size else t

        return Hyper(
            lr=StepTable.stack([h.lr for h in hypers]),
            bias_correction1=torch.stack([pad(h.bias_correction1, width) for h in hypers]),
            bias_correction2_sqrt=torch.stack([pad(h.bias_correction2_sqrt, width2) for h in hypers]),
            consts=_stacked_consts([h.consts for h in hypers], device),
            weight_decay=torch.stack([h.weight_decay for h in hypers]),
            update_clip=_stacked_clip([h.update_clip for h in hypers], device),
        )

    def keep(self, positions: torch.Tensor) -> "Hyper":
        """The rows at these positions (a stacked Hyper: a pack compacting)."""
        self.lr.keep(positions.tolist())
        return Hyper(
            self.lr,
            self.bias_correction1[positions],
            self.bias_correction2_sqrt[positions],
            self.consts if isinstance(self.consts.eps, float) else Consts(*(c[positions] for c in self.consts)),
            self.weight_decay[positions],
            self.update_clip if isinstance(self.update_clip, float) else self.update_clip[positions],
        )


def bias_table(beta: float, steps: int) -> list[float]:
    """1 - beta**k for update counts k = 0, 1, ... (in double, as torch computes it in Python), up to the count
    `steps` (no count exceeds the steps run) or the first count where it is 1.0 in double, whichever comes first:
    beta**k only falls from there, so every later count has that value too, and a reader takes
    min(count, len - 1). 357 entries for beta 0.9, 37,413 for 0.999, 3.7M for 0.99999 (0.45 s): a long run's table is
    its betas' length, not its steps' (they were steps + 1 long: 2.1 GB and 27 s with the lr's at 30M steps)."""
    out = []
    for k in range(steps + 1):  # the count 0 is never used (the first update has count 1): a placeholder
        out.append(1 - beta**k)
        if k and out[-1] == 1.0:
            break
    return out


def _stacked_consts(each: list[Consts], device: torch.device) -> Consts:
    """The runs' constants: floats when every run has the same ones, else one (K,) fp32 tensor each (the value
    torch's kernels compute with: a Python scalar rounded to fp32)."""
    if all(c == each[0] for c in each):
        return each[0]
    return Consts(*(torch.tensor(column, dtype=torch.float32, device=device) for column in zip(*each)))


def _stacked_clip(each: list[float], device: torch.device) -> float | torch.Tensor:
    """The runs' update_clip: one float when every run has the same, else a (K,) fp32 tensor."""
    if all(c == each[0] for c in each):
        return each[0]
    return torch.tensor(each, dtype=torch.float32, device=device)


def per_step_scalars(lr: torch.Tensor, h: Hyper, counts: torch.Tensor) -> torch.Tensor:
    """The (len(PerStep), R) fp32 per-step scalars of R updates at their lr (R,) or (1,) and update counts (R,)
    int64, in double as torch computes them in Python, then rounded to fp32 as its kernels take them. `h`'s tables
    are one row (a group's, shared by its R weights) or R rows (a pack's runs)."""
    updates = counts.shape[0]

    def at_counts(table: torch.Tensor) -> torch.Tensor:  # a count past the table reads its last value (bias_table)
        at = counts.clamp(max=table.shape[-1] - 1).view(-1, 1)
        return table.reshape(-1, table.shape[-1]).expand(updates, -1).gather(1, at).view(-1)

    lr = lr.expand(updates)
    rows = {
        PerStep.decay: 1 - lr * h.weight_decay.expand(updates),
        PerStep.bias_correction2_sqrt: at_counts(h.bias_correction2_sqrt),
        PerStep.step_size_neg: -(lr / at_counts(h.bias_correction1)),
    }
    return torch.stack([rows[r] for r in PerStep]).float()


def update_(
    w: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    per_step: torch.Tensor,
    consts: Consts,
    decays: bool,
    update_clip: float | torch.Tensor = 0.0,
):
    """One AdamW update of K stacked weights w (K, ...) with gradients g and moments m, v, in place; run k with
    the per-step scalars per_step[:, k] (fp32, from `per_step_scalars`) and the constants `consts` (Hyper.consts).
    Each op computes in fp32 and rounds once to the weight's dtype, as torch's CPU kernels do with Python-scalar
    operands, except `add`, whose kernel rounds its scalar to the tensor's dtype first (eps in bf16 is not eps
    in fp32); the operand order is theirs too (addcmul is self + (value*t1)*t2, addcdiv is
    self + (value*t1)/t2). So pure fp16 turns eps=1e-8 into 0 and divides 0 by 0 as torch does, and pure bf16
    loses updates below its resolution. `update_clip` (Hyper.update_clip; 0 = off, no op added) scales each run's
    step size by StableAdamW's 1 / max(1, RMS / update_clip) (`clip_factor`)."""
    shape = (-1, *[1] * (w.dim() - 1))
    rows = per_step.view(len(PerStep), *shape)
    decay, bias_correction2_sqrt = rows[PerStep.decay], rows[PerStep.bias_correction2_sqrt]
    step_size_neg = rows[PerStep.step_size_neg]
    one_minus_beta1, beta2, one_minus_beta2, eps = (c if isinstance(c, float) else c.view(shape) for c in consts)
    if decays:
        w.mul_(decay)
    if isinstance(one_minus_beta1, float) or m.dtype == one_minus_beta1.dtype:
        m.lerp_(g, one_minus_beta1)
    else:  # lerp wants one dtype: compute it in fp32 and round, as the kernel does with a scalar weight
        m.copy_(torch.lerp(m.float(), g.float(), one_minus_beta1))
    if isinstance(one_minus_beta2, float):
        v.mul_(beta2).addcmul_(g, g, value=one_minus_beta2)
    else:
        v.mul_(beta2).addcmul_(g * one_minus_beta2, g)
    if not isinstance(update_clip, float) or update_clip > 0:
        step_size_neg = step_size_neg * clip_factor(g, v, bias_correction2_sqrt, eps, update_clip)
    denom = v.sqrt().div_(bias_correction2_sqrt)
    denom.add_(eps if isinstance(eps, float) else eps.to(v.dtype))  # add is the one op whose scalar torch rounds first
    w.addcdiv_(m * step_size_neg, denom)


def update_all_(
    ws: list[torch.Tensor],
    gs: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    per_step: torch.Tensor,
    consts: Consts,
    decays: bool,
) -> None:
    """`update_` of many fp32 weights, each with its gradient and moments, at the one set of per-step scalars
    per_step[:, 0] (`per_step_scalars` of their common update count) and float `consts`, as multi-tensor ops:
    the same ops in the same order, so on the CPU (where torch runs a foreach op tensor by tensor) the same numbers
    bit for bit."""
    decay, bias_correction2_sqrt, step_size_neg = (per_step[row, 0] for row in PerStep)
    one_minus_beta1, beta2, one_minus_beta2, eps = consts
    if decays:
        torch._foreach_mul_(ws, decay)
    torch._foreach_lerp_(ms, gs, one_minus_beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, gs, gs, value=one_minus_beta2)
    denoms = torch._foreach_sqrt(vs)
    torch._foreach_div_(denoms, bias_correction2_sqrt)
    torch._foreach_add_(denoms, eps)
    torch._foreach_addcdiv_(ws, torch._foreach_mul(ms, step_size_neg), denoms)


def clip_factor(
    g: torch.Tensor,
    v: torch.Tensor,
    bias_correction2_sqrt: torch.Tensor,
    eps: float | torch.Tensor,
    update_clip: float | torch.Tensor,
) -> torch.Tensor:
    """StableAdamW's per-run factor 1 / max(1, RMS / update_clip) of K stacked tensors, shaped (K, 1, ...) like
    `bias_correction2_sqrt`: RMS = sqrt(mean(g**2 / max(v_hat, eps**2))) over each run's tensor, v_hat =
    v / bias_correction2_sqrt**2 this step's bias-corrected second moment. In fp32 whatever the weights' dtype; a
    run whose update_clip is 0 gets 1."""
    k, shape = g.shape[0], bias_correction2_sqrt.shape
    v_hat = v.float() / (bias_correction2_sqrt * bias_correction2_sqrt)
    if isinstance(eps, float):  # a Python scalar, not a tensor made from one: a CUDA graph captures no host copy
        floor = v_hat.clamp(min=eps * eps)
    else:
        floor = torch.maximum(v_hat, eps.float().view(shape).square())
    ratio = g.float().square() / floor
    rms = ratio.reshape(k, -1).mean(1).sqrt().view(shape)
    if isinstance(update_clip, float):
        return 1 / torch.clamp(rms / update_clip, min=1.0)
    clip = update_clip.view(shape)
    return torch.where(clip > 0, 1 / torch.clamp(rms / clip, min=1.0), torch.ones_like(rms))


def _undecorated(method: Callable) -> Callable:
    """The function a decorator made with functools.wraps wrapped (the method itself where none did)."""
    return getattr(method, "__wrapped__", method)


class KnownCounts:
    """What the host knows of the weights' update counts without reading them (a read in a step would be a sync,
    and none is allowed inside a CUDA graph's capture), so that weights with one count take one update: per
    weight, a token shared by the weights known to hold the same count, recorded with the "step" tensor that
    holds it. A weight with no state holds 0 (ZERO). Weights a step updates from one count share a new token,
    their counts advanced together however often a captured step replays; a weight whose count is not known
    (updated apart, or state set from outside, as a checkpoint does: another tensor than the one recorded) has
    a token of its own until `read`."""

    ZERO = object()

    def __init__(self):
        self.tokens: dict[torch.Tensor, tuple[torch.Tensor, object]] = {}

    def token(self, state: dict, p: torch.Tensor) -> object:
        s = state.get(p)
        if not s:
            return self.ZERO
        known = self.tokens.get(p)
        return known[1] if known is not None and known[0] is s["step"] else object()

    def one(self, state: dict, params: Sequence[torch.Tensor]) -> bool:
        """Whether these weights hold one count, as far as the host knows."""
        first = self.token(state, params[0])
        return all(self.token(state, p) is first for p in params[1:])

    def stepped(self, state: dict, params: Sequence[torch.Tensor], together: bool) -> None:
        """A step updated these weights: from one count (`together`: one count after it), or not."""
        if together:
            token = object()
            self.tokens.update((p, (state[p]["step"], token)) for p in params)
        else:
            for p in params:
                self.tokens.pop(p, None)

    def zeroed(self, state: dict, params: Sequence[torch.Tensor]) -> None:
        """These weights' counts were set to 0 in place."""
        self.tokens.update((p, (state[p]["step"], self.ZERO)) for p in params)

    def read(self, state: dict) -> None:
        """Know every count as it is now (one read back to the host): after a checkpoint set the state."""
        held = [(p, s["step"]) for p, s in state.items() if s]
        values = torch.stack([t for _, t in held]).tolist() if held else []
        tokens: dict[float, object] = {}
        self.tokens = {p: (t, tokens.setdefault(n, object())) for (p, t), n in zip(held, values)}


class DeviceAdamW(torch.optim.Optimizer):
    """One run's AdamW: torch's param groups and state layout ("step", "exp_avg", "exp_avg_sq" per weight,
    so checkpoints and sweep.run.adam_lag read it as torch's), its update computed by `update_`.

    The loop calls `at(step)` before `step()`: the lr is the schedule's at that step. Each group may carry
    `lr_scale` (sweep.run.finetune.param_groups): its lr is the schedule's times that. A group's fp32 weights
    that a step updates and whose counts the host knows are one (`KnownCounts`: the case unless some weight got
    no gradient at some steps) take one multi-tensor update (`update_all_`); the others one update each. State
    set from outside (sweep/run/checkpoint.py) calls `state_set()`."""

    def __init__(
        self,
        groups: list[dict],
        lr_at: Callable[[int], float],
        steps: int,
        betas: Sequence[float],
        eps: float,
        weight_decay: float,
        device: torch.device,
        update_clip: float = 0.0,
        span: int = SPAN,
    ):
        super().__init__(groups, dict(lr=lr_at(0), betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.clock = torch.zeros(1, dtype=torch.long, device=device)
        """The step the next update belongs to (its lr), on the device: a captured step reads it there."""
        self.hyper = [
            Hyper.of(
                lr_at, steps, g["betas"], g["eps"], g["weight_decay"], device, g.get("lr_scale", 1.0), update_clip, span
            )
            for g in self.param_groups
        ]
        self.known = KnownCounts()

    # torch wraps these two in torch._disable_dynamo, whose first call imports torch._dynamo: ~2 s of CPU in
    # every run process, for an optimizer dynamo never traces (compile=true compiles the forward only,
    # sweep/run/compiled.py). So they call torch's own methods undecorated (functools.wraps' __wrapped__).
    def add_param_group(self, param_group: dict) -> None:
        _undecorated(torch.optim.Optimizer.add_param_group)(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _undecorated(torch.optim.Optimizer.zero_grad)(self, set_to_none)

    def at(self, step: int, stop: int | None = None) -> None:
        """The next update is step `step`'s (its lr); the updates up to `stop` (default: this one) may follow from
        the device alone (a window of steps, a graph's warm-up), their lrs in the tables."""
        for h in self.hyper:
            h.lr.cover(step, stop if stop is not None else step + 1)
        self.clock.fill_(step)

    def saved(self, into: Sequence[torch.Tensor] | None = None) -> Saved:
        """A copy of the state as it is now, which puts it back in place when called (a window's snapshot,
        sweep/run/window.py; `into`: the last one's buffers, see `copies`): a captured update writes the tensors it
        was captured with. State made since (a window's first update creates it) is zeroed in place, count 0: the
        fresh state the next update would create, in the tensors a graph captured after it updates. (Deleting it
        left a graph updating tensors the optimizer no longer held, their counts never taken back: on an H100 a
        graphed fp16 run whose first windows overflowed indexed past the bias-correction tables, a device-side
        assert; docs/gpu.md.)"""
        keys = [(p, k) for p, s in self.state.items() for k, v in s.items() if torch.is_tensor(v)]
        saved = copies([self.state[p][k] for p, k in keys], into)
        params, tokens = set(self.state), dict(self.known.tokens)

        def restore() -> None:
            made = [p for p, s in self.state.items() if p not in params and s]
            if made:
                torch._foreach_zero_([v for p in made for v in self.state[p].values() if torch.is_tensor(v)])
            copy_back([self.state[p][k] for p, k in keys], saved)
            self.known.tokens = dict(tokens)
            self.known.zeroed(self.state, made)

        return Saved(saved, restore)

    def buckets(self) -> dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]]:
        """Every group's weights by dtype and device (group index, dtype, device: what one multi-tensor update
        takes), in the group's order."""
        out: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        for i, group in enumerate(self.param_groups):
            for p in group["params"]:
                out.setdefault((i, p.dtype, p.device), []).append(p)
        return out

    def state_set(self) -> None:
        """The state was set from outside (a checkpoint loaded): learn the counts (one read back to the host)."""
        self.known.read(self.state)

    @torch.no_grad()
    def step(self, stepping: Sequence[bool] | None = None) -> None:
        """Update every weight that has a gradient (torch skips the others, count included). `stepping`: the
        loop's [whether the run steps] (StackedAdamW's, for one run); [False] updates nothing. No closure."""
        if stepping is not None and not stepping[0]:
            return
        for key, bucket in self.buckets().items():
            group, h = self.param_groups[key[0]], self.hyper[key[0]]
            params = [p for p in bucket if p.grad is not None]
            if not params:
                continue
            together = self.known.one(self.state, params)
            for p in params:
                if not self.state[p]:  # torch's lazy state, with the count on the weight's device
                    self.state[p] = {
                        "step": torch.zeros((), dtype=torch.float32, device=p.device),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }
            states = [self.state[p] for p in params]
            counts = [s["step"] for s in states]
            torch._foreach_add_(counts, 1.0)
            lr, decays = h.lr.at(self.clock), group["weight_decay"] != 0
            if together and key[1] == torch.float32 and not h.update_clip:
                moments = [[s[k] for s in states] for k in ("exp_avg", "exp_avg_sq")]
                per_step = per_step_scalars(lr, h, counts[0].view(1).long())
                update_all_(params, [p.grad for p in params], *moments, per_step, h.consts, decays)
            else:
                # (len(PerStep), weights): one column per weight, at its own update count
                per_step = per_step_scalars(lr, h, torch.stack(counts).long())
                for i, (p, s) in enumerate(zip(params, states)):
                    one = [t.unsqueeze(0) for t in (p, p.grad, s["exp_avg"], s["exp_avg_sq"])]  # a stack of one run
                    update_(*one, per_step[:, i : i + 1], h.consts, decays, h.update_clip)
            self.known.stepped(self.state, params, together)
