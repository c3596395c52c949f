"""What opening a SQLite ledger costs, with Optuna's migration scripts parsed once per process and without.

    python bench/ledger_open.py [--ledgers 20] [--rounds 3]

Each round runs two fresh interpreters in turn: one opens `--ledgers` new SQLite ledgers and then each of them
again with Optuna as it is, the other the same after `sweep.search.optuna_schema.parse_migrations_once()` (what
importing sweep.search.ledger does). Both open one ledger first, so Optuna's and SQLAlchemy's imports and the
first parse are outside the figures. It prints the milliseconds per open, new and again, for each round.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import sys, tempfile, time
import optuna
optuna.logging.set_verbosity(optuna.logging.WARNING)
if sys.argv[1] == "once":
    from sweep.search.optuna_schema import parse_migrations_once
    assert parse_migrations_once()
n = int(sys.argv[2])
with tempfile.TemporaryDirectory() as d:
    optuna.storages.RDBStorage(f"sqlite:///{d}/first.db")
    start = time.perf_counter()
    for i in range(n):
        optuna.storages.RDBStorage(f"sqlite:///{d}/{i}.db")
    new = time.perf_counter()
    for i in range(n):
        optuna.storages.RDBStorage(f"sqlite:///{d}/{i}.db")
    again = time.perf_counter()
print(f"{(new - start) / n * 1e3:.1f} {(again - new) / n * 1e3:.1f}")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ledgers", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"ms per SQLite ledger opened ({args.ledgers} new, then each again), Optuna as it is | parsed once")
    for r in range(args.rounds):
        figures = []
        for mode in ("as_is", "once"):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, mode, str(args.ledgers)],
                cwd=REPO,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            figures.append(f"new {float(out[0]):6.1f}  again {float(out[1]):5.1f}")
        print(f"round {r + 1}: {figures[0]} | {figures[1]}")


if __name__ == "__main__":
    main()
