"""Summary tables of a finished sweep directory (the older name of `python -m sweep.report`).

    python -m sweep.summary outputs/sweeps/2026-11-22/10-00-00 [--write]

Prints the same tables as `python -m sweep.report DIR --no-html`; `--write` also writes summary.md,
summary.csv, summary.parquet and summary_<table>.csv into the directory. The tables live in
`sweep/report/` (see its modules); this module only keeps the old command working.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from sweep.report.__main__ import main as report_main

    parser = argparse.ArgumentParser(
        prog="python -m sweep.summary", description="Print the summary tables of a sweep directory."
    )
    parser.add_argument("sweep_dir", type=Path, help="a multirun directory (holds <n>/result.json)")
    parser.add_argument(
        "--write",
        action="store_true",
        help="also write summary.md, summary.csv, summary.parquet and summary_<table>.csv there",
    )
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"sweep.summary: no such directory: {args.sweep_dir}", file=sys.stderr)
        return 2
    return report_main(
        [str(args.sweep_dir), "--no-html", *(["--write"] if args.write else [])], prog="python -m sweep.summary"
    )


if __name__ == "__main__":
    sys.exit(main())
