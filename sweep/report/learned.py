"""Whether a setting trained at all in the sweep's steps: `stable` says only that nothing blew up.

A run at too low an lr, or at a width that learns nothing in a short horizon (SP at width 512 in 30 steps:
docs/ladder.md), ends stable with an eval loss near the untrained model's. The frontier and the recommendation
then name the best of runs that did not learn as "the best". Here a setting has **barely trained** when its
mean eval loss is still LEARNED x its runs' first training loss or more (result.json `initial_loss`: the loss of
the untrained weights on the first batch, over the runs that trained from scratch): the same bar as the
no_progress verdict's (monitor.trend_progress's default), but for a whole setting, and without that verdict's
condition on how far the weights travelled (a run that moved little is slow, not broken: still not an answer to
take to production). Only with the eval loss: the final training loss is one minibatch at one random timestep,
too noisy for a ratio (sweep/report/noise.py).

The first training loss is itself one minibatch: the ratio is a coarse reading, so the bar sits far from both
sides and the text gives the numbers. Measured (`make demo` on a 2-core AMD EPYC, torch 2.13.0+cpu): every
combination's best lr, 1e-3, ends at 0.18-0.19 of it; the lr 1e-4 runs, too low for 30 steps (not any
combination's best, so not named), at 0.91-0.93; SP at width 512 in 30 steps at 0.8-1.1 (docs/ladder.md).
"""

from __future__ import annotations

import pandas as pd

from sweep.report.noise import EVAL

LEARNED = 0.6
"""A setting whose mean eval loss is at least this many times its runs' mean first training loss has barely trained
(monitor.trend_progress's default, the no_progress verdict's bar)."""


def barely(quality: float, initial: float) -> bool:
    return quality == quality and initial == initial and initial > 0 and quality / initial >= LEARNED


def initial_of(runs: pd.DataFrame, mask) -> float:
    """The mean first training loss of the runs `mask` selects that trained from scratch (NaN without one): a run
    that started from weights (result.json `loaded`: model.init_from, a resumed checkpoint, a fine-tune) starts
    near where it ends, and its ratio says nothing of whether it learned (no_progress leaves those out too)."""
    if "initial_loss" not in runs:
        return float("nan")
    fresh = runs.loaded.isna() if "loaded" in runs else True
    values = pd.to_numeric(runs.initial_loss[mask & fresh], errors="coerce").dropna()
    return float(values.mean()) if len(values) else float("nan")


def frontier_lines(table: pd.DataFrame, runs: pd.DataFrame, labels: pd.Series, quality: str) -> list[str]:
    """One sentence under the frontier naming the combinations whose best lr barely trained ('' when none)."""
    if quality != EVAL or table.empty or "eval_at_best" not in table:
        return []
    said = []
    for combo, best in table.eval_at_best.items():
        initial = initial_of(runs, labels == combo)
        if barely(best, initial):
            said.append(f"{combo} ({best:.3g} against {initial:.3g})")
    if not said:
        return []
    steps = pd.to_numeric(runs.steps_run, errors="coerce").max() if "steps_run" in runs else float("nan")
    within = f" in {int(steps)} steps" if steps == steps else ""
    return [
        f"Barely trained{within}: even the best lr's eval loss is at least {LEARNED:.0%} of the first training loss, "
        f"so its frontier is where runs stopped blowing up, not where they train well: {', '.join(said[:6])}"
        + (f" and {len(said) - 6} more" if len(said) > 6 else "")
        + " (a longer horizon, more steps, tells)"
    ]


def recommendation_note(runs: pd.DataFrame, run_dirs: list[str], quality_mean: float, quality: str) -> str:
    """' Warning: ...' where the recommended setting (its runs' directories) barely trained; '' otherwise."""
    if quality != EVAL or not run_dirs or "run_dir" not in runs:
        return ""
    mask = runs.run_dir.astype(str).isin(run_dirs)
    initial = initial_of(runs, mask)
    if not barely(quality_mean, initial):
        return ""
    steps = pd.to_numeric(runs.steps_run[mask], errors="coerce").max() if "steps_run" in runs else float("nan")
    within = f" in {int(steps)} steps" if steps == steps else ""
    return (
        f" Warning: this setting barely trained{within}: its eval loss {quality_mean:.3g} is "
        f"{quality_mean / initial:.0%} of its runs' first training loss {initial:.3g}, so its lr is the best of runs "
        "that did not learn, not one shown to train well; run longer (more steps) before taking it to production."
    )
