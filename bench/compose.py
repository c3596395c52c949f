"""One Hydra composition plus validation (`tests/conftest.make_run`) over a grid's cells, with and without
sweep/config/compose_memo.py, in one process.

    OMP_NUM_THREADS=1 python bench/compose.py [--rounds 3]

The grid is 3 precisions x 4 lrs: each precision's first cell composes afresh, the other three differ from it
only in a value and reuse its defaults list and merge. Prints the CPU time per call of each, alternated.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sweep.config import compose_memo  # noqa: E402
from tests.conftest import make_run  # noqa: E402

CELLS = [(p, lr) for p in ("fp32", "bf16_amp", "fp16_amp") for lr in ("1e-4", "3e-4", "1e-3", "3e-3")]


def per_call() -> float:
    start = time.process_time()
    for precision, lr in CELLS:
        make_run(f"precision={precision}", f"optim.lr={lr}")
    return (time.process_time() - start) / len(CELLS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    make_run()  # imports and the first parse of every file, outside the timing
    for _ in range(args.rounds):
        compose_memo.uninstall()  # a fresh memo each round, so each precision's first cell composes afresh
        without = per_call()
        compose_memo.install()
        with_memo = per_call()
        print(
            f"{len(CELLS)} cells of make_run: without {without * 1e3:.1f} ms/call, with {with_memo * 1e3:.1f} ms/call"
        )


if __name__ == "__main__":
    main()
