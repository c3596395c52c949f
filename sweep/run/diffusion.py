"""The training objective: noise a clean batch, name the regression target, score a prediction.

Two families, both built on diffusers' schedulers so the numbers match what diffusers
pipelines later sample with:

* ``"ddpm"`` (``DDPMScheduler``): integer timesteps t ~ U{0, ..., T-1},
  ``noisy = sqrt(a_t) * x0 + sqrt(1 - a_t) * noise`` with a_t the cumulative alpha product.
  The target is the noise (``"epsilon"``) or ``sqrt(a_t) * noise - sqrt(1 - a_t) * x0``
  (``"v_prediction"``).
* ``"flow"`` (rectified flow, ``FlowMatchEulerDiscreteScheduler``): sigma in [0, 1),
  ``noisy = (1 - sigma) * x0 + sigma * noise``, target ``noise - x0`` (the velocity; the
  ``prediction`` argument selects among DDPM targets and does not apply here). The scheduler
  has no training-side ``add_noise``, so sigma is drawn here: u ~ U[0, 1) mapped through the
  scheduler's shift, ``sigma = shift * u / (1 + (shift - 1) * u)``. That is the continuous
  version of the scheduler's own sigma table (which is the same map at u = k/T, k = 1..T),
  and unlike the table it keeps the model's timestep ``sigma * T`` inside [0, T) like DDPM's.

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

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler
from torch import Tensor

if TYPE_CHECKING:
    from diffusers import FlowMatchEulerDiscreteScheduler

KINDS = ("ddpm", "flow")
PREDICTIONS = ("epsilon", "v_prediction")


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
        self.scheduler: DDPMScheduler | FlowMatchEulerDiscreteScheduler
        if kind == "ddpm":
            try:
                self.scheduler = DDPMScheduler(
                    num_train_timesteps=num_train_timesteps, beta_schedule=beta_schedule, prediction_type=prediction
                )
            except NotImplementedError as e:  # diffusers' way of rejecting a schedule name
                raise ValueError(f"unknown beta_schedule {beta_schedule!r}: {e}") from e
        else:
            # Imported here: its module imports scipy.stats (1-4 s here), which a DDPM run never needs.
            from diffusers import FlowMatchEulerDiscreteScheduler

            self.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=num_train_timesteps, shift=flow_shift)

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
            noisy = self.scheduler.add_noise(x0, noise, t)
            target = noise if self.prediction == "epsilon" else self.scheduler.get_velocity(x0, noise, t)
            return noisy, target
        sigma = _per_sample(timesteps.float() / self.num_train_timesteps, x0)
        return (1 - sigma) * x0 + sigma * noise, noise - x0

    @staticmethod
    def loss(pred: Tensor, target: Tensor) -> Tensor:
        """Mean squared error reduced in float32, whatever the prediction's dtype."""
        return F.mse_loss(pred.float(), target.float())
