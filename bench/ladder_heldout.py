"""A ladder's held-out check: fit on the sizes up to --fit-max, predict --target, and set the prediction against
the bracket the sweep measured there (docs/ladder.md, issue #30).

    python -m sweep -m +ladder=width model.param=mup replicates=2 model.width=32,64,128,256,512 ... \
        hydra.sweep.dir=/tmp/heldout2/mup
    python bench/ladder_heldout.py /tmp/heldout2/mup --fit-max 256 --target 512

It prints, per combination, the fit the report makes (each seed's bracket a point when there are replicates) and
the fit on one merged bracket per size (stable for every seed), each with its 90% interval and whether that
holds the measured bracket at the target; then the fit on every size, predicting --beyond.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sweep.report.ladder import fit_line, ladder_fit
from sweep.report.runs import PARAM, runs_from_dirs


def describe(name: str, row: dict, measured: tuple | None) -> str:
    width = row["high"] / row["low"]
    text = (
        f"  {name:<34} exponent {row['exponent']:+.2f}, {row['points']} points: {row['predicted_lr']:.3g} "
        f"(90% interval {row['low']:.3g} .. {row['high']:.3g}: {width:.1f}x wide)"
    )
    if measured is not None:
        lo, hi = measured
        holds = row["low"] <= lo and hi <= row["high"]
        text += f"; measured [{lo:.3g}, {hi:.3g}) {'inside' if holds else 'NOT inside'}"
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("--fit-max", type=float, required=True, help="fit on the sizes up to this one")
    ap.add_argument("--target", type=float, required=True, help="the held-out size to predict (swept too)")
    ap.add_argument("--beyond", type=float, default=None, help="with every size fitted, predict this size")
    ap.add_argument("--confidence", type=float, default=0.9)
    args = ap.parse_args()
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
    fit = ladder_fit(runs[sizes <= args.fit_max], target=args.target, confidence=args.confidence)
    for combo, row in fit.iterrows():
        held = [p for p in full.attrs["points"][combo] if p[0] == args.target]
        measured = (held[0][1], held[0][2]) if held and held[0][3] == held[0][3] else None
        print(f"{combo}: fit on {axis} <= {args.fit_max:g}, predict {args.target:g}")
        print(describe("as the report fits it", row.to_dict(), measured))
        merged = fit_line(fit.attrs["points"][combo], args.target, args.confidence)
        print(describe("one merged bracket per size", merged, measured))
        if args.beyond:
            print(f"  every size fitted, predict {args.beyond:g}:")
            print(describe("as the report fits it", full.loc[combo].to_dict(), None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
