"""sweep.run.adam_lag: AdamW's second moment rolled back to where a spike began, against the gradients before it."""

from __future__ import annotations

import json

import pytest
import torch

from sweep.diagnose.mechanism import second_moment_lag
from sweep.run.adam_lag import adamw_second_moment, lag_note, lag_ratio


def adamw_run(noise: list[float], beta2: float, clip: float = 0.0, seed: int = 0):
    """AdamW on a few tensors fed gradients of the given scales; per step: (sum v, steps) after it, |g|^2."""
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (7, 30, 3)]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, beta2), foreach=False)
    after, sq = [], []
    for scale in noise:
        for p in params:
            p.grad = scale * torch.randn_like(p)
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()
        sq.append(norm**2)
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        after.append(adamw_second_moment(opt))
    return after, sq


@pytest.mark.parametrize("clip", [0.0, 5.0])
def test_the_rolled_back_sum_is_the_one_the_optimizer_had(clip):
    noise = [1.0] * 40 + [4.0] * 10
    after, sq = adamw_run(noise, beta2=0.999, clip=clip)
    first_bad, verdict_step = 44, 49  # the verdict step's own update is never applied
    v_sum, steps, beta2 = after[verdict_step - 1]
    recent = list(enumerate(sq))[verdict_step + 1 - 32 : verdict_step + 1]  # the monitor's, the verdict step's included
    ratio, n = lag_ratio(v_sum, steps, beta2, recent, first_bad, verdict_step, clip)
    v_then, steps_then, _ = after[first_bad - 1]
    capped = [min(q, clip**2) if clip else q for q in sq]
    want = sum(capped[verdict_step + 1 - 32 : first_bad]) / n / (v_then / (1 - beta2**steps_then))
    assert n == first_bad - (verdict_step + 1 - 32) and steps == 49 and steps_then == 44
    assert ratio == pytest.approx(want, rel=1e-5)


def test_a_jump_in_gradient_noise_lags_with_beta2_0999_and_not_with_095():
    noise = [1.0] * 300 + [4.0] * 20  # the gradients' scale grows 4x (16x in squares), as at a 16x smaller batch
    notes = {}
    for beta2 in (0.999, 0.95):
        after, sq = adamw_run(noise, beta2)
        v_sum, steps, _ = after[318]
        notes[beta2] = lag_note(v_sum, steps, beta2, list(enumerate(sq))[-32:], first_bad=315, verdict_step=319)
    assert "second moment lagged" in notes[0.999] and "beta2=0.999 averages ~1000 steps" in notes[0.999]
    assert "second moment kept up" in notes[0.95]


def test_a_clipped_run_is_told_the_unclipped_factor_and_the_clip_not_the_steps_taken():
    """StableAdamW's clip scales the steps down by a per-tensor factor no one kept: the note must not say the
    steps taken were ~Nx too large, only what they would have been unclipped, and name the clip."""
    after, sq = adamw_run([1.0] * 300 + [4.0] * 20, beta2=0.999)
    v_sum, steps, beta2 = after[318]
    args = (v_sum, steps, beta2, list(enumerate(sq))[-32:], 315, 319)
    ratio, _ = lag_ratio(*args)
    factor = f"~{ratio**0.5:.2g}x too large"
    plain, clipped = lag_note(*args), lag_note(*args, update_clip=1.0)
    assert f"so the steps were {factor};" in plain and "update_clip" not in plain
    assert "so the steps were" not in clipped
    assert f"so unclipped the steps would have been {factor}; update_clip=1 divided each tensor's step" in clipped
    assert "the size of the steps taken is not measured" in clipped
    assert clipped.startswith(plain.split(", so the steps")[0])  # the measured part, which diagnose parses, as before
    assert second_moment_lag(clipped) == second_moment_lag(plain) == pytest.approx(ratio, rel=1e-2)


def test_steady_gradients_keep_up_and_missing_history_says_nothing():
    after, sq = adamw_run([1.0] * 100, beta2=0.999)
    v_sum, steps, beta2 = after[98]
    assert lag_ratio(v_sum, steps, beta2, list(enumerate(sq))[-32:], 95, 99)[0] == pytest.approx(1.0, abs=0.5)
    assert lag_note(v_sum, steps, beta2, list(enumerate(sq))[-32:], 60, 99) == ""  # began before the kept norms
    assert lag_note(0.0, 0, beta2, [], 0, 0) == ""


def test_the_monitor_keeps_the_recent_norms_across_a_checkpoint():
    from sweep.run.monitor import DivergenceMonitor
    from sweep.run.precision import ScalerEvent

    from .conftest import make_run

    cfg = make_run().monitor
    m = DivergenceMonitor(cfg)
    for step in range(40):
        m.observe(step, 0.5, float(step), ScalerEvent.step)
    m.observe(40, 0.5, float("inf"), ScalerEvent.skip)  # a non-finite norm is no update: not kept
    assert [s for s, _ in m.recent_sq] == list(range(8, 40)) and m.recent_sq[-1] == (39, 39.0**2)
    numbers, tensors = m.state_dict()
    again = DivergenceMonitor(cfg)
    again.load_state_dict(json.loads(json.dumps(numbers)), tensors)
    assert again.recent_sq == m.recent_sq
