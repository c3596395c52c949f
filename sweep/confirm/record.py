"""confirmation.json: written whole after every seed (a reader or a resume never sees half of one), and read back
by a resume, which redoes none of the settings it already holds for the same grid runs and horizon.

Format (sweep/report/confirmation.py reads it for the report; docs/confirmation.md has the table):
    {"format": "dit-sweep-confirmation/1", "steps", "factor", "budget", "limit_s", "sweep_seconds", "seconds",
     "runs", "steps_trained", "complete", "interrupted",
     "settings": [{"combination", "params", "lr", "why", "step_down_from", "steps", "grid_steps", "held",
                   "note", "seconds", "seeds": [{"seed", "status", "verdict", "first_bad_step", "eval_loss",
                   "final_loss", "steps_run", "start_step", "how", "reason", "seconds", "grid_run", "record"}]}],
     "left_out": [{"combination", "params", "lr", "why", "estimate_s"}], "command"}
Paths are relative to the sweep directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from sweep.report.confirmation import CONFIRMATION_FILE, FORMAT
from sweep.run.results import json_safe


def write_record(sweep_dir: Path, record: dict) -> Path:
    """`record` as <sweep>/confirmation.json, atomically (a temporary file renamed)."""
    path = Path(sweep_dir) / CONFIRMATION_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(json_safe({"format": FORMAT, **record}), indent=2, allow_nan=False) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def previous_settings(sweep_dir: Path) -> dict[tuple, dict]:
    """The settings an earlier confirmation of this sweep recorded, by (combination, lr, steps); {} when there is
    none or it cannot be read (it is then redone)."""
    try:
        data = json.loads((Path(sweep_dir) / CONFIRMATION_FILE).read_text())
        if data.get("format") != FORMAT:
            return {}
        return {(s["combination"], s.get("lr"), s["steps"]): s for s in data["settings"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def relative(path: str | Path, sweep_dir: Path) -> str:
    """A path as confirmation.json holds it: relative to the sweep directory where it lies inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path(sweep_dir).resolve()))
    except ValueError:
        return str(path)
