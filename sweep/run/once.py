"""Lines that would repeat for every run of a sweep, said once per sweep.

The runs of a sweep share its data, so a data line ("data.drop_bad: left out 2 of 11 samples", "data: 11
training files from DIR, 1 held out") is the same for each of its 96 runs: a user's trial saw the same two
for every run. `say_once` logs a line the first time the current sweep says it, and at debug level after that
(Hydra's default INFO level leaves it out of the console and of later jobs' own log files: the first job's
log has it); a line that differs (another data.path in a cell) is said again.

A sweep is what `per_sweep(sweep_dir)` is open around: sweep/job.py and the packed launcher open it
around each job of a multirun, and the sweep's start forgets what an earlier sweep in the same directory
and process said (sweep/callbacks.py OutputDirCheck). Outside one (a single run, a test calling execute)
every line is said. Memory is per process: with the in-process launchers (Hydra's basic, packed) a line is
said once per sweep; jobs that run in processes of their own (joblib, submitit, Slurm) say it once per
worker process.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

_current: str | None = None
_said: dict[str, set[str]] = {}


@contextlib.contextmanager
def per_sweep(sweep_dir: Path | str | None) -> Iterator[None]:
    """Inside, say_once says each line once for the sweep of `sweep_dir` (None: every line, as for a single run)."""
    global _current
    before, _current = _current, None if sweep_dir is None else str(Path(sweep_dir).resolve())
    try:
        yield
    finally:
        _current = before


def forget(sweep_dir: Path | str) -> None:
    """A new sweep starts in `sweep_dir`: what an earlier one there said is said again."""
    _said.pop(str(Path(sweep_dir).resolve()), None)


def say_once(logger: logging.Logger, level: int, msg: str, *args: object) -> bool:
    """Log `msg % args` at `level` unless the current sweep said it already (then at debug); True when said."""
    text = msg % args if args else msg
    if _current is not None:
        said = _said.setdefault(_current, set())
        if text in said:
            logger.debug("%s (said once for the sweep)", text)
            return False
        said.add(text)
    logger.log(level, "%s", text)
    return True
