"""StableAdamW update clipping (`optim.update_clip`, sweep/run/adamw.py) against the paper's formula.

The reference here is a plain per-tensor loop: torch.optim.AdamW's single-tensor update, with the step size of
each tensor multiplied by 1 / max(1, RMS / update_clip), RMS = sqrt(mean(g**2 / max(v_hat, eps**2))) and v_hat
the bias-corrected second moment after this step's update (Wortsman et al. 2023b, Algorithm 2; the authors'
StableAdamWUnfused keeps the weight decay at the scheduled lr). Clipping off, or never reached, must leave every
bit of DeviceAdamW as it is; a pack clips each run's tensor on its own.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch

from sweep.config import ConfigError, flatten
from sweep.run.adamw import Consts, DeviceAdamW, PerStep, update_
from sweep.run.stacked_adamw import StackedAdamW

from .conftest import make_run
from .test_adamw import same_bits, schedule, weights
from .test_graph_ready import HostReads

CPU = torch.device("cpu")
BETAS, EPS = (0.9, 0.999), 1e-8


class ReferenceStableAdamW:
    """The paper's update on torch's AdamW semantics, one tensor at a time, every scalar a Python double."""

    def __init__(self, ws, lr_at, betas, eps, weight_decay, update_clip):
        self.ws, self.lr_at, self.betas, self.eps = ws, lr_at, betas, eps
        self.wd, self.clip = weight_decay, update_clip
        self.state = {id(w): dict(n=0, m=torch.zeros_like(w), v=torch.zeros_like(w)) for w in ws}
        self.factors: list[float] = []  # every tensor's clip factor, each step

    @torch.no_grad()
    def step(self, step: int) -> None:
        b1, b2 = self.betas
        lr = self.lr_at(step)
        for w in self.ws:
            s, g = self.state[id(w)], w.grad
            s["n"] += 1
            n, m, v = s["n"], s["m"], s["v"]
            w.mul_(1 - lr * self.wd)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            v_hat = v / (1 - b2**n)
            rms = math.sqrt(float((g.double() ** 2 / v_hat.double().clamp(min=self.eps**2)).mean()))
            factor = 1 / max(1.0, rms / self.clip) if self.clip > 0 else 1.0
            self.factors.append(factor)
            denom = (v.sqrt() / math.sqrt(1 - b2**n)).add_(self.eps)
            w.addcdiv_(m, denom, value=-(lr / (1 - b1**n)) * factor)


def grads_at(step: int, ws, gen: torch.Generator) -> list[torch.Tensor]:
    """Gradients whose scale swings by 1e4 every few steps: v lags behind them, so clipping switches on and off."""
    scale = 10.0 ** (2 * (step % 5 == 4))
    return [torch.randn(w.shape, generator=gen) * scale * 1e-3 for w in ws]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_update_clip_is_the_papers_formula_in_fp32(weight_decay):
    ours, theirs = weights(torch.float32), weights(torch.float32)
    opt = DeviceAdamW([{"params": ours}], schedule, 20, BETAS, EPS, weight_decay, CPU, update_clip=1.0)
    ref = ReferenceStableAdamW(theirs, schedule, BETAS, EPS, weight_decay, 1.0)
    gen = torch.Generator().manual_seed(3)
    for step in range(20):
        for w, u, g in zip(ours, theirs, grads_at(step, ours, gen)):
            w.grad, u.grad = g.clone(), g.clone()
        opt.at(step)
        opt.step()
        ref.step(step)
        for i, (w, u) in enumerate(zip(ours, theirs)):
            torch.testing.assert_close(w, u, rtol=2e-6, atol=1e-7, msg=f"step {step}, weight {i}")
    assert min(ref.factors) < 0.5, "the test must reach clipping"
    assert max(ref.factors) == 1.0, "and steps where it is not active"


def test_a_gradient_jump_is_clipped_by_the_expected_factor():
    """Small gradients for 10 steps, then 100x: the clipped step is the unclipped one times 1 / RMS."""
    # weights from 0: they stay ~1e-2, so a step of ~1e-3 is read back from them to ~1e-6 (not one ulp of a 1)
    plain, clipped = [torch.zeros(8, 5, requires_grad=True)], [torch.zeros(8, 5, requires_grad=True)]
    lr_at = lambda s: 1e-3  # noqa: E731
    a = DeviceAdamW([{"params": plain}], lr_at, 11, BETAS, EPS, 0.0, CPU)
    b = DeviceAdamW([{"params": clipped}], lr_at, 11, BETAS, EPS, 0.0, CPU, update_clip=1.0)
    gen = torch.Generator().manual_seed(4)
    for step in range(11):
        g = torch.randn(plain[0].shape, generator=gen) * (1e-4 if step < 10 else 1e-2)
        before = [plain[0].detach().clone(), clipped[0].detach().clone()]
        plain[0].grad, clipped[0].grad = g.clone(), g.clone()
        for opt in (a, b):
            opt.at(step)
            opt.step()
    v = a.state[plain[0]]["exp_avg_sq"]  # the moments do not depend on the weights: equal in both
    v_hat = v.double() / (1 - BETAS[1] ** 11)
    rms = float((g.double() ** 2 / v_hat.clamp(min=EPS**2)).mean().sqrt())
    assert rms > 3, rms  # the jump: v still remembers the small gradients (bias correction: about sqrt(11))
    step_plain, step_clipped = plain[0] - before[0], clipped[0] - before[1]
    torch.testing.assert_close(step_clipped, step_plain / rms, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_clip_never_reached_is_update_clip_0_bit_for_bit(dtype):
    off, far = weights(dtype), weights(dtype)
    a = DeviceAdamW([{"params": off}], schedule, 20, BETAS, EPS, 0.1, CPU)
    b = DeviceAdamW([{"params": far}], schedule, 20, BETAS, EPS, 0.1, CPU, update_clip=1e30)
    gen = torch.Generator().manual_seed(6)
    for step in range(20):
        for w, u, g in zip(off, far, grads_at(step, off, gen)):
            w.grad, u.grad = g.to(dtype), g.to(dtype)
        for opt in (a, b):
            opt.at(step)
            opt.step()
        for i, (w, u) in enumerate(zip(off, far)):
            assert same_bits(w, u), f"step {step}, weight {i}"


@pytest.mark.parametrize("clips", [(1.0, 1.0), (1.0, 0.0), (0.5, 2.0)])
def test_a_pack_clips_each_run_as_it_clips_alone(clips):
    alone = [weights(torch.float32, seed=k)[:3] for k in range(2)]
    opts = [
        DeviceAdamW([{"params": ws}], schedule, 20, BETAS, EPS, 0.05, CPU, update_clip=c) for ws, c in zip(alone, clips)
    ]
    stacked = {str(i): torch.stack([ws[i].detach() for ws in alone]).requires_grad_() for i in range(3)}
    packed = StackedAdamW([SimpleNamespace(optimizer=o) for o in opts], stacked)
    gen = torch.Generator().manual_seed(7)
    for step in range(20):
        grads = grads_at(step, list(stacked.values()), gen)
        for (i, w), g in zip(stacked.items(), grads):
            w.grad = g * torch.tensor([1.0, 3.0]).view(-1, *[1] * (g.dim() - 1))  # the runs' gradients differ
            for k, ws in enumerate(alone):
                ws[int(i)].grad = w.grad[k].clone()
        for opt in opts:
            opt.at(step)
            opt.step()
        packed.at(step)
        packed.step(stacked)
        for k, ws in enumerate(alone):
            for i, w in enumerate(ws):
                assert same_bits(stacked[str(i)][k], w), f"step {step}, run {k}, weight {i}"


@pytest.mark.parametrize("clip", [1.0, torch.tensor([1.0, 0.0])])
def test_clipping_reads_nothing_back_to_the_host(clip):
    k = 2
    w, g = torch.randn(k, 4, 3), torch.randn(k, 4, 3)
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    per_step = torch.ones(len(PerStep), k)
    eps = EPS if isinstance(clip, float) else torch.full((k,), EPS)
    with HostReads() as reads:
        update_(w, g, m, v, per_step, Consts(0.1, 0.999, 0.001, eps), False, clip)
    assert reads.ops > 10 and reads.seen == [], reads.seen


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_negative_or_nonfinite_update_clip_is_a_one_line_config_error(value):
    with pytest.raises(ConfigError, match="^" + re.escape("optim.update_clip: ")) as e:
        make_run(f"optim.update_clip={value}")
    assert "\n" not in str(e.value)


def test_update_clip_is_an_ordinary_key_and_a_packs_runs_may_differ_in_it():
    from sweep.run.packing import pack_key

    on, off = make_run("optim.update_clip=1.0"), make_run()
    assert off.optim.update_clip == 0.0 and on.optim.update_clip == 1.0
    import dataclasses

    assert flatten(dataclasses.asdict(on))["optim.update_clip"] == 1.0
    assert pack_key(on) == pack_key(off)  # per run in StackedAdamW: they share a pack


def test_a_swept_update_clip_is_recorded_under_its_dotted_name():
    from sweep.job import swept_params

    from .conftest import compose_cfg

    cfg = compose_cfg(["optim.update_clip=1.0"])
    assert swept_params(cfg, ["optim.update_clip=1.0"], {}) == {"optim.update_clip": 1.0}
