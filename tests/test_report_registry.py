"""The summary-table registry (sweep/report/registry.py): a table registered once, by one function and one
`register` call, shows in the terminal text, summary.md, summary_<name>.csv, report.html and the choices
of `python -m sweep.report --table`, with no other edit. A renderer that kept its own list fails here."""

from __future__ import annotations

import pandas as pd
import pytest

from sweep.report.__main__ import main, parser
from sweep.report.html import render_html
from sweep.report.registry import TABLES, SummaryTable, TableInputs, register
from sweep.report.runs import runs_from_dirs
from sweep.report.summary import summarize
from sweep.report.text import render_markdown, render_text, write_summary

from .test_report_tables import make_grid

NAME = "runs_per_precision"


def runs_per_precision(t: TableInputs) -> pd.DataFrame:
    """A table no renderer knows: stable and diverged runs per precision."""
    counts = pd.crosstab(t.runs["param:precision"], t.runs.status)
    counts.index.name = "precision"
    return counts


@pytest.fixture
def extra_table():
    spec = register(
        SummaryTable(
            name=NAME,
            title="Runs per precision",
            build=runs_per_precision,
            explain=lambda s: f"{len(s.runs)} runs counted by precision and status",
            help="runs counted by precision and status",
        )
    )
    yield spec
    del TABLES[NAME]


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    return make_grid(tmp_path_factory.mktemp("registry") / "sweep")


def test_a_registered_table_shows_in_every_renderer(extra_table, sweep_dir, tmp_path):
    s = summarize(runs_from_dirs(sweep_dir))
    table = s.tables[NAME]
    assert s.runs_per_precision is table  # every table is an attribute of the summary too
    assert table.loc["fp16_pure", "diverged"] == 6 and table.loc["fp32", "stable"] == 4

    text = render_text(s)
    assert "Runs per precision (18 runs counted by precision and status)" in text
    assert text.index("Runs per precision") > text.index("Root causes")  # after those registered before it
    assert text.index("Runs per precision") < text.index("Recommendation")
    assert "fp16_pure" in text.split("Runs per precision", 1)[1]

    md = render_markdown(s)
    assert (
        "## Runs per precision\n\n18 runs counted by precision and status.\n\n| precision | diverged | stable |" in md
    )
    assert "| fp16_pure | 6 | 0 |" in md

    written = {p.name for p in write_summary(tmp_path, s)}
    assert f"summary_{NAME}.csv" in written
    back = pd.read_csv(tmp_path / f"summary_{NAME}.csv", index_col="precision")
    pd.testing.assert_frame_equal(back, table, check_names=False, check_dtype=False)

    page = render_html(s, "registry", "test")
    assert "<h2>Runs per precision</h2>" in page and "18 runs counted by precision and status" in page


def test_a_registered_table_is_a_choice_of_the_cli(extra_table, sweep_dir, capsys):
    assert NAME in parser()._option_string_actions["--table"].choices
    with pytest.raises(SystemExit):
        main(["--help"])
    assert f"{NAME}  runs counted by precision and status" in capsys.readouterr().out

    assert main([str(sweep_dir), "--table", NAME, "--no-html"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("18 runs: ") and "Runs per precision" in out
    assert "Divergence map" not in out and "Recommendation" not in out  # --table: that table alone


def test_a_table_can_stay_out_of_the_html_page(sweep_dir, monkeypatch):
    monkeypatch.setitem(
        TABLES,
        NAME,
        SummaryTable(NAME, "Runs per precision", runs_per_precision, lambda s: "-", "-", in_html=False),
    )
    s = summarize(runs_from_dirs(sweep_dir))
    assert "Runs per precision" in render_text(s) and "Runs per precision" not in render_html(s, "t", "t")


def test_a_name_is_registered_once_and_an_unregistered_one_is_no_choice(sweep_dir, capsys):
    with pytest.raises(ValueError, match="already registered"):
        register(SummaryTable("frontier", "Again", runs_per_precision, lambda s: "", ""))
    with pytest.raises(SystemExit) as exit_:
        main([str(sweep_dir), "--table", NAME, "--no-html"])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_the_built_in_tables_in_their_order():
    assert list(TABLES) == [
        "divergence_map",
        "frontier",
        "lr_sensitivity",
        "toggles",
        "root_causes",
        "ladder",
        "diagnoses",
        "errors",
    ]
