"""The device-side loss scaler against its references, decision by decision.

sweep.run.scaler.DeviceLossScaler decides on the device for K runs at once; tests/reference_scaler.py's
LossScaler (DeepSpeed's rules: hysteresis, a minimum, a collapse) is the host reference, and torch's own
`_amp_update_scale_` (what torch.amp.GradScaler.update runs) is the reference for the rules they share.
"""

from __future__ import annotations

import random

import pytest
import torch

from sweep.config import LossScalerConfig
from sweep.run.precision import ScalerEvent
from sweep.run.scaler import EVENTS, DeviceLossScaler

from .reference_scaler import LossScaler


def random_config(rng: random.Random) -> LossScalerConfig:
    return LossScalerConfig(
        enabled=rng.random() < 0.85,
        init_scale=rng.choice([2.0**4, 2.0**16, 1000.0]),
        growth_factor=rng.choice([2.0, 1.5, 3.0]),
        backoff_factor=rng.choice([0.5, 0.3, 0.75]),
        growth_interval=rng.choice([1, 2, 3, 7]),
        hysteresis=rng.choice([1, 2, 3]),
        min_scale=rng.choice([1.0, 8.0, 100.0]),
        stop_at_min=rng.random() < 0.6,
        max_consecutive_skips=rng.choice([2, 5, 50]),
    )


@pytest.mark.parametrize("seed", range(12))
def test_device_scaler_decides_as_the_host_reference_for_every_run_of_a_pack(seed):
    rng = random.Random(seed)
    cfgs = [random_config(rng) for _ in range(6)]
    device_scaler, refs = DeviceLossScaler(cfgs), [LossScaler(c) for c in cfgs]
    alive = [True] * len(cfgs)  # a collapsed run's later decisions do not matter (it has left the run)
    overflow_rate = rng.choice([0.1, 0.4, 0.8])
    for _ in range(60):
        found_inf = [rng.random() < overflow_rate for _ in cfgs]
        before = device_scaler.scale.tolist()
        codes = device_scaler.update(torch.tensor(found_inf)).tolist()
        skips, after = device_scaler.consecutive_skips.tolist(), device_scaler.scale.tolist()
        for i, ref in enumerate(refs):
            if not alive[i]:
                continue
            assert before[i] == ref.scale
            event = ref.update(not found_inf[i])
            assert EVENTS[codes[i]] is event
            assert device_scaler.state_dict(i) == ref.state_dict()
            if event is ScalerEvent.collapse:
                assert device_scaler.collapse_reason(i, codes[i], skips[i], after[i]) == ref.collapse_reason
                alive[i] = False


def test_device_scaler_follows_torch_grad_scaler_where_their_rules_agree():
    """hysteresis 1, no minimum, no collapse: GradScaler's rules. Its update op is the reference."""
    rng = random.Random(0)
    cfg = LossScalerConfig(
        enabled=True,
        init_scale=2.0**16,
        growth_interval=3,
        hysteresis=1,
        min_scale=2.0**-60,
        max_consecutive_skips=10**6,
    )
    ours = DeviceLossScaler([cfg])
    scale, tracker = torch.tensor([2.0**16]), torch.zeros(1, dtype=torch.int32)
    for _ in range(200):
        found_inf = rng.random() < 0.3
        torch._amp_update_scale_(scale, tracker, torch.tensor([float(found_inf)]), 2.0, 0.5, 3)
        code = ours.update(torch.tensor([found_inf])).item()
        assert EVENTS[code] is (ScalerEvent.skip if found_inf else ScalerEvent.step)  # GradScaler skips on inf
        assert ours.scale_of() == scale.item()
        assert ours.clean_steps.item() == tracker.item()


def test_a_pack_of_lone_scalers_keeps_each_runs_state_and_compacts():
    cfgs = [LossScalerConfig(enabled=True, init_scale=2.0**k) for k in (4, 8, 12)]
    lone = [DeviceLossScaler([c]) for c in cfgs]
    lone[1].update(torch.tensor([True]))  # run 1 backs off before packing
    pack = DeviceLossScaler.stack(lone)
    assert pack.scale.tolist() == [16.0, 128.0, 4096.0]
    pack.keep([2, 0])
    assert pack.scale.tolist() == [4096.0, 16.0] and [c.init_scale for c in pack.cfgs] == [4096.0, 16.0]
    pack.update(torch.tensor([True, False]))
    assert pack.scale.tolist() == [2048.0, 16.0] and pack.state_dict(0)["consecutive_skips"] == 1


def test_disabled_runs_never_skip_and_keep_scale_one():
    scaler = DeviceLossScaler([LossScalerConfig(enabled=False), LossScalerConfig(enabled=True)])
    codes = scaler.update(torch.tensor([True, True])).tolist()
    assert [EVENTS[c] for c in codes] == [ScalerEvent.step, ScalerEvent.skip]
    assert scaler.scale.tolist() == [1.0, 2.0**15]


def test_loading_an_unscaled_state_keeps_the_runs_own_start_like_the_reference():
    saved = LossScaler(LossScalerConfig(enabled=False)).state_dict()
    on = LossScalerConfig(enabled=True)
    ours, ref = DeviceLossScaler([on]), LossScaler(on)
    assert ours.load_state_dict(saved) is ref.load_state_dict(saved) is False
    assert ours.scale_of() == ref.scale == 2.0**16
    grown = {"enabled": True, "scale": 512.0, "clean_steps": 3, "hysteresis_left": 1, "consecutive_skips": 0}
    assert ours.load_state_dict(grown) and ours.state_dict() == grown
