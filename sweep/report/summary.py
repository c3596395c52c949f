"""All the tables of one sweep, computed once from the runs table, for the terminal, Markdown and HTML."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from sweep.report.ladder import ladder_fit
from sweep.report.recommend import Recommendation, recommend
from sweep.report.tables import (
    diagnoses,
    divergence_cells,
    divergence_map,
    frontier,
    frontier_records,
    lr_sensitivity,
    root_causes,
    swept_axes,
    toggle_effects,
)

STATUSES = ("stable", "diverged", "skipped", "error", "running", "interrupted")


@dataclass
class Summary:
    runs: pd.DataFrame
    axes: list[str]
    cells: pd.DataFrame
    divergence_map: pd.DataFrame
    map_columns: str
    """The axes of the divergence map's columns, "precision/attention"."""
    frontier: pd.DataFrame
    lr_sensitivity: pd.DataFrame
    toggles: pd.DataFrame
    root_causes: pd.DataFrame
    recommendation: Recommendation
    ladder: pd.DataFrame = field(default_factory=pd.DataFrame)
    """The frontier across sizes (sweep/report/ladder.py); empty unless model.width or model.depth is swept."""
    diagnoses: pd.DataFrame = field(default_factory=pd.DataFrame)
    """Diverged runs' diagnosis.json (sweep/diagnose): mechanism, agreement, fix and whether it was confirmed."""

    def confirmed_fixes(self) -> str:
        """A sentence citing the fixes that real runs confirmed, one per mechanism and fix ('' when none)."""
        if self.diagnoses.empty:
            return ""
        ok = self.diagnoses[self.diagnoses.fix_confirmed == "yes"]
        if ok.empty:
            return ""
        said = [
            f"{fix} for {mechanism} ({len(g)} failure{'s' if len(g) > 1 else ''}, "
            f"e.g. {g.index[0]}: {g.outcome.iloc[0]})"
            for (mechanism, fix), g in ok.groupby(["mechanism", "fix"], sort=False)
        ]
        return "Confirmed fixes (runs from step 0 that stayed stable): " + "; ".join(said) + "."

    def counts_line(self) -> str:
        counts = self.runs.status.value_counts()
        known = [f"{counts[k]} {k}" for k in STATUSES if k in counts]
        superseded = int(self.runs.superseded_by.notna().sum()) if "superseded_by" in self.runs else 0
        if superseded:  # killed, and its cell redone by a later run: nothing is missing
            known = [
                f"{k} ({'superseded' if superseded == counts['interrupted'] else f'{superseded} superseded'})"
                if k.endswith(" interrupted")
                else k
                for k in known
            ]
        other = [f"{n} {k}" for k, n in counts.items() if k not in STATUSES]
        return f"{len(self.runs)} runs: " + ", ".join(known + other)


def summarize(runs: pd.DataFrame, ladder_target: float | None = None, confidence: float = 0.9) -> Summary:
    """Every table of the summary (the runs table must not be empty). A superseded run (killed, its cell
    redone) is counted, but the tables are computed without it. `ladder_target`: the size the ladder
    table extrapolates the largest stable lr to (`ladder.target`)."""
    all_runs = runs
    if "superseded_by" in runs:
        runs = runs[runs.superseded_by.isna()].reset_index(drop=True)
    cells, recs = divergence_cells(runs), frontier_records(runs)
    dmap, legend = divergence_map(runs, cells)
    toggles = toggle_effects(runs, recs)
    return Summary(
        runs=all_runs,
        axes=swept_axes(runs),
        cells=cells,
        divergence_map=dmap,
        map_columns=legend,
        frontier=frontier(runs, recs),
        lr_sensitivity=lr_sensitivity(runs),
        toggles=toggles,
        root_causes=root_causes(runs),
        recommendation=recommend(runs, recs, toggles),
        ladder=ladder_fit(runs, ladder_target, confidence, recs),
        diagnoses=diagnoses(runs),
    )
