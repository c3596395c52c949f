"""Could a lone run be a pack of one? Its numbers and its speed in the loop's lone layout (sweep/run/lone.py)
against its stacked layout (sweep/run/packed.py, K=1), on the same machine, for each precision policy.

    python bench/pack_of_one.py [--steps 40] [--repeats 3] [OVERRIDE ...]

For each policy it builds the run twice from the same config (sweep.run.execute.prepare: same seeds, same
initial weights) and trains it lone and as a pack of one, `--repeats` times each, alternating. It prints
whether every metrics row is bit-identical (loss, gradient norm, loss scale, lr; attention statistics are
compared separately: a pack records none), the first step whose loss differs, and the median seconds per
step of each. Issues #32 and #47 asked for this before a lone run may become a pack of one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from throughput import run_config

from sweep.config import Progress
from sweep.run.execute import prepare
from sweep.run.progress import RunProgress
from sweep.run.results import MetricsLog, RunResult
from sweep.run.train import Loop

POLICIES = ("fp32", "bf16_amp", "fp16_amp", "bf16_pure")
NUMBERS = ("loss", "grad_norm", "loss_scale", "lr", "skipped")


def one(run, packed: bool) -> tuple[list[dict], float]:
    with tempfile.TemporaryDirectory() as d:
        parts = prepare(run, Path(d), RunResult(status="error"))
        metrics, progress = MetricsLog(), RunProgress(run.steps, Progress.none, run.log_every)
        start = time.perf_counter()
        Loop([run], [parts], [metrics], progress, stacked=packed).run(0)  # a stacked pack of one, or lone
        return metrics.rows, (time.perf_counter() - start) / max(1, len(metrics.rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    print(f"{'policy':10} {'rows equal':>10} {'first loss diff':>16} {'logit stats':>12} {'lone ms':>8} {'pack ms':>8}")
    for policy in POLICIES:
        run = run_config([f"precision={policy}", f"steps={args.steps}", "threads=1", *args.overrides])
        times = {False: [], True: []}
        rows = {}
        for _ in range(args.repeats):
            for packed in (False, True):
                rows[packed], seconds = one(run, packed)
                times[packed].append(seconds)
        lone, pack = rows[False], rows[True]
        same = len(lone) == len(pack) and all(
            all(repr(a.get(k)) == repr(b.get(k)) for k in NUMBERS) for a, b in zip(lone, pack)
        )
        diff = next((a["step"] for a, b in zip(lone, pack) if repr(a["loss"]) != repr(b["loss"])), "-")
        logits = "lone only" if any(r.get("attn_max_logit") not in ("", None) for r in lone) else "neither"
        ms = [1e3 * statistics.median(times[p]) for p in (False, True)]
        print(f"{policy:10} {str(same):>10} {str(diff):>16} {logits:>12} {ms[0]:8.2f} {ms[1]:8.2f}", flush=True)


if __name__ == "__main__":
    main()
