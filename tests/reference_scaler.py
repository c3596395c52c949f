"""The host reference of the loss scaler: sweep/run/scaler.py's DeviceLossScaler rules, one run, Python floats.

tests/test_precision.py checks its state machine against torch.amp.GradScaler's rules and DeepSpeed's
(hysteresis, a minimum, a collapse); tests/test_scaler.py checks the device scaler against it, decision by
decision and checkpoint by checkpoint. No run uses it.
"""

from __future__ import annotations

import torch

from sweep.config import LossScalerConfig
from sweep.run.precision import ScalerEvent


class LossScaler:
    """Dynamic loss scaling with a minimum and hysteresis; disabled, it is the identity and never skips."""

    def __init__(self, cfg: LossScalerConfig):
        self.cfg = cfg
        self.enabled = cfg.enabled
        self.scale = float(cfg.init_scale) if cfg.enabled else 1.0
        self._clean_steps = 0
        self._hysteresis_left = cfg.hysteresis
        self.consecutive_skips = 0
        self.collapse_reason = ""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        """Divide the gradients back by the scale, in place, one fused foreach op."""
        if self.enabled and grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, grads_finite: bool) -> ScalerEvent:
        """Advance the scale after a backward; only meaningful when enabled."""
        if not self.enabled:
            return ScalerEvent.step
        if grads_finite:
            self.consecutive_skips = 0
            self._hysteresis_left = self.cfg.hysteresis
            self._clean_steps += 1
            if self._clean_steps >= self.cfg.growth_interval:
                self.scale *= self.cfg.growth_factor
                self._clean_steps = 0
            return ScalerEvent.step
        self._clean_steps = 0
        self.consecutive_skips += 1
        at_min = self.scale <= self.cfg.min_scale
        if at_min and self.cfg.stop_at_min:
            self.collapse_reason = f"overflow with the loss scale already at its minimum {self.cfg.min_scale:g}"
            return ScalerEvent.collapse
        self._hysteresis_left -= 1
        if self._hysteresis_left <= 0:
            self.scale = max(self.scale * self.cfg.backoff_factor, self.cfg.min_scale)
            self._hysteresis_left = self.cfg.hysteresis
        if self.consecutive_skips > self.cfg.max_consecutive_skips:
            self.collapse_reason = (
                f"{self.consecutive_skips} consecutive overflow-skipped steps (scale now {self.scale:g})"
            )
            return ScalerEvent.collapse
        return ScalerEvent.skip

    def state_dict(self) -> dict:
        return {
            "enabled": self.enabled,
            "scale": self.scale,
            "clean_steps": self._clean_steps,
            "hysteresis_left": self._hysteresis_left,
            "consecutive_skips": self.consecutive_skips,
        }

    def load_state_dict(self, state: dict) -> bool:
        """Adopt a saved state; return False, keeping this scaler's own start, when the state comes from a
        run without loss scaling: its scale 1.0 was never a decision, and adopting it would silently
        train an fp16 run unscaled. (Checkpoints older than the `enabled` key: a state no live scaler
        leaves behind, scale 1.0 with no clean or skipped step counted, reads as disabled.)"""
        saved_enabled = state.get("enabled")
        if saved_enabled is None:
            saved_enabled = not (
                float(state["scale"]) == 1.0 and state["clean_steps"] == state["consecutive_skips"] == 0
            )
        if self.enabled and not saved_enabled:
            return False
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self.consecutive_skips = int(state["consecutive_skips"])
        return True
