"""The optimizer step alone: sweep.run.adamw.DeviceAdamW against torch's single-tensor AdamW, on the CPU.

    python bench/adamw.py [--model video_dit_tiny] [--steps 25] [--rounds 3]

DeviceAdamW is torch's AdamW bit for bit (tests/test_adamw.py) with its per-step scalars on the device, so a
CUDA graph can capture it; this prints what that costs per step where there is no graph: the median time of
one `step()` of each, on the model's own weights (random gradients), per pure precision, interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from throughput import fresh_parts, run_config

from sweep.run.precision import PrecisionPolicy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="video_dit_tiny")
    ap.add_argument("--steps", type=int, default=25, help="timed steps per round (after 5 untimed)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    device = torch.device("cpu")
    print(f"device cpu, torch {torch.__version__}, {torch.get_num_threads()} threads, model {args.model}")
    print(f"{'precision':<12}{'weights':>9}{'torch ms':>10}{'device ms':>11}{'extra':>8}")
    for name in ("fp32", "bf16_pure", "fp16_pure"):
        run = run_config([f"precision={name}", f"model={args.model}", f"steps={args.steps + 10}", "progress=none"])
        parts = fresh_parts(run, PrecisionPolicy.from_config(run.precision, device, run.compile), device)
        params = [p for p in parts.model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        ours = parts.optimizer
        theirs = torch.optim.AdamW(params, lr=run.optim.lr, foreach=False)
        times = {"torch": [], "device": []}
        for _ in range(args.rounds):
            for which, opt in (("torch", theirs), ("device", ours)):
                ours.state.clear()  # every round counts its updates from 1: the tables cover steps + 10
                spent = []
                for step in range(args.steps + 5):
                    if which == "device":
                        ours.at(step)
                    start = time.perf_counter()
                    opt.step()
                    spent.append(time.perf_counter() - start)
                times[which].append(statistics.median(spent[5:]))
        a, b = statistics.median(times["torch"]) * 1e3, statistics.median(times["device"]) * 1e3
        print(f"{name:<12}{len(params):>9}{a:>10.2f}{b:>11.2f}{b - a:>+8.2f}")


if __name__ == "__main__":
    main()
