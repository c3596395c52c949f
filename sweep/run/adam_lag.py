"""Whether AdamW's second moment had kept up with the gradients when the loss spiked.

AdamW steps by lr * m / sqrt(v), with v an average of squared gradients over ~1/(1-beta2) steps (1000
at beta2=0.999). When the gradients grow faster than v can follow (a smaller batch after a resume, an
instability starting), v lags, the steps are too large until it catches up, and the loss spikes
(Wortsman et al. 2023, "slow second-moment update").

The sum of v over all weights follows the squared global gradient norm exactly: sum(v_t) = beta2 *
sum(v_t-1) + (1 - beta2) * |g_t|^2. So from the optimizer state at the verdict and the norms the
monitor kept, the sum is rolled back to where the spike began, bias-corrected, and compared with the
mean squared norm of the steps before it (what a short-memory v would hold): ~1 or below when v kept
up, >> 1 when it lagged. Read on the bad path only, from what is already at hand.

StableAdamW's update clipping (`optim.update_clip`, sweep/run/adamw.py) leaves v as it is and only scales
each tensor's step down by its own RMS of g / sqrt(v_hat) over the threshold, a number not kept; so the
ratio is measured the same with the clip on, and says how large the steps would have been without it.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

LAGGED = 4.0
"""A second moment this many times below the recent squared gradients makes the steps >= 2x too large."""


def adamw_second_moment(optimizer: torch.optim.Optimizer) -> tuple[float, int, float]:
    """(sum of exp_avg_sq over all weights, the step count, beta2) of a torch AdamW (its first group's beta2);
    (0.0, 0, 0.0), nothing to compare, for another optimizer (sweep/run/optimizers.py)."""
    total, steps = 0.0, 0
    if not isinstance(optimizer, torch.optim.Optimizer):  # a LibraryOptimizer: its state is not AdamW's
        return total, steps, 0.0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if "exp_avg_sq" in state:
                total += float(state["exp_avg_sq"].float().sum())
                steps = max(steps, int(state["step"]))
    return total, steps, optimizer.param_groups[0]["betas"][1]


def lag_ratio(
    v_sum: float,
    steps: int,
    beta2: float,
    recent: Sequence[tuple[int, float]],
    first_bad: int,
    verdict_step: int,
    grad_clip: float = 0.0,
) -> tuple[float, int] | None:
    """(mean squared gradient norm before `first_bad` / bias-corrected sum(v) at `first_bad`, how many norms).

    `v_sum` and `steps` are the optimizer's now, after the updates of the steps before `verdict_step`;
    `recent` are (step, squared global gradient norm) of the last finite steps, unclipped (capped at
    grad_clip**2 here, as the optimizer saw them). None when there is nothing to compare.
    """
    sq = {s: min(q, grad_clip**2) if grad_clip > 0 else q for s, q in recent}
    before = [q for s, q in sq.items() if s < first_bad]
    if not before:  # the spike began before the kept norms: nothing to roll back with
        return None
    for s in range(verdict_step - 1, first_bad - 1, -1):  # undo the updates made since the spike began
        if s in sq:  # a finite step, so an applied one (the scaler skips non-finite steps)
            v_sum, steps = (v_sum - (1 - beta2) * sq[s]) / beta2, steps - 1
    if steps < 1 or not v_sum > 0:  # no update before the spike, or a rollback lost to rounding
        return None
    return sum(before) / len(before) / (v_sum / (1 - beta2**steps)), len(before)


def lag_note(
    v_sum: float,
    steps: int,
    beta2: float,
    recent: Sequence[tuple[int, float]],
    first_bad: int,
    verdict_step: int,
    grad_clip: float = 0.0,
    update_clip: float = 0.0,
) -> str:
    """lag_ratio as a clause for a loss_spike's cause ('' when there is nothing to compare).

    With `update_clip` > 0 the steps taken were scaled down by a per-tensor factor that is not kept: the
    clause says how large the unclipped steps would have been and the clip's threshold, not the steps taken.
    """
    found = lag_ratio(v_sum, steps, beta2, recent, first_bad, verdict_step, grad_clip)
    if found is None:
        return ""
    ratio, n = found
    if ratio >= LAGGED:
        too_large = f"~{math.sqrt(ratio):.2g}x too large"
        steps_were = f"so the steps were {too_large}"
        if update_clip > 0:
            steps_were = (
                f"so unclipped the steps would have been {too_large}; update_clip={update_clip:g} divided each "
                f"tensor's step by max(1, RMS(g/sqrt(v))/{update_clip:g}), a factor not recorded, so the size of "
                "the steps taken is not measured"
            )
        return (
            f"; AdamW's second moment lagged: the {n} squared gradient norms before step {first_bad} "
            f"average {ratio:.3g}x its sum (beta2={beta2:g} averages ~{1 / (1 - beta2):.0f} steps), "
            f"{steps_were}; a lower beta2 or a reset optimizer state re-estimates it"
        )
    return (
        f"; AdamW's second moment kept up: the {n} squared gradient norms before step {first_bad} "
        f"average {ratio:.2g}x its sum"
    )
