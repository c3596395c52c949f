"""All the tables of one sweep, computed once from the runs table, for the terminal, Markdown and HTML.

Which tables, and the `Summary` that holds them: registry.py.
"""

from __future__ import annotations

import pandas as pd

from sweep.report.confirmation import Confirmation
from sweep.report.recommend import recommend
from sweep.report.registry import TABLES, Summary, TableInputs
from sweep.report.tables import map_legend, marginal_runs, swept_axes


def summarize(
    runs: pd.DataFrame,
    ladder_target: float | None = None,
    confidence: float = 0.9,
    target: str | None = None,
    confirmation: Confirmation | None = None,
) -> Summary:
    """Every table of the summary (the runs table must not be empty). A superseded run (killed, its cell
    redone) is counted, but the tables are computed without it. `ladder_target`: the size the ladder
    table extrapolates the largest stable lr to (`ladder.target`). `target`: the device kind the
    recommendation is for (cpu, cuda; None: sweep/report/target.py's default). `confirmation`: the sweep's
    confirmation at a longer horizon (sweep/report/confirmation.py), which the frontier and the recommendation
    respect.

    The runs table gains a `marginal` column (sweep/report/marginal.py; False for a superseded run)."""
    live = runs.superseded_by.isna() if "superseded_by" in runs else pd.Series(True, index=runs.index)
    all_runs = runs.assign(marginal=False)
    all_runs.loc[live, "marginal"] = marginal_runs(runs[live])
    runs = all_runs[live].reset_index(drop=True)
    inputs = TableInputs(runs, ladder_target, confidence, confirmation)
    tables = {name: spec.build(inputs) for name, spec in TABLES.items()}
    return Summary(
        runs=all_runs,
        axes=swept_axes(runs),
        cells=inputs.cells,
        map_columns=map_legend(inputs.cells),
        tables=tables,
        recommendation=recommend(runs, inputs.records, tables["toggles"], target, confirmation, tables.get("ladder")),
    )
