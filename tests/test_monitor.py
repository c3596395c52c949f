"""The monitor's verdict criteria on hand-made numbers."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from sweep.config import MonitorConfig
from sweep.run.monitor import DivergenceMonitor
from sweep.run.precision import ScalerEvent

STEP = ScalerEvent.step


def test_finite_decreasing_loss_is_fine():
    m = DivergenceMonitor(MonitorConfig())
    assert all(m.observe(i, 1.0 - 0.01 * i, 1.0, STEP) is None for i in range(50))


def test_nonfinite_loss_and_grad():
    m = DivergenceMonitor(MonitorConfig())
    assert m.observe(0, 1.0, 1.0, STEP) is None
    d = m.observe(1, math.nan, 1.0, STEP)
    assert (d.verdict, d.step) == ("nonfinite_loss", 1)
    d = DivergenceMonitor(MonitorConfig()).observe(0, 1.0, math.inf, STEP)
    assert (d.verdict, d.cause.where) == ("nonfinite_grad", "backward")


def test_spike_is_relative_to_smoothed_running_minimum():
    m = DivergenceMonitor(MonitorConfig(spike_factor=10, ema_beta=0.5))
    for i in range(20):
        assert m.observe(i, 1.0 if i < 10 else 0.2, 1.0, STEP) is None
    assert m.observe(20, 1.9, 1.0, STEP) is None  # < 10 x the smoothed min (~0.2)
    d = m.observe(21, 5.0, 1.0, STEP)
    assert d is not None and d.verdict == "loss_spike" and d.step == 21


def test_single_low_batch_does_not_lower_the_spike_threshold_much():
    m = DivergenceMonitor(MonitorConfig(spike_factor=10, ema_beta=0.9))
    m.observe(0, 1.0, 1.0, STEP)
    m.observe(1, 0.01, 1.0, STEP)  # one lucky batch
    assert m.observe(2, 0.5, 1.0, STEP) is None


def test_scaler_skips_are_not_verdicts_until_collapse():
    m = DivergenceMonitor(MonitorConfig())
    m.observe(0, 1.0, 1.0, STEP)
    assert m.observe(1, math.inf, math.nan, ScalerEvent.skip) is None
    assert m.observe(2, math.nan, math.nan, ScalerEvent.skip) is None
    d = m.observe(3, math.nan, math.nan, ScalerEvent.collapse, "overflow at minimum")
    assert d.verdict == "scale_collapse" and d.cause.where == "scaler" and "since step 1" in d.cause.detail


def after_update(m: DivergenceMonitor, step: int, params, grads):
    """An applied update, as sweep.run.step.Steps.after_update counts it and checks the stall."""
    return m.stall_check(step, params, grads) if m.count_update(step) else None


def test_stall_distinguishes_underflowed_grads_from_lost_updates():
    w = torch.ones(100)
    m = DivergenceMonitor(MonitorConfig(stall_window=2, stall_fraction=0.9))
    m.start([w])
    assert after_update(m, 0, [w], [torch.zeros(100)]) is None  # not a check step
    d = after_update(m, 1, [w], [torch.zeros(100)])
    assert d.verdict == "stalled" and d.cause.where == "backward" and "underflow" in d.cause.detail

    m = DivergenceMonitor(MonitorConfig(stall_window=1, stall_fraction=0.9))
    m.start([w])
    d = after_update(m, 0, [w], [torch.full((100,), 1e-3)])
    assert d.verdict == "stalled" and d.cause.where == "optimizer"

    m = DivergenceMonitor(MonitorConfig(stall_window=1, stall_fraction=0.9))
    m.start([w])
    assert after_update(m, 0, [w + 1e-3], [torch.full((100,), 1e-3)]) is None


def test_a_spike_on_an_overflow_skipped_step_is_still_a_spike():
    """fp16 AMP: the exploding loss overflows the gradients, the scaler skips; the loss itself is the signal."""
    m = DivergenceMonitor(MonitorConfig(spike_factor=10))
    m.observe(0, 1.0, 1.0, STEP)
    assert m.observe(1, 3.0, math.inf, ScalerEvent.skip) is None  # an ordinary overflow skip
    d = m.observe(2, 250.0, math.inf, ScalerEvent.skip)
    assert (d.verdict, d.step) == ("loss_spike", 2)


def test_initial_loss_is_taken_from_a_skipped_first_step():
    m = DivergenceMonitor(MonitorConfig(spike_factor=10))
    assert m.observe(0, 1.0, math.inf, ScalerEvent.skip) is None
    assert m.initial_loss == 1.0
    assert m.observe(1, 120.0, 1.0, STEP).verdict == "loss_spike"


def test_small_batch_loss_noise_is_not_a_spike():
    """At batch 1-2 a diffusion loss swings with the sampled timesteps. The recorded loss curve of a healthy
    batch-1 run (tests/data: median 0.05, a tenth of the steps above 0.54) must not be a verdict, though
    many single steps sit above 10x the smoothed minimum (what the raw-loss test before used to flag)."""
    text = (Path(__file__).parent / "data" / "healthy_batch1_losses.txt").read_text()
    losses = [float(line) for line in text.splitlines() if line and not line.startswith("#")]
    assert len(losses) == 300
    m = DivergenceMonitor(MonitorConfig(spike_factor=10, ema_beta=0.9))
    assert [m.observe(i, loss, 1.0, STEP) for i, loss in enumerate(losses)] == [None] * 300
    assert sum(loss > 10 * m.ema_min for loss in losses) >= 10


def test_a_sustained_rise_is_a_spike_from_the_step_it_began():
    m = DivergenceMonitor(MonitorConfig(spike_factor=10, ema_beta=0.9))
    for i in range(50):
        assert m.observe(i, 1.0 if i == 0 else 0.1, 1.0, STEP) is None
    verdicts = [m.observe(50 + i, loss, 1.0, STEP) for i, loss in enumerate([0.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0])]
    d = next(v for v in verdicts if v is not None)
    assert d.verdict == "loss_spike" and d.step == 51  # 0.5 is under 10 x 0.1; the rise began at 2.0
    assert verdicts.index(d) > 1  # decided a few steps later, once the smoothed loss is up too


def test_a_loss_far_above_the_initial_loss_is_a_spike_at_once():
    """A transient explosion (lr 3e-2 on small data: 1.0 -> 30 at step 4, back to ~2 by step 20) averages
    under 10x over any ~10 steps, but no healthy batch goes 10x above the untrained model's loss."""
    m = DivergenceMonitor(MonitorConfig(spike_factor=10, ema_beta=0.9))
    for step, loss in enumerate([1.016, 1.427, 0.996, 2.363]):
        assert m.observe(step, loss, 1.0, STEP) is None
    d = m.observe(4, 30.4, 1.0, STEP)
    assert (d.verdict, d.step) == ("loss_spike", 4) and "initial loss" in d.cause.detail
