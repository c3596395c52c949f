"""monitor.diagnose=auto: at the end of a multirun, diagnose one diverged run per distinct failure, within a budget.

A distinct failure is a verdict and mechanism with every swept value but the lr and the seed; of its runs the
one at the smallest lr is diagnosed (the lr the user would try first). Failures are taken largest first: the
first always (a small sweep's run time would not pay for any), the others while the estimated cost fits the
budget (monitor.diagnose_budget x the sweep's own run time; 0 diagnoses none); the rest are named with the
command that diagnoses them. Every diagnosis writes its run's diagnosis.json, which the summary reads.
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
from sweep.run.results import recorded_mechanism

log = logging.getLogger("sweep")

COST = 8.0
"""A diagnosis's estimated cost in multiples of its run's own time (replay + six short rows + the fix)."""


def distinct_failures(results: list[dict]) -> list[list[dict]]:
    """Diverged runs grouped by verdict, mechanism and swept values but lr and seed; largest group first, each
    sorted by lr."""
    groups: dict[str, list[dict]] = {}
    for r in results:
        if r.get("status") != "diverged":
            continue
        key = failure_key(r.get("verdict"), recorded_mechanism(r), r.get("params") or {})
        groups.setdefault(key, []).append(r)
    for g in groups.values():
        g.sort(key=lambda r: (r.get("params") or {}).get("optim.lr") or 0.0)
    return sorted(groups.values(), key=len, reverse=True)


def diagnose_sweep(sweep_dir: Path, budget: float, progress: Callable[[str], None] = print) -> list[Path]:
    """Diagnose the sweep's distinct failures within `budget` x its run time; returns the run dirs diagnosed."""
    results = []
    for path in sorted(Path(sweep_dir).glob("*/result.json")):
        try:
            results.append(json.loads(path.read_text()) | {"_dir": path.parent})
        except (OSError, ValueError):
            continue
    failures = distinct_failures(results)
    if not failures:
        return []
    limit = budget * sum(r.get("seconds") or 0.0 for r in results)
    within = f"the largest, then the others within {limit:.0f} s" if budget else "none"
    progress(
        f"Diagnosing {len(failures)} distinct failure(s) of {sum(map(len, failures))} diverged run(s): {within} "
        f"(monitor.diagnose_budget={budget:g} x the sweep's run time; monitor.diagnose=off skips this)"
    )
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
            f"diagnosing {run['_dir'].name} ({run.get('verdict')}@{run.get('first_bad_step')}, "
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
