"""The summary as terminal text (100 columns) and Markdown, and the summary files of a sweep directory.

Files written next to the runs (`write_summary`):
- summary.md              every table and the recommendation
- summary.csv / .parquet  the runs table, one row per run (what every table is computed from)
- summary_<table>.csv     each table on its own; the divergence map in long form, one row per cell
"""

from __future__ import annotations

import logging
import re
import textwrap
from pathlib import Path

import pandas as pd

from sweep.report.ladder import ladder_lines
from sweep.report.noise import quality_column, quality_name
from sweep.report.summary import Summary

log = logging.getLogger("sweep")

WIDTH = 100
TITLES = {
    "divergence_map": "Divergence map",
    "frontier": "Stability frontier",
    "lr_sensitivity": "LR sensitivity",
    "toggles": "Effect of each toggle",
    "root_causes": "Root causes",
    "ladder": "Frontier across sizes",
    "diagnoses": "Diagnoses",
}


def explanations(s: Summary) -> dict[str, str]:
    """One sentence under each table's title, saying how to read it."""
    q = quality_name(quality_column(s.runs))
    return {
        "divergence_map": f"columns: {s.map_columns}; rows: {s.divergence_map.index.name or '-'}; cell: stable, "
        "verdict@first_bad_step, or k/n div (diverged of the decided seeds); "
        "* = more runs still running, - = no run",
        "frontier": "per combination: the largest lr stable in every replicate and the smallest lr that "
        f"diverged; at the former the {q}: mean, spread (sd over replicates, - with one) and replicates; "
        f"best_lr, the stable lr of the lowest mean {q}; mean steps/s of its stable runs",
        "lr_sensitivity": f"Wortsman et al. 2023: mean over the lr grid of min({q}, initial loss) - best_loss, "
        "diverged runs at the initial loss; lower is more robust, 0 = every lr reached the best loss, - = no "
        "stable run; spread: sd of the same number per seed; vs_best: tie = within noise (2 standard errors)",
        "toggles": "runs equal in everything else but this axis (a vs b): pairs, diverged with a and with b; "
        "combos: matched combinations; lr_steps: change of the largest stable lr from a to b, in "
        f"lr-grid steps; eval_change: mean relative change of the {q} from a to b over pairs stable on both "
        "sides, eval_noise: 2 standard errors of it; quality: tie when within noise (or under 0.1%)",
        "root_causes": "diverged runs: verdict and mechanism (why: sweep/diagnose) x where it first went wrong",
        "ladder": "per combination of the other axes: log(largest stable lr) fitted against log(size) over the "
        "sizes whose lr bracket is closed (lr* = sqrt(max stable x min diverging)); exponent = slope; the "
        "prediction at the target size with its interval (Student t, residual + bracket variance; 3+ sizes); "
        "an extrapolation, not a measurement (docs/ladder.md)",
        "diagnoses": "diverged runs diagnosed (python -m sweep.diagnose RUN_DIR; diagnosis.json): mechanism; "
        "table_agrees: whether the counterfactual runs (same config, fp32, reference kernels, without extreme "
        "samples, lr/10, update clipping) bear it out; the fix, and whether a run from step 0 with it was stable",
    }


def tables(s: Summary) -> dict[str, pd.DataFrame]:
    return {
        "divergence_map": s.divergence_map,
        "frontier": s.frontier,
        "lr_sensitivity": s.lr_sensitivity,
        "toggles": s.toggles,
        "root_causes": s.root_causes,
        "ladder": s.ladder,
        "diagnoses": s.diagnoses,
    }


def render_text(s: Summary, width: int = WIDTH) -> str:
    """The text printed at the end of a multirun and by `python -m sweep.report`."""
    parts = [s.counts_line()]
    notes = explanations(s)
    for key, table in tables(s).items():
        if table.empty:
            continue
        head = textwrap.fill(f"{TITLES[key]} ({notes[key]})", width, subsequent_indent="  ")
        parts += ["", head, table_text(table, index=key != "toggles", width=width)]
        if key == "ladder":
            parts += [textwrap.fill(line, width, subsequent_indent="  ") for line in ladder_lines(table)]
    parts += ["", "Recommendation", textwrap.fill(s.recommendation.line, width, subsequent_indent="  ")]
    if s.confirmed_fixes():
        parts.append(textwrap.fill(s.confirmed_fixes(), width, subsequent_indent="  "))
    return "\n".join(parts)


def table_text(table: pd.DataFrame, index: bool = True, width: int = WIDTH) -> str:
    return table.to_string(index=index, line_width=width, float_format=_num, na_rep="-")


def render_markdown(s: Summary, title: str = "Sweep summary") -> str:
    notes = explanations(s)
    md = [f"# {md_escape(title)}", "", md_escape(s.counts_line()) + "."]  # statuses come from result.json files
    for key, table in tables(s).items():
        if not table.empty:
            md += [
                "",
                f"## {TITLES[key]}",
                "",
                md_escape(notes[key]) + ".",
                "",
                to_markdown(table, index=key != "toggles"),
            ]
            if key == "ladder":
                md += ["", *(f"- {md_escape(line)}" for line in ladder_lines(table))]
    md += ["", "## Recommendation", "", md_escape(s.recommendation.line)]
    if s.confirmed_fixes():
        md += ["", md_escape(s.confirmed_fixes())]
    return "\n".join(md) + "\n"


def to_markdown(table: pd.DataFrame, index: bool = True) -> str:
    """A GitHub-style Markdown table; MultiIndex columns joined with '/'."""
    names = ["/".join(map(str, c)) if isinstance(c, tuple) else str(c) for c in table.columns]
    head = ([str(table.index.name or "")] if index else []) + names
    lines = ["| " + " | ".join(md_escape(h) for h in head) + " |", "|" + "---|" * len(head)]
    for idx, row in table.iterrows():
        cells = ([_fmt(idx)] if index else []) + [_fmt(v) for v in row]
        lines.append("| " + " | ".join(md_escape(c) for c in cells) + " |")
    return "\n".join(lines)


def md_escape(text: str) -> str:
    """Config strings in Markdown: no table breaks, no HTML, no emphasis (bf16_amp stays readable:
    an underscore inside a word emphasizes nothing)."""
    for ch in "\\|*`<>[]":
        text = text.replace(ch, "\\" + ch)
    return re.sub(r"(?<!\w)_|_(?!\w)", r"\\_", text).replace("\n", " ")


def write_summary(sweep_dir: Path, s: Summary) -> list[Path]:
    """summary.md, summary.csv, summary.parquet (when pyarrow is there) and summary_<table>.csv."""
    sweep_dir = Path(sweep_dir)
    written = [sweep_dir / "summary.md", sweep_dir / "summary.csv"]
    written[0].write_text(render_markdown(s, f"Sweep summary: {sweep_dir.name}"))
    s.runs.to_csv(written[1], index=False)
    try:
        parquet_safe(s.runs).to_parquet(sweep_dir / "summary.parquet", index=False)
        written.append(sweep_dir / "summary.parquet")
    except ImportError:
        log.info("summary.parquet not written: pip install pyarrow")
    long_forms = {
        "divergence_map": s.cells.drop(columns=["row_key"], errors="ignore"),
        "frontier": s.frontier,
        "lr_sensitivity": s.lr_sensitivity,
        "toggles": s.toggles,
        "root_causes": s.root_causes,
        "ladder": s.ladder,
        "diagnoses": s.diagnoses,
    }
    for key, table in long_forms.items():
        if not table.empty:
            path = sweep_dir / f"summary_{key}.csv"
            table.to_csv(path, index=key not in ("divergence_map", "toggles"))
            written.append(path)
    return written


def parquet_safe(runs: pd.DataFrame) -> pd.DataFrame:
    """Object columns holding several Python types (1e-3 and "auto") become text: Parquet wants one type."""
    out = runs.copy()
    for c in out.columns:
        if out[c].dtype == object:
            types = {type(v) for v in out[c] if v is not None}
            if len(types) > 1 or (types and not types <= {str, bool, int, float}):
                out[c] = out[c].map(lambda v: None if v is None else str(v))
    return out


def _num(x: float) -> str:
    return f"{x:.4g}"


def _fmt(v) -> str:
    if v is None or (not isinstance(v, (list, tuple, dict)) and pd.isna(v)):
        return "-"
    if isinstance(v, float):
        return _num(v)
    return str(v)
