"""The training objective: noise a clean batch, name the regression target, score a prediction.

Two families, with the numbers of diffusers' schedulers so they match what diffusers pipelines
later sample with:

* ``"ddpm"``: integer timesteps t ~ U{0, ..., T-1},
  ``noisy = sqrt(a_t) * x0 + sqrt(1 - a_t) * noise`` with a_t the cumulative alpha product.
  The target is the noise (``"epsilon"``) or ``sqrt(a_t) * noise - sqrt(1 - a_t) * x0``
  (``"v_prediction"``). The schedule is diffusers' ``DDPMScheduler``'s, reimplemented here:
  its betas for our three beta schedules (with its defaults beta_start=0.0001, beta_end=0.02,
  and ``betas_for_alpha_bar`` for ``squaredcos_cap_v2``), its ``alphas_cumprod``, and the
  arithmetic of its ``add_noise`` / ``get_velocity``, operation for operation, so the results
  are bit-identical (``tests/test_diffusion.py`` checks that against ``DDPMScheduler`` with
  ``torch.equal``). Importing diffusers cost every run process ~0.35 s of its own (more before
  torch loads ``torch._dynamo``, see docs/overhead.md) for a few lines of arithmetic, so
  diffusers is a test-time reference here, not a dependency of the run path.
* ``"flow"`` (rectified flow, diffusers' ``FlowMatchEulerDiscreteScheduler``): sigma in [0, 1),
  ``noisy = (1 - sigma) * x0 + sigma * noise``, target ``noise - x0`` (the velocity; the
  ``prediction`` argument selects among DDPM targets and does not apply here). The scheduler
  has no training-side ``add_noise``, so sigma is drawn here: u ~ U[0, 1) mapped through the
  scheduler's shift, ``sigma = shift * u / (1 + (shift - 1) * u)``. That is the continuous
  version of the scheduler's own sigma table (which is the same map at u = k/T, k = 1..T; a test
  checks it against the scheduler), and unlike the table it keeps the model's timestep
  ``sigma * T`` inside [0, T) like DDPM's.

Precision. Noising always runs in float32, whatever dtype ``x0`` arrives in: diffusers'
``add_noise`` casts ``alphas_cumprod`` to the sample's dtype, and in bfloat16 ``1 - a_t``
rounds to 0 for the first ten timesteps of the linear schedule (over 10% off for 19 of
them), i.e. the model would be trained on un-noised inputs labelled as noisy. The caller
casts ``noisy`` to the model's dtype afterwards; that rounding is part of what a precision
sweep measures, a wrong schedule is not. The loss is likewise reduced in float32, because a
mean over 10^4-10^6 squared errors accumulated in bf16/fp16 loses the small per-element
differences that late training is made of (and fp16 can overflow on large errors).

All randomness comes from the ``torch.Generator`` passed in, never the global RNG, so a step
can be replayed bit for bit from a saved generator state.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

KINDS = ("ddpm", "flow")
PREDICTIONS = ("epsilon", "v_prediction")
BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
# DDPMScheduler's defaults (diffusers 0.42.1), which the sweep never overrides.
BETA_START, BETA_END = 0.0001, 0.02
# betas_for_alpha_bar's default cap, the one DDPMScheduler uses for squaredcos_cap_v2.
MAX_BETA = 0.999


def _cosine_betas(num_train_timesteps: int) -> Tensor:
    """diffusers' betas_for_alpha_bar(T) (alpha_transform_type="cosine", max_beta=0.999): floats, then float32."""

    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    betas = []
    for i in range(num_train_timesteps):
        t1 = i / num_train_timesteps
        t2 = (i + 1) / num_train_timesteps
        betas.append(min(1 - alpha_bar(t2) / alpha_bar(t1), MAX_BETA))
    return torch.tensor(betas, dtype=torch.float32)


def ddpm_betas(num_train_timesteps: int, beta_schedule: str) -> Tensor:
    """DDPMScheduler(num_train_timesteps, beta_schedule=...).betas, bit for bit (float32)."""
    if beta_schedule == "linear":
        return torch.linspace(BETA_START, BETA_END, num_train_timesteps, dtype=torch.float32)
    if beta_schedule == "scaled_linear":  # linear in sqrt(beta), as latent diffusion uses
        return torch.linspace(BETA_START**0.5, BETA_END**0.5, num_train_timesteps, dtype=torch.float32) ** 2
    if beta_schedule == "squaredcos_cap_v2":  # GLIDE's cosine schedule
        return _cosine_betas(num_train_timesteps)
    raise ValueError(f"unknown beta_schedule {beta_schedule!r}; choose one of {BETA_SCHEDULES}")


def ddpm_alphas_cumprod(num_train_timesteps: int, beta_schedule: str) -> Tensor:
    """DDPMScheduler's alphas_cumprod (float32): the cumulative product of 1 - beta."""
    return torch.cumprod(1.0 - ddpm_betas(num_train_timesteps, beta_schedule), dim=0)


def shift_sigmas(u: Tensor, shift: float) -> Tensor:
    """Map uniform u in [0, 1] to flow-matching sigmas with diffusers' timestep shift."""
    # Same formula as FlowMatchEulerDiscreteScheduler.__init__; shift > 1 spends more
    # training on high noise levels, which larger inputs need.
    return shift * u / (1 + (shift - 1) * u)


def _per_sample(values: Tensor, like: Tensor) -> Tensor:
    """Reshape (B,) to (B, 1, 1, ...) so it broadcasts against `like`."""
    return values.view(-1, *([1] * (like.dim() - 1)))


class DiffusionObjective:
    """Draws (noisy, timesteps, target) for a clean batch and computes the fp32 loss."""

    def __init__(
        self,
        kind: str = "ddpm",
        num_train_timesteps: int = 1000,
        beta_schedule: str = "linear",
        prediction: str = "epsilon",
        flow_shift: float = 1.0,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown diffusion kind {kind!r}; choose one of {KINDS}")
        if prediction not in PREDICTIONS:
            raise ValueError(f"unknown prediction {prediction!r}; choose one of {PREDICTIONS}")
        if num_train_timesteps < 1:
            raise ValueError(f"num_train_timesteps must be >= 1, got {num_train_timesteps}")
        if flow_shift <= 0:
            raise ValueError(f"flow_shift must be > 0, got {flow_shift}")
        self.kind, self.prediction = kind, prediction
        self.num_train_timesteps, self.flow_shift = num_train_timesteps, flow_shift
        # The largest float32 timestep below T, the cap for flow timesteps.
        t_max = torch.tensor(float(num_train_timesteps))
        self._below_t = torch.nextafter(t_max, torch.zeros(())).item()
        # The DDPM schedule (float32, CPU until the first corrupt() moves it); flow needs none, its
        # sigmas come from shift_sigmas.
        self.alphas_cumprod: Tensor | None = None
        if kind == "ddpm":
            self.alphas_cumprod = ddpm_alphas_cumprod(num_train_timesteps, beta_schedule)

    def sample(self, x0: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        """Draw timesteps and noise from generator; return float32 (noisy, timesteps (B,), target)."""
        batch, device = x0.shape[0], generator.device
        # Timesteps first, then noise: a fixed draw order is part of the replay contract.
        if self.kind == "ddpm":
            t = torch.randint(0, self.num_train_timesteps, (batch,), generator=generator, device=device)
            timesteps = t.to(torch.float32)
        else:
            u = torch.rand(batch, generator=generator, device=device, dtype=torch.float32)
            # u < 1, but the shift and *T can round up to exactly T in float32; keep [0, T).
            timesteps = (shift_sigmas(u, self.flow_shift) * self.num_train_timesteps).clamp(max=self._below_t)
        noise = torch.randn(x0.shape, generator=generator, device=device, dtype=torch.float32)
        timesteps, noise = timesteps.to(x0.device), noise.to(x0.device)
        noisy, target = self.corrupt(x0, noise, timesteps)
        return noisy, timesteps, target

    def corrupt(self, x0: Tensor, noise: Tensor, timesteps: Tensor) -> tuple[Tensor, Tensor]:
        """Noise x0 to the given timesteps in float32; return (noisy, target)."""
        # See the module docstring: diffusers would compute the schedule in x0's dtype.
        x0, noise = x0.float(), noise.float()
        if self.kind == "ddpm":
            t = timesteps.long()  # DDPM timesteps are integer-valued; sample() draws them so
            sqrt_a, sqrt_one_minus_a = self._ddpm_coefficients(t, x0)
            # DDPMScheduler.add_noise and .get_velocity, same operations in the same order.
            noisy = sqrt_a * x0 + sqrt_one_minus_a * noise
            target = noise if self.prediction == "epsilon" else sqrt_a * noise - sqrt_one_minus_a * x0
            return noisy, target
        sigma = _per_sample(timesteps.float() / self.num_train_timesteps, x0)
        return (1 - sigma) * x0 + sigma * noise, noise - x0

    def _ddpm_coefficients(self, t: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
        """sqrt(a_t) and sqrt(1 - a_t) per sample, broadcastable against `like`, as DDPMScheduler computes them."""
        assert self.alphas_cumprod is not None
        # Kept on the sample's device after the first call, as diffusers does; `like` is float32
        # here, so the dtype cast diffusers makes (the bf16 hazard above) is a no-op.
        self.alphas_cumprod = self.alphas_cumprod.to(device=like.device)
        alphas_cumprod = self.alphas_cumprod.to(dtype=like.dtype)
        t = t.to(like.device)
        sqrt_a = _per_sample((alphas_cumprod[t] ** 0.5).flatten(), like)
        sqrt_one_minus_a = _per_sample(((1 - alphas_cumprod[t]) ** 0.5).flatten(), like)
        return sqrt_a, sqrt_one_minus_a

    @staticmethod
    def loss(pred: Tensor, target: Tensor) -> Tensor:
        """Mean squared error reduced in float32, whatever the prediction's dtype."""
        return F.mse_loss(pred.float(), target.float())
