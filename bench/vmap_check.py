"""Whether the SDPA kernels a pack refuses on CUDA (sweep.run.packing.cuda_vmap_failure) still fail under vmap.

    python bench/vmap_check.py [--steps 6]

For each refused combination: two runs packed (sweep.run.packing.execute_pack, which does not ask the refusal:
the launcher's grouping does) and the same two runs alone. It prints whether the pack trained, the error it
ended with if not, and per run whether the verdict matches the run alone and how far the packed loss curve
is from it. A kernel whose pack trains and matches no longer needs its refusal on this torch build
(issue #31). On the CPU nothing is refused: there it says so and checks nothing.
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from throughput import run_config

from sweep.run.build import resolve_device
from sweep.run.execute import execute
from sweep.run.packing import cuda_vmap_failure, execute_pack

REFUSED = [("bf16_amp", "math"), ("bf16_amp", "efficient"), ("fp16_amp", "efficient"), ("fp32", "efficient")]


def losses(run_dir: Path) -> list[float]:
    with open(run_dir / "metrics.csv") as f:
        return [float(row["loss"]) for row in csv.DictReader(f) if row.get("loss") not in (None, "")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    device = resolve_device("auto")
    print(f"device {device}, torch {torch.__version__}")
    base = Path(tempfile.mkdtemp(prefix="vmap_check_"))
    for precision, attention in REFUSED:
        runs = [
            run_config(
                [
                    f"precision={precision}",
                    f"attention={attention}",
                    f"steps={args.steps}",
                    f"optim.lr={lr}",
                    f"seed={i}",
                    "progress=none",
                    "monitor.forensics=false",
                ]
            )
            for i, lr in enumerate([1e-4, 1e-3])
        ]
        why = cuda_vmap_failure(runs[0], device)
        name = f"{precision}/{attention}"
        if why is None:
            print(f"{name:<20} not refused here: nothing to check")
            continue
        here = base / name.replace("/", "_")
        alone = [execute(r, here / f"alone{i}", {}) for i, r in enumerate(runs)]
        packed = execute_pack(runs, [here / f"packed{i}" for i in range(2)], [{}, {}], ["0", "1"])
        if any(p.status == "error" for p in packed):
            reason = next(p.reason for p in packed if p.status == "error")
            print(f"{name:<20} STILL FAILS packed: {(reason or '').strip().splitlines()[:1]}")
            continue
        lines = []
        for i, (a, p) in enumerate(zip(alone, packed)):
            la, lp = losses(here / f"alone{i}"), losses(here / f"packed{i}")
            gap = max((abs(x - y) / max(abs(x), 1e-12) for x, y in zip(la, lp)), default=float("nan"))
            same = (a.status, a.verdict, a.first_bad_step) == (p.status, p.verdict, p.first_bad_step)
            lines.append(f"run {i}: {p.status}/{p.verdict} {'=' if same else '!='} alone, loss rel. gap {gap:.1e}")
        print(f"{name:<20} packs now: " + "; ".join(lines))


if __name__ == "__main__":
    main()
