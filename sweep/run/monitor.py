"""The divergence monitor: decides, step by step, whether a run has diverged and how.

The training loop hands it the step's loss and global gradient norm (fetched together in one device
sync) and the loss scaler's decision; every `stall_window` steps it also compares the weights with
the previous check. The first criterion met becomes the run's verdict (a `Verdict`: docs/design.md, "Verdicts"):

- nonfinite_loss: the loss is NaN/Inf.
- nonfinite_grad: the loss is finite but the gradient norm is not (and no loss scaler absorbs it).
- scale_collapse: the scaler overflowed at its minimum scale, or skipped too many steps in a row.
- loss_spike: the smoothed loss (an EMA, this step included) above `spike_factor` x its own running
  minimum, or one loss above `spike_factor` x the initial loss. The first bad step is where the raw
  loss first rose above `spike_factor` x the running minimum in the excursion that tripped it.
  Smoothing the tested loss matters: a diffusion loss swings with the sampled timesteps, and at batch
  1-2 a tenth of a healthy run's batches land above 10x the smoothed minimum (measured: median 0.05,
  90th percentile 0.54), so a raw-loss test calls healthy small-batch runs diverged. Those batches stay
  near the untrained model's loss, though, and a real explosion goes far above it: that is the raw test.
  The monitor keeps the last RECENT squared gradient norms, so the cause can say whether AdamW's second
  moment had kept up (sweep.run.adam_lag).
- stalled: at least `stall_fraction` of the weights (by magnitude) did not change over a window in
  which updates were applied: either the gradients underflowed to exact zeros (fp16 without loss scaling)
  or the updates were below the weights' resolution (pure bf16 at small lr).
- bad_input is decided before the forward, from the batch itself (sweep.data.checks.check_batch).

It also measures how far the weights travel, for the verdicts decided from the whole curve at the end of a run
(sweep/run/trend.py): at each stall check the distance from the last check's weights is added to `weight_path`,
and at the run's last step (`measure_end`) the rest is `weight_tail` (`travelled` is both); `weight_norm0` and
`weight_norm` are the weights' norms at the start and at the last measurement.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from sweep.config import MonitorConfig, Verdict
from sweep.run.precision import ScalerEvent


@dataclass
class Cause:
    """Where a run first went wrong: data|forward|loss|backward|optimizer|scaler|checkpoint."""

    where: str
    module: str | None
    detail: str


@dataclass
class Divergence:
    """A verdict and the step it was first met."""

    verdict: Verdict
    step: int
    cause: Cause

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "first_bad_step": self.step, "cause": asdict(self.cause)}


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _norm(flat: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(flat, dtype=torch.float32))


class DivergenceMonitor:
    """Applies the verdict criteria to the numbers the loop reports."""

    def __init__(self, cfg: MonitorConfig):
        self.cfg = cfg
        self.initial_loss: float | None = None
        self.ema: float | None = None
        self.ema_min = math.inf
        self._snapshot: torch.Tensor | None = None
        self._updates_since_snapshot = 0
        self.last_unchanged_fraction = math.nan
        self.last_zero_grad_fraction = math.nan
        self._skip_start: int | None = None
        self._above_since: int | None = None  # first step of the current run of raw losses above the threshold
        self.updates = 0  # updates applied by this run (a non-finite weight with none applied came in that way)
        self.recent_sq: list[
            tuple[int, float]
        ] = []  # (step, squared gradient norm) of the last RECENT finite ones (sweep.run.adam_lag)
        self.weight_norm0: float | None = None  # ||weights|| at `start` (fp32)
        self.weight_norm: float | None = None  # ||weights|| at the last measurement
        self.weight_path = 0.0  # sum of ||weights - the last check's|| over the checks so far (fp32)
        self.weight_tail = 0.0  # ||weights - the last check's|| after the run's last step: not state (a resume's
        # next check measures from that same check, so keeping it would count the stretch twice)

    RECENT = 32
    _STATE = (
        "initial_loss",
        "ema",
        "ema_min",
        "_updates_since_snapshot",
        "_skip_start",
        "_above_since",
        "recent_sq",
        "weight_norm0",
        "weight_norm",
        "weight_path",
    )  # not `updates`: per run
    _NEWER = {"_above_since": None, "recent_sq": [], "weight_norm0": None, "weight_norm": None, "weight_path": 0.0}
    """Absent from older checkpoints: their defaults (weight_norm0 then is the loaded snapshot's norm)."""

    def state_dict(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """(JSON-able numbers, tensors) to checkpoint; a resumed run judges its steps as the original would."""
        return {k: getattr(self, k) for k in self._STATE}, (
            {"snapshot": self._snapshot} if self._snapshot is not None else {}
        )

    def load_state_dict(self, numbers: dict, tensors: dict[str, torch.Tensor]) -> None:
        for k in self._STATE:
            setattr(self, k, numbers.get(k, self._NEWER[k]) if k in self._NEWER else numbers[k])
        self.recent_sq = [(int(s), float(q)) for s, q in self.recent_sq]  # JSON made the pairs lists
        self._snapshot = tensors.get("snapshot")
        if self.weight_norm0 is None and self._snapshot is not None:
            self.weight_norm0 = self.weight_norm = _norm(self._snapshot)

    def observe(
        self, step: int, loss: float, grad_norm: float, event: ScalerEvent, scaler_detail: str = ""
    ) -> Divergence | None:
        """Check one step's loss, gradient norm and scaler decision.

        With a loss scaler, a non-finite loss or gradient is an overflow the scaler absorbs by skipping
        the step and backing off; it becomes a verdict only when the scaler collapses (the Hallo case:
        NaN predictions after a resume, the scale halving down to its minimum).
        """
        if event is ScalerEvent.collapse:
            since = f"; overflows since step {self._skip_start}" if self._skip_start is not None else ""
            return Divergence(Verdict.scale_collapse, step, Cause("scaler", None, scaler_detail + since))
        if self.initial_loss is None and math.isfinite(loss):
            self.initial_loss = self.ema = loss
        if math.isfinite(grad_norm):
            self.recent_sq.append((step, grad_norm * grad_norm))
            del self.recent_sq[: -self.RECENT]
        spike = self._spike(step, loss)
        if event is ScalerEvent.skip:
            # The scaler skips the update, but a finite loss far above the running minimum is still a
            # spike: fp16 runs would otherwise hide their explosion behind overflow skips.
            self._skip_start = step if self._skip_start is None else self._skip_start
            return spike
        self._skip_start = None
        if not math.isfinite(loss):
            return Divergence(Verdict.nonfinite_loss, step, Cause("forward", None, f"loss is {loss}"))
        if not math.isfinite(grad_norm):
            return Divergence(
                Verdict.nonfinite_grad,
                step,
                Cause("backward", None, f"gradient norm is {grad_norm} with a finite loss {loss:.4g}"),
            )
        return spike

    def _spike(self, step: int, loss: float) -> Divergence | None:
        """Fold a finite loss into the smoothed loss; loss_spike once it exceeds spike_factor x its running minimum."""
        if self.initial_loss is None or not math.isfinite(loss):
            return None
        factor = self.cfg.spike_factor
        threshold = factor * min(self.ema_min, self.initial_loss)
        self._above_since = (step if self._above_since is None else self._above_since) if loss > threshold else None
        self.ema = self.cfg.ema_beta * self.ema + (1 - self.cfg.ema_beta) * loss
        if self.ema <= threshold and loss <= factor * self.initial_loss:
            self.ema_min = min(self.ema_min, self.ema)
            return None
        first = step if self._above_since is None else self._above_since
        if loss > factor * self.initial_loss:
            what = f"the loss {loss:.4g} > {factor:g} x the initial loss {self.initial_loss:.4g} at step {step}"
        else:
            what = (
                f"smoothed loss {self.ema:.4g} > {factor:g} x its running min {threshold / factor:.4g} at step "
                f"{step}; the loss {loss:.4g}"
            )
        return Divergence(
            Verdict.loss_spike, first, Cause("optimizer", None, f"{what}, above {threshold:.4g} from step {first}")
        )

    def start(self, params: list[torch.Tensor]) -> None:
        """Take the first weight snapshot, before any update."""
        self._snapshot = _flat(params).clone()
        self._updates_since_snapshot = 0
        self.weight_norm0 = self.weight_norm = _norm(self._snapshot)
        self.weight_path = 0.0

    def count_update(self, step: int) -> bool:
        """Count an applied update: whether step `step` is a stall check (every `stall_window` steps)."""
        self._updates_since_snapshot += 1
        self.updates += 1
        return (step + 1) % self.cfg.stall_window == 0 and self._snapshot is not None

    def measure_end(self, params: list[torch.Tensor]) -> None:
        """The weights after the run's last step, when that step was no stall check: the rest of their path, kept
        apart (`weight_tail`) from the checks' `weight_path`, which a checkpoint carries on."""
        if self._snapshot is not None:
            now = _flat(params)
            self.weight_tail = _norm(now.float() - self._snapshot.float())
            self.weight_norm = _norm(now)

    @property
    def travelled(self) -> float:
        """How far the weights travelled from `start` to the last measurement: the checks' path and the tail."""
        return self.weight_path + self.weight_tail

    def _travel(self, now: torch.Tensor) -> None:
        self.weight_path += _norm(now.float() - self._snapshot.float())
        self.weight_norm = _norm(now)
        self.weight_tail = 0.0

    def stall_check(self, step: int, params: list[torch.Tensor], grads: list[torch.Tensor]) -> Divergence | None:
        """Compare the weights with the last check (after count_update said this step is one)."""
        now = _flat(params)
        self._travel(now)
        same = now == self._snapshot
        # Weighted by |w|: zero-initialised weights (adaLN-Zero, biases) sit where every update is
        # representable and would hide that the weights carrying the model stopped moving.
        mass = self._snapshot.abs().float()
        total = mass.sum()
        unchanged = ((mass * same).sum() / total).item() if total > 0 else same.float().mean().item()
        zero_grads = (_flat(grads) == 0).float().mean().item() if grads else math.nan
        self.last_unchanged_fraction, self.last_zero_grad_fraction = unchanged, zero_grads
        self._snapshot = now.clone()
        updates, self._updates_since_snapshot = self._updates_since_snapshot, 0
        if updates == 0 or unchanged < self.cfg.stall_fraction:
            return None
        window = f"steps {step + 1 - self.cfg.stall_window}-{step}"
        if zero_grads >= self.cfg.stall_fraction:
            return Divergence(
                Verdict.stalled,
                step,
                Cause(
                    "backward",
                    None,
                    f"gradients underflowed: {zero_grads:.0%} of gradient elements are exactly 0 and "
                    f"{unchanged:.0%} of the weight mass unchanged over {window}",
                ),
            )
        return Divergence(
            Verdict.stalled,
            step,
            Cause(
                "optimizer",
                None,
                f"updates lost: {unchanged:.0%} of the weight mass unchanged over {window} while "
                f"{1 - zero_grads:.0%} of gradient elements are non-zero (updates below the weights' resolution)",
            ),
        )
