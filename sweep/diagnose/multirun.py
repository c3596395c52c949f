"""monitor.diagnose=auto: at the end of a multirun, diagnose one diverged run per distinct failure, within a budget.

A distinct failure is a verdict and mechanism with every swept value but the lr and the seed; of its runs the
one at the smallest lr is diagnosed (the lr the user would try first). Failures are taken largest first: the
first always (a small sweep's run time would not pay for any), the others while the estimated cost fits the
budget (monitor.diagnose_budget x the sweep's own run time; 0 diagnoses none); the rest are named with the
command that diagnoses them. Every diagnosis writes its run's diagnosis.json, which the summary reads.
After the confirmation at a longer horizon (confirm.mode=auto), `diagnose_confirmation` does the same for the
seeds that failed there (sweep/callbacks.py calls both).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Callable

from sweep.diagnose.diagnosis import DIAGNOSIS_FILE, diagnose
from sweep.diagnose.record import DiagnoseError
from sweep.report.causes import failure_key
from sweep.run.interrupt import Stopped, stopping_on_signals
from sweep.run.results import RESULT_FILE, TRIAL_FILE, recorded_mechanism

log = logging.getLogger("sweep")

COST = 8.0
"""A diagnosis's estimated cost in multiples of its run's own time (replay + six short rows + the fix)."""


def distinct_failures(results: list[dict], by_lr: bool = True) -> list[list[dict]]:
    """Diverged runs grouped by verdict, mechanism and swept values but lr and seed; largest group first, each
    sorted by lr (by_lr=False: both in the order given)."""
    groups: dict[str, list[dict]] = {}
    for r in results:
        if r.get("status") != "diverged":
            continue
        key = failure_key(r.get("verdict"), recorded_mechanism(r), r.get("params") or {})
        groups.setdefault(key, []).append(r)
    if not by_lr:
        return list(groups.values())
    for g in groups.values():
        g.sort(key=lambda r: (r.get("params") or {}).get("optim.lr") or 0.0)
    return sorted(groups.values(), key=len, reverse=True)


def diagnose_sweep(sweep_dir: Path, budget: float, progress: Callable[[str], None] = print) -> list[Path]:
    """Diagnose the sweep's distinct failures within `budget` x its run time; returns the run dirs diagnosed."""
    results = _read([(path.parent, path) for path in sorted(Path(sweep_dir).glob(f"*/{RESULT_FILE}"))])
    failures = distinct_failures(results)
    if not failures:
        return []
    limit = budget * sum(r.get("seconds") or 0.0 for r in results)
    within = f"the largest, then the others within {limit:.0f} s" if budget else "none"
    progress(
        f"Diagnosing {len(failures)} distinct failure(s) of {sum(map(len, failures))} diverged run(s): {within} "
        f"(monitor.diagnose_budget={budget:g} x the sweep's run time; monitor.diagnose=off skips this)"
    )
    return _diagnose(failures, budget, limit, sweep_dir, progress)


def diagnose_confirmation(sweep_dir: Path, budget: float, progress: Callable[[str], None] = print) -> list[Path]:
    """Diagnose the seeds that diverged at the confirmation's longer horizon (confirmation.json; sweep/confirm/), one
    per distinct failure as the grid's are: the first always (the recommended setting's, where it failed: why the
    answer did not hold is the finding), the others within `budget` x the sweep's run time. Each diagnosis.json is
    written in its seed's run dir (<sweep>/confirm/<setting>/seed_<s>/), where the report reads it
    (sweep/report/confirmation.py). Returns the run dirs diagnosed."""
    from sweep.report.confirmation import CONFIRMATION_FILE, RECOMMENDED

    try:
        record = json.loads((Path(sweep_dir) / CONFIRMATION_FILE).read_text())
        settings = sorted(record["settings"], key=lambda s: RECOMMENDED not in s.get("why", []))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none, or damaged: the report says which
        return []
    failed = [
        (Path(sweep_dir) / x["record"]).parent
        for s in settings
        for x in (s.get("seeds") or [])
        if isinstance(x, dict) and x.get("status") == "diverged" and isinstance(x.get("record"), str)
    ]
    failures = distinct_failures(_read([(d, d / TRIAL_FILE) for d in failed]), by_lr=False)
    if not failures:
        return []
    grid = _read([(path.parent, path) for path in sorted(Path(sweep_dir).glob(f"*/{RESULT_FILE}"))])
    limit = budget * sum(r.get("seconds") or 0.0 for r in grid)
    within = f"the first, then the others within {limit:.0f} s" if budget else "none"
    steps = sorted({s.get("steps") for s in settings if isinstance(s.get("steps"), int)})
    progress(
        f"Diagnosing {len(failures)} distinct failure(s) of the confirmation at {'/'.join(map(str, steps))} steps: "
        f"{within} (monitor.diagnose_budget={budget:g} x the sweep's run time)"
    )
    return _diagnose(failures, budget, limit, sweep_dir, progress)


def _read(paths: list[tuple[Path, Path]]) -> list[dict]:
    """Each (run dir, its record) read, with the run dir as `_dir`; an unreadable record left out."""
    out = []
    for run_dir, path in paths:
        try:
            out.append(json.loads(path.read_text()) | {"_dir": run_dir})
        except (OSError, ValueError, TypeError):
            continue
    return out


def _name(run_dir: Path, sweep_dir: Path) -> str:
    """The run dir as the sweep's progress names it: `3`, `confirm/<setting>/seed_1`."""
    try:
        return str(Path(run_dir).relative_to(sweep_dir))
    except ValueError:
        return str(run_dir)


def _diagnose(failures: list[list[dict]], budget: float, limit: float, sweep_dir: Path, progress) -> list[Path]:
    """Diagnose the first run of each group: the first group always, the others while their estimated cost fits
    `limit` seconds; returns the run dirs diagnosed (or diagnosed before)."""
    done, spent, left = [], 0.0, []
    for group in failures:
        run = group[0]
        if (run["_dir"] / DIAGNOSIS_FILE).is_file():  # a resumed sweep: diagnosed before
            done.append(run["_dir"])
            continue
        estimate = COST * (run.get("seconds") or 0.0)
        if budget == 0 or (done and spent + estimate > limit):  # the largest failure is always diagnosed
            left.append(run["_dir"])
            continue
        start = time.perf_counter()
        progress(
            f"diagnosing {_name(run['_dir'], sweep_dir)} ({run.get('verdict')}@{run.get('first_bad_step')}, "
            f"{len(group)} run(s) like it)"
        )
        try:
            with stopping_on_signals(when="after the step of the diagnosis's run in progress"):
                d = diagnose(run["_dir"], progress=lambda line: progress("  " + line))
        except (DiagnoseError, ValueError, RuntimeError) as e:  # a diagnosis never fails the sweep
            progress(f"  not diagnosed: {e}")
            continue
        except Stopped as e:  # Ctrl-C/SIGTERM: the sweep stops, as it does during its runs
            print(
                f"sweep: {e.name}: stopped diagnosing {run['_dir']} (no diagnosis.json written; every run of the "
                f"sweep is done): python -m sweep.diagnose {run['_dir']} diagnoses it, python -m sweep.report "
                f"{sweep_dir} prints the summary",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(128 + e.signum) from None
        spent += time.perf_counter() - start
        fix = d["fix"]
        progress(
            f"  {d['mechanism']}; fix {' '.join(fix['overrides']) or '-'}: "
            f"{'confirmed' if fix.get('confirmed') else 'not confirmed'} ({time.perf_counter() - start:.0f} s)"
        )
        done.append(run["_dir"])
    if left:
        progress(
            f"{len(left)} distinct failure(s) left undiagnosed by the budget: python -m sweep.diagnose "
            + " ".join(str(p) for p in left[:3])
            + (" ..." if len(left) > 3 else "")
        )
    return done
