"""The runs table: one row per run of a sweep, read from its run directories.

Every table of the report is computed from this one DataFrame, whichever source it came from (run
directories here, the Optuna study in `study.py`): the outcome columns below, then one `param:<dotted
key>` column per swept or overridden config value. A job directory that Hydra started but that has no
result.json yet is a `running` run (its params come from `.hydra/overrides.yaml`), so a report of a
sweep in progress shows what is still missing. A result.json that cannot be read, is cut short, or
does not have the contract's shape (docs/design.md, "Files of one run") is left out and named in
`runs.attrs["skipped"]`, for the caller to report: one foreign or damaged file must not stop the
report of the others. So is a started run whose `.hydra/overrides.yaml` cannot be read: its cell is unknown,
and as a row without params it would split every table by every fixed key.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pandas as pd

from sweep.run.results import METRICS_FILE, RESULT_FILE, is_being_written, json_type
from sweep.run.results import record_problem as result_problem  # the one shape rule of result.json

OUTCOME_COLUMNS = [
    "status",
    "verdict",
    "first_bad_step",
    "cause_where",
    "cause_module",
    "mechanism",
    "final_loss",
    "initial_loss",
    "min_loss",
    "eval_loss",
    "steps_run",
    "steps_per_second",
    "seed",
    "run_dir",
    "pruned_at_step",
    "packed",
    "superseded_by",
    "reason",
    "device",
    "loaded",
]
INT_COLUMNS = ["first_bad_step", "steps_run", "seed", "pruned_at_step", "packed"]
FLOAT_COLUMNS = ["final_loss", "initial_loss", "min_loss", "eval_loss", "steps_per_second"]
RESULT_KEYS = [
    c
    for c in OUTCOME_COLUMNS
    if c not in ("status", "run_dir", "cause_where", "cause_module", "mechanism", "superseded_by")
]
"""Outcome columns that result.json holds under the same name."""
PARAM = "param:"
DECIDED = ("stable", "diverged")
"""Statuses that say something about stability; skipped, error, running and interrupted runs do not."""
STARTING_S = 10.0
"""How long after Hydra made a job directory it counts as running without holding its lock."""


def runs_frame(rows: list[dict]) -> pd.DataFrame:
    """The canonical runs DataFrame from row dicts (outcome keys plus `param:` keys), in a fixed order.

    Rows are sorted by run directory (job numbers numerically), columns are the outcome columns then
    the params in order of first appearance, and dtypes are fixed, so two sources that saw the same
    runs give equal frames.
    """
    rows = sorted(rows, key=lambda r: _natural_key(r.get("run_dir") or ""))
    params: dict[str, None] = {}
    for r in rows:
        params.update(dict.fromkeys(k for k in r if k.startswith(PARAM)))
    df = pd.DataFrame(
        [{c: r.get(c) for c in OUTCOME_COLUMNS + list(params)} for r in rows], columns=OUTCOME_COLUMNS + list(params)
    )
    for c in INT_COLUMNS:
        df[c] = pd.array([None if _missing(v) else int(v) for v in df[c]], dtype="Int64")
    for c in FLOAT_COLUMNS:
        df[c] = pd.to_numeric(df[c], errors="coerce").astype(float)
    for c in [
        "status",
        "verdict",
        "cause_where",
        "cause_module",
        "run_dir",
        "superseded_by",
        "reason",
        "device",
        *params,
    ]:
        df[c] = df[c].astype(object).where(df[c].notna(), None)
    return df.reset_index(drop=True)


def outcome_row(status: str, run_dir: str | None, params: dict, **outcome) -> dict:
    """One row of the runs table."""
    row = {"status": status, "run_dir": run_dir, **{k: outcome.get(k) for k in OUTCOME_COLUMNS if k in outcome}}
    row.update({PARAM + k: _hashable(v) for k, v in (params or {}).items()})
    return row


def _mechanism(result: dict, run_dir: Path) -> str | None:
    """The run's mechanism: its diagnosis's (diagnosis.json, after the counterfactual runs) where it has one,
    else the one result.json names from the recorded signals."""
    diagnosis, _ = read_diagnosis(run_dir)
    if diagnosis is not None and diagnosis.get("mechanism") is not None:
        return diagnosis["mechanism"]
    return (result.get("mechanism") or {}).get("name")


DIAGNOSIS_FILE = "diagnosis.json"


def read_diagnosis(run_dir: Path) -> tuple[dict | None, str | None]:
    """A run dir's diagnosis.json as the report reads it: (its content, None); (None, None) when there is none;
    (None, why) when it cannot be read or has not the shape sweep/diagnose writes (docs/design.md,
    "diagnosis.json"): the run is still reported, its diagnosis left out and named (before, a diagnosis.json of
    valid JSON but the wrong shape, `null` or `{"fix": "x"}`, stopped the report with a traceback)."""
    path = Path(run_dir) / DIAGNOSIS_FILE
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        return None, f"{path}: unreadable ({type(e).__name__}: {_first_line(e)})"
    problem = diagnosis_problem(d)
    return (None, f"{path}: {problem}") if problem else (d, None)


def diagnosis_problem(d) -> str | None:
    """Why a parsed diagnosis.json cannot be read by the report (its mechanism, the diagnoses table), or None."""
    if not isinstance(d, dict):
        return f"not a JSON object (a JSON {json_type(d)})"
    for key in ("mechanism", "verdict"):
        if d.get(key) is not None and not isinstance(d[key], str):
            return f"{key} is not a string or null"
    fix = d.get("fix")
    if fix is not None and not isinstance(fix, dict):
        return "fix is not an object or null"
    overrides = (fix or {}).get("overrides")
    if overrides is not None and not (isinstance(overrides, list) and all(isinstance(o, str) for o in overrides)):
        return "fix.overrides is not a list of strings"
    return None


def _diagnosis_run(path: Path, sweep_dir: Path) -> bool:
    """Whether `path` lies in a run dir's `diagnosis/` folder (its replay, counterfactual, bisection and fix runs).
    Those write trial.json today (sweep/diagnose/trials.py); a sweep diagnosed by an older version holds
    result.json there, which this leaves out."""
    for folder in path.relative_to(sweep_dir).parents:
        if folder.name == "diagnosis" and (sweep_dir / folder.parent / RESULT_FILE).is_file():
            return True
    return False


def runs_from_dirs(sweep_dir: Path, starting_s: float = STARTING_S) -> pd.DataFrame:
    """Every run under `sweep_dir`: finished ones from result.json, started ones as `running` or
    `interrupted` (see the module docstring; the end-of-sweep summary passes starting_s=0: every job of
    its sweep has returned).

    `attrs["skipped"]` lists "<path>: <why>" for each result.json (or started run's overrides.yaml) left out (see
    the module docstring).
    """
    sweep_dir = Path(sweep_dir)
    rows, finished, skipped = [], set(), []
    for path in sorted(sweep_dir.rglob(RESULT_FILE)):
        if _diagnosis_run(path, sweep_dir):  # a diagnosis's own runs (sweep/diagnose) are not the sweep's
            continue
        finished.add(path.parent.resolve())  # a damaged result.json still means the job ended: not running
        try:
            r = json.loads(path.read_text())
        except (OSError, ValueError) as e:  # written atomically, so only a foreign or damaged file gets here
            skipped.append(f"{path}: unreadable ({type(e).__name__}: {_first_line(e)})")
            continue
        problem = result_problem(r)
        if problem is not None:
            skipped.append(f"{path}: {problem}")
            continue
        cause = r.get("cause") or {}
        if (problem := read_diagnosis(path.parent)[1]) is not None:
            skipped.append(f"{problem} (the run is kept, its diagnosis left out)")
        rows.append(
            outcome_row(
                r.get("status", "error"),
                str(path.parent.resolve()),
                r.get("params") or {},
                cause_where=cause.get("where"),
                cause_module=cause.get("module"),
                mechanism=_mechanism(r, path.parent),
                **{k: r.get(k) for k in RESULT_KEYS if k in r},
            )
        )
    done = {}  # a cell (its params) -> the first finished run of it
    for r in rows:
        if r["status"] != "interrupted":
            done.setdefault(_cell(r), r["run_dir"])
    for r in rows:  # stopped by Ctrl-C/SIGTERM (result.json says so), then redone by a resume
        if r["status"] == "interrupted" and done.get(_cell(r)) is not None:
            r["superseded_by"] = done[_cell(r)]
    for overrides in sweep_dir.rglob(".hydra/overrides.yaml"):
        job_dir = overrides.parent.parent.resolve()
        if job_dir in finished:
            continue
        params = _params_from_overrides(overrides)
        if isinstance(params, str):  # its cell is unknown: as a row without params it would split every table
            skipped.append(f"{overrides}: {params} (a started run, cell unknown)")
            continue
        row = outcome_row("running", str(job_dir), params)
        twin = done.get(_cell(row))
        if twin is not None:
            row.update(status="interrupted", superseded_by=twin)
        elif not is_being_written(job_dir) and not younger_than(overrides, starting_s):
            row["status"] = "interrupted"
        rows.append(row)
    runs = runs_frame(rows)
    runs.attrs["skipped"] = skipped
    return runs


def _cell(row: dict) -> frozenset:
    """What identifies a run's cell: its swept params (result.json `params`, or the job's overrides)."""
    return frozenset((k, v) for k, v in row.items() if k.startswith(PARAM))


def younger_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.stat().st_mtime < seconds
    except OSError:
        return False


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _params_from_overrides(path: Path) -> dict | str:
    """A started job's params from Hydra's overrides.yaml, named as sweep.job.swept_params names them; why not (one
    line) when the file cannot be read as a list of overrides."""
    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        lines = yaml.safe_load(path.read_text()) or []
        if not isinstance(lines, list):
            raise ValueError(f"a YAML {type(lines).__name__}, not a list of overrides")
        parsed = OverridesParser.create().parse_overrides([str(line) for line in lines])
    except Exception as e:  # noqa: BLE001  (a hand-edited, damaged or foreign file)
        return f"unreadable ({type(e).__name__}: {_first_line(e)})"
    return {
        o.key_or_group: o.value()
        for o in parsed
        if not o.key_or_group.startswith(("hydra", "ledger", "logger")) and not o.is_delete()
    }


def load_metrics(run_dir: str | None) -> pd.DataFrame | None:
    """A run's metrics.csv (one row per step), or None when it has none."""
    if not run_dir:
        return None
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return None
    try:
        return pd.read_csv(path)
    except (OSError, ValueError, pd.errors.EmptyDataError):
        return None


def param_columns(runs: pd.DataFrame) -> list[str]:
    return [c for c in runs.columns if c.startswith(PARAM)]


def _hashable(v):
    """Params become table keys: lists and dicts (e.g. data.faults) are kept as their JSON text."""
    return json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else v


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and v != v) or v is pd.NA


def _natural_key(s: str) -> list:
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", s)]
