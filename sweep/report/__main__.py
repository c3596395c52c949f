"""Print a sweep's summary tables and write its report.html, from run directories or from the ledger.

    python -m sweep.report outputs/sweeps/2026-11-22/10-00-00           # the run directories
    python -m sweep.report outputs/sweeps/2026-11-22/10-00-00 --target cpu  # recommend for this CPU
    python -m sweep.report outputs/sweeps/2026-11-22/10-00-00 --self-contained  # report.html with plotly inside
    python -m sweep.report outputs/sweeps/2026-11-22/10-00-00/ledger.db # the sweep's Optuna study
    python -m sweep.report postgresql://me@db/sweeps --study my-sweep   # a study on a server
    SWEEP_LEDGER_URL=postgresql://me:secret@db/sweeps python -m sweep.report --study my-sweep

report.html loads plotly-<version>.min.js, written once beside it (sweep/report/html.py); --self-contained
puts plotly inside instead, one file to mail. The tables go to stdout (the same from either source), what was
read and written to stderr. A wrong path or an unknown study is one line and exit status 2. A storage password
is never printed or written: the report names the storage as postgresql://me:***@db/sweeps. A directory's
multirun.yaml gives only defaults, its ladder.* and its report.target (so the recommendation is the one its
summary.md holds): every run says its own params (result.json, or a started job's .hydra/overrides.yaml), so a
sweep whose multirun.yaml is missing or damaged reports as well (`python -m sweep -m` into such a directory is
refused: it cannot tell that sweep from another, sweep/callbacks.py). Its
confirmation.json (the answer rerun at a longer horizon, sweep/confirm/) is read too: the frontier's `held`
column, and a recommendation that names a setting that held (a damaged one is one line on stderr); from a storage
with no confirmation.json beside it (a server URL), the study's copy of it (its `confirmation` attr).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

from sweep.config.validate import ladder_target_problem
from sweep.report.confirmation import CONFIRMATION_ATTR, read_confirmation, study_confirmation
from sweep.report.html import REPORT_FILE, dir_title
from sweep.report.ladder import ladder_settings
from sweep.report.registry import TABLES
from sweep.report.runs import DIAGNOSIS_FILE, runs_from_dirs
from sweep.report.study import (
    JOURNAL_SUFFIXES,
    SQLITE_SUFFIXES,
    SourceError,
    is_storage,
    runs_from_study,
    storage_url,
)
from sweep.report.summary import summarize
from sweep.report.target import TARGETS, recorded_target
from sweep.report.text import WIDTH, render_text, write_summary
from sweep.run.results import RESULT_FILE
from sweep.search.ledger import LEDGER_FILE, mask_url

ENV_URL = "SWEEP_LEDGER_URL"


def parser(prog: str = "python -m sweep.report") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog="A directory is read as run directories (<n>/result.json; a started job without one\n"
        "is running while its process lives, else interrupted (superseded when a later run redid\n"
        "its cell); an unreadable or malformed result.json is skipped and named).\n"
        "A storage is a URL (sqlite:///, postgresql://, mysql://), a SQLite\n"
        "file (.db, .sqlite) or an Optuna journal file (.log, .jsonl); the tables come from its\n"
        "trials, the curves from the run directories the trials name, where they exist.\n\n" + table_list(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "source",
        nargs="?",
        metavar="PATH_OR_STORAGE_URL",
        default=os.environ.get(ENV_URL),
        help=f"a sweep directory, a ledger file, or an Optuna storage URL (default: ${ENV_URL}, "
        "so that a password need not be typed on the command line)",
    )
    p.add_argument(
        "--study", metavar="NAME", help="the study to read from a storage holding several (default: its only study)"
    )
    p.add_argument(
        "--html",
        metavar="FILE",
        type=Path,
        help=f"where to write the report (default: {REPORT_FILE} in the sweep directory, or next to "
        "a ledger file, or in the current directory for a server URL)",
    )
    p.add_argument("--no-html", action="store_true", help="print the tables only; write no report.html")
    p.add_argument(
        "--self-contained",
        action="store_true",
        help="one file with plotly.js inside (4.8 MB more: to mail it); by default the report loads "
        "plotly-<version>.min.js, written once beside it",
    )
    p.add_argument(
        "--write",
        action="store_true",
        help="also write summary.md, summary.csv, summary.parquet and summary_<table>.csv next to the report, "
        "and the recommendation into the sweep's Optuna study (its user attrs, which optuna-dashboard shows)",
    )
    p.add_argument(
        "--table",
        action="append",
        choices=list(TABLES),
        metavar="NAME",
        help="print only this table (repeatable), after the run counts and without the recommendation; "
        "the files written keep every table (the tables are listed below)",
    )
    p.add_argument(
        "--ladder-target",
        type=float,
        metavar="SIZE",
        help="a size sweep (model.width or model.depth swept with the lr): extrapolate the largest stable lr "
        "to this width or depth (default: ladder.target from the sweep's multirun.yaml; docs/ladder.md)",
    )
    p.add_argument(
        "--target",
        choices=TARGETS,
        help="the device the recommendation is for: it leaves out the combinations the target cannot run "
        "(fp32/tf32 with flash on cuda; efficient/cudnn attention and tf32 on cpu) and breaks ties by the steps/s "
        "measured when the runs ran on it, else by its cost (cuda: bf16 before fp16 before tf32 before fp32) (default: "
        "the sweep's report.target from its multirun.yaml, else the device the runs recorded, cuda for a sweep that "
        "ran on the CPU: a proxy for the GPU a model trains on)",
    )
    p.add_argument(
        "--width",
        type=_columns,
        default=WIDTH,
        metavar="COLUMNS",
        help=f"wrap the tables at this many columns (default: {WIDTH})",
    )
    return p


def _columns(text: str) -> int:
    """--width: a whole number of columns >= 1 (0 or less was textwrap's ValueError, a traceback)."""
    try:
        columns = int(text)
    except ValueError:
        columns = 0
    if columns < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of columns >= 1, got {text!r}")
    return columns


def table_list() -> str:
    """The registered tables (sweep/report/registry.py), one line each, for --help."""
    width = max(len(name) for name in TABLES)
    return "tables (--table NAME; with --write each is also summary_NAME.csv):\n" + "\n".join(
        f"  {name:<{width}}  {spec.help}" for name, spec in TABLES.items()
    )


def load(source: str, study: str | None):
    """(runs, title, where the runs came from (masked), default output directory)."""
    path = Path(source)
    if "://" not in source and path.is_dir():
        if study is not None:  # a study was asked for: the sweep directory's own ledger
            if not (path / LEDGER_FILE).is_file():
                raise SourceError(f"--study needs a storage, and {source} has no {LEDGER_FILE}")
            return load(str(path / LEDGER_FILE), study)
        return runs_from_dirs(path), dir_title(path), f"run directories under {path}", path
    if is_storage(source):
        url = storage_url(source)
        runs, name = runs_from_study(url, study)
        out = (
            path.parent
            if "://" not in source
            else (Path(url.split(":///", 1)[1]).parent if url.startswith("sqlite:///") else Path.cwd())
        )
        return runs, f"Sweep report: study {name}", f"study {name!r} in {mask_url(url)}", out
    if "://" not in source and path.exists():  # summary.md, a result.json: there, but not what the report reads
        raise SourceError(
            f"{source} is a file, not a sweep directory or a ledger ({' '.join(SQLITE_SUFFIXES + JOURNAL_SUFFIXES)});"
            " give the sweep's directory"
        )
    raise SourceError(f"no such sweep directory or ledger file: {source}")


def main(argv: list[str] | None = None, prog: str = "python -m sweep.report") -> int:
    args = parser(prog).parse_args(argv)
    name = prog.split()[-1]
    if not args.source:
        print(f"{name}: give a sweep directory or a storage URL (or set ${ENV_URL})", file=sys.stderr)
        return 2
    try:
        runs, title, source, out_dir = load(args.source, args.study)
    except SourceError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    skipped = runs.attrs.get("skipped", [])
    for line in skipped:
        print(f"{name}: skipped {line}", file=sys.stderr)
    if runs.empty:
        print(f"{name}: no runs in {source}" + _skipped_note(skipped), file=sys.stderr)
        return 2
    target, confidence = ladder_settings(out_dir) if args.ladder_target is None else (args.ladder_target, 0.9)
    problem = None if target is None else ladder_target_problem(target)
    if problem is not None:
        # log(target) must exist and exp(fit at it) fit a float: 0 or -3 was a math domain error (a traceback),
        # inf predicted an lr of 0, 1e308 and 1e-300 overflowed (a traceback)
        where = "--ladder-target" if args.ladder_target is not None else f"ladder.target in {out_dir}/multirun.yaml"
        print(f"{name}: {where}: {problem}", file=sys.stderr)
        return 2
    confirmation, problem = read_confirmation(out_dir) if _local(args.source) else (None, None)
    if confirmation is None and problem is None and CONFIRMATION_ATTR in runs.attrs:  # a study: its copy of it
        confirmation, problem = study_confirmation(runs.attrs[CONFIRMATION_ATTR], runs.attrs.get("study", ""))
    if problem:
        print(f"{name}: {problem}", file=sys.stderr)
    device = args.target if args.target is not None or not _local(args.source) else recorded_target(out_dir)
    summary = summarize(runs, target, confidence, device, confirmation)
    print(render_text(summary, args.width, args.table), flush=True)
    written, notes, failed = [], [], []  # notes: written elsewhere; failed: not written
    here = Path(args.html).parent if args.html else Path(out_dir)
    if args.write:
        files, note = write_files("the summary files", lambda d: write_summary(d, summary), here, not args.html)
        written += files
        if note:
            (notes if files else failed).append(note)
        from sweep.search.answer import record_report_answer  # the answer on the study too (optuna-dashboard)

        if (problem := record_report_answer(args.source, args.study, summary)) is not None:
            print(f"{name}: {problem}", file=sys.stderr)
    if not args.no_html:
        from sweep.report.html import write_report

        file = Path(args.html).name if args.html else REPORT_FILE
        files, note = write_files(
            file, lambda d: write_report(d / file, summary, title, source, args.self_contained), here, not args.html
        )
        written += files
        if note:
            (notes if files else failed).append(note)
    for line in notes:
        print(f"{name}: {line}", file=sys.stderr)
    if failed:
        print(f"{name}: {'; '.join(failed)}", file=sys.stderr)
        return 1
    print(
        f"{name}: {len(runs)} runs from {source}"
        + _skipped_note(skipped)
        + (f"; wrote {', '.join(map(str, written))}" if written else ""),
        file=sys.stderr,
    )
    return 0


def _local(source: str) -> bool:
    """A sweep directory or a ledger file (or SQLite URL) beside one: where its confirmation.json would be."""
    return "://" not in source or source.startswith("sqlite:///")


def write_files(what: str, write: Callable[[Path], list[Path]], where: Path, fallback: bool) -> tuple[list, str]:
    """`write(directory)` into `where`, else, when `where` was not asked for (no --html), into the current
    directory, as the data doctor does: (the files written, a note saying why they are not in `where`, or
    what went wrong when none was written). Before, a sweep directory on a read-only mount (or another user's)
    ended the report, its tables printed, with a traceback."""
    try:
        return write(where), ""
    except OSError as e:
        first = f"{e.filename or where}: {e.strerror or type(e).__name__}"
    cwd = Path.cwd()
    if fallback and cwd.resolve() != where.resolve():
        try:
            return write(cwd), f"{first}: wrote {what} into the current directory instead"
        except OSError as e:
            first += f"; {e.filename or cwd}: {e.strerror or type(e).__name__}"
    return [], (
        f"could not write {what} ({first}); give --html FILE where you can write (--write puts the summary files "
        "next to it), or --no-html"
    )


def _skipped_note(skipped: list[str]) -> str:
    """How many runs were left out (a result.json, or a started run's overrides.yaml, unreadable or malformed) and
    how many diagnosis.json files (their runs are kept), for the line that says how many runs were used."""
    diagnoses = sum(line.split(": ", 1)[0].endswith(DIAGNOSIS_FILE) for line in skipped)
    overrides = sum(line.split(": ", 1)[0].endswith("overrides.yaml") for line in skipped)
    counts = [
        f"{n} {name}"
        for n, name in (
            (len(skipped) - diagnoses - overrides, RESULT_FILE),
            (overrides, "started run"),
            (diagnoses, DIAGNOSIS_FILE),
        )
        if n
    ]
    return f" ({', '.join(counts)} skipped: unreadable or malformed, named above)" if skipped else ""


if __name__ == "__main__":
    from sweep.exit import exit_after

    exit_after(main)
