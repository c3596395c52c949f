"""The loss scaler's state machine and the precision policies' device checks."""

from __future__ import annotations

import torch

from sweep.config import LossScalerConfig
from sweep.run.precision import PrecisionPolicy, ScalerEvent

from .conftest import make_run
from .reference_scaler import LossScaler


def scaler(**kw) -> LossScaler:
    return LossScaler(LossScalerConfig(enabled=True, **kw))


def test_disabled_scaler_is_identity_and_never_skips():
    s = LossScaler(LossScalerConfig(enabled=False))
    loss = torch.tensor(2.0)
    assert s.scale_loss(loss) is loss
    assert s.update(False) is ScalerEvent.step


def test_backoff_and_growth_follow_gradscaler():
    s = scaler(init_scale=1024.0, growth_interval=3)
    assert s.update(False) is ScalerEvent.skip and s.scale == 512.0
    for _ in range(2):
        assert s.update(True) is ScalerEvent.step and s.scale == 512.0
    assert s.update(True) is ScalerEvent.step and s.scale == 1024.0  # third clean step in a row


def test_hysteresis_tolerates_overflows_before_backing_off():
    s = scaler(init_scale=1024.0, hysteresis=2)
    assert s.update(False) is ScalerEvent.skip and s.scale == 1024.0
    assert s.update(False) is ScalerEvent.skip and s.scale == 512.0
    s.update(True)  # a clean step restores the hysteresis budget
    assert s.update(False) is ScalerEvent.skip and s.scale == 512.0


def test_overflow_at_minimum_collapses_like_deepspeed():
    s = scaler(init_scale=4.0, min_scale=1.0)
    events = [s.update(False) for _ in range(3)]
    assert events == [ScalerEvent.skip, ScalerEvent.skip, ScalerEvent.collapse]
    assert s.scale == 1.0 and "minimum" in s.collapse_reason


def test_too_many_consecutive_skips_collapse_without_stop_at_min():
    s = scaler(init_scale=4.0, min_scale=1.0, stop_at_min=False, max_consecutive_skips=5)
    events = [s.update(False) for _ in range(6)]
    assert events[:5] == [ScalerEvent.skip] * 5 and events[5] is ScalerEvent.collapse
    assert "consecutive" in s.collapse_reason


def test_unscale_divides_gradients_back():
    s = scaler(init_scale=8.0)
    grads = [torch.full((3,), 8.0), torch.full((2,), 16.0)]
    s.unscale_(grads)
    assert torch.equal(grads[0], torch.ones(3)) and torch.equal(grads[1], torch.full((2,), 2.0))


def test_state_dict_round_trip():
    s = scaler(init_scale=64.0, hysteresis=3)
    s.update(False)
    t = scaler(init_scale=64.0, hysteresis=3)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()


def test_tf32_is_skipped_on_cpu_with_a_reason():
    policy = PrecisionPolicy.from_config(make_run("precision=tf32").precision)
    assert "CUDA" in policy.unsupported_reason(torch.device("cpu"))
    assert (
        PrecisionPolicy.from_config(make_run("precision=fp16_amp").precision).unsupported_reason(torch.device("cpu"))
        is None
    )


def test_tf32_flags_are_reset_per_run():
    PrecisionPolicy.from_config(make_run("precision=tf32").precision).apply_global_flags()
    assert torch.backends.cuda.matmul.allow_tf32
    PrecisionPolicy.from_config(make_run("precision=fp32").precision).apply_global_flags()
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"
