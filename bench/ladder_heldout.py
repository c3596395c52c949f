"""A ladder's held-out check: fit on the sizes up to --fit-max, predict --target, and set the prediction against
the bracket the sweep measured there (docs/ladder.md, issue #30).

    python -m sweep -m +ladder=width model.param=mup replicates=2 model.width=32,64,128,256,512 ... \
        hydra.sweep.dir=/tmp/heldout2/mup
    python bench/ladder_heldout.py /tmp/heldout2/mup --fit-max 256 --target 512

It prints, per combination, the fit the report makes (each seed's bracket a point when there are replicates) and
the fit on one merged bracket per size (stable for every seed), each with its 90% interval and whether that
holds the measured bracket at the target, and the same fit of the best eval lr against the best eval lr measured
there; then the fit on every size, predicting --beyond. A target swept on too
few lrs for a bracket (every one stable, or none) still says whether the interval can hold it.

With --window it prints only the lrs to sweep at --target, comma-separated: the fitted sweep's own grid values
inside the fit's 90% interval there, and one more on each side (bench/ladder_real_width.sh sweeps the held-out
widths on these, not on the whole grid).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sweep.config.validate import ladder_target_problem
from sweep.report.ladder import fit_line, ladder_fit
from sweep.report.runs import PARAM, runs_from_dirs
from sweep.report.tables import LR


def describe(name: str, row: dict, measured: tuple | None) -> str:
    width = row["high"] / row["low"]
    text = (
        f"  {name:<34} exponent {row['exponent']:+.2f}, {row['points']} points: {row['predicted_lr']:.3g} "
        f"(90% interval {row['low']:.3g} .. {row['high']:.3g}: {width:.1f}x wide)"
    )
    if measured is not None:
        text += "; " + measured_text(row["low"], row["high"], *measured)
    return text


def measured_text(low: float, high: float, lo, hi) -> str:
    """The target's measured bracket [largest stable, smallest diverging) against the interval; an open one (no
    lr stable for every seed, or none diverging) decides only when the interval ends on its known side."""
    if lo is None or hi is None:
        if lo is not None:  # stable up to the top of the swept lrs: the true largest stable lr is at least lo
            return f"measured: stable for every seed up to {lo:.3g}, none diverging " + (
                "(NOT inside: above the interval)" if lo > high else "(undecided: sweep higher lrs)"
            )
        if hi is not None:
            return f"measured: no lr stable for every seed, {hi:.3g} the lowest swept " + (
                "(NOT inside: below the interval)" if hi < low else "(undecided: sweep lower lrs)"
            )
        return "measured: no run at the target (not checked)"
    if lo >= hi:
        return f"measured: not monotone (stable for every seed at {lo:.3g}, diverging at {hi:.3g} below it): no bracket"
    holds = low <= lo and hi <= high
    return f"measured [{lo:.3g}, {hi:.3g}) {'inside' if holds else 'NOT inside'}"


def best_text(row: dict, points: list[tuple], target: float) -> str:
    """The best eval lr's fit (the report's best_* columns) against the best eval lr measured at the target, known
    to within half a grid step on each side (sweep.report.ladder.best_point)."""
    if row.get("best_exponent") is None or row["best_exponent"] != row["best_exponent"]:
        return "  best eval lr: too few sizes with one inside the lr grid to fit"
    name = "best eval lr, fitted the same way"
    text = f"  {name:<34} exponent {row['best_exponent']:+.2f}: {row['predicted_best_lr']:.3g}"
    if row["best_low"] == row["best_low"]:
        text += f" (90% interval {row['best_low']:.3g} .. {row['best_high']:.3g})"
    held = [p for p in points if p[0] == target]
    if not held or held[0][3] != held[0][3]:
        return text + "; measured: no best eval lr inside the grid at the target (not checked)"
    best, lo, hi = held[0][3], held[0][1], held[0][2]
    inside = row["best_low"] <= best <= row["best_high"]
    return text + f"; measured {best:.3g} (within [{lo:.3g}, {hi:.3g})) {'inside' if inside else 'NOT inside'}"


def window(grid: list[float], low: float, high: float) -> list[float]:
    """The values of `grid` in [low, high] (or, when none is, the two around it) and one more on each side."""
    inside = [i for i, lr in enumerate(grid) if low <= lr <= high]
    if not inside:
        above = next((i for i, lr in enumerate(grid) if lr > high), len(grid))
        inside = [above - 1, above]
    first, last = max(min(inside) - 1, 0), min(max(inside) + 1, len(grid) - 1)
    return grid[first : last + 1]


def nan_free(value) -> float | None:
    return None if value is None or value != value else float(value)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("--fit-max", type=float, required=True, help="fit on the sizes up to this one")
    ap.add_argument("--target", type=float, required=True, help="the held-out size to predict (swept too)")
    ap.add_argument("--beyond", type=float, default=None, help="with every size fitted, predict this size")
    ap.add_argument("--confidence", type=float, default=0.9)
    ap.add_argument("--window", action="store_true", help="print only the lrs to sweep at --target (see above)")
    args = ap.parse_args(argv)
    for flag, size in (("--fit-max", args.fit_max), ("--target", args.target), ("--beyond", args.beyond)):
        problem = None if size is None else ladder_target_problem(size)  # -1 was a math domain error (a traceback)
        if problem:
            ap.error(f"{flag}: {problem}")
    if not 0 < args.confidence < 1:  # 2 or nan printed an interval "inf .. inf" and "NOT inside"
        ap.error(f"--confidence: must be in (0, 1), got {args.confidence:g}")
    runs = runs_from_dirs(args.sweep_dir)
    if runs.empty:
        print(f"bench/ladder_heldout.py: no runs under {args.sweep_dir}", file=sys.stderr)
        return 2
    full = ladder_fit(runs, target=args.beyond or args.target, confidence=args.confidence)
    if full.empty:
        print("bench/ladder_heldout.py: not a ladder sweep (model.width or model.depth with the lr)", file=sys.stderr)
        return 2
    axis = full.attrs["axis"]
    sizes = runs[PARAM + axis].astype(float)
    fitted_sizes = sizes <= args.fit_max
    if not fitted_sizes.any():  # printed nothing, status 0
        print(
            f"bench/ladder_heldout.py: no {axis} <= --fit-max {args.fit_max:g} to fit (the smallest is "
            f"{sizes.min():g})",
            file=sys.stderr,
        )
        return 2
    fit = ladder_fit(runs[fitted_sizes], target=args.target, confidence=args.confidence)
    if args.window:
        grid = sorted({float(lr) for lr in runs[PARAM + LR].dropna()})
        fitted = fit.dropna(subset=["low", "high"])
        if fitted.empty:  # no size had a bracket: nothing to centre on
            print("bench/ladder_heldout.py: no fit (no size has a bracket): the whole grid", file=sys.stderr)
            chosen = grid
        else:
            chosen = sorted({lr for _, row in fitted.iterrows() for lr in window(grid, row["low"], row["high"])})
        print(",".join(f"{lr:g}" for lr in chosen))
        return 0
    for combo, row in fit.iterrows():
        held = [p for p in full.attrs["points"].get(combo, []) if p[0] == args.target]
        measured = (nan_free(held[0][1]), nan_free(held[0][2])) if held else (None, None)  # (None, None): not run
        print(f"{combo}: fit on {axis} <= {args.fit_max:g}, predict {args.target:g}")
        print(describe("as the report fits it", row.to_dict(), measured))
        merged = fit_line(fit.attrs["points"][combo], args.target, args.confidence)
        print(describe("one merged bracket per size", merged, measured))
        print(best_text(row.to_dict(), full.attrs["best_points"].get(combo, []), args.target))
        if args.beyond:
            print(f"  every size fitted, predict {args.beyond:g}:")
            print(describe("as the report fits it", full.loc[combo].to_dict(), None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
