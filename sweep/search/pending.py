"""Trials the ledger could not take when their run ended, recorded later.

A run's result.json is written before its trial (sweep/job.py), so a ledger that is locked by another
process (SQLite, after `ledger.lock_timeout_s`), a database server that is down, or a ledger file that
is damaged loses nothing: the job leaves `<run dir>/.ledger_pending.json` saying where the trial
belongs, and it is recorded at the next chance: at the start and the end of the sweep
(sweep/callbacks.py `PendingTrials`), when a sweep whose jobs run in processes of their own is stopped by a
signal (sweep.run.interrupt.launch_forwarding_signals), or with `python -m sweep.sync_ledger SWEEP_DIR`.

The job leaves the marker before it writes the ledger and removes it once its trial is in, so a job killed
while it records (joblib kills a sweep's other workers when one job ends by an exception) leaves its trial to
be recorded, not lost. A run directory that a live process still writes (sweep.run.results.is_being_written)
is left alone: its job records its own trial.

The marker holds no password: a storage URL with one is left out ("storage_withheld"), and whoever
records it later passes the live URL (the sweep's resolved `ledger.storage`, or SWEEP_LEDGER_URL).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from pathlib import Path
from typing import Callable, Optional

from sweep.config import LedgerConfig
from sweep.run.results import is_being_written
from sweep.search.ledger import record_run, storage_error_line, url_has_password

log = logging.getLogger("sweep")

PENDING_FILE = ".ledger_pending.json"


def mark_pending(
    cfg: LedgerConfig, sweep_dir: Path, run_dir: Path, penalty_factor: float, error: str, quiet: bool = False
) -> bool:
    """Leave the marker in the run directory; False when it cannot be written (a read-only directory: said in
    one line, unless `quiet`)."""
    withheld = bool(cfg.storage) and url_has_password(cfg.storage)
    marker = {
        "storage": None if withheld else cfg.storage,
        "storage_withheld": withheld,
        "study_name": cfg.study_name,
        "trial_number": cfg.trial_number,
        "sweep_dir": str(Path(sweep_dir).resolve()),
        "sweep_dir_as_given": str(sweep_dir),  # the study of a sweep an older version named (ledger.study_name)
        "penalty_factor": penalty_factor,
        "error": error,
    }
    path = Path(run_dir) / PENDING_FILE
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(marker, indent=2) + "\n")
        tmp.replace(path)
    except OSError as e:
        if not quiet:
            log.error("ledger: cannot leave %s either (%s): record this run by hand", path, e)
        return False
    return True


RECORDING = "the job ended before its trial was recorded"
"""The marker's error while its job records the trial (sweep/job.py record): what it means once found later."""


def unmark_pending(run_dir: Path) -> None:
    """The run's trial is in the ledger: no marker any more."""
    with contextlib.suppress(OSError):
        (Path(run_dir) / PENDING_FILE).unlink()


def pending_runs(sweep_dir: Path) -> list[Path]:
    """Run directories under `sweep_dir` whose trial waits to be recorded (not those a live job still writes)."""
    return sorted(p.parent for p in Path(sweep_dir).rglob(PENDING_FILE) if not is_being_written(p.parent))


def record_pending(
    sweep_dir: Path,
    storage: Optional[str] = None,
    choices_of: Callable[[str], Optional[list]] = lambda key: None,
    lock_timeout_s: float = 30.0,
) -> tuple[list[Path], list[str]]:
    """Record every pending trial under `sweep_dir`; returns (runs recorded, problems, one line each).

    `storage` replaces a withheld URL (and only that: a marker's own storage wins)."""
    done, problems = [], []
    for run_dir in pending_runs(sweep_dir):
        try:
            marker = json.loads((run_dir / PENDING_FILE).read_text())
            result = json.loads((run_dir / "result.json").read_text())
            url = storage if marker.get("storage_withheld") else marker.get("storage")
            if marker.get("storage_withheld") and not url:
                raise ValueError("its storage URL holds a password: set SWEEP_LEDGER_URL")
            cfg = dataclasses.replace(
                LedgerConfig(),
                storage=url,
                study_name=marker.get("study_name"),
                trial_number=marker.get("trial_number"),
                lock_timeout_s=lock_timeout_s,
            )
            given = marker.get("sweep_dir_as_given")
            aliases = (given,) if isinstance(given, str) else ()
            record_run(cfg, Path(marker["sweep_dir"]), run_dir, result, choices_of, marker["penalty_factor"], aliases)
            (run_dir / PENDING_FILE).unlink()
            done.append(run_dir)
        except Exception as e:  # noqa: BLE001  (the ledger may still be down: stays pending, said in one line)
            problems.append(f"{run_dir}: {storage_error_line(e)}")
    return done, problems
