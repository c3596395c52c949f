"""The frontier across sizes: fit log(largest stable lr) against log(size), extrapolate to a target size.

Small-scale proxies (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training
instabilities"): the lr at which a transformer diverges falls with its size, and qk-layernorm and z-loss
move it. A sweep that steps a model's width (or depth) through several values, lr swept (a grid, or the
Optuna frontier search, `+ladder=width`), gives each size a bracket [max stable lr, min diverging lr)
per combination of the other axes (precision, attention, ...). Per combination:

- each size's lr* is the bracket's geometric middle, sqrt(max_stable * min_diverging); a size whose runs
  never diverged (or never held) has no bracket and is left out, and the table says how many were;
- with replicate seeds (`replicates: 2`), each seed's own bracket at each size is one point (`points`: sizes x
  seeds), the standard regression with replicated observations: the prediction is then for one new run at the
  target, and the seeds' spread is in the residuals. The per-size bracket above (stable for every seed) stays
  the table's and the plot's; merged into one point per size, two replicates would leave a 4-size fit 2
  degrees of freedom and an interval about twice as wide and over-covering (tests/test_ladder_v2.py
  simulates both against a known line, seed noise and the grid's rounding);
- a least-squares line log lr* = a + b log size over those points; `exponent` is b;
- the prediction at `target` with a `confidence` interval from Student's t with n - 2 degrees of
  freedom (n points), whose variance is the residual variance plus the brackets' own (an lr* is only known to
  within its bracket: uniform in log, variance log(ratio)^2 / 12). Three sizes are the fewest that give
  an interval; with two the line is drawn and the interval is left empty.

- a curvature test (v2): log lr* = a + b log size + c log(size)^2 fitted by least squares, and a two-sided
  t-test of c = 0: t = c / se(c), se(c)^2 = s^2 [(X'X)^-1]_cc with s^2 the quadratic fit's residual variance
  (n - 3 degrees of freedom) plus the brackets' own variance as above; `curved` when p < 0.05. It needs
  four points over at least three sizes (four sizes, or three with replicates). A curved ladder says the
  straight line, and its interval, should not be extrapolated far;
- a warning when the target lies more than 4x beyond the largest measured size (TARGET_REACH);
- the same line through the best eval lr of each size (`best_point`, columns best_*): the lr that trains best is
  what a user takes to production, the largest stable lr only its ceiling. It is known to within the grid: half a
  grid step (in log) on each side, the same uniform-in-log variance as a bracket's. A best at the grid's smallest
  lr, or at its largest with no larger lr that diverged, may lie beyond the grid and is left out. Under µP the best
  lr should not move with width (its exponent near 0); under SP it falls.

`model.param` (sp|mup) swept alongside is one more of the other axes: SP and µP get separate fits, one
row each, side by side. A ladder sweep needs at least three sizes (`check_ladder_sizes`: one line,
exit status 2 from the sweep).

An extrapolation far past the fitted sizes is a hypothesis, not a measurement: docs/ladder.md holds
one held-out check (fit on the smaller sizes, predict a larger one, run it).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from sweep.report.learned import LEARNED, barely, initial_of
from sweep.report.noise import EVAL
from sweep.report.runs import PARAM
from sweep.report.tables import LR, frontier_records, seed_labels, sort_key

SIZE_AXES = ("model.width", "model.depth")
COLUMNS = [
    "sizes",
    "points",
    "left_out",
    "exponent",
    "r2",
    "target",
    "predicted_lr",
    "low",
    "high",
    "curvature",
    "curvature_p",
    "curved",
    "reach",
    "best_sizes",
    "best_exponent",
    "predicted_best_lr",
    "best_low",
    "best_high",
]
BEST_COLUMNS = {"sizes": "best_sizes", "exponent": "best_exponent", "predicted_lr": "predicted_best_lr"}
BEST_COLUMNS |= {"low": "best_low", "high": "best_high"}
"""The best eval lr's fit (`best_point`): fit_line's columns renamed."""
CURVATURE_ALPHA = 0.05
"""The curvature test's level: `curved` when the two-sided p of c = 0 is below it."""
TARGET_REACH = 4.0
"""A target more than this many times the largest measured size gets a warning."""
MIN_SIZES = 3
"""The fewest sizes a ladder sweep may have: fewer give no interval."""


def check_ladder_sizes(axis: str, values: list[str]) -> str | None:
    """A one-line reason when a ladder over `axis` (width or depth) sweeps fewer than MIN_SIZES distinct
    values, else None. `values` are the swept values as written (e.g. "32,64"); a range or interval
    that cannot be counted here is let through."""
    if not values or any("(" in v for v in values):
        return None
    distinct = {v.strip() for v in values if v.strip()}
    if len(distinct) < MIN_SIZES:
        return (
            f"model.{axis}: a ladder needs at least {MIN_SIZES} sizes to give an interval, got {len(distinct)} "
            f"({', '.join(sorted(distinct, key=sort_key))}): write a list (model.{axis}=a,b,c,...), or drop "
            f"+ladder={axis} to run one size"
        )
    return None


def ladder_settings(sweep_dir) -> tuple[float | None, float]:
    """(ladder.target, ladder.confidence) from a sweep directory's multirun.yaml; (None, 0.9) when it has
    none or cannot be read (the report works without it: the table then fits without predicting)."""
    import yaml

    try:
        node = (yaml.safe_load((Path(sweep_dir) / "multirun.yaml").read_text()) or {}).get("ladder") or {}
        target, confidence = node.get("target"), float(node.get("confidence", 0.9))
        return (target if isinstance(target, int) else float(target) if target is not None else None), confidence
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
        return None, 0.9


def ladder_axis(runs: pd.DataFrame) -> str | None:
    """The swept size axis of a sweep (model.width or model.depth with two or more values), else None."""
    if PARAM + LR not in runs:
        return None
    for axis in SIZE_AXES:
        if PARAM + axis in runs and runs[PARAM + axis].dropna().nunique() > 1:
            return axis
    return None


def ladder_fit(
    runs: pd.DataFrame, target: float | None = None, confidence: float = 0.9, recs: pd.DataFrame | None = None
) -> pd.DataFrame:
    """Per combination of the non-size axes: the fit and the prediction at `target` (module docstring).
    `recs` (tables.frontier_records) is computed when not given.

    The frame's attrs hold `axis` and `points`: {combination: [(size, max_stable, min_diverging, lr*)]}.
    """
    axis = ladder_axis(runs)
    if axis is None:
        return pd.DataFrame(columns=COLUMNS)
    recs = frontier_records(runs) if recs is None else recs
    others = [a for a in recs.attrs["axes"] if a != axis]
    label = combination_labels(recs, others)
    per_seed = seed_points(runs, axis, others)
    per_seed_best = seed_points(runs, axis, others, best_point)
    run_labels = (  # each run's combination_labels, from its param: columns
        runs[[PARAM + a for a in others]].astype(str).agg("/".join, axis=1)
        if others
        else pd.Series("all", index=runs.index)
    )
    out, points, best_points, barely = [], {}, {}, {}
    for combo, group in recs.groupby(label, sort=False):
        pts, bests, left_out = [], [], 0
        for rec in group.sort_values(axis, key=lambda s: s.map(sort_key)).to_dict("records"):
            pts.append(bracket_point(float(rec[axis]), rec["max_stable_lr"], rec["min_diverging_lr"]))
            bests.append(best_point(float(rec[axis]), rec))
            left_out += pd.isna(pts[-1][3])
            if _barely(rec, runs, (run_labels == combo) & (runs[PARAM + axis] == rec[axis]), recs.attrs["quality"]):
                barely.setdefault(combo, []).append(float(rec[axis]))
        points[combo], best_points[combo] = pts, bests
        fit = fit_line(_replicated(per_seed.get(combo, []), pts), target, confidence)
        inside = {p[0] for p in bests if not pd.isna(p[3])}  # a size whose best (over its seeds) may lie off the
        seeds_best = [p for p in per_seed_best.get(combo, []) if p[0] in inside]  # grid gives no seed point either
        best = fit_line(_replicated(seeds_best, bests), target, confidence)
        out.append(
            {
                "combination": combo,
                **fit,
                "sizes": sum(not pd.isna(p[3]) for p in pts),
                "left_out": left_out,
                **{BEST_COLUMNS[k]: best[k] for k in BEST_COLUMNS},
            }
        )
    table = pd.DataFrame(out).set_index("combination")[COLUMNS] if out else pd.DataFrame(columns=COLUMNS)
    table.index.name = "/".join(others) or "combination"
    table.attrs.update(axis=axis, points=points, seed_points=per_seed, confidence=confidence)
    table.attrs.update(best_points=best_points, best_seed_points=per_seed_best, barely=barely)
    return table


def _barely(rec: dict, runs: pd.DataFrame, mask, quality: str) -> bool:
    """Whether a size's best lr barely trained (sweep/report/learned.py): its bracket is then where runs stopped
    blowing up, not where they train."""
    best = rec["spreads"].get(rec.get("best_lr")) if rec.get("best_lr") is not None else None
    return quality == EVAL and best is not None and best.n > 0 and barely(best.mean, initial_of(runs, mask))


def _replicated(seeds: list[tuple], merged: list[tuple]) -> list[tuple]:
    """The points a fit takes: one per (size, seed) where the sweep has replicates, else one per size."""
    return seeds if len(seeds) > len({s for s, *_ in seeds}) else merged


def combination_labels(frame: pd.DataFrame, others: list[str]) -> pd.Series:
    """Each row's values of the non-size axes `others`, as "v1/v2" ("all" without any): the fit's row names."""
    return frame[others].astype(str).agg("/".join, axis=1) if others else pd.Series("all", index=frame.index)


def bracket_point(size: float, lo, hi) -> tuple:
    """(size, max stable lr, min diverging lr, lr*): lr* the bracket's geometric middle, NaN without a bracket."""
    if lo is None or hi is None or pd.isna(lo) or pd.isna(hi) or not 0 < lo < hi:
        return (size, lo, hi, np.nan)
    return (size, float(lo), float(hi), math.sqrt(lo * hi))


def best_point(size: float, rec: dict) -> tuple:
    """(size, lo, hi, best lr) of a frontier record: its lr of the lowest mean eval loss, known to within the grid
    around it: [lo, hi) spans half a grid step (in log) on each side, the geometric middles with its neighbours in
    the record's `grid` (at either end, the other side's step). NaN where it says nothing of the best lr: no stable
    lr, an lr grid of one, or the best at the smallest lr run or at the largest with no larger one run that
    diverged (the best may lie beyond the grid)."""
    best, grid = rec.get("best_lr"), sorted(x for x in (rec.get("grid") or []) if x > 0)
    if best is None or pd.isna(best) or best not in grid or len(grid) < 2:
        return (size, None, None, np.nan)
    i = grid.index(best)
    if i == 0 or (i == len(grid) - 1 and rec.get("min_diverging_lr") is None):
        return (size, None, None, np.nan)
    below = grid[i] / grid[i - 1]
    above = grid[i + 1] / grid[i] if i + 1 < len(grid) else below
    return (size, best / math.sqrt(below), best * math.sqrt(above), float(best))


def seed_points(runs: pd.DataFrame, axis: str, others: list[str], point=None) -> dict[str, list[tuple]]:
    """Per combination of `others`: one point per (size, seed), each seed's frontier from its runs alone; `point`
    (size, record) -> point: None for the stability bracket (`bracket_point`), `best_point` for the best lr."""
    out: dict[str, list[tuple]] = {}
    for _, alone in runs.groupby(seed_labels(runs), sort=True):
        recs = frontier_records(alone)
        if recs.empty or any(a not in recs for a in (axis, *others)):  # a seed that did not sweep the axes
            continue
        for combo, rec in zip(combination_labels(recs, others), recs.to_dict("records")):
            size = float(rec[axis])
            out.setdefault(combo, []).append(
                point(size, rec) if point else bracket_point(size, rec["max_stable_lr"], rec["min_diverging_lr"])
            )
    return out


def fit_line(points: list[tuple], target: float | None, confidence: float) -> dict:
    """The log-log least-squares fit of lr* against size over the points that have one, and the
    prediction at `target` with its interval (NaN where there are too few points)."""
    from scipy import stats

    fitted = [(s, lo, hi, lr) for s, lo, hi, lr in points if not pd.isna(lr)]
    n = len(fitted)
    row = {"sizes": len({s for s, *_ in fitted}), "points": n, "exponent": np.nan, "r2": np.nan}
    row.update(target=target, predicted_lr=np.nan)
    row.update(low=np.nan, high=np.nan, curvature=np.nan, curvature_p=np.nan, curved=None, reach=np.nan)
    if fitted and target is not None:
        row["reach"] = float(target) / max(s for s, *_ in fitted)
    if n < 2 or len({s for s, *_ in fitted}) < 2:
        return row
    x = np.log([s for s, *_ in fitted])
    y = np.log([lr for *_, lr in fitted])
    b, a = np.polyfit(x, y, 1)
    resid = y - (a + b * x)
    sxx = float(((x - x.mean()) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    row.update(exponent=float(b), r2=1 - float((resid**2).sum()) / ss_tot if ss_tot > 0 else np.nan)
    row.update(curvature_test(fitted))
    if target is None:
        return row
    x0 = math.log(target)
    row["predicted_lr"] = _exp(a + b * x0)
    if n < 3:
        return row
    bracket_var = float(np.mean([math.log(hi / lo) ** 2 / 12 for _, lo, hi, _ in fitted]))
    var = float((resid**2).sum()) / (n - 2) + bracket_var
    se = math.sqrt(var * (1 + 1 / n + (x0 - x.mean()) ** 2 / sxx))
    t = float(stats.t.ppf(0.5 + confidence / 2, n - 2))
    row.update(low=_exp(a + b * x0 - t * se), high=_exp(a + b * x0 + t * se))
    return row


def _exp(v: float) -> float:
    """e**v, inf past float's range (math.exp raises there: a steep fit far from its sizes)."""
    return math.exp(v) if v < 709.0 else math.inf


def curvature_test(fitted: list[tuple]) -> dict:
    """{curvature: c, curvature_p: two-sided p of c = 0, curved: p < CURVATURE_ALPHA} of the fit
    log lr* = a + b x + c x^2, x = log size (module docstring); NaN and None with fewer than 4 points or 3 sizes."""
    from scipy import stats

    out = {"curvature": np.nan, "curvature_p": np.nan, "curved": None}
    n = len(fitted)
    if n < 4 or len({s for s, *_ in fitted}) < 3:
        return out
    x = np.log([s for s, *_ in fitted])
    y = np.log([lr for *_, lr in fitted])
    xc = x - x.mean()  # centred: the same c, a better-conditioned X'X
    design = np.column_stack([np.ones(n), xc, xc**2])
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    bracket_var = float(np.mean([math.log(hi / lo) ** 2 / 12 for _, lo, hi, _ in fitted]))
    var = float((resid**2).sum()) / (n - 3) + bracket_var
    se = math.sqrt(var * float(np.linalg.inv(design.T @ design)[2, 2]))
    c = float(coef[2])
    p = float(2 * stats.t.sf(abs(c) / se, n - 3)) if se > 0 else (0.0 if c else 1.0)
    out.update(curvature=c, curvature_p=p, curved=bool(p < CURVATURE_ALPHA))
    return out


def ladder_lines(table: pd.DataFrame) -> list[str]:
    """One sentence per combination, for the terminal and summary.md."""
    if table.empty:
        return []
    axis = table.attrs["axis"].split(".")[-1]
    conf = table.attrs["confidence"]
    lines = []
    for combo, r in table.iterrows():
        if pd.isna(r.exponent):
            lines.append(
                f"{combo}: {int(r.sizes)} sizes with a bracket ({int(r.left_out)} left out): too few to fit"
                + _best_text(r, axis, conf)
            )
            continue
        runs = f", {int(r.points)} seed brackets" if "points" in r and r.points > r.sizes else ""
        line = f"{combo}: max stable lr ∝ {axis}^{r.exponent:.2f} over {int(r.sizes)} sizes{runs} (R² {r.r2:.2f})"
        if not pd.isna(r.predicted_lr):
            line += f"; at {axis} {r.target:g}: {r.predicted_lr:.3g}"
            line += (
                f" ({conf:.0%} interval {r.low:.3g}..{r.high:.3g})"
                if not pd.isna(r.low)
                else " (no interval: it needs 3 sizes)"
            )
        if r.curved is not None and not pd.isna(r.curved):
            verdict = "curved: do not trust the line far out" if r.curved else "no significant curvature"
            line += f"; {verdict} (c {r.curvature:+.3g}, p {r.curvature_p:.2g})"
        if not pd.isna(r.reach) and r.reach > TARGET_REACH:
            line += (
                f"; warning: {axis} {r.target:g} is {r.reach:.1f}x the largest measured {axis} "
                f"(more than {TARGET_REACH:g}x: an extrapolation no run here has checked)"
            )
        if r.left_out:
            line += f"; {int(r.left_out)} size(s) without a bracket left out"
        if sizes := table.attrs.get("barely", {}).get(combo):
            line += (
                f"; barely trained at {axis} {', '.join(f'{x:g}' for x in sizes)} (even the best lr's eval loss at"
                f" least {LEARNED:.0%} of the first training loss): there the bracket is where runs stopped blowing"
                " up, not where they train"
            )
        lines.append(line + _best_text(r, axis, conf))
    return lines


def _best_text(r: pd.Series, axis: str, conf: float) -> str:
    """The best eval lr's fit, for the end of a combination's sentence."""
    if "best_exponent" not in r or pd.isna(r.best_exponent):
        return f"; best eval lr: {int(r.get('best_sizes', 0))} size(s) with one inside the lr grid, too few to fit"
    line = f"; best eval lr ∝ {axis}^{r.best_exponent:.2f} over {int(r.best_sizes)} sizes"
    if not pd.isna(r.predicted_best_lr):
        line += f", at {axis} {r.target:g}: {r.predicted_best_lr:.3g}"
        line += f" ({conf:.0%} interval {r.best_low:.3g}..{r.best_high:.3g})" if not pd.isna(r.best_low) else ""
    return line
