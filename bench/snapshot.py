"""What a window's snapshot costs (sweep.run.window.Snapshot): the host's time to take one, fresh or written
over the last window's buffers, and to put one back; on a GPU also the time until the device has done it.

    python bench/snapshot.py [--model video_dit_tiny] [--reps 200] [OVERRIDE ...]

On a GPU the device idles while the host takes a window's snapshot (between the window's sync and its first
step), so the host figure is what a graphed loop pays per window (issue #31's "the window snapshot's cost on the
S model": `--model video_dit_s`). Medians of `--reps` snapshots, interleaved fresh / reused.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from step_ops import stepped_once

from sweep.run.window import Snapshot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="video_dit_tiny")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("overrides", nargs="*", help="more config overrides (device=cuda, precision=bf16_amp, ...)")
    args = ap.parse_args()
    lone = stepped_once(args.model, args.overrides)  # AdamW's state made, as in every window after the first
    parts = lone.parts
    cuda = parts.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed(f) -> tuple[float, float]:
        """(host seconds, seconds until the device is done) of one call."""
        sync()
        start = time.perf_counter()
        f()
        host = time.perf_counter() - start
        sync()
        return host, time.perf_counter() - start

    last = Snapshot.of(lone)
    fresh, reused, restore = [], [], []
    for _ in range(args.reps):
        fresh.append(timed(lambda: Snapshot.of(lone)))
        reused.append(timed(lambda: Snapshot.of(lone, reuse=last)))
        restore.append(timed(last.restore))
    tensors = len(last.weights) + len(last.optimizer.copies)
    mib = sum(t.numel() * t.element_size() for t in [*last.weights, *last.optimizer.copies]) / 2**20
    print(f"device {parts.device}, torch {torch.__version__}, model {args.model}: {tensors} tensors, {mib:.1f} MiB")
    for name, times in (("snapshot, fresh buffers", fresh), ("snapshot, the last one's", reused), ("restore", restore)):
        host, done = (statistics.median(t[i] for t in times) * 1e6 for i in (0, 1))
        print(f"  {name:26s} host {host:8.1f} us" + (f", device done {done:8.1f} us" if cuda else ""))


if __name__ == "__main__":
    main()
