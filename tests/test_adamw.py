"""DeviceAdamW (sweep/run/adamw.py) is torch's single-tensor AdamW bit for bit, with its lr on the device.

Against `torch.optim.AdamW(foreach=False)` with the lr set as a Python float every step, as the loop did
before: fp32, bf16 and fp16 weights (pure fp16 keeps eps's rounding to 0), weight decay, linear warmup
then cosine (the lr a device table), skipped steps (the update count stays), two groups at their own
lr_scale, and a weight that gets no gradient at some steps. fp32 weights whose update counts are one take one
multi-tensor update (sweep.run.adamw.update_all_), checked to be the same numbers, and taken only where the
counts are one (state set from outside, a window taken back).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sweep.run import adamw
from sweep.run.adamw import DeviceAdamW, Hyper, PerStep, per_step_scalars, update_all_
from sweep.run.build import lr_schedule
from sweep.run.stacked_adamw import StackedAdamW, group_of

from .conftest import make_run


@functools.cache
def run_schedule() -> Callable[[int], float]:
    """The lr schedule a run builds (sweep.run.build.lr_schedule), composed once, on first use."""
    return lr_schedule(make_run("optim.lr=3e-3", "optim.warmup_steps=3", "optim.schedule=cosine", "steps=20"))


def schedule(step: int) -> float:
    """Warmup for 3 steps, then cosine to 0 at step 20: a different lr every step."""
    return run_schedule()(step)


def weights(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(8, 5), (5,), (3, 2, 4), ()]
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def groups(ws: list[torch.Tensor]) -> list[dict]:
    return [
        {"params": ws[:2], "lr": schedule(0), "lr_scale": 1.0},
        {"params": ws[2:], "lr": schedule(0) * 10, "lr_scale": 10.0},
    ]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """NaN where the other has NaN (pure fp16's 0/0 must match too; a NaN's sign bit is not a number), every
    other element equal bit for bit (so -0 is not +0)."""
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    nan = a.isnan()
    bits = [torch.where(nan, 0, t.detach()).view(ints) for t in (a, b)]
    return a.dtype == b.dtype and torch.equal(nan, b.isnan()) and torch.equal(*bits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_device_adamw_is_torch_single_tensor_adamw_bit_for_bit(dtype, weight_decay):
    ours, theirs = weights(dtype), weights(dtype)
    eps, betas = 1e-8, (0.9, 0.999)
    a = DeviceAdamW(groups(ours), schedule, 20, betas, eps, weight_decay, torch.device("cpu"))
    b = torch.optim.AdamW(
        groups(theirs), betas=betas, eps=eps, weight_decay=weight_decay, foreach=False, capturable=False
    )
    gen = torch.Generator().manual_seed(1)
    for step in range(20):
        # Weight 2's gradients stay near 1e-8, where eps is most of the denominator (adaLN-Zero's weights at the
        # start; fp16 flushes them to 0, hence 0/0); the others' go from 1e-8 to 1e2.
        scales = [10 ** (step % 6 * 2 - 8)] * 2 + [10 ** (step % 3 - 9), 10 ** (step % 6 * 2 - 8)]
        grads = [(torch.randn(w.shape, generator=gen) * c).to(dtype) for w, c in zip(ours, scales)]
        for w, u, g in zip(ours, theirs, grads):
            w.grad, u.grad = g.clone(), g.clone()
        if step % 5 == 2:  # a weight with no gradient: torch neither updates it nor counts the step
            ours[1].grad = theirs[1].grad = None
        if step % 7 == 4:  # a skipped step (the scaler's overflow): no update, no count
            continue
        a.at(step)
        for group in b.param_groups:
            group["lr"] = schedule(step) * group["lr_scale"]
        a.step()
        b.step()
        for i, (w, u) in enumerate(zip(ours, theirs)):
            assert same_bits(w, u), f"step {step}, weight {i}: {(w.float() - u.float()).abs().max()}"
            for key in ("exp_avg", "exp_avg_sq"):
                assert same_bits(a.state[w][key], b.state[u][key]), f"step {step}, weight {i}, {key}"
            assert float(a.state[w]["step"]) == float(b.state[u]["step"])


def test_pure_fp16_keeps_torchs_zero_over_zero_at_the_first_update():
    # The Sana case: fp16 weights, a weight whose gradient is 0. eps=1e-8 rounds to 0 in fp16, so torch's
    # first update is 0/0 = NaN; a graph-safe AdamW that keeps eps in fp32 would give a finite 0.
    w = torch.ones(4, dtype=torch.float16, requires_grad=True)
    opt = DeviceAdamW([{"params": [w]}], lambda s: 1e-4, 4, (0.9, 0.999), 1e-8, 0.0, torch.device("cpu"))
    w.grad = torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.float16)
    opt.at(0)
    opt.step()
    assert torch.isnan(w[0]) and torch.isfinite(w[1])


def test_scalars_are_pythons_doubles_rounded_to_fp32():
    h = Hyper.of(schedule, 20, (0.9, 0.95), 1e-6, 0.05, torch.device("cpu"))
    counts = torch.tensor([1, 7, 20])
    per_step = per_step_scalars(h.lr.at(torch.tensor([9])), h, counts)
    lr = schedule(9)
    assert h.consts == (1 - 0.9, 0.95, 1 - 0.95, 1e-6)  # Python floats, as torch's kernels take them
    for j, n in enumerate(counts.tolist()):
        expect = {
            PerStep.decay: 1 - lr * 0.05,
            PerStep.bias_correction2_sqrt: (1 - 0.95**n) ** 0.5,
            PerStep.step_size_neg: -(lr / (1 - 0.9**n)),
        }
        for row, value in expect.items():
            assert per_step[row, j].item() == torch.tensor(value, dtype=torch.float32).item(), (row.name, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_packs_update_is_each_runs_own_update_bit_for_bit(dtype):
    # Three runs with their own lr schedule, betas, eps and weight decay, stacked; run 1 skips some steps.
    hypers = [(1.0, (0.9, 0.999), 1e-8, 0.0), (0.3, (0.8, 0.95), 1e-6, 0.1), (3.0, (0.9, 0.99), 1e-8, 0.01)]
    alone = [weights(dtype, seed=k)[:3] for k in range(3)]
    opts = [
        DeviceAdamW([{"params": ws}], lambda s, f=f: schedule(s) * f, 20, betas, eps, wd, torch.device("cpu"))
        for ws, (f, betas, eps, wd) in zip(alone, hypers)
    ]
    stacked = {str(i): torch.stack([ws[i].detach() for ws in alone]).requires_grad_() for i in range(3)}
    packed = StackedAdamW([SimpleNamespace(optimizer=o) for o in opts], stacked)
    gen = torch.Generator().manual_seed(2)
    for step in range(20):
        stepping = [True, step % 4 != 1, True]
        for i, w in stacked.items():
            scale = 10 ** (step % 3 - 9) if i == "2" else 10 ** (step % 6 * 2 - 8)
            w.grad = (torch.randn(w.shape, generator=gen) * scale).to(dtype)
            for k, ws in enumerate(alone):
                ws[int(i)].grad = w.grad[k].clone()
        for k, opt in enumerate(opts):
            if stepping[k]:
                opt.at(step)
                opt.step()
        packed.at(step)
        packed.step(stepping)
        for k, ws in enumerate(alone):
            for i, w in enumerate(ws):
                assert same_bits(stacked[str(i)][k], w), f"step {step}, run {k}, weight {i}"
                m, v = packed.moments[str(i)]
                assert same_bits(m[k], opts[k].state[w]["exp_avg"]) and same_bits(v[k], opts[k].state[w]["exp_avg_sq"])


def test_a_packs_update_takes_each_weights_own_group_bit_for_bit():
    # µP's two groups (models/mup.py): the hidden weights at lr / m with weight decay x m. Three runs of the same two
    # groups, each its own lr and decay; weights 0 and 3 in the base group, 1 and 2 in the hidden one.
    lr_scale, wd_scale = 0.25, 4.0
    alone = [weights(torch.float32, seed=k) for k in range(3)]
    opts = []
    for k, ws in enumerate(alone):
        f, wd = (1.0, 0.3, 3.0)[k], (0.0, 0.1, 0.01)[k]
        two = [
            {"params": [ws[0], ws[3]], "lr": schedule(0), "lr_scale": 1.0, "weight_decay": wd},
            {
                "params": [ws[1], ws[2]],
                "lr": schedule(0) * lr_scale,
                "lr_scale": lr_scale,
                "weight_decay": wd * wd_scale,
            },
        ]
        opts.append(DeviceAdamW(two, lambda s, f=f: schedule(s) * f, 20, (0.9, 0.99), 1e-8, wd, torch.device("cpu")))
    names = [str(i) for i in range(4)]
    stacked = {n: torch.stack([ws[i].detach() for ws in alone]).requires_grad_() for i, n in enumerate(names)}
    model = torch.nn.Module()
    for n, w in zip(names, alone[0]):
        model.register_parameter(f"w{n}", torch.nn.Parameter(w.detach()))
    assert group_of(model, opts[0]) == {}  # another model's weights: none of them in the optimizer
    packed = StackedAdamW([SimpleNamespace(optimizer=o) for o in opts], stacked, {"0": 0, "1": 1, "2": 1, "3": 0})
    gen = torch.Generator().manual_seed(3)
    for step in range(20):
        for i, n in enumerate(names):
            stacked[n].grad = torch.randn(stacked[n].shape, generator=gen) * 10.0 ** (step % 5 - 4)
            for k, ws in enumerate(alone):
                ws[i].grad = stacked[n].grad[k].clone()
        for opt in opts:
            opt.at(step)
            opt.step()
        packed.at(step)
        packed.step()
        for k, ws in enumerate(alone):
            for i, w in enumerate(ws):
                assert same_bits(stacked[names[i]][k], w), f"step {step}, run {k}, weight {i}"
    with pytest.raises(ValueError, match="same param groups"):
        StackedAdamW([SimpleNamespace(optimizer=o) for o in opts], stacked)  # two groups, no weight's group named


def test_group_of_names_each_weights_group():
    model = torch.nn.Linear(3, 2)
    opt = DeviceAdamW(
        [{"params": [model.weight]}, {"params": [model.bias], "lr_scale": 0.5}],
        schedule, 4, (0.9, 0.99), 1e-8, 0.0, torch.device("cpu"),
    )  # fmt: skip
    assert group_of(model, opt) == {"weight": 0, "bias": 1}


VIEWS = {"view", "select", "slice", "unsqueeze", "expand", "alias", "as_strided", "detach", "_unsafe_view"}
"""Ops that only make views: no kernel on a GPU."""
ALLOCATIONS = {"empty", "empty_like", "empty_strided"}


class Dispatched(TorchDispatchMode):
    """Counts the ops dispatched inside it whose name `counted` says to count."""

    def __init__(self, counted: Callable[[str], bool]):
        super().__init__()
        self.counted, self.count = counted, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += self.counted(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_weights_take_one_multi_tensor_update_per_group(dtype):
    # 40 weights in one group, and one that never gets a gradient (a weight the forward does not use): fp32
    # weights whose counts are one take a multi-tensor update (a few ops for the group, each a kernel or a few on
    # a GPU); pure bf16 weights (a foreach op would round its tensor scalar to bf16 on a GPU) take one update each.
    ws = [torch.randn(3, 4).to(dtype).requires_grad_() for _ in range(40)]
    unused = torch.zeros(2, dtype=dtype, requires_grad=True)
    opt = DeviceAdamW([{"params": [*ws, unused]}], lambda s: 1e-3, 4, (0.9, 0.999), 1e-8, 0.1, torch.device("cpu"))
    counted = []
    for step in range(3):
        for w in ws:
            w.grad = torch.randn_like(w)
        opt.at(step)
        with Dispatched(lambda name: name not in VIEWS) as ops:  # ops that compute: kernels on a GPU
            opt.step()
        counted.append(ops.count)
    later = counted[1:]  # the first step also makes the state, three tensors a weight
    if dtype == torch.float32:
        assert max(later) < 40, counted
    else:
        assert min(later) > 40 * 5, counted


def torch_twin(ws: list[torch.Tensor], wd: float = 0.1) -> tuple[list[torch.Tensor], torch.optim.AdamW]:
    """Copies of `ws` and torch's single-tensor AdamW over them, at a constant lr of 1e-3 (DeviceAdamW's below)."""
    twins = [w.detach().clone().requires_grad_() for w in ws]
    return twins, torch.optim.AdamW(twins, lr=1e-3, eps=1e-8, weight_decay=wd, foreach=False)


def step_both(ours, a, theirs, b, step: int, gen: torch.Generator) -> None:
    for w, u in zip(ours, theirs):
        w.grad = torch.randn(w.shape, generator=gen)
        u.grad = w.grad.clone()
    a.at(step)
    a.step()
    b.step()


def test_counts_set_from_outside_are_read_before_one_update_takes_them(monkeypatch):
    # A checkpoint sets each weight's state (sweep/run/checkpoint.py): counts 3 and 7, so one set of scalars would
    # give weight 1 weight 0's bias correction. Before state_set() the host knows nothing (per-weight updates);
    # after it, uneven counts stay per weight, and even ones take one update. All are torch's, bit for bit.
    together = []
    monkeypatch.setattr(adamw, "update_all_", lambda *args: together.append(1) or update_all_(*args))
    ours = weights(torch.float32)[:2]
    theirs, b = torch_twin(ours)
    a = DeviceAdamW([{"params": ours}], lambda s: 1e-3, 20, (0.9, 0.999), 1e-8, 0.1, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    for n, w, u in zip((3, 7), ours, theirs):
        state = {"step": torch.tensor(float(n)), "exp_avg": torch.randn(w.shape, generator=gen)}
        state["exp_avg_sq"] = torch.rand(w.shape, generator=gen)
        a.state[w] = {k: v.clone() for k, v in state.items()}
        b.state[u] = {k: v.clone() for k, v in state.items()}
    for step in range(4):
        if step == 2:
            a.state_set()
        step_both(ours, a, theirs, b, step, gen)
        assert all(same_bits(w, u) for w, u in zip(ours, theirs)), step
    assert not together
    for w, u in zip(ours, theirs):  # even counts, once read: one update
        a.state[w]["step"].fill_(9.0)
        b.state[u]["step"].fill_(9.0)
    a.state_set()
    step_both(ours, a, theirs, b, 4, gen)
    assert together and all(same_bits(w, u) for w, u in zip(ours, theirs))


def test_a_taken_back_step_leaves_the_counts_one(monkeypatch):
    # A window's snapshot (saved) taken before the state existed and after: each restore puts back counts that
    # are one, the host knows it (every update is one multi-tensor update), and the next updates are torch's
    # without the taken-back steps.
    together = []
    monkeypatch.setattr(adamw, "update_all_", lambda *args: together.append(1) or update_all_(*args))
    ours = weights(torch.float32)
    theirs, b = torch_twin(ours)
    a = DeviceAdamW([{"params": ours}], lambda s: 1e-3, 20, (0.9, 0.999), 1e-8, 0.1, torch.device("cpu"))
    gen, lost = torch.Generator().manual_seed(4), torch.Generator().manual_seed(5)
    for step in range(6):
        if step in (0, 3):
            restore = a.saved()
            for w in ours:
                w.grad = torch.randn(w.shape, generator=lost)
            before = [w.detach().clone() for w in ours]
            a.at(step)
            a.step()
            restore()
            with torch.no_grad():
                for w, old in zip(ours, before):
                    w.copy_(old)
        step_both(ours, a, theirs, b, step, gen)
        assert all(same_bits(w, u) for w, u in zip(ours, theirs)), step
        assert [float(a.state[w]["step"]) for w in ours] == [float(b.state[u]["step"]) for u in theirs]
    assert len(together) == 6 + 2


def test_a_windows_snapshot_writes_over_the_last_ones_buffers():
    # A window's snapshot (sweep/run/window.py) copies AdamW's state into the last window's buffers: nothing
    # allocated, and putting it back gives the state as it was when it was taken, not the last one's.
    ws = weights(torch.float32)
    opt = DeviceAdamW([{"params": ws}], lambda s: 1e-3, 20, (0.9, 0.999), 1e-8, 0.1, torch.device("cpu"))
    gen = torch.Generator().manual_seed(6)

    def step(i: int) -> None:
        for w in ws:
            w.grad = torch.randn(w.shape, generator=gen)
        opt.at(i)
        opt.step()

    step(0)
    first = opt.saved()
    step(1)
    with Dispatched(ALLOCATIONS.__contains__) as made:
        second = opt.saved(into=first.copies)
    assert made.count == 0 and all(a is b for a, b in zip(second.copies, first.copies))
    kept = {(w, k): t.clone() for w in ws for k, t in opt.state[w].items()}
    step(2)
    second()
    assert all(same_bits(opt.state[w][k], t) for (w, k), t in kept.items())
    other = adamw.copies([torch.zeros(3)], into=[torch.ones(4)])  # another shape: a new buffer
    assert other[0].shape == (3,) and not other[0].any()
