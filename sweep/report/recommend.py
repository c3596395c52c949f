"""The one-line recommendation at the end of the summary, each claim backed by the table row it comes from.

Candidates are the (combination, lr) settings stable in every replicate (no decided run diverged) and not
marginal (sweep/report/marginal.py: above the combination's best lr and far worse than it), or the combinations
so stable when the sweep has no lr. Their quality is the eval loss (sweep/report/noise.py; the final loss when no
run has one), a mean over the replicates with its spread.
- For the machine the user trains on (sweep/report/target.py: `report.target`, `--target`; default cuda): the
  combinations it cannot run are left out (fp32/tf32 with flash on CUDA), and the line says which and why.
- Quality first: the setting with the lowest mean eval loss, and every setting within noise of it
  (noise.within_noise: two standard errors of the difference; with one replicate nothing ties but
  differences under 0.1%, and the line says the noise was not measured), or, where replicates do not measure
  it, a setting at the same lr that differs from the best in one axis only, whose row in the toggle table is a
  `tie` (the paired noise of that axis over the sweep's matched runs): the line cites that row.
- Then the tie-break: the fastest combination when the runs' steps/s were measured on the target's kind of
  device, else the cheapest on the target (target.COST: on CUDA bf16 before fp16 before tf32 before fp32, flash before
  efficient/cudnn before math before eager); the line says which. Speeds compare like with like: runs trained
  alone against runs trained alone, or runs packed k at a time against the same (a packed run's steps/s is its
  share of a pack's wall time, not comparable with a lone run's); the line says which.
- Then margin: the most grid steps below the next lr up that diverged or was marginal; then the toggle advice.
- The line states the recommended lr's eval loss and spread, the best-eval stable lr and the largest
  stable lr of its combination, and how many grid steps each sits below the next lr that diverged or was
  marginal.
- Never a wrong kernel: a setting whose modulate or attention kernel fails the parity check (sweep.parity:
  modulate=fused_buggy) is no candidate however good its loss, and the line says it was left out.
- Toggles: from the toggle table, every axis value that diverged less without losing lr (or gained lr
  without diverging more) than the value it was paired with.
- A ladder sweep (model.width or model.depth swept with the lr, sweep/report/ladder.py): the size is what the user
  trains at, not a choice (the largest model has the lowest loss), so the candidates are those at the largest size
  measured, no toggle advice is about the size, and the line adds the ladder's prediction at `ladder.target` for
  the recommended combination of the other axes: the largest stable lr there, with its interval.
- The failures read (sweep/report/failures.py): with nothing to recommend, the line names the failed runs'
  dominant cause and its fix (the data and the doctor for `bad_input`, the error for `error`, a lower lr only
  where the lr is the cause); with a recommendation, failures no lr fixes (bad input, a corrupt checkpoint,
  errors) are named after it ("Whatever the lr: ...").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from sweep.report.confirmation import Confirmation, confirmed_candidates, pick_note, same_lr_value
from sweep.report.failures import failure_reading, not_the_lr
from sweep.report.ladder import ladder_axis
from sweep.report.learned import recommendation_note
from sweep.report.noise import Spread, quality_column, quality_name, within_noise
from sweep.report.runs import PARAM
from sweep.report.speed import like_with_like_speed
from sweep.report.tables import (
    FAILED,
    LR,
    PRECISION,
    combo_axes,
    combo_labels,
    frontier_records,
    marginal_column,
    same_lr,
    toggle_effects,
)
from sweep.report.target import (
    DEFAULTS,
    cost,
    cost_text,
    measured_on,
    precision_dtypes,
    ran_on,
    resolve_target,
    unrunnable,
)


@dataclass
class Advice:
    """Prefer `axis=better` over `axis=worse`, as the toggle table's row `row` shows."""

    axis: str
    better: object
    worse: object
    row: str
    evidence: str

    def text(self) -> str:
        return f"prefer {self.axis}={self.better} over {self.worse} ({self.evidence}) [toggles: {self.row}]"


@dataclass
class Recommendation:
    line: str
    precision: object = None
    combination: str | None = None
    settings: dict = field(default_factory=dict)
    """The recommended overrides, e.g. {"precision": "bf16_amp", "attention": "flash", "optim.lr": 0.001}."""
    margin: bool = False
    """A stable lr of the grid lies between the recommended lr and the smallest one that diverged."""
    advice: list[Advice] = field(default_factory=list)
    quality: Spread | None = None
    """The recommended setting's eval loss over its replicates."""
    ties: int = 1
    """Settings within noise of the best eval loss (the recommended one among them)."""
    target: str | None = None
    """The device kind the recommendation is for (sweep/report/target.py): cpu or cuda."""
    target_why: str = ""
    """Why that target: "as asked", "the device the sweep ran on", or the default for a CPU sweep."""
    left_out: dict[str, str] = field(default_factory=dict)
    """Stable combinations the target cannot run -> why (target.unrunnable)."""
    tie_break: str = ""
    """How ties between combinations within noise are broken: "the target's cost" or "steps/s measured on
    <device>" (the line names it when settings of more than one combination tied)."""
    run_dirs: list[str] = field(default_factory=list)
    """The run directories of the recommended setting's runs (its combination at its lr, every replicate)."""
    marginal_run_dirs: list[str] = field(default_factory=list)
    """The run directories of every marginal run of the sweep (sweep/report/marginal.py)."""


def toggle_advice(toggles: pd.DataFrame) -> list[Advice]:
    """Axis values to prefer, one per toggle-table row with a clear direction (precision aside).

    Stability decides first (diverged less without losing lr, or gained lr without diverging more);
    when stability is even, a quality difference beyond noise (the table's `quality` column) decides.
    A tie within noise is no advice.
    """
    out = []
    for r in toggles.itertuples(index=False):
        if r.axis in (PRECISION, LR) or not same_lr(r.axis, r.a, r.b):  # matched lrs of unlike optimizers: no advice
            continue
        steps = 0.0 if pd.isna(r.lr_steps) else r.lr_steps + 0.0
        b_better = (r.diverged_b < r.diverged_a and steps >= 0) or (r.diverged_b <= r.diverged_a and steps > 0)
        a_better = (r.diverged_a < r.diverged_b and steps <= 0) or (r.diverged_a <= r.diverged_b and steps < 0)
        even = r.diverged_a == r.diverged_b and steps == 0
        quality = getattr(r, "quality", "") or ""
        if even and quality.endswith(" better"):
            b_better = quality == f"{r.b} better"
            a_better = not b_better
        if not (a_better or b_better):
            continue
        better, worse = (r.b, r.a) if b_better else (r.a, r.b)
        d_better, d_worse = (r.diverged_b, r.diverged_a) if b_better else (r.diverged_a, r.diverged_b)
        evidence = f"diverged {d_better} vs {d_worse} of {r.pairs} paired runs"
        if not pd.isna(r.lr_steps) and r.combos:
            evidence += f", largest stable lr {steps if b_better else -steps + 0.0:+.1f} grid steps"
        if even:
            change = r.eval_change if b_better else 1 / (1 + r.eval_change) - 1
            evidence += f", eval loss {change:+.1%} (noise ±{r.eval_noise:.1%})"
        out.append(Advice(r.axis, better, worse, f"{r.axis} {r.a} vs {r.b}", evidence))
    return out


def recommend(
    runs: pd.DataFrame,
    recs: pd.DataFrame | None = None,
    toggles: pd.DataFrame | None = None,
    target: str | None = None,
    confirmation: Confirmation | None = None,
    ladder: pd.DataFrame | None = None,
) -> Recommendation:
    """What to use on `target` (cpu or cuda; None: target.resolve_target's default): the best eval loss within
    noise, then the fastest or cheapest on the target, then the most margin (module docstring).

    `recs` (tables.frontier_records) and `toggles` (tables.toggle_effects) are computed when not given.
    `confirmation`: the sweep's confirmation at a longer horizon (sweep/report/confirmation.py): `recs` then come
    without the lrs that failed it, and where the grid's pick failed, the line steps down and says why.
    `ladder`: a ladder sweep's table (ladder.ladder_fit), whose prediction at its target the line cites.
    """
    target, why = resolve_target(runs, target)
    out = _recommend(runs, recs, toggles, target, confirmation, ladder)
    out.target, out.target_why = target, why
    if out.settings or out.left_out:  # "nothing was stable" holds on any target
        out.line += f" Target: {target} ({why}){_left_out_text(out.left_out)}."
    marginal = marginal_column(runs)
    out.marginal_run_dirs = [str(d) for d in runs.run_dir[marginal] if d]
    return out


def _recommend(
    runs: pd.DataFrame,
    recs: pd.DataFrame | None,
    toggles: pd.DataFrame | None,
    target: str,
    confirmation: Confirmation | None,
    ladder: pd.DataFrame | None,
):
    stable = runs[runs.status == "stable"]
    if stable.empty:
        reading = failure_reading(runs) or "no run has finished (running or interrupted)"
        return Recommendation(f"No stable run in this sweep, so nothing to recommend: {reading}.")
    recs = frontier_records(runs) if recs is None else recs
    toggles = toggle_effects(runs, recs) if toggles is None else toggles
    advice = toggle_advice(toggles)
    size = ladder_axis(runs)
    advice = [a for a in advice if a.axis != size]  # a ladder's size is not a choice (module docstring)
    axes = combo_axes(runs)
    quality = quality_column(runs)
    cands = _candidates(runs, recs, axes, quality)
    wrong = wrong_kernels(runs)
    if wrong:
        everywhere = any(a not in axes for a, _ in wrong)  # set alike for every run: every candidate has it
        right = [
            not everywhere and not any((a, str(c[a])) in wrong for a in KERNEL_AXES if a in axes)
            for _, c in cands.iterrows()
        ]
        advice = [a for a in advice if (a.axis, str(a.better)) not in wrong]
        if len(cands) and not any(right):
            names = ", ".join(f"{a}={v}" for a, v in sorted(wrong))
            return Recommendation(
                f"Every stable setting uses a kernel that fails the parity check ({names}; python -m sweep.parity): "
                "nothing to recommend."
            )
        cands = cands.loc[right].copy()
    cands, held = confirmed_candidates(cands, confirmation)  # where the grid's pick failed at a longer horizon
    if size is not None and len(cands):
        cands = at_largest_size(cands, size)
    if cands.empty:
        what = "combination" if recs.empty else "lr"
        where = "" if recs.empty else " of any combination"
        reading = failure_reading(runs)
        return Recommendation(
            held
            or f"No {what} was stable in every replicate{where}: nothing to recommend; "
            + (f"{reading}." if reading else "see the divergence map.")
        )
    choices = {a: choice_by_combo(runs, axes, a) for a in DEFAULTS}
    precision_of, attention_of = choices[PRECISION], choices["attention"]
    left_out = unrunnable_combos(target, cands.combination, precision_of, attention_of)
    cands = cands[~cands.combination.isin(left_out)].copy()
    if cands.empty:
        return Recommendation(
            f"No setting stable in every replicate can run on {target}: nothing to recommend.", left_out=left_out
        )
    speed, basis = like_with_like_speed(stable, combo_labels(stable, axes))
    on = measured_on(stable, target)
    cands["_speed"] = [speed.get(c, np.nan) for c in cands.combination]
    cands["_cost"] = [cost(target, precision_of[c], attention_of[c], choices["optim"][c]) for c in cands.combination]
    cands["_follows"] = [
        sum(str(c[a.axis]) == str(a.better) for a in advice if a.axis in c) for _, c in cands.iterrows()
    ]
    measured = cands[cands._q.map(lambda q: q.n > 0)]
    pool = measured if len(measured) else cands
    best_row = pool.loc[pool._q.map(lambda q: q.mean).idxmin()] if len(measured) else None
    top = best_row._q if best_row is not None else None
    paired = {i: paired_tie(c, best_row, axes, toggles) for i, c in pool.iterrows()} if top is not None else {}
    tied = (
        pool[[c._q is top or within_noise(c._q, top) or bool(paired[i]) for i, c in pool.iterrows()]]
        if (top is not None)
        else pool
    )
    first = ["_speed"] if on else ["_cost"]
    best = tied.sort_values(
        [*first, "_margin", "_follows", "_mean", "combination"],
        ascending=[not on, False, False, True, True],
        na_position="last",
    ).iloc[0]
    rec = recs.set_index("combination").loc[best.combination] if len(recs) else None
    tie_break = f"steps/s measured on {on}" if on else "the target's cost"
    named = _precision_by_combo(runs, axes).get(best.combination)
    tied = tied.assign(
        _precision=[precision_of[c] for c in tied.combination], _optim=[choices["optim"][c] for c in tied.combination]
    )
    how = _tie_break_text(target, tie_break, stable, tied) if tied.combination.nunique() > 1 else ""  # else: margin
    out = _line(best, rec, axes, named, speed, basis, advice, quality, len(tied), top, how, paired.get(best.name, ""))
    out.left_out, out.tie_break = left_out, tie_break
    out.run_dirs = _run_dirs(runs, axes, best)
    out.line += recommendation_note(runs, out.run_dirs, best._q.mean if best._q.n else np.nan, quality)
    out.line += held + pick_note(best.combination, None if pd.isna(best[LR]) else best[LR], confirmation)
    for axis, value in sorted(wrong):
        out.line += f" Not {axis}={value}: its kernel fails the parity check (python -m sweep.parity --{axis} {value})."
    if other := not_the_lr(runs):
        out.line += f" Whatever the lr: {other}."
    if size is not None:
        out.line += ladder_text(ladder, out.settings, size)
    return out


def paired_tie(cand, best, axes: list[str], toggles: pd.DataFrame) -> str:
    """The toggle-table row ("precision bf16_amp vs fp16_amp") by which `cand` ties with `best` where their
    replicates cannot say (within_noise None: one replicate): the same lr, one axis apart, and that axis's row for
    the two values a `tie`; "" otherwise."""
    if within_noise(cand._q, best._q) is not None or not same_lr_value(cand[LR], best[LR]):  # the best: True
        return ""
    apart = [a for a in axes if _key(cand[a]) != _key(best[a])]
    if len(apart) != 1 or toggles is None or toggles.empty:
        return ""
    axis, values = apart[0], {_key(cand[apart[0]]), _key(best[apart[0]])}
    for r in toggles.itertuples(index=False):
        if r.axis == axis and {_key(r.a), _key(r.b)} == values and getattr(r, "quality", "") == "tie":
            return f"{axis} {r.a} vs {r.b}"
    return ""


def at_largest_size(cands: pd.DataFrame, size: str) -> pd.DataFrame:
    """A ladder sweep's candidates at the largest size that has one: the size closest to the one trained."""
    sizes = cands[size].astype(float)
    return cands[sizes == sizes.max()]


def ladder_text(ladder: pd.DataFrame | None, settings: dict, size: str) -> str:
    """' At width 512 (ladder.target) the ladder predicts ...' for the recommended combination of the other axes, or
    what is missing for it; the recommended setting is at the largest size with a stable setting."""
    axis = size.split(".")[-1]
    said = f" A ladder over {axis}: this is at the largest {axis} with a stable setting, {_fmt(settings[size])}"
    if ladder is None or ladder.empty:
        return said + "."
    others = [a for a in ladder.index.name.split("/") if a in settings] if ladder.index.name else []
    label = "/".join(str(settings[a]) for a in others) or "all"
    if label not in ladder.index:
        return said + "."
    row = ladder.loc[label]
    if pd.isna(row.target):
        return f"{said}; for the lr at the size you train, set ladder.target (or --ladder-target) [ladder: {label}]."
    if pd.isna(row.predicted_lr):
        best = _best_prediction(row)  # the best eval lr's fit may stand where the edge's does not
        best = f"; at {axis} {row.target:g} (ladder.target) the ladder predicts{best[4:]}" if best else ""
        return f"{said}; for the largest stable lr at the size you train, no fit of its sizes{best} [ladder: {label}]."
    interval = (
        f"{ladder.attrs.get('confidence', 0.9):.0%} interval {row.low:.3g}..{row.high:.3g}"
        if not pd.isna(row.low)
        else "no interval: it needs 3 sizes"
    )
    return (
        f"{said}; at {axis} {row.target:g} (ladder.target) the ladder predicts a largest stable lr of "
        f"{row.predicted_lr:.3g} ({interval}; an extrapolation: confirm it at that {axis}){_best_prediction(row)} "
        f"[ladder: {label}]{_against_prediction(settings.get('optim.lr'), row, axis)}."
    )


def _best_prediction(row: pd.Series) -> str:
    """' and a best eval lr of ...' where the ladder fitted the best eval lr too (sweep/report/ladder.py)."""
    if "predicted_best_lr" not in row or pd.isna(row.predicted_best_lr):
        return ""
    interval = f" ({row.best_low:.3g}..{row.best_high:.3g})" if not pd.isna(row.best_low) else ""
    return f" and a best eval lr of {row.predicted_best_lr:.3g}{interval}"


def _against_prediction(lr, row: pd.Series, axis: str) -> str:
    """Where the recommended lr (measured at a smaller size) stands against the ladder's prediction at the target: a
    warning when it is at or above the prediction (it would likely diverge at the size trained), else its margin
    below the prediction and whether the interval's low end lies below it."""
    if lr is None or pd.isna(lr) or not lr > 0:
        return ""
    if lr >= row.predicted_lr:
        return (
            f"; warning: the lr recommended here, {lr:.3g}, is at or above that prediction: at {axis} {row.target:g} "
            f"it would likely diverge, so start below {row.predicted_lr:.3g} there"
        )
    said = f"; the lr recommended here, {lr:.3g}, is {row.predicted_lr / lr:.2g}x below that prediction"
    if pd.isna(row.low):
        return said
    return said + (f", inside its interval (low end {row.low:.3g})" if lr > row.low else ", below its interval")


def unrunnable_combos(target: str, combinations, precision_of: dict, attention_of: dict) -> dict[str, str]:
    """The combinations (in their order, once each) that `target` cannot run -> why (target.unrunnable), from each
    combination's precision and attention (choice_by_combo)."""
    return {
        c: why
        for c in dict.fromkeys(combinations)
        if (why := unrunnable(target, precision_of.get(c), attention_of.get(c)))
    }


def _tie_break_text(target: str, tie_break: str, stable: pd.DataFrame, tied: pd.DataFrame) -> str:
    """How the tied settings were ordered, for the line: by speed, or by the target's cost and why."""
    if tie_break != "the target's cost":
        return f"fastest of those (tie-break: {tie_break})"
    ran = ", ".join(sorted(ran_on(stable))) or "an unrecorded device"
    fp8 = any(precision_dtypes(str(p))[2] for p in tied._precision)
    text = cost_text(target, fp8=fp8, optimizers=tied._optim.nunique() > 1)
    return (
        f"cheapest of those on {target} (tie-break: the target's cost, {text}; "
        f"the steps/s were measured on {ran}, not on {target})"
    )


def _left_out_text(left_out: dict[str, str]) -> str:
    """'; left out: fp32/flash (why); tf32/flash (why)', the combinations grouped by their reason."""
    by_reason: dict[str, list[str]] = {}
    for combo, why in left_out.items():
        by_reason.setdefault(why, []).append(combo)
    return "".join(f"; left out: {', '.join(c)} ({why})" for why, c in by_reason.items())


def _run_dirs(runs: pd.DataFrame, axes: list[str], best) -> list[str]:
    """The run directories of the recommended setting: its combination, at its lr when the sweep has one."""
    mine = combo_labels(runs, axes) == best.combination
    if not pd.isna(best[LR]) and PARAM + LR in runs:
        mine &= pd.to_numeric(runs[PARAM + LR], errors="coerce") == best[LR]
    return [str(d) for d in runs.run_dir[mine & runs.status.eq("stable")] if d]


KERNEL_AXES = ("modulate", "attention")
"""Swept axes that choose a kernel, by the parity check's name for its kind (sweep.parity)."""


def wrong_kernels(runs: pd.DataFrame) -> set[tuple[str, str]]:
    """The (axis, value) pairs the runs set, swept or not, whose kernel fails the parity check (sweep.parity.fails)."""
    from sweep.parity import fails

    return {
        (a, str(v))
        for a in KERNEL_AXES
        if PARAM + a in runs
        for v in runs[PARAM + a].dropna().unique()
        if fails(a, str(v))
    }


def _candidates(runs: pd.DataFrame, recs: pd.DataFrame, axes: list[str], quality: str) -> pd.DataFrame:
    """One row per (combination, lr stable in every replicate): quality Spread `_q` over its stable runs, its
    mean, and the margin in grid steps. Without an lr in the params, one row per combination stable in every
    replicate, by the rule tables.lr_stability applies per lr: no decided run diverged."""
    rows = []
    if recs.empty:  # no lr in the params: the combinations themselves
        labels = combo_labels(runs, axes)
        diverged = set(labels[runs.status == "diverged"])
        ok = runs.status == "stable"
        for combo, group in runs[ok].groupby(labels[ok], sort=False):
            if combo in diverged:
                continue
            q = Spread.of(group[quality])
            rows.append(
                {
                    "combination": combo,
                    LR: np.nan,
                    "_q": q,
                    "_margin": np.nan,
                    **{a: group[PARAM + a].iloc[0] for a in axes},
                }
            )
    else:
        for rec in recs.to_dict("records"):
            for lr, q in rec["spreads"].items():
                if rec["by_lr"].get(lr) != "stable":  # marginal, or found wanting later (a confirmation)
                    continue
                rows.append(
                    {
                        "combination": rec["combination"],
                        LR: lr,
                        "_q": q,
                        "_margin": _steps_below(lr, rec),
                        **{a: rec[a] for a in axes},
                    }
                )
    cands = pd.DataFrame(rows, columns=["combination", LR, "_q", "_margin", *axes])
    cands["_mean"] = [q.mean for q in cands._q]
    return cands


def _edge(lr: float, rec) -> float | None:
    """The combination's next lr above `lr` that is not stable in its `by_lr` (diverged or marginal), or None."""
    return min((x for x, s in rec["by_lr"].items() if x > lr and s != "stable"), default=None)


def _steps_below(lr: float, rec) -> float:
    """Grid steps from `lr` up to the next lr that diverged or was marginal (1: the next lr did); inf when none did."""
    bad = _edge(lr, rec)
    if bad is None:
        return np.inf
    grid = rec["grid"]
    return float(grid.index(bad) - grid.index(lr))


def _line(
    best, rec, axes, precision, speed, basis, advice, quality, ties: int, top: Spread | None, how: str = "", by=""
) -> Recommendation:
    """The line and the Recommendation; `how` says how ties were broken ("fastest of those ..."), `by` which toggle
    row tied the setting with the best where replicates did not (paired_tie)."""
    settings = {} if precision is None or PRECISION in axes else {PRECISION: precision}
    settings.update({a: _py(best[a]) for a in axes})
    parts, margin = [], False
    q: Spread = best._q
    if not pd.isna(best[LR]):
        settings[LR] = float(best[LR])
    name = quality_name(quality)
    if q.n:
        if q is top or top is None:
            more = f"{ties - 1} more setting{'s' if ties > 2 else ''}"
            noise = "the best" + (f"; {more} within noise of it" if ties > 1 else "")
        else:
            noise = f"within noise of the best {top.mean:.4g}, one of {ties} tied settings"
            noise += f" (a tie by the toggle table's paired noise [toggles: {by}])" if by else ""
        if not q.measured:
            noise += "; noise not measured: replicates=3 measures it"
        parts.append(f"{name} {q.text()}, {noise}")
    if rec is not None:
        source = f"[frontier: {best.combination}]"
        steps = best._margin
        parts.append(f"lr {best[LR]:.4g}: {_below(best[LR], rec)}")
        margin = bool(np.isfinite(steps) and steps > 1)
        if rec.best_lr is not None and not pd.isna(rec.best_lr) and rec.best_lr != best[LR]:
            parts.append(f"best-eval stable lr {rec.best_lr:.4g}: {_below(rec.best_lr, rec)}")
        if rec.max_stable_lr != best[LR]:
            parts.append(f"largest stable lr {rec.max_stable_lr:.4g}: {_below(rec.max_stable_lr, rec)}")
        if len(rec.grid) > 1 and best[LR] == min(rec.grid) and best[LR] == rec.best_lr:
            parts.append(f"lr {best[LR]:.4g} is the smallest lr swept: a lower one may train better, sweep lower lrs")
        if rec.marginal_lrs:
            lrs = ", ".join(f"{x:.4g}" for x in rec.marginal_lrs)
            parts.append(f"skipped as marginal (stable, but far worse than the best lr): {lrs}")
        parts[-1] += f" {source}"
    rate = speed.get(best.combination, np.nan)
    who = f"{best.combination} at " if axes else ""
    if pd.isna(rate):
        parts.append(f"{how + ', ' if how else ''}no run recorded its speed")
    else:
        parts.append(f"{how + ', ' if how else ''}{who}{rate:.3g} steps/s ({basis})")
    if rec is None:
        parts[-1] += f" [frontier: {best.combination}]"
    line = "Use " + " ".join(f"{k}={_fmt(v)}" for k, v in settings.items()) + " (" + "; ".join(parts) + ")."
    if advice:
        line += " Toggles: " + "; ".join(a.text() for a in advice) + "."
    return Recommendation(line, precision, best.combination, settings, margin, advice, q, ties)


def _below(lr: float, rec) -> str:
    steps = _steps_below(lr, rec)
    if not np.isfinite(steps):
        return f"no lr up to {max(rec.grid):.4g} diverged, sweep higher lrs to find its edge"
    bad = _edge(lr, rec)
    if rec.by_lr[bad] == "diverged":
        if steps <= 1:
            return f"no margin, the next grid lr {bad:.4g} diverged"
        return f"{int(steps)} grid steps below the smallest diverging lr {bad:.4g}"
    status = rec.by_lr[bad]  # marginal, failed at a longer horizon (sweep/report/confirmation.py), or above such
    what = "was marginal" if status == "marginal" else status if status.startswith(FAILED) else f"is {status}"
    if steps <= 1:
        return f"no margin, the next grid lr {bad:.4g} {what}"
    return f"{int(steps)} grid steps below lr {bad:.4g}, which {what}"


def choice_by_combo(runs: pd.DataFrame, axes: list[str], axis: str) -> dict:
    """Each combination's value of `axis` (its first run's); DEFAULTS[axis] where the runs do not name it."""
    labels = combo_labels(runs, axes)
    if PARAM + axis not in runs:
        return dict.fromkeys(labels, DEFAULTS[axis])
    named = runs[PARAM + axis].groupby(labels).first().to_dict()
    return {c: DEFAULTS[axis] if named.get(c) is None else named[c] for c in labels}


def _precision_by_combo(runs: pd.DataFrame, axes: list[str]) -> dict:
    if PARAM + PRECISION not in runs:
        return {}
    labels = combo_labels(runs, axes)
    return runs[PARAM + PRECISION].groupby(labels).first().to_dict()


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _key(v) -> str:
    return str(v)


def _py(v):
    """A plain Python value (a bool column of a DataFrame hands out numpy bools)."""
    return v.item() if isinstance(v, np.generic) else v
