"""The summary tables of a sweep, each registered once: what builds it and what its renderers need.

Every renderer reads this registry, in its order: the terminal text and summary.md (`text.py`),
summary_<name>.csv (`text.py` `write_summary`), report.html (`html.py`) and the `--table` choices of
`python -m sweep.report` (`__main__.py`). A new table is one function and one registration:

    def runs_per_status(t: TableInputs) -> pd.DataFrame:
        return t.runs.status.value_counts().rename_axis("status").to_frame("runs")

    register(SummaryTable(
        name="runs_per_status",           # summary_runs_per_status.csv, --table runs_per_status
        title="Runs per status",          # the heading everywhere
        build=runs_per_status,
        explain=lambda s: "how many runs ended in each status",  # the sentence under the heading
        help="runs counted by status",    # its line in --help
    ))

An empty table is left out everywhere. `Summary` (below; built by summary.py `summarize`) holds every
table: `s.tables[name]`, or `s.<name>`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import pandas as pd

from sweep.report.causes import diagnoses, errors, errors_text, root_causes
from sweep.report.confirmation import Confirmation, confirm_records, with_held
from sweep.report.figures import HEATMAP_ID, heatmap, ladder_figure
from sweep.report.ladder import ladder_fit, ladder_lines
from sweep.report.marginal import factor
from sweep.report.noise import quality_column, quality_name
from sweep.report.recommend import Recommendation
from sweep.report.tables import (
    divergence_cells,
    divergence_map,
    frontier,
    frontier_records,
    lr_notes,
    lr_sensitivity,
    toggle_effects,
)


@dataclass
class TableInputs:
    """What a table is built from: the runs (superseded ones left out) and what several tables share,
    computed once on first use."""

    runs: pd.DataFrame
    ladder_target: float | None = None
    """The size the ladder extrapolates the largest stable lr to (`ladder.target`)."""
    confidence: float = 0.9
    """The ladder interval's level (`ladder.confidence`)."""
    confirmation: Confirmation | None = None
    """The sweep's confirmation at a longer horizon (confirmation.json, sweep/report/confirmation.py), if any."""

    @cached_property
    def cells(self) -> pd.DataFrame:
        """The divergence map in long form, one row per cell (`tables.divergence_cells`)."""
        return divergence_cells(self.runs)

    @cached_property
    def records(self) -> pd.DataFrame:
        """Per combination: stability per lr and the frontier columns (`tables.frontier_records`), as the
        confirmation at a longer horizon leaves them (`confirmation.confirm_records`)."""
        return confirm_records(frontier_records(self.runs), self.confirmation)


@dataclass(frozen=True)
class Plot:
    """A figure of report.html that goes with a table (shown only when the table is not empty)."""

    div_id: str
    make: Callable[[Summary], Any]
    """The plotly figure, from the summary."""
    above: bool = False
    """True: between the table's note and the table (the heatmap); False: after every table."""


@dataclass(frozen=True)
class SummaryTable:
    """One summary table: how it is built from the runs and how each renderer shows it."""

    name: str
    """Its key: `Summary.tables[name]`, summary_<name>.csv, `--table name`."""
    title: str
    """The heading in the terminal, summary.md and report.html."""
    build: Callable[[TableInputs], pd.DataFrame]
    """The table from the runs; an empty one is left out everywhere."""
    explain: Callable[[Summary], str]
    """The sentence under the heading that says how to read the table (it may name the quality column)."""
    help: str
    """One line for `python -m sweep.report --help`."""
    index: bool = True
    """Whether the table's index is shown (and written to its CSV); False where it is a plain row number."""
    long_form: Callable[[Summary], pd.DataFrame] | None = None
    """summary_<name>.csv when it is not the table as shown (written without index)."""
    lines: Callable[[pd.DataFrame], list[str]] | None = None
    """Sentences after the table in the terminal and summary.md."""
    text: Callable[[pd.DataFrame, int], str] | None = None
    """The table as the terminal shows it, at a width, when not as a grid (long messages: the errors table)."""
    in_html: bool = True
    """Whether report.html shows it."""
    plot: Plot | None = None
    """Its figure in report.html, if any."""


STATUSES = ("stable", "diverged", "skipped", "error", "running", "interrupted")


@dataclass
class Summary:
    """Every table of one sweep, built once (summary.py `summarize`), and what the renderers say around them."""

    runs: pd.DataFrame
    axes: list[str]
    cells: pd.DataFrame
    """The divergence map in long form, one row per cell (the heatmap and summary_divergence_map.csv)."""
    map_columns: str
    """The axes of the divergence map's columns, "precision/attention"."""
    tables: dict[str, pd.DataFrame]
    """Every registered table by name (sweep/report/registry.py), in registry order; empty when it has no rows.
    Each is an attribute too: `s.frontier` is `s.tables["frontier"]`."""
    recommendation: Recommendation

    def __getattr__(self, name: str) -> pd.DataFrame:
        tables = self.__dict__.get("tables", {})  # not self.tables: copy and pickle look up before __init__
        if name in tables:
            return tables[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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


TABLES: dict[str, SummaryTable] = {}
"""Every summary table by name, in the order the renderers show them."""


def register(table: SummaryTable) -> SummaryTable:
    """Add a table after those already registered; a name is registered once."""
    if table.name in TABLES:
        raise ValueError(f"a summary table named {table.name!r} is already registered")
    TABLES[table.name] = table
    return table


def shown(s: Summary, only: Iterable[str] | None = None) -> list[tuple[SummaryTable, pd.DataFrame]]:
    """(table spec, its table) for every registered table that is not empty, in registry order;
    `only`: these names alone."""
    names = None if only is None else set(only)
    return [
        (spec, s.tables[name])
        for name, spec in TABLES.items()
        if (names is None or name in names) and not s.tables[name].empty
    ]


def _factor(s: Summary) -> float:
    """How many times the best lr's quality makes a run above it marginal (sweep/report/marginal.py)."""
    return factor(quality_column(s.runs))


def _quality(s: Summary) -> str:
    """What the tables call quality: the eval loss, or the final loss when no stable run has one."""
    return quality_name(quality_column(s.runs))


register(
    SummaryTable(
        name="divergence_map",
        title="Divergence map",
        build=lambda t: divergence_map(t.runs, t.cells)[0],
        explain=lambda s: (
            f"columns: {s.map_columns}; rows: {s.divergence_map.index.name or '-'}; cell: stable, "
            "verdict@first_bad_step, or k/n div (diverged of the decided seeds); marginal (m k/n with seeds): "
            f"stable, but above the combination's best lr and its {_quality(s)} over {_factor(s):g}x the best's; "
            "ERROR: the error's short reason (the errors table has it whole); "
            "* = more runs still running, - = no run"
        ),
        help="rows lr, columns the other axes; each cell stable, marginal, verdict@step, k/n div or ERROR: why",
        long_form=lambda s: s.cells.drop(columns=["row_key"], errors="ignore"),
        plot=Plot(HEATMAP_ID, lambda s: heatmap(s.cells, s.divergence_map), above=True),
    )
)
register(
    SummaryTable(
        name="frontier",
        title="Stability frontier",
        build=lambda t: with_held(frontier(t.runs, t.records), t.records, t.confirmation),
        explain=lambda s: (
            "per combination: the largest lr stable in every replicate and not marginal, the marginal lrs it "
            f"skipped (stable, but their {_quality(s)} over {_factor(s):g}x the best lr's), and the smallest lr that "
            f"diverged; at the largest stable lr the {_quality(s)}: mean, spread (sd over replicates, - with one) and "
            f"replicates; best_lr, the stable lr of the lowest mean {_quality(s)}; mean steps/s of its stable runs "
            "(of one packing, as in the recommendation)"
            + (
                "; held: whether the largest stable lr stayed stable at the longer horizon"
                if "held" in s.frontier
                else ""
            )
            + lr_notes(s.runs)
        ),
        help="per combination: largest stable lr (marginal lrs skipped), smallest diverging lr, loss at the former,"
        " whether it held at the longer horizon",
        lines=lambda table: table.attrs.get("confirmation", []) + table.attrs.get("learned", []),
    )
)
register(
    SummaryTable(
        name="lr_sensitivity",
        title="LR sensitivity",
        build=lambda t: lr_sensitivity(t.runs),
        explain=lambda s: (
            f"Wortsman et al. 2023: mean over the lr grid of min({_quality(s)}, initial loss) - "
            "best_loss, diverged runs at the initial loss; lower is more robust, 0 = every lr reached the best loss, "
            "- = no stable run; spread: sd of the same number per seed; vs_best: tie = within noise (2 standard "
            "errors)"
        ),
        help="per combination: loss given up across the lr grid (Wortsman et al. 2023)",
    )
)
register(
    SummaryTable(
        name="toggles",
        title="Effect of each toggle",
        build=lambda t: toggle_effects(t.runs, t.records),
        explain=lambda s: (
            "runs equal in everything else but this axis (a vs b): pairs, diverged with a and with "
            "b; combos: matched combinations; lr_steps: change of the largest stable lr from a to b, in lr-grid "
            f"steps; eval_change: mean relative change of the {_quality(s)} from a to b over pairs stable on both "
            "sides, eval_noise: 2 standard errors of it; quality: tie when within noise (or under 0.1%)"
            + (" (lr_steps - between optimizers whose lrs mean different things)" if lr_notes(s.runs) else "")
        ),
        help="per axis and pair of values, all else equal: divergences, lr steps, loss change",
        index=False,
    )
)
register(
    SummaryTable(
        name="root_causes",
        title="Root causes",
        build=lambda t: root_causes(t.runs),
        explain=lambda s: "diverged runs: verdict and mechanism (why: sweep/diagnose) x where it first went wrong",
        help="diverged runs: verdict and mechanism x where they first went wrong",
    )
)
register(
    SummaryTable(
        name="ladder",
        title="Frontier across sizes",
        build=lambda t: ladder_fit(t.runs, t.ladder_target, t.confidence, t.records),
        explain=lambda s: (
            "per combination of the other axes: log(largest stable lr) fitted against log(size) "
            "over the sizes whose lr bracket is closed (lr* = sqrt(max stable x min diverging)); exponent = slope; "
            "the prediction at the target size with its interval (Student t, residual + bracket variance; 3+ "
            "sizes); best_*: the same fit of the best eval lr (known to within half a grid step each side; a best "
            "at the grid's edge left out); an extrapolation, not a measurement (docs/ladder.md)"
        ),
        help="a size sweep: largest stable lr fitted on width or depth, extrapolated",
        lines=ladder_lines,
        plot=Plot("ladder", lambda s: ladder_figure(s.ladder)),
    )
)
register(
    SummaryTable(
        name="diagnoses",
        title="Diagnoses",
        build=lambda t: diagnoses(t.runs),
        explain=lambda s: (
            "diverged runs diagnosed (python -m sweep.diagnose RUN_DIR; diagnosis.json): mechanism; "
            "table_agrees: whether the counterfactual runs (same config, fp32, reference kernels, without extreme "
            "samples, lr/10, update clipping) bear it out; the fix, and whether a run from step 0 with it was stable"
        ),
        help="diagnosed runs: mechanism, counterfactual agreement, the fix and if it held",
    )
)
register(
    SummaryTable(
        name="errors",
        title="Errors and skipped runs",
        build=lambda t: errors(t.runs),
        explain=lambda s: (
            "each distinct error (status error: a crash or a bug), then each distinct reason a run was skipped "
            "(a combination this device cannot run); the reason as result.json gives it (first line), how many runs, "
            "one run dir (its result.json and __main__.log have the rest)"
        ),
        help="each distinct error or skip reason: the message, how many runs, one run dir",
        index=False,
        text=errors_text,
    )
)
