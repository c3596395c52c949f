"""How long the synthetic clips take: rendering a dataset's whole cache, and one batch loaded and checked.

    python bench/synthetic_data.py [--samples 256] [--batch 32]

The default data shape (8 frames of 3x16x16). The figures that tests/test_data.py used to hold to 2 s and
0.1 s on any machine (a timed assert), printed here instead.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sweep.data.batches import BatchOrder, load_batch
from sweep.data.checks import check_batch
from sweep.data.synthetic import SyntheticClips


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    start = time.perf_counter()
    ds = SyntheticClips(args.samples, seed=0, frames=8, channels=3, height=16, width=16)
    ds.clip(0)  # renders the whole cache
    render = time.perf_counter() - start
    start = time.perf_counter()
    batch = load_batch(ds, BatchOrder(args.samples, args.batch, seed=0).indices(0))
    issue = check_batch(batch)
    load = time.perf_counter() - start
    print(f"rendering {args.samples} clips: {render:.3f} s")
    print(f"one batch of {args.batch} loaded and checked: {load * 1e3:.1f} ms")
    if issue is not None:
        sys.exit(f"bench/synthetic_data.py: the clean data failed its check: {issue.detail}")


if __name__ == "__main__":
    main()
