"""Summary tables of a sweep, read back from its run directories.

    python -m sweep.summary outputs/sweeps/2026-11-22/10-00-00

The divergence map answers "which combinations diverge, and when": rows are learning rates, columns
every combination of the other axes that vary, and a cell is `stable` or the short name of the
divergence kind with its first bad step (`nan-loss@12`); with several seeds per cell, the fraction
that diverged. The frontier gives, per combination, the largest stable lr and the smallest diverging one.
Axes are discovered from the runs' params, never hard-coded.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from .results import RESULT_FILE

SHORT = {"nonfinite_loss": "nan-loss", "nonfinite_grad": "nan-grad", "loss_spike": "spike",
         "scale_collapse": "scale-min", "stalled": "stalled", "bad_input": "bad-input",
         "corrupt_checkpoint": "bad-ckpt"}
LR = "optim.lr"


def load_runs(sweep_dir: Path) -> pd.DataFrame:
    """One row per run directory holding a result.json: its outcome plus its params as columns."""
    rows = []
    for path in sorted(Path(sweep_dir).rglob(RESULT_FILE)):
        r = json.loads(path.read_text())
        row = {k: v for k, v in r.items() if k not in ("params", "versions", "cause", "kernels")}
        row["cause_where"] = (r.get("cause") or {}).get("where")
        row["run_dir"] = str(path.parent)
        row.update({f"param:{k}": v for k, v in (r.get("params") or {}).items()})
        rows.append(row)
    return pd.DataFrame(rows)


def swept_axes(runs: pd.DataFrame) -> list[str]:
    """Params that take more than one value in this sweep (seed counts as replicates, not an axis)."""
    cols = [c for c in runs.columns if c.startswith("param:")]
    return [c[6:] for c in cols if c[6:] != "seed" and runs[c].astype(str).nunique() > 1]


def cell_label(group: pd.DataFrame) -> str:
    """stable / kind@step for one run; `k/n div` for replicates (several seeds)."""
    if len(group) > 1:
        decided = group[group.status.isin(["stable", "diverged"])]
        n_div = int((decided.status == "diverged").sum())
        return f"{n_div}/{len(decided)} div" if len(decided) else group.status.iloc[0]
    r = group.iloc[0]
    if r.status == "diverged":
        return f"{SHORT.get(r.verdict, r.verdict)}@{int(r.first_bad_step)}"
    return {"error": "ERROR"}.get(r.status, r.status)


def _combo_key(runs: pd.DataFrame, axes: list[str]) -> pd.Series:
    """Each run's combination of `axes` values, as "v1/v2/..."."""
    if not axes:
        return pd.Series(["all"] * len(runs), index=runs.index)
    return runs[[f"param:{a}" for a in axes]].astype(str).agg("/".join, axis=1)


def divergence_map(runs: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Rows lr (sorted), columns the combinations of the other swept axes; returns (table, column legend).

    With two or more column axes the columns are a MultiIndex (one header line per axis), which
    keeps a precision x attention map inside 100 terminal columns.
    """
    axes = swept_axes(runs)
    row_axis = LR if LR in axes else (axes[0] if axes else None)
    col_axes = [a for a in axes if a != row_axis]
    cols = [f"param:{a}" for a in col_axes] or ["_all"]
    df = runs.assign(_all="all", _row=runs[f"param:{row_axis}"] if row_axis else "run")
    df[cols] = df[cols].astype(str)
    table = df.groupby(["_row", *cols], sort=True).apply(cell_label, include_groups=False).unstack(cols)
    table = table.reindex(sorted(table.index, key=_sort_key))
    table.index.name = row_axis or ""
    table.columns.names = col_axes or [None]
    return table.fillna("-"), "/".join(col_axes) or "(no other swept axis)"


def frontier(runs: pd.DataFrame) -> pd.DataFrame:
    """Per combination of the non-lr axes: largest stable lr, smallest diverging lr, loss at the former."""
    axes = [a for a in swept_axes(runs) if a != LR]
    if f"param:{LR}" not in runs.columns:
        return pd.DataFrame()
    df = runs.assign(_col=_combo_key(runs, axes), _lr=runs[f"param:{LR}"].astype(float))
    out = []
    for combo, g in df.groupby("_col", sort=True):
        # a lr counts as stable only if every replicate at it was stable
        by_lr = g.groupby("_lr").status.agg(lambda s: "stable" if (s == "stable").all()
                                            else ("diverged" if (s == "diverged").any() else s.iloc[0]))
        stable = by_lr[by_lr == "stable"].index
        diverged = by_lr[by_lr == "diverged"].index
        best = max(stable) if len(stable) else None
        loss = g[(g._lr == best) & (g.status == "stable")].final_loss.mean() if best is not None else None
        out.append({"combination": combo, "max_stable_lr": best,
                    "min_diverging_lr": min(diverged) if len(diverged) else None,
                    "final_loss_at_max_stable": loss, "runs": len(g)})
    table = pd.DataFrame(out).set_index("combination")
    table.index.name = "/".join(axes) or "combination"
    return table


def _sort_key(v):
    try:
        return (0, float(v))
    except (TypeError, ValueError):
        return (1, str(v))


def to_markdown(table: pd.DataFrame) -> str:
    """A GitHub-style Markdown table (no extra dependency)."""
    head = [str(table.index.name or "")] + ["/".join(map(str, c)) if isinstance(c, tuple) else str(c)
                                            for c in table.columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for idx, row in table.iterrows():
        lines.append("| " + " | ".join([_fmt(idx)] + [_fmt(v) for v in row]) + " |")
    return "\n".join(lines)


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and pd.isna(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def render(runs: pd.DataFrame) -> str:
    """The text printed at the end of a multirun."""
    if runs.empty:
        return "no runs with a result.json found"
    dmap, legend = divergence_map(runs)
    counts = runs.status.value_counts().to_dict()
    parts = [f"{len(runs)} runs: " + ", ".join(f"{counts[k]} {k}" for k in
                                              ("stable", "diverged", "skipped", "error") if k in counts),
             "", f"Divergence map (columns: {legend}; cell: stable or verdict@first_bad_step)",
             dmap.to_string()]
    front = frontier(runs)
    if not front.empty:
        parts += ["", "Stability frontier", front.to_string(float_format=lambda x: f"{x:.4g}", na_rep="-")]
    return "\n".join(parts)


def write_summary(sweep_dir: Path, runs: pd.DataFrame) -> list[Path]:
    """summary.md (the tables) and summary.csv (one row per run) in the sweep directory."""
    sweep_dir = Path(sweep_dir)
    dmap, legend = divergence_map(runs)
    md = [f"# Sweep summary\n\n{len(runs)} runs.\n\n## Divergence map\n\nColumns: {legend}.\n", to_markdown(dmap)]
    front = frontier(runs)
    if not front.empty:
        md += ["\n## Stability frontier\n", to_markdown(front)]
    (sweep_dir / "summary.md").write_text("\n".join(md) + "\n")
    runs.to_csv(sweep_dir / "summary.csv", index=False)
    return [sweep_dir / "summary.md", sweep_dir / "summary.csv"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sweep.summary",
                                     description="Print the summary tables of a sweep directory.")
    parser.add_argument("sweep_dir", type=Path, help="a multirun directory (holds <n>/result.json)")
    parser.add_argument("--write", action="store_true", help="also write summary.md and summary.csv there")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"sweep.summary: no such directory: {args.sweep_dir}", file=sys.stderr)
        return 2
    runs = load_runs(args.sweep_dir)
    if runs.empty:
        print(f"sweep.summary: no result.json under {args.sweep_dir}", file=sys.stderr)
        return 2
    print(render(runs))
    if args.write:
        write_summary(args.sweep_dir, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
