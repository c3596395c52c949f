"""Record the trials a sweep's ledger could not take when their runs ended (sweep/search/pending.py).

    python -m sweep.sync_ledger outputs/sweeps/<date>/<time>
    SWEEP_LEDGER_URL=postgresql://... python -m sweep.sync_ledger DIR   # a storage whose URL holds a password

A sweep does this itself at its start and end; this is for a ledger that came back after the sweep
ended. Exit status 0 when nothing is left pending, 1 otherwise (one line per run), 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path


def _seconds(text: str) -> float:
    """--lock-timeout: a finite number of seconds > 0, as ledger.lock_timeout_s must be (-1 or nan was taken)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sweep.sync_ledger", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="the sweep (or single run) directory")
    parser.add_argument(
        "--lock-timeout", type=_seconds, default=30.0, help="seconds to wait for a locked ledger (default 30)"
    )
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"sweep.sync_ledger: {args.sweep_dir} is not a directory", file=sys.stderr)
        return 2
    from hydra import initialize_config_dir

    from sweep.__main__ import CONF_DIR
    from sweep.job import group_or_enum_choices
    from sweep.search.pending import record_pending

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):  # config-group options, as a job sees them
        done, problems = record_pending(
            args.sweep_dir, os.environ.get("SWEEP_LEDGER_URL"), group_or_enum_choices, args.lock_timeout
        )
    print(f"recorded {len(done)} pending trial(s)" + "".join(f"\n  {d}" for d in done))
    for line in problems:
        print(f"still pending: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    from sweep.exit import exit_after

    exit_after(main)
