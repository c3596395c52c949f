"""The dynamic loss scaler of K runs at once, decided on the device.

The rules follow torch.amp.GradScaler (init 2**16, x2 after `growth_interval` clean steps, x0.5 on
overflow) and add what DeepSpeed's has: hysteresis (overflows tolerated before backing off) and a
minimum scale at which another overflow stops the run ("Current loss scale already at minimum").
It is our own because GradScaler has neither, and because the monitor must see each decision.

Its state is held as (K,) tensors on the run's device: one scaler serves a lone run (K=1) and a pack
of K runs, each run with its own scale and its own knobs. `update` takes the step's overflow flags as a
tensor and returns each run's decision as a tensor, so no host branch sits between the backward and the
optimizer step: the decision reaches the host with the loss and gradient norm, in the step's one sync.

The scale is float64: its products are exactly the Python floats a host scaler would compute, so a run's
loss scale sequence (and with it every gradient) is bit-for-bit the host's, whatever the factors.
`update` writes the state in place: the state tensors keep their storage for the life of the scaler
(`keep` and `stack` aside, which make a new pack), so a captured CUDA graph that reads and updates them
advances the same state on every replay.
tests/test_scaler.py checks it decision by decision against a host reference written with Python floats
(tests/reference_scaler.py) and against torch.amp.GradScaler.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sweep.config import LossScalerConfig
from sweep.run.precision import ScalerEvent

EVENTS = (ScalerEvent.step, ScalerEvent.skip, ScalerEvent.collapse, ScalerEvent.collapse)
"""The decision codes `update` returns: EVENTS[code] (two collapses: at the minimum, too many skips)."""
STEP, SKIP, AT_MIN, TOO_MANY = range(4)


class DeviceLossScaler:
    """K runs' loss scales and their decisions, as tensors on one device; disabled runs never skip."""

    def __init__(self, cfgs: Sequence[LossScalerConfig], device: torch.device | str = "cpu"):
        self.cfgs = list(cfgs)
        f64 = dict(dtype=torch.float64, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        self.enabled_runs = [c.enabled for c in self.cfgs]
        self.any_enabled = any(self.enabled_runs)
        self.enabled = torch.tensor(self.enabled_runs, dtype=torch.bool, device=device)
        self.growth_factor = torch.tensor([c.growth_factor for c in self.cfgs], **f64)
        self.backoff_factor = torch.tensor([c.backoff_factor for c in self.cfgs], **f64)
        self.min_scale = torch.tensor([c.min_scale for c in self.cfgs], **f64)
        self.growth_interval = torch.tensor([c.growth_interval for c in self.cfgs], **i64)
        self.hysteresis = torch.tensor([c.hysteresis for c in self.cfgs], **i64)
        self.max_skips = torch.tensor([c.max_consecutive_skips for c in self.cfgs], **i64)
        self.stop_at_min = torch.tensor([c.stop_at_min for c in self.cfgs], dtype=torch.bool, device=device)
        self.scale = torch.tensor([float(c.init_scale) if c.enabled else 1.0 for c in self.cfgs], **f64)
        self.clean_steps = torch.zeros(len(self.cfgs), **i64)
        self.hysteresis_left = self.hysteresis.clone()
        self.consecutive_skips = torch.zeros(len(self.cfgs), **i64)

    _STATE = ("scale", "clean_steps", "hysteresis_left", "consecutive_skips")
    _KNOBS = ("enabled", "growth_factor", "backoff_factor", "min_scale", "growth_interval", "hysteresis")
    _KNOBS += ("max_skips", "stop_at_min")

    @classmethod
    def stack(cls, scalers: Sequence["DeviceLossScaler"]) -> "DeviceLossScaler":
        """One scaler for the runs of `scalers` (each keeps its state), in that order: a pack's."""
        first = scalers[0]
        out = cls.__new__(cls)
        out.cfgs = [c for s in scalers for c in s.cfgs]
        out.enabled_runs = [e for s in scalers for e in s.enabled_runs]
        out.any_enabled = any(out.enabled_runs)
        for name in cls._STATE + cls._KNOBS:
            setattr(out, name, torch.cat([getattr(s, name).to(getattr(first, name).device) for s in scalers]))
        return out

    def keep(self, positions: list[int]) -> None:
        """Keep only the runs at these positions (in this order), as a pack compacts."""
        index = torch.tensor(positions, dtype=torch.long, device=self.scale.device)
        for name in self._STATE + self._KNOBS:
            setattr(self, name, getattr(self, name)[index])
        self.cfgs = [self.cfgs[i] for i in positions]
        self.enabled_runs = [self.enabled_runs[i] for i in positions]
        self.any_enabled = any(self.enabled_runs)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The K losses (K,) times their scales (each in the loss's dtype, as a Python float multiplies)."""
        return loss * self.scale.to(loss.dtype) if self.any_enabled else loss

    def inverse(self) -> torch.Tensor:
        """1 / scale per run (K,) float64: what unscaling multiplies the gradients by (1.0 when disabled)."""
        return self.scale.reciprocal()

    def update(self, found_inf: torch.Tensor) -> torch.Tensor:
        """Advance every run's scale after a backward; return each run's decision code (K,) (EVENTS).

        In this order: a clean step counts towards growth; an overflow at the minimum
        collapses (when stop_at_min) before touching hysteresis; any other overflow spends hysteresis,
        backs off once it is spent, and collapses after too many skips in a row.
        """
        on, bad = self.enabled, found_inf & self.enabled
        clean = on & ~found_inf
        self.consecutive_skips.copy_(
            torch.where(clean, 0, torch.where(bad, self.consecutive_skips + 1, self.consecutive_skips))
        )
        self.hysteresis_left.copy_(torch.where(clean, self.hysteresis, self.hysteresis_left))
        counted = torch.where(clean, self.clean_steps + 1, torch.where(bad, 0, self.clean_steps))
        grow = counted >= self.growth_interval
        self.scale.copy_(torch.where(clean & grow, self.scale * self.growth_factor, self.scale))
        self.clean_steps.copy_(torch.where(clean & grow, 0, counted))
        at_min = bad & (self.scale <= self.min_scale) & self.stop_at_min
        overflow = bad & ~at_min
        spent = self.hysteresis_left - overflow.long()
        back = overflow & (spent <= 0)
        self.scale.copy_(torch.where(back, torch.maximum(self.scale * self.backoff_factor, self.min_scale), self.scale))
        self.hysteresis_left.copy_(torch.where(back, self.hysteresis, spent))
        too_many = overflow & (self.consecutive_skips > self.max_skips)
        return torch.where(at_min, AT_MIN, torch.where(too_many, TOO_MANY, torch.where(bad, SKIP, STEP)))

    def collapse_reason(self, i: int, code: int, skips: int, scale: float) -> str:
        """Why run i collapsed, from its decision code and its consecutive
        skips and scale after the update (host numbers); "" when it did not."""
        if code == AT_MIN:
            return f"overflow with the loss scale already at its minimum {self.cfgs[i].min_scale:g}"
        if code == TOO_MANY:
            return f"{skips} consecutive overflow-skipped steps (scale now {scale:g})"
        return ""

    def state(self) -> dict[str, torch.Tensor]:
        """A copy of the state, for `restore` (a window's snapshot, sweep/run/window.py)."""
        return {k: getattr(self, k).clone() for k in self._STATE}

    def restore(self, state: dict[str, torch.Tensor]) -> None:
        """Put back a `state()` copy, in place (the state tensors keep their storage)."""
        for k, v in state.items():
            getattr(self, k).copy_(v)

    def scale_of(self, i: int = 0) -> float:
        return float(self.scale[i])

    def state_dict(self, i: int = 0) -> dict:
        """Run i's state as a checkpoint holds it (plain numbers)."""
        return {
            "enabled": self.enabled_runs[i],
            "scale": float(self.scale[i]),
            "clean_steps": int(self.clean_steps[i]),
            "hysteresis_left": int(self.hysteresis_left[i]),
            "consecutive_skips": int(self.consecutive_skips[i]),
        }

    def load_state_dict(self, state: dict, i: int = 0) -> bool:
        """Adopt a saved state for run i; return False, keeping this run's own start, when the state comes from a
        run without loss scaling: its scale 1.0 was never a decision, and adopting it would silently train an fp16
        run unscaled. (Checkpoints older than the `enabled` key: a state no live scaler leaves behind, scale 1.0
        with no clean or skipped step counted, reads as disabled.)"""
        saved_enabled = state.get("enabled")
        if saved_enabled is None:
            saved_enabled = not (
                float(state["scale"]) == 1.0 and state["clean_steps"] == state["consecutive_skips"] == 0
            )
        if self.enabled_runs[i] and not saved_enabled:
            return False
        self.scale[i] = float(state["scale"])
        self.clean_steps[i] = int(state["clean_steps"])
        self.hysteresis_left[i] = int(state["hysteresis_left"])
        self.consecutive_skips[i] = int(state["consecutive_skips"])
        return True
