"""The summary tables of what went wrong, computed from the runs table (`runs.py`): where the runs first went
wrong (root_causes), the diagnoses of the diverged ones (diagnoses), and each distinct error (errors). The
tables of what went right (the map, the frontier, lr sensitivity, toggles) are in tables.py; both are
registered in registry.py.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pandas as pd

from sweep.report.runs import PARAM, read_diagnosis
from sweep.report.tables import SHORT, WHERE, first_line
from sweep.run.results import recorded_mechanism

NOT_PER_FAILURE = ("optim.lr", "seed")
"""The swept values that do not split a distinct failure (sweep/diagnose/multirun.py diagnoses one run of each)."""
GROUP_DIAGNOSIS = " (group's diagnosis)"


def failure_key(verdict: str | None, mechanism: str | None, params: dict) -> str:
    """A distinct failure: the verdict, the mechanism the run's own signals gave, and every swept value but
    NOT_PER_FAILURE (sweep/diagnose/multirun.py diagnoses one run of each; root_causes counts its others)."""
    kept = {k: v for k, v in params.items() if k not in NOT_PER_FAILURE}
    return json.dumps([verdict, mechanism, kept], sort_keys=True, default=str)


def root_causes(runs: pd.DataFrame) -> pd.DataFrame:
    """Diverged runs counted by verdict and mechanism (rows: sweep/diagnose/mechanism.py, "-" for runs recorded
    before it) and where they first went wrong (columns), with totals. A run not diagnosed itself, of a distinct
    failure whose diagnosed run got another mechanism than its own signals gave, is counted under the diagnosis's,
    marked "(group's diagnosis)"."""
    div = runs[runs.status == "diverged"]
    if div.empty:
        return pd.DataFrame()
    where = div.cause_where.map(lambda w: w if isinstance(w, str) and w else "unknown")
    mechanism = (div.mechanism if "mechanism" in div else pd.Series("-", index=div.index)).map(
        lambda m: m if isinstance(m, str) and m else "-"
    )
    mechanism = _by_group_diagnosis(div, mechanism)
    table = pd.crosstab([div.verdict.fillna("unknown"), mechanism], where)
    cols = [w for w in WHERE if w in table] + sorted(set(table.columns) - set(WHERE) - {"unknown"})
    cols += ["unknown"] if "unknown" in table else []
    verdicts = table.index.get_level_values(0)
    order = [v for v in SHORT if v in verdicts] + sorted(set(verdicts) - set(SHORT))
    rows = sorted(table.index, key=lambda vm: (order.index(vm[0]), vm[1]))
    table = table.loc[rows, cols]
    table["total"] = table.sum(axis=1)
    table.index.names, table.columns.name = ["verdict", "mechanism"], "where"
    return table


def _by_group_diagnosis(div: pd.DataFrame, mechanism: pd.Series) -> pd.Series:
    """`mechanism`, with each undiagnosed run of a diagnosed distinct failure (failure_key) given that diagnosis's,
    marked as such."""
    if "run_dir" not in div:
        return mechanism
    axes = [c for c in div.columns if c.startswith(PARAM)]
    recorded, diagnosed = {}, set()
    for i, run_dir in div.run_dir.items():
        path = Path(str(run_dir))
        diagnosed |= {i} if (path / "diagnosis.json").is_file() else set()
        try:
            recorded[i] = recorded_mechanism(json.loads((path / "result.json").read_text()))
        except (OSError, ValueError):
            recorded[i] = None

    def failure(i) -> str:
        return failure_key(div.at[i, "verdict"], recorded[i], {a[len(PARAM) :]: str(div.at[i, a]) for a in axes})

    found = {failure(i): mechanism[i] for i in diagnosed}

    def counted(i, m: str) -> str:
        group = found.get(failure(i)) if i not in diagnosed else None
        return m if group is None or group == m else group + GROUP_DIAGNOSIS  # its own signals said as much: m

    return pd.Series([counted(i, m) for i, m in mechanism.items()], index=mechanism.index)


# --- 6. diagnoses ------------------------------------------------------------------------------


def diagnoses(runs: pd.DataFrame) -> pd.DataFrame:
    """Diverged runs with a diagnosis.json (python -m sweep.diagnose, or monitor.diagnose=auto at the end of a
    sweep): the run's swept values, verdict@step, mechanism, whether the counterfactual table agrees with it,
    and the fix with whether a run from step 0 confirmed it."""
    rows = []
    axes = [c for c in runs.columns if c.startswith(PARAM) and _varies(runs, c)]
    for r in runs[runs.status == "diverged"].to_dict("records"):  # records: "param:x" is no attribute name
        d, _ = read_diagnosis(Path(str(r["run_dir"])))  # a malformed one is named by runs_from_dirs
        if d is None:
            continue
        fix = d.get("fix") or {}
        rows.append(
            {
                "run": " ".join(f"{a.removeprefix(PARAM)}={r[a]}" for a in axes) or Path(str(r["run_dir"])).name,
                "outcome": f"{d.get('verdict')}@{d.get('first_bad_step')}",
                "mechanism": d.get("mechanism"),
                "table_agrees": "yes" if d.get("agrees") else "no",
                "fix": " ".join(fix.get("overrides") or []) or "-",
                "fix_confirmed": "yes" if fix.get("confirmed") else ("no" if fix.get("tried") else "not run"),
            }
        )
    return pd.DataFrame(rows).set_index("run") if rows else pd.DataFrame()


def _varies(runs: pd.DataFrame, column: str) -> bool:
    return runs[column].astype(str).nunique() > 1


# --- 7. errors ---------------------------------------------------------------------------------


def errors(runs: pd.DataFrame) -> pd.DataFrame:
    """Each distinct error, then each distinct reason a run was skipped (a pruned run aside: the map says
    `pruned@step`): status, the reason result.json gives (its first line), how many runs, and one run dir."""
    failed = runs[runs.status.isin(["error", "skipped"])]
    if "pruned_at_step" in failed:
        failed = failed[failed.pruned_at_step.isna()]
    if failed.empty:
        return pd.DataFrame()
    reasons = failed.reason.map(first_line) if "reason" in failed else pd.Series("", index=failed.index)
    rows = [
        {
            "status": status,
            "reason": reason or "(no reason recorded)",
            "runs": len(group),
            "run_dir": next((d for d in group.run_dir if d), None),
        }
        for (status, reason), group in failed.groupby([failed.status, reasons], sort=False)
    ]
    rows.sort(key=lambda r: (r["status"] != "error", -r["runs"], r["reason"]))
    return pd.DataFrame(rows, columns=["status", "reason", "runs", "run_dir"])


def errors_text(table: pd.DataFrame, width: int) -> str:
    """The errors table for the terminal: a line per row (status, runs, one run dir), its reason indented under it
    (a reason and a run dir side by side do not fit a terminal's width)."""
    out = []
    for r in table.itertuples(index=False):
        out.append(f"{r.status}: {r.runs} run{'s' if r.runs != 1 else ''}, e.g. {r.run_dir}")
        out.append(textwrap.fill(r.reason, width, initial_indent="  ", subsequent_indent="    "))
    return "\n".join(out)
