"""compile=true against eager on the default model: training steps/s, and compile time cold vs cached.

    OMP_NUM_THREADS=1 python bench/compile.py [--steps 30] [--precisions fp32,bf16_amp] [--attention math] [--threads 1]

Per precision, in one process: an eager run, then two compiled runs of the same config. Compiled
run 1 starts from an empty inductor cache (a fresh TORCHINDUCTOR_CACHE_DIR, unless --cache-dir
names one); run 2 is a new run of the same shapes after torch._dynamo.reset(), as the next job of a
multirun is, so its compile comes from inductor's FX graph cache and AOTAutograd's cache.
"compile s" is sweep.run.compiled.compile_run (compile + the profiled kernel check) before step 0;
steps/s is the real training loop (sweep.run.train.train) after it, logit-watch steps (every
monitor.logit_every, eager) included.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--precisions", default="fp32,bf16_amp")
    parser.add_argument("--attention", default="math")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-dir", default=None, help="inductor cache dir (default: a fresh, empty one)")
    args = parser.parse_args()
    # Before torch is imported, so run 1 really starts cold.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="inductor-bench-")

    from hydra import compose, initialize_config_dir

    from sweep.config import Progress, to_run_config
    from sweep.run.build import build_parts, reset_process_state, resolve_device
    from sweep.run.compiled import compile_run
    from sweep.run.precision import PrecisionPolicy
    from sweep.run.progress import RunProgress
    from sweep.run.results import MetricsLog
    from sweep.run.train import train

    conf = str(Path(__file__).resolve().parents[1] / "conf")

    def one(precision: str, compiled: bool) -> tuple[float, float]:
        overrides = [
            f"precision={precision}",
            f"attention={args.attention}",
            f"steps={args.steps}",
            f"threads={args.threads}",
            f"compile={str(compiled).lower()}",
            "progress=none",
        ]
        with initialize_config_dir(config_dir=conf, version_base="1.3"):
            run = to_run_config(compose(config_name="config", overrides=overrides))
        device = resolve_device(run.device)
        policy = PrecisionPolicy.from_config(run.precision, device, run.compile)
        reset_process_state(run, policy)
        parts = build_parts(run, device, policy)
        start = time.perf_counter()
        if compiled:
            compile_run(run, parts)
        compile_seconds = time.perf_counter() - start
        start = time.perf_counter()
        train(run, parts, MetricsLog(), RunProgress(run.steps, Progress.none, run.log_every))
        return compile_seconds, run.steps / (time.perf_counter() - start)

    print(
        f"inductor cache: {os.environ['TORCHINDUCTOR_CACHE_DIR']}; attention={args.attention}, "
        f"threads={args.threads}, {args.steps} steps, default model and data (video_dit_tiny, batch 4, 8x16x16)"
    )
    print(
        f"{'precision':10s} {'eager steps/s':>14s} {'compiled steps/s':>17s} {'speed-up':>9s} "
        f"{'compile s (cold)':>17s} {'compile s (cached)':>19s}"
    )
    for precision in args.precisions.split(","):
        _, eager = one(precision, False)
        cold, _ = one(precision, True)
        cached, compiled = one(precision, True)
        print(
            f"{precision:10s} {eager:14.1f} {compiled:17.1f} {compiled / eager:8.2f}x {cold:17.1f} {cached:19.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
