"""All the tables of one sweep, computed once from the runs table, for the terminal, Markdown and HTML.

Which tables, and the `Summary` that holds them: registry.py.
"""

from __future__ import annotations

import pandas as pd

from sweep.report.confirmation import Confirmation
from sweep.report.recommend import recommend
from sweep.report.registry import TABLES, Summary, TableInputs
from sweep.report.tables import map_legend, swept_axes


def summarize(
    runs: pd.DataFrame,
    ladder_target: float | None = None,
    confidence: float = 0.9,
    confirmation: Confirmation | None = None,
) -> Summary:
    """Every table of the summary (the runs table must not be empty). A superseded run (killed, its cell
    redone) is counted, but the tables are computed without it. `ladder_target`: the size the ladder
    table extrapolates the largest stable lr to (`ladder.target`). `confirmation`: the sweep's confirmation at a
    longer horizon (sweep/report/confirmation.py), which the frontier and the recommendation respect."""
    all_runs = runs
    if "superseded_by" in runs:
        runs = runs[runs.superseded_by.isna()].reset_index(drop=True)
    inputs = TableInputs(runs, ladder_target, confidence, confirmation)
    tables = {name: spec.build(inputs) for name, spec in TABLES.items()}
    return Summary(
        runs=all_runs,
        axes=swept_axes(runs),
        cells=inputs.cells,
        map_columns=map_legend(inputs.cells),
        tables=tables,
        recommendation=recommend(runs, inputs.records, tables["toggles"], confirmation),
    )
