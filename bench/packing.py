"""Trial packing against running the same runs one after another, and against the machine's matmul limit.

    python bench/packing.py [--model video_dit_tiny] [--precision fp32] [--packs 1,2,4,8,16] [--steps 10] [OVERRIDE ...]

For each pack size K: K runs that differ only in lr (log-spaced, all stable) run once one after
another (sweep.run.execute.execute, the path every lone run takes) and once as one pack
(sweep.run.packing.execute_pack), both end to end (build, train, files). It prints the wall times, the
speed-up, and the model FLOP/s the packed run achieves (K x the FLOPs of one forward+backward,
counted by torch's FlopCounterMode, per second of training) as a fraction of a large matmul's
FLOP/s (2048² on the CPU, 8192² on a GPU) measured in the same process and compute dtype.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from device_kernels import device_time, report
from host_parts import host_parts
from host_parts import line as host_line
from throughput import matmul_flops, run_config, step_flops

import sweep.run.window as window
from sweep.run.build import build_parts, reset_process_state, resolve_device
from sweep.run.execute import execute
from sweep.run.graph import StepGraph
from sweep.run.packed import Stacked
from sweep.run.packing import execute_pack, refusal
from sweep.run.precision import PrecisionPolicy
from sweep.run.step import Steps

PACK_PARTS = {
    "alone: decide": (Steps, "decide"),  # a step run by itself (monitor.sync_every=1): its row, the sync wait, judging
    "forward+backward": (Stacked, "forward_backward"),  # every step's, eager window steps' and captures' included
    "replay": (StepGraph, "__call__"),
    "snapshot": (window.Snapshot, "of"),
    "sync wait": (window, "judge_window"),
    "stand": (window.Windows, "_stand"),
}
"""Where a pack's host time goes (bench/host_parts.py): on a GPU, `sync wait` is the device's share."""


def runs_for(k: int, args) -> list:
    lrs = [10 ** (-5 + 1.5 * i / max(1, k - 1)) for i in range(k)]  # 1e-5 .. 3e-4: stable everywhere
    return [
        run_config(
            [
                f"model={args.model}",
                f"precision={args.precision}",
                f"attention={args.attention}",
                f"steps={args.steps}",
                f"optim.lr={lr:.3g}",
                f"seed={i}",
                "progress=none",
                "monitor.forensics=false",
                *args.override,
            ]
        )
        for i, lr in enumerate(lrs)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="video_dit_tiny")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--attention", default="math")
    ap.add_argument("--packs", default="1,2,4,8,16")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--packed-only", action="store_true", help="skip the K runs one after another (no speed-up column)")
    ap.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="N",
        help="after the figures, the largest pack once more under torch.profiler: where its device time went by "
        "kind, and its N longest kernels (bench/device_kernels.py; 0: not run)",
    )
    ap.add_argument(
        "override", nargs="*", help="config overrides for every run, e.g. data.frames=4 data.height=8 data.width=8"
    )
    args = ap.parse_args()
    device = resolve_device("auto")
    one = runs_for(1, args)[0]
    if (reason := refusal(one, device)) is not None:
        sys.exit(f"bench/packing.py: these runs would train alone, not packed: {reason}")
    policy = PrecisionPolicy.from_config(one.precision, device)
    reset_process_state(one, policy)
    flops = step_flops(one, build_parts(one, device, policy))
    peak = matmul_flops(policy.compute_dtype, device)
    print(
        f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, model {args.model}, "
        f"{args.precision}, attention {args.attention}, {args.steps} steps per run, {' '.join(args.override)} "
        f"{flops / 1e9:.2f} GFLOP per run-step, matmul {peak / 1e9:.0f} GFLOP/s"
    )
    print(
        f"{'K':>3}{'sequential s':>14}{'packed s':>10}{'speed-up':>10}{'packed run-steps/s':>20}"
        f"{'model GFLOP/s':>15}{'of matmul':>11}{'verdicts equal':>16}"
    )
    with tempfile.TemporaryDirectory() as tmp:  # warm-up: allocator, vmap's first trace
        execute_pack(runs_for(2, args)[:2], [Path(tmp) / "a", Path(tmp) / "b"], [{}, {}], ["", ""])
    for k in (int(x) for x in args.packs.split(",")):
        runs = runs_for(k, args)
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            alone = [] if args.packed_only else [execute(r, Path(tmp) / f"seq{i}", {}) for i, r in enumerate(runs)]
            sequential = time.perf_counter() - start
            with host_parts(PACK_PARTS) as spent:
                start = time.perf_counter()
                packed = execute_pack(runs, [Path(tmp) / f"pack{i}" for i in range(k)], [{}] * k, [""] * k)
                together = time.perf_counter() - start
        same = all(
            (a.status, a.verdict, a.first_bad_step) == (b.status, b.verdict, b.first_bad_step)
            for a, b in zip(alone, packed)
        )
        if any(r.status == "error" for r in packed + alone):
            errors = {r.reason or "" for r in packed + alone if r.status == "error"}
            print(f"{k:>3}  runs ended with status error, no figure: {'; '.join(sorted(errors))[:200]}")
            continue
        train_s = max(r.steps_run / r.steps_per_second for r in packed if r.steps_per_second)
        achieved = k * args.steps * flops / train_s
        speed_up = f"{sequential / together:.2f}x" if alone else "-"
        print(
            f"{k:>3}{sequential:>14.1f}{together:>10.1f}{speed_up:>10}{k * args.steps / train_s:>20.1f}"
            f"{achieved / 1e9:>15.1f}{achieved / peak:>11.1%}{str(same) if alone else '-':>16}"
        )
        print(f"      the pack end to end, {host_line(spent, together, args.steps, 'pack-step')}")
    if args.kernels:  # apart from the timed packs: the profiler slows the host
        with tempfile.TemporaryDirectory() as tmp, device_time(device) as rows:
            execute_pack(runs, [Path(tmp) / f"pack{i}" for i in range(k)], [{}] * k, [""] * k)
        print(f"K={k}, the pack end to end under torch.profiler (build, train, eval, files):")
        print(report(rows, args.steps, args.kernels, "pack-step"))


if __name__ == "__main__":
    main()
