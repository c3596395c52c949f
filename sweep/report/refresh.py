"""A finished sweep's answer written again after a later command changed it, so that every place says one thing.

    python -m sweep.confirm SWEEP_DIR        # then summary.md, report.html and the study hold what it confirmed

The end of a multirun writes its answer in four places: the terminal, summary.md (with summary.csv, .parquet and
summary_<table>.csv), report.html and the user attributes of its Optuna study (and, with logger=mlflow, summary.md
on the sweep's parent MLflow run). `python -m sweep.confirm` run later
changes that answer (the frontier's `held` column, a recommendation that steps down to an lr that held), and
`python -m sweep.diagnose` on one of its runs adds a diagnosis: `rewrite_answer` summarizes the sweep's runs
again as its end did (its multirun.yaml's ladder.* and report.target) and rewrites the files its end wrote, those
that are there (a sweep whose end never ran gets none; `python -m sweep.report SWEEP_DIR --write` writes them).
"""

from __future__ import annotations

from pathlib import Path

from sweep.report.confirmation import read_confirmation
from sweep.report.html import REPORT_FILE, write_sweep_report
from sweep.report.ladder import ladder_settings
from sweep.report.registry import Summary
from sweep.report.runs import runs_from_dirs
from sweep.report.summary import summarize
from sweep.report.target import recorded_target
from sweep.report.text import write_summary

SUMMARY_FILE = "summary.md"


def rewrite_answer(sweep_dir: Path) -> tuple[Summary | None, list[Path], list[str]]:
    """(the summary, the files rewritten, one line per problem). The recommendation is for the sweep's own
    report.target, as its files were. Nothing is rewritten where the sweep has no finished run; the study's answer
    only where summary.md was there (the sweep's end recorded one)."""
    sweep_dir = Path(sweep_dir)
    summary, problems = summary_of(sweep_dir, recorded_target(sweep_dir))
    if summary is None:
        return None, [], problems
    written: list[Path] = []
    if (sweep_dir / SUMMARY_FILE).is_file():
        try:
            written += write_summary(sweep_dir, summary)
        except OSError as e:
            problems.append(f"could not rewrite the summary files ({e.filename or sweep_dir}: {e.strerror})")
        from sweep.search.answer import record_report_answer  # optuna: only once there is an answer to record

        if (problem := record_report_answer(str(sweep_dir), None, summary)) is not None:
            problems.append(problem)
        if (problem := relog_mlflow(sweep_dir)) is not None:
            problems.append(problem)
    if (sweep_dir / REPORT_FILE).is_file():
        files, problem = write_sweep_report(sweep_dir, summary)
        written += files[:1]  # report.html; a plotly.js already beside it is not rewritten
        problems += [problem] if problem else []
    return summary, written, problems


def relog_mlflow(sweep_dir: Path) -> str | None:
    """With logger=mlflow, the rewritten summary.md on the sweep's parent MLflow run too (sweep/run/mlflow_sink.py
    `relog_summary`), with the sweep's own logger.mlflow (its multirun.yaml, interpolations resolved); one line
    when it cannot be."""
    import dataclasses

    from omegaconf import OmegaConf

    from sweep.config import MlflowConfig

    saved = Path(sweep_dir) / "multirun.yaml"
    try:
        node = OmegaConf.select(OmegaConf.load(saved), "logger.mlflow", default=None) if saved.is_file() else None
        values = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    except Exception as e:  # noqa: BLE001  (an ${oc.env:...} URI whose variable is not set here, a damaged file)
        return f"logger mlflow: the sweep's parent run keeps its earlier summary.md: its multirun.yaml's logger: {e}"
    known = {f.name for f in dataclasses.fields(MlflowConfig)}
    cfg = MlflowConfig(**{k: v for k, v in values.items() if k in known})
    if not cfg.enabled:
        return None
    from sweep.run.mlflow_sink import relog_summary  # mlflow: only for a sweep that logged to it

    return relog_summary(cfg, sweep_dir)


def summary_of(sweep_dir: Path, target: str | None) -> tuple[Summary | None, list[str]]:
    """The sweep's summary as `python -m sweep.report SWEEP_DIR --target TARGET` computes it (None: no run), and one
    line per problem (a damaged confirmation.json)."""
    runs = runs_from_dirs(sweep_dir)
    confirmation, problem = read_confirmation(sweep_dir)
    problems = [problem] if problem else []
    if runs.empty:
        return None, problems
    ladder, confidence = ladder_settings(sweep_dir)
    return summarize(runs, ladder, confidence, target, confirmation), problems


def rewritten_line(sweep_dir: Path, written: list[Path]) -> str:
    """What the commands that rewrite a sweep's files say of it."""
    return f"Rewritten in {sweep_dir}: {', '.join(p.name for p in written)}"
