"""Tests for sweep.run.diffusion: shapes, determinism, noising algebra, the bf16 schedule hazard, and bit-exact
parity of our DDPM schedule with diffusers' DDPMScheduler (diffusers is the reference here, not a run dependency)."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

from sweep.config import BetaSchedule, Prediction
from sweep.run.diffusion import BETA_SCHEDULES, PREDICTIONS, DiffusionObjective, ddpm_betas, shift_sigmas

from .conftest import run_cli

T = 1000
VIDEO = (6, 3, 4, 8, 8)  # (B, C, F, H, W)
CONFIGS = [
    dict(kind="ddpm", prediction="epsilon"),
    dict(kind="ddpm", prediction="v_prediction", beta_schedule="squaredcos_cap_v2"),
    dict(kind="flow", flow_shift=1.0),
    dict(kind="flow", flow_shift=3.0),
]


def _gen(seed: int) -> torch.Generator:
    """A seeded CPU generator."""
    return torch.Generator().manual_seed(seed)


def _x0(shape: tuple[int, ...] = VIDEO, seed: int = 0) -> torch.Tensor:
    """A clean batch in [-1, 1]."""
    return torch.rand(shape, generator=_gen(seed)) * 2 - 1


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("shape", [VIDEO, (5, 3, 8, 8)])
def test_shapes_dtypes_and_timestep_range(cfg: dict, shape: tuple[int, ...]) -> None:
    noisy, t, target = DiffusionObjective(**cfg).sample(_x0(shape), _gen(1))
    assert noisy.shape == target.shape == shape
    assert t.shape == (shape[0],)
    assert noisy.dtype == target.dtype == t.dtype == torch.float32
    assert noisy.isfinite().all() and target.isfinite().all()
    assert (t >= 0).all() and (t < T).all()


@pytest.mark.parametrize("cfg", CONFIGS)
def test_timesteps_cover_the_range(cfg: dict) -> None:
    _, t, _ = DiffusionObjective(**cfg).sample(_x0((4096, 1)), _gen(2))
    assert t.min() < 50 and t.max() > 950
    if cfg["kind"] == "ddpm":
        assert torch.equal(t, t.round())


@pytest.mark.parametrize("cfg", CONFIGS)
def test_same_generator_state_is_bit_identical_and_global_rng_untouched(cfg: dict) -> None:
    obj, x0 = DiffusionObjective(**cfg), _x0()
    torch.manual_seed(0)
    global_state = torch.get_rng_state()
    a = obj.sample(x0, _gen(5))
    b = obj.sample(x0, _gen(5))
    c = obj.sample(x0, _gen(6))
    assert torch.equal(torch.get_rng_state(), global_state)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert not torch.equal(a[0], c[0])
    # A saved generator state replays the step.
    g = _gen(7)
    obj.sample(x0, g)
    state = g.get_state()
    first = obj.sample(x0, g)
    g.set_state(state)
    assert all(torch.equal(u, v) for u, v in zip(first, obj.sample(x0, g)))


def test_ddpm_endpoints_noisy_is_noise_near_t_max_and_x0_near_zero() -> None:
    obj, x0 = DiffusionObjective("ddpm"), _x0()
    noise = torch.randn(VIDEO, generator=_gen(3))
    b = VIDEO[0]
    late, _ = obj.corrupt(x0, noise, torch.full((b,), T - 1.0))
    early, _ = obj.corrupt(x0, noise, torch.zeros(b))
    assert (late - noise).abs().amax() < 0.02
    assert (early - x0).abs().amax() < 0.05
    assert (early - x0).abs().amax() > 0  # t=0 still adds a little noise


def test_ddpm_targets_match_closed_form() -> None:
    x0, noise = _x0(), torch.randn(VIDEO, generator=_gen(4))
    t = torch.tensor([0.0, 1.0, 10.0, 500.0, 998.0, 999.0])
    abar = DDPMScheduler(T).alphas_cumprod[t.long()].view(-1, 1, 1, 1, 1)
    noisy, eps = DiffusionObjective("ddpm").corrupt(x0, noise, t)
    assert torch.allclose(noisy, abar.sqrt() * x0 + (1 - abar).sqrt() * noise, atol=1e-6)
    assert torch.equal(eps, noise)
    _, v = DiffusionObjective("ddpm", prediction="v_prediction").corrupt(x0, noise, t)
    assert torch.allclose(v, abar.sqrt() * noise - (1 - abar).sqrt() * x0, atol=1e-6)


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_flow_algebra_is_exact(shift: float) -> None:
    obj, x0 = DiffusionObjective("flow", flow_shift=shift), _x0()
    g = _gen(8)
    noisy, t, target = obj.sample(x0, g)
    # Re-draw the same noise: sample() draws timesteps first, then noise.
    g = _gen(8)
    torch.rand(VIDEO[0], generator=g)
    noise = torch.randn(VIDEO, generator=g)
    sigma = (t / T).view(-1, 1, 1, 1, 1)
    assert torch.equal(target, noise - x0)
    assert torch.equal(noisy, (1 - sigma) * x0 + sigma * noise)
    # Both endpoints of the straight path: x0 at sigma=0, noise at sigma=1.
    assert torch.allclose(noisy + (1 - sigma) * target, noise, atol=1e-6)
    assert torch.allclose(noisy - sigma * target, x0, atol=1e-6)


@pytest.mark.parametrize("shift", [1.0, 3.0, 7.5])
def test_flow_shift_reproduces_the_scheduler_sigma_table(shift: float) -> None:
    obj = DiffusionObjective("flow", flow_shift=shift)
    grid = torch.arange(T, 0, -1, dtype=torch.float32) / T  # the scheduler's unshifted sigmas
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=T, shift=shift)
    assert torch.allclose(shift_sigmas(grid, shift), scheduler.sigmas, atol=1e-6)
    # shift > 1 puts more training mass at high noise.
    _, t, _ = obj.sample(_x0((4096, 1)), _gen(9))
    assert (t.mean() > 0.6 * T) == (shift > 1.5)


def test_bf16_input_is_noised_in_fp32() -> None:
    obj = DiffusionObjective("ddpm")
    x0 = _x0().bfloat16()
    noisy, t, target = obj.sample(x0, _gen(10))
    assert noisy.dtype == target.dtype == t.dtype == torch.float32
    ref_noisy, ref_t, ref_target = obj.sample(x0.float(), _gen(10))
    assert torch.equal(noisy, ref_noisy) and torch.equal(t, ref_t) and torch.equal(target, ref_target)
    # The early-timestep noise coefficient survives (diffusers in bf16 zeroes it, see below).
    early, _ = obj.corrupt(x0, torch.ones(VIDEO), torch.zeros(VIDEO[0]))
    coef = early - x0.float() * DDPMScheduler(T).alphas_cumprod[0].sqrt()
    assert torch.allclose(coef, torch.full_like(coef, 0.01), rtol=1e-3)


def test_diffusers_add_noise_in_bf16_loses_the_early_noise() -> None:
    """Documents a diffusers behaviour; if this starts failing, diffusers fixed it upstream."""
    sched = DDPMScheduler(T, beta_schedule="linear")
    t = torch.arange(T)
    x0, noise = torch.zeros(T, 1), torch.ones(T, 1)
    exact = (1 - sched.alphas_cumprod).sqrt()
    coef_fp32 = sched.add_noise(x0, noise, t).flatten()
    coef_bf16 = sched.add_noise(x0.bfloat16(), noise.bfloat16(), t).float().flatten()
    assert torch.allclose(coef_fp32, exact, rtol=1e-5)
    rel = (coef_bf16 - exact).abs() / exact
    assert (coef_bf16[:5] == 0).all()  # no noise at all: t=0..4 train on clean inputs
    assert (rel > 0.1).sum() >= 15  # measured on diffusers 0.42.1: 19 timesteps over 10% off


def test_our_schedule_names_are_the_configs() -> None:
    assert BETA_SCHEDULES == tuple(b.value for b in BetaSchedule)
    assert PREDICTIONS == tuple(p.value for p in Prediction)


@pytest.mark.parametrize("num_steps", [1000, 50])
@pytest.mark.parametrize("prediction", PREDICTIONS)
@pytest.mark.parametrize("beta_schedule", BETA_SCHEDULES)
def test_ddpm_schedule_and_noising_are_bit_identical_to_diffusers(beta_schedule, prediction, num_steps) -> None:
    """Our reimplementation vs DDPMScheduler itself: betas, alphas_cumprod, add_noise and get_velocity, bit for bit."""
    ref = DDPMScheduler(num_train_timesteps=num_steps, beta_schedule=beta_schedule, prediction_type=prediction)
    obj = DiffusionObjective("ddpm", num_train_timesteps=num_steps, beta_schedule=beta_schedule, prediction=prediction)
    assert torch.equal(ddpm_betas(num_steps, beta_schedule), ref.betas)
    assert obj.alphas_cumprod.dtype == ref.alphas_cumprod.dtype == torch.float32
    assert torch.equal(obj.alphas_cumprod, ref.alphas_cumprod)
    # Both ends, their neighbours and the middle, on a video and an image batch; corrupt() takes float
    # timesteps (what sample() passes), diffusers integer ones.
    t = torch.tensor([0, 1, 2, num_steps // 3, num_steps // 2, num_steps - 10, num_steps - 2, num_steps - 1])
    for shape in [(len(t), 3, 4, 8, 8), (len(t), 3, 8, 8)]:
        x0, noise = _x0(shape, seed=13), torch.randn(shape, generator=_gen(14))
        noisy, target = obj.corrupt(x0, noise, t.to(torch.float32))
        assert torch.equal(noisy, ref.add_noise(x0, noise, t))
        assert torch.equal(target, noise if prediction == "epsilon" else ref.get_velocity(x0, noise, t))


def test_the_run_path_does_not_import_diffusers() -> None:
    """No run needs diffusers (~0.35 s per process) or scipy (flow's scheduler imported scipy.stats)."""
    code = (
        "import sys, torch, sweep.job, sweep.run.execute; from sweep.run.diffusion import DiffusionObjective as D; "
        "[D(k).sample(torch.zeros(2, 3, 4, 4), torch.Generator()) for k in ('ddpm', 'flow')]; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'diffusers', 'scipy'}))"
    )
    result = run_cli("-c", code, check=True)
    assert result.stdout.strip() == "[]"


def test_loss_is_fp32_mse() -> None:
    pred = torch.randn(4, 3, 8, 8, generator=_gen(11)).bfloat16()
    target = torch.randn(4, 3, 8, 8, generator=_gen(12))
    loss = DiffusionObjective().loss(pred, target)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert torch.allclose(loss, ((pred.float() - target) ** 2).mean())
    # fp16 would overflow squaring these; the fp32 reduction does not.
    big = torch.full((2, 2), 300.0, dtype=torch.float16)
    assert DiffusionObjective.loss(big, -big).isfinite()


def test_invalid_arguments_raise_with_choices() -> None:
    with pytest.raises(ValueError, match="ddpm"):
        DiffusionObjective(kind="edm")
    with pytest.raises(ValueError, match="v_prediction"):
        DiffusionObjective(prediction="sample")
    with pytest.raises(ValueError, match="beta_schedule"):
        DiffusionObjective(beta_schedule="cubic")
    with pytest.raises(ValueError):
        DiffusionObjective(kind="flow", flow_shift=0.0)
