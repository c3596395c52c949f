"""The summary as terminal text (100 columns) and Markdown, and the summary files of a sweep directory.

Files written next to the runs (`write_summary`):
- summary.md              every table and the recommendation
- summary.csv / .parquet  the runs table, one row per run (what every table is computed from)
- summary_<table>.csv     each table on its own; the divergence map in long form, one row per cell

Which tables, their titles and their notes come from the registry (sweep/report/registry.py).
"""

from __future__ import annotations

import logging
import re
import textwrap
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from sweep.report.registry import TABLES, Summary, shown

log = logging.getLogger("sweep")

WIDTH = 100


def render_text(s: Summary, width: int = WIDTH, only: Iterable[str] | None = None) -> str:
    """The text printed at the end of a multirun and by `python -m sweep.report`: the run counts, every
    registered table (sweep/report/registry.py) that is not empty, the recommendation. `only`: the counts
    and these tables alone (`--table`)."""
    parts = [s.counts_line()]
    for spec, table in shown(s, only):
        head = textwrap.fill(f"{spec.title} ({spec.explain(s)})", width, subsequent_indent="  ")
        body = spec.text(table, width) if spec.text else table_text(table, index=spec.index, width=width)
        parts += ["", head, body]
        if spec.lines:
            parts += [textwrap.fill(line, width, subsequent_indent="  ") for line in spec.lines(table)]
    if only is not None:
        return "\n".join(parts)
    parts += ["", "Recommendation", textwrap.fill(s.recommendation.line, width, subsequent_indent="  ")]
    if s.confirmed_fixes():
        parts.append(textwrap.fill(s.confirmed_fixes(), width, subsequent_indent="  "))
    return "\n".join(parts)


def table_text(table: pd.DataFrame, index: bool = True, width: int = WIDTH) -> str:
    return table.to_string(index=index, line_width=width, float_format=_num, na_rep="-")


def render_markdown(s: Summary, title: str = "Sweep summary") -> str:
    md = [f"# {md_escape(title)}", "", md_escape(s.counts_line()) + "."]  # statuses come from result.json files
    for spec, table in shown(s):
        md += [
            "",
            f"## {md_escape(spec.title)}",
            "",
            md_escape(spec.explain(s)) + ".",
            "",
            to_markdown(table, index=spec.index),
        ]
        if spec.lines:
            md += ["", *(f"- {md_escape(line)}" for line in spec.lines(table))]
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
    """summary.md, summary.csv, summary.parquet (when pyarrow is there) and summary_<table>.csv of each table with
    rows (an empty table's file from an earlier write is removed)."""
    sweep_dir = Path(sweep_dir)
    written = [sweep_dir / "summary.md", sweep_dir / "summary.csv"]
    written[0].write_text(render_markdown(s, f"Sweep summary: {sweep_dir.name}"))
    s.runs.to_csv(written[1], index=False)
    try:
        parquet_safe(s.runs).to_parquet(sweep_dir / "summary.parquet", index=False)
        written.append(sweep_dir / "summary.parquet")
    except ImportError:
        log.info("summary.parquet not written: pip install pyarrow")
    for name, spec in TABLES.items():
        table = spec.long_form(s) if spec.long_form else s.tables[name]
        path = sweep_dir / f"summary_{name}.csv"
        if table.empty:
            path.unlink(missing_ok=True)  # written before, when the table had rows: it would say what no longer holds
        else:
            table.to_csv(path, index=spec.index and spec.long_form is None)
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
