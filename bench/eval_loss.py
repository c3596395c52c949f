"""How large the eval set must be: agreement between two held-out sets, and the cost per run.

    PYTHONPATH=. python bench/eval_loss.py [--sizes 8,16,32,64,128] [--seeds 4]

For each setup (the default run: tiny video DiT, fp32, lr 1e-4, 50 steps; the demo's bf16_amp at lr 1e-3,
30 steps), train once with eval off, then evaluate the final weights on `--seeds` disjoint held-out sets
(eval.seed 0..n-1: other clips, other noise) of each size. Prints per size the mean and the largest
|a - b| / mean(a, b) over all pairs of sets, and the median wall time of one evaluation against the
run's own time (build + train with eval off): the overhead of the one end-of-run evaluation
(eval.every=0). Results: docs/eval_loss.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from sweep.config import to_run_config
from sweep.run.evaluate import build_eval_set, eval_loss
from sweep.run.execute import new_result, prepare
from sweep.run.progress import RunProgress
from sweep.run.results import MetricsLog
from sweep.run.train import train

CONF = str(Path(__file__).resolve().parents[1] / "conf")
SETUPS = {
    "default (fp32, lr 1e-4, 50 steps)": ["progress=none", "eval.enabled=false"],
    "demo (video DiT, bf16_amp, flash, lr 1e-3, 30 steps)": [
        "progress=none",
        "eval.enabled=false",
        "precision=bf16_amp",
        "attention=flash",
        "optim.lr=1e-3",
        "steps=30",
    ],
}


def trained(overrides: list[str]):
    """(run config, its parts after training, the run's seconds: build + train)."""
    with initialize_config_dir(config_dir=CONF, version_base=None):
        run = to_run_config(compose("config", overrides=overrides))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        parts = prepare(run, Path(tmp), new_result(run, {}))
        train(run, parts, MetricsLog(), RunProgress(run.steps, run.progress, run.log_every))
    return run, parts, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,16,32,64,128")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="timed evaluations per size (the median is shown)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    for name, overrides in SETUPS.items():
        run, parts, run_s = trained(overrides)
        print(f"\n{name}: run {run_s:.1f} s (build + {run.steps} steps, eval off)")
        print(f"{'samples':>8} {'mean |a-b|/m':>13} {'max |a-b|/m':>12} {'eval s':>8} {'overhead':>9}  losses")
        for n in sizes:
            losses, times = [], []
            for seed in range(args.seeds):
                r = dataclasses.replace(run, eval=dataclasses.replace(run.eval, samples=n, seed=seed))
                data = build_eval_set(r, parts.objective, parts.device, r.model.is_image)
                parts.model.eval()
                for _ in range(args.repeats if seed == 0 else 1):
                    t0 = time.perf_counter()
                    loss = eval_loss(parts.model, data, parts.policy, parts.device, r.eval.batch_size)
                    times.append(time.perf_counter() - t0) if seed == 0 else None
                losses.append(loss)
            rel = [abs(a - b) / ((a + b) / 2) for a, b in itertools.combinations(losses, 2)]
            eval_s = statistics.median(times)
            print(
                f"{n:>8} {statistics.mean(rel):>12.2%} {max(rel):>12.2%} {eval_s:>8.3f} {eval_s / run_s:>8.2%}  "
                + " ".join(f"{x:.4f}" for x in losses)
            )


if __name__ == "__main__":
    main()
