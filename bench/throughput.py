"""Throughput of the default model on this machine, per precision, against the machine's matmul limit.

    python bench/throughput.py [--steps 20] [--model video_dit_tiny] [--precisions fp32,bf16_amp,...]

For each precision: steps/second of the real training loop (sweep.run.train.train, monitor included),
the model FLOP/s it achieves (FLOPs of one forward+backward counted by torch's FlopCounterMode) as
a fraction of a large matmul's FLOP/s (2048² on the CPU, 8192² on a GPU) measured in the same
process and compute dtype, and the overhead of the divergence monitor: the same steps in a bare loop
(forward, backward, optimizer step; no gradient norm, no sync, no checks) versus the monitored loop.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hydra import compose, initialize_config_dir

from sweep.config import Progress, to_run_config
from sweep.run.build import build_parts, reset_process_state, resolve_device
from sweep.run.precision import PrecisionPolicy
from sweep.run.progress import RunProgress
from sweep.run.results import MetricsLog
from sweep.run.train import train

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def run_config(overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=overrides))


def matmul_flops(dtype: torch.dtype, device: torch.device, n: int | None = None, reps: int = 10) -> float:
    """FLOP/s of an n x n matmul: 2048 on the CPU, 8192 on a GPU (2048 is too small to fill one)."""
    n = n or (8192 if device.type == "cuda" else 2048)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(2):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - start)


def step_flops(run, parts) -> int:
    """FLOPs of one forward+backward of the model at the run's batch."""
    x0 = torch.stack([parts.dataset[i] for i in parts.order.indices(0)]).to(parts.device)
    noisy, t, target = parts.objective.sample(x0, torch.Generator(parts.device).manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter, parts.policy.autocast(parts.device):
        loss = parts.objective.loss(parts.model(noisy.to(parts.policy.param_dtype), t), target)
        loss.backward()
    parts.model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def bare_steps(run, parts, steps: int) -> float:
    """Seconds for `steps` steps without monitor, gradient norm or host sync."""
    model, opt, policy, device = parts.model, parts.optimizer, parts.policy, parts.device
    batches = [torch.stack([parts.dataset[i] for i in parts.order.indices(s)]) for s in range(steps)]
    start = time.perf_counter()
    for x0 in batches:
        noisy, t, target = parts.objective.sample(x0.to(device), parts.noise_gen)
        with policy.gemm_mode():  # the run's GEMM path (sweep/run/gemm.py), as the loop has it
            with policy.autocast(device):
                loss = parts.objective.loss(model(noisy.to(policy.param_dtype), t), target)
            (loss * parts.scaler.scale_of()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", default="video_dit_tiny")
    ap.add_argument("--precisions", default="fp32,bf16_amp,fp16_amp,bf16_pure")
    ap.add_argument("--attention", default="math")
    ap.add_argument("--sync-every", type=int, default=1, help="monitor.sync_every: steps per device sync (windows)")
    args = ap.parse_args()
    device = resolve_device("auto")
    print(
        f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, model {args.model}, "
        f"attention {args.attention}, {args.steps} steps per figure, monitor.sync_every={args.sync_every}"
    )
    print(
        f"{'precision':<17}{'steps/s':>9}{'ms/step':>9}{'GFLOP/step':>12}{'model GFLOP/s':>15}"
        f"{'matmul GFLOP/s':>16}{'of matmul':>11}{'bare ms/step':>14}{'monitor cost':>14}"
    )
    for name in args.precisions.split(","):
        # lr small enough that every precision stays stable for the whole figure
        run = run_config(
            [
                f"precision={name}",
                f"model={args.model}",
                f"attention={args.attention}",
                f"steps={args.steps}",
                "optim.lr=1e-5",
                "progress=none",
                "monitor.stall_fraction=1.0",
                f"monitor.sync_every={args.sync_every}",
            ]
        )
        policy = PrecisionPolicy.from_config(run.precision, device, run.compile)
        reset_process_state(run, policy)
        parts = build_parts(run, device, policy)
        flops = step_flops(run, parts)
        train(run, parts, MetricsLog(), RunProgress(2, Progress.none, 1))  # warm-up (allocator, kernels)
        reset_process_state(run, policy)
        parts = build_parts(run, device, policy)
        start = time.perf_counter()
        verdict = train(run, parts, MetricsLog(), RunProgress(run.steps, Progress.none, 1))
        monitored = (time.perf_counter() - start) / run.steps
        if verdict is not None:
            print(f"{name:<17} diverged during the benchmark ({verdict.verdict}); figure not valid")
            continue
        reset_process_state(run, policy)
        parts = build_parts(run, device, policy)
        bare = bare_steps(run, parts, run.steps) / run.steps
        with policy.gemm_mode():  # the peak the run's own GEMM path can reach
            peak = matmul_flops(policy.compute_dtype, device)
        name = f"{name} (emul.)" if policy.gemm == "emulated" else name
        print(
            f"{name:<17}{1 / monitored:>9.2f}{monitored * 1e3:>9.1f}{flops / 1e9:>12.2f}"
            f"{flops / monitored / 1e9:>15.1f}{peak / 1e9:>16.1f}{flops / monitored / peak:>11.1%}"
            f"{bare * 1e3:>14.1f}{(monitored - bare) / bare:>+14.1%}"
        )


if __name__ == "__main__":
    main()
