"""What a sweep's failures say, for the recommendation line: their dominant cause and what fixes it.

"Try lower optim.lr" is the answer only when the runs failed because of the lr. A sweep whose every run was
refused by the data check (issue #45: latents slightly past [-1, 1], all `bad_input`) needs its data looked at,
and one whose runs all ended `error` needs the error read. The cause of a failed run is, in order:
- its mechanism, where one is known (a diagnosis's, or what result.json named from the recorded signals;
  `unexplained` is none), e.g. `activation_overflow`;
- else its verdict (`bad_input`, `scale_collapse`, `loss_spike`, ...);
- else its status: `error` (with its reason) or `skipped` (pruned runs are no failure: the sweeper stopped them).

The dominant cause is the one most failed runs share; the line says how many of the failed runs it covers and
what fixes it (sweep/diagnose/known.py for a mechanism; below for a verdict or status), and, where the cause is
the lr, the smallest lr that failed against the smallest tried.
"""

from __future__ import annotations

import pandas as pd

from sweep.diagnose.known import KNOWN
from sweep.report.runs import PARAM
from sweep.report.tables import LR

NOT_THE_LR = {
    "bad_input": (
        "the data, not the lr: the batches failed the data check before the forward (NaN/Inf, values past "
        "data.range_limit, or files of another shape or frame count than the run's); each run's cause names its "
        "first samples, and python -m sweep.doctor <data.path> --channels C --frames F --height H --width W (the "
        "run's sizes: without them it holds shapes only to the folder's majority) names every file and why "
        "(data.drop_bad=true leaves them out; raise data.range_limit for unscaled latents)"
    ),
    "corrupt_checkpoint": (
        "the checkpoint, not the lr: it failed verification at the load, before any step; a good copy of the file "
        "(fetch or save it again), or a resume from an earlier checkpoint"
    ),
    "scale_collapse": "the fp16 loss scaler, not the lr: it fell to its floor; bf16 needs no loss scaling",
    "kernel": "a kernel, not the lr: the reference kernel (python -m sweep.parity checks them)",
    "nondeterministic": "nondeterminism, not the lr: deterministic=true",
    "error": "errors, not verdicts: the run crashed; read the errors table",
    "skipped": "skipped before training",
}
"""Causes that lowering the lr does not fix -> what does (a verdict, status or mechanism)."""
NOT_THE_LR["loss_scale_collapse"] = NOT_THE_LR["scale_collapse"]  # the mechanism of that verdict
LR_CAUSES = ("loss_spike", "nonfinite_loss", "nonfinite_grad", "slow_divergence", "no_progress", "lr_too_high")
"""Causes a lower lr is the first thing to try for (when no mechanism names another fix)."""


def causes(runs: pd.DataFrame) -> pd.Series:
    """Each failed run's cause (module docstring), indexed like `runs`; pruned and undecided runs left out."""
    pruned = runs.pruned_at_step.notna() if "pruned_at_step" in runs else pd.Series(False, index=runs.index)
    failed = runs[runs.status.isin(("diverged", "error", "skipped")) & ~pruned]
    out = {}
    for i, r in failed.iterrows():
        mechanism = r.get("mechanism")
        if isinstance(mechanism, str) and mechanism and mechanism != "unexplained":
            out[i] = mechanism
        elif r.status == "diverged" and isinstance(r.get("verdict"), str):
            out[i] = r.verdict
        else:
            out[i] = r.status
    return pd.Series(out, dtype=object)


def failure_reading(runs: pd.DataFrame) -> str:
    """What the failures say, as a clause for the recommendation line ("" when no run failed): e.g. "all 12
    failed runs failed bad_input: the data, not the lr: python -m sweep.doctor ..."."""
    cause = causes(runs)
    if cause.empty:
        return ""
    counts = cause.value_counts()
    top, n = counts.index[0], int(counts.iloc[0])
    total = len(cause)
    share = f"all {total} failed runs" if n == total else f"{n} of the {total} failed runs"
    if n * 2 <= total:  # no cause covers most of them
        mix = ", ".join(f"{c} {k}" for c, k in counts.head(3).items())
        return f"the {total} failed runs have no dominant cause ({mix}): see the divergence map and root causes"
    return f"{share}: {top}: {_fix(top, runs.loc[cause.index[cause == top]], runs)}"


def not_the_lr(runs: pd.DataFrame) -> str:
    """For a sweep that has a recommendation: a clause naming failures that a lower lr does not fix (bad input, a
    corrupt checkpoint, errors), "" when there are none: they are the user's to fix whatever lr is chosen."""
    cause = causes(runs)
    counts = cause[cause.isin(("bad_input", "corrupt_checkpoint", "error"))].value_counts()
    return "; ".join(
        f"{k} run{'s' if k > 1 else ''} failed {c}: {_fix(c, runs.loc[cause.index[cause == c]], runs)}"
        for c, k in counts.items()
    )


def _fix(cause: str, failed: pd.DataFrame, runs: pd.DataFrame) -> str:
    """What fixes `cause`, said for the runs `failed` of the sweep's `runs`."""
    if cause == "error" or cause == "skipped":
        reasons = failed.reason.dropna() if "reason" in failed else pd.Series(dtype=object)
        first = _cut(str(reasons.mode().iloc[0])) if len(reasons) else "no reason recorded"
        return f"{NOT_THE_LR[cause]} (most often: {first})"
    if cause in NOT_THE_LR:
        return NOT_THE_LR[cause]
    if cause not in LR_CAUSES and cause in KNOWN:
        return KNOWN[cause]
    return "a lower lr" + _lr_range(failed, runs)


def _lr_range(failed: pd.DataFrame, runs: pd.DataFrame) -> str:
    """', the smallest lr tried (1e-4) failed too: try lower optim.lr or a precision with fp32 master weights'."""
    column = PARAM + LR
    if column not in runs:
        return " (optim.lr) or a precision with fp32 master weights"
    lrs = pd.to_numeric(runs[column], errors="coerce").dropna()
    bad = pd.to_numeric(failed[column], errors="coerce").dropna()
    if lrs.empty or bad.empty:
        return " (optim.lr) or a precision with fp32 master weights"
    if bad.min() <= lrs.min():
        return (
            f": the smallest lr tried ({lrs.min():.4g}) failed too; try lower optim.lr or a precision with fp32 "
            "master weights"
        )
    return f": the smallest lr that failed was {bad.min():.4g} (the grid starts at {lrs.min():.4g})"


REASON_CHARS = 120
"""At most this many characters of an error's reason in the line (the errors table has more, result.json all)."""


def _cut(reason: str) -> str:
    line = " ".join((reason.strip().splitlines() or [""])[0].split())
    return line if len(line) <= REASON_CHARS else line[: REASON_CHARS - 3].rsplit(" ", 1)[0] + "..."
