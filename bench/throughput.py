"""Throughput of the default model on this machine, per precision, against the machine's matmul limit.

    python bench/throughput.py [--steps 20] [--model video_dit_tiny] [--precisions fp32,bf16_amp,...]

For each precision: steps/second of the real training loop (sweep.run.train.train, monitor included),
the model FLOP/s it achieves (FLOPs of one forward+backward counted by torch's FlopCounterMode) as
a fraction of a large matmul's FLOP/s (2048² on the CPU, 8192² on a GPU) measured in the same
process and compute dtype, and the overhead of the divergence monitor: the same steps in a bare loop
(forward, backward, optimizer step; no gradient norm, no sync, no checks) versus the monitored loop.
The two loops run interleaved for --rounds rounds (alternating which goes first), each on freshly built
parts; ms/step figures are medians over rounds, the monitor's cost the median of the rounds' paired
ratios, with their range in brackets: on a shared machine one pair of runs is not a measurement.
On CUDA more figures: the real loop with graph=true (windows of --graph-every steps replayed from
one CUDA graph, over the run's second half), the bare step captured by hand as one CUDA graph (noise,
forward, backward, torch's fused capturable AdamW: the reference issue #15 holds the loop to, within
1.25x), their ratio, the reference's model FLOP/s as a share of the matmul's, and the loop's own step as
one graph replayed with no windows (what the monitor costs on the device, apart from the windows' host work).
On the CPU, "monitor in-loop" is the monitor's share of one monitored run timed from inside it
(monitor_share): no second loop, so none of the noise between two runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from host_parts import host_parts
from host_parts import line as host_line
from hydra import compose, initialize_config_dir

from models import LogitStats
from sweep.config import Progress, to_run_config
from sweep.run.build import build_parts, reset_process_state, resolve_device
from sweep.run.compiled import compile_run
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
    for step, x0 in enumerate(batches):
        noisy, t, target = parts.objective.sample(x0.to(device), parts.noise_gen)
        opt.at(step)  # the step's lr (sweep/run/adamw.py), as the loop sets it
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
    ap.add_argument(
        "--rounds", type=int, default=5, help="monitored and bare loops, interleaved: figures are medians over rounds"
    )
    ap.add_argument(
        "--graph-every",
        default="8",
        help="CUDA: monitor.sync_every of the graph=true figure (windows to replay); a list (8,10,16) adds a "
        "line per further value",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="compile=true: every loop's model compiled (and profiled) as a run does it (sweep/run/compiled.py)",
    )
    args = ap.parse_args()
    try:
        windows = [int(w) for w in args.graph_every.split(",")]
    except ValueError:
        ap.error(f"--graph-every: a comma-separated list of whole numbers, not {args.graph_every!r}")
    if any(w < 2 for w in windows):
        ap.error("--graph-every: windows of at least 2 steps (1 is no window, and so no graph)")
    device = resolve_device("auto")
    print(
        f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, model {args.model}, "
        f"attention {args.attention}, {args.steps} steps per figure, monitor.sync_every={args.sync_every}"
    )
    print(
        f"{'precision':<17}{'steps/s':>9}{'ms/step':>9}{'GFLOP/step':>12}{'model GFLOP/s':>15}"
        f"{'matmul GFLOP/s':>16}{'of matmul':>11}{'bare ms/step':>14}{'monitor cost':>14}{'(range)':>20}"
        f"{'monitor in-loop':>16}"
        + (
            f"{'graphed ms':>13}{'bare graph ms':>15}{'graphed/bare':>11}{'bare of mm':>12}"
            if device.type == "cuda"
            else ""
        )
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
                f"compile={str(args.compile).lower()}",
            ]
        )
        policy = PrecisionPolicy.from_config(run.precision, device, run.compile)
        flops = step_flops(run, fresh_parts(dataclasses.replace(run, compile=False), policy, device))
        train(run, fresh_parts(run, policy, device), MetricsLog(), RunProgress(2, Progress.none, 1))  # warm-up
        monitored, bare = [], []
        for r in range(args.rounds):  # interleaved, in alternating order: the machine's drift hits both alike
            for which in ("monitored", "bare") if r % 2 == 0 else ("bare", "monitored"):
                parts = fresh_parts(run, policy, device)
                if which == "bare":
                    bare.append(bare_steps(run, parts, run.steps) / run.steps)
                    continue
                start = time.perf_counter()
                verdict = train(run, parts, MetricsLog(), RunProgress(run.steps, Progress.none, 1))
                monitored.append((time.perf_counter() - start) / run.steps)
                if verdict is not None:
                    break
            if verdict is not None:
                break
        if verdict is not None:
            print(f"{name:<17} diverged during the benchmark ({verdict.verdict}); figure not valid")
            continue
        with policy.gemm_mode():  # the peak the run's own GEMM path can reach
            peak = matmul_flops(policy.compute_dtype, device)
        name = f"{name} (emul.)" if policy.gemm == "emulated" else name
        ratios = sorted(m / b - 1 for m, b in zip(monitored, bare))
        share = monitor_share(run, fresh_parts(run, policy, device)) if device.type == "cpu" else float("nan")
        step, bare_step = statistics.median(monitored), statistics.median(bare)
        line = (
            f"{name:<17}{1 / step:>9.2f}{step * 1e3:>9.1f}{flops / 1e9:>12.2f}"
            f"{flops / step / 1e9:>15.1f}{peak / 1e9:>16.1f}{flops / step / peak:>11.1%}"
            f"{bare_step * 1e3:>14.1f}{statistics.median(ratios):>+14.1%}"
            f"{'[' + f'{ratios[0]:+.1%} .. {ratios[-1]:+.1%}' + ']':>20}{share:>16.1%}"
        )
        if device.type == "cuda":  # graph=true, and the bare step as one graph: the figure the loop is held to
            long = dataclasses.replace(run, steps=max(run.steps, 64))
            reference = bare_graph_step(run, fresh_parts(run, policy, device), run.steps)
            own = loop_graph_step(run, policy, device, run.steps)
            for i, every in enumerate(windows):
                graphed, where = graphed_step(long, policy, device, every)
                if i == 0:
                    line += f"{graphed * 1e3:>13.2f}{reference * 1e3:>15.2f}{graphed / reference:>10.2f}x"
                    line += f"{flops / reference / peak:>12.1%}"
                else:
                    line += f"\n  graphed, windows of {every}: {graphed * 1e3:.2f} ms/step, {graphed / reference:.2f}x"
                line += f"\n  graphed run (windows of {every}), whole {long.steps} steps, {where}"
            line += (
                f"\n  the loop's step as one graph, replayed back to back (no windows): {own * 1e3:.2f} ms/step, "
                f"{own / reference:.2f}x the bare graph"
            )
        print(line)


def monitor_share(run, parts) -> float:
    """The share of one monitored run's time spent in the monitor's own calls, timed inside the run: the batch
    check, the step's record (unscale, norm, scaler decision, clipping), the verdict, the stall check, the
    attention-logit statistics and the metrics row. On the CPU ops run as they are called, so this needs no
    second loop to compare with; on a GPU they are queued, and only the interleaved comparison means anything."""
    import sweep.data.batches as batches_module
    from sweep.run.step import Steps

    spent = [0.0]

    def timed(f):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        return call

    patched = [(Steps, n) for n in ("record", "judge", "after_update", "log")] + [
        (batches_module, "check_batch"),
        (LogitStats, "observe"),  # the attention-logit statistics, every monitor.logit_every steps
        (LogitStats, "collect"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patched]
    for owner, name, f in saved:
        setattr(owner, name, timed(f))
    try:
        start = time.perf_counter()
        train(run, parts, MetricsLog(), RunProgress(run.steps, Progress.none, 1))
        total = time.perf_counter() - start
    finally:
        for owner, name, f in saved:
            setattr(owner, name, f)
    return spent[0] / total


class _Clock:
    """A window-safe step hook that notes when the host saw each step (at its window's end)."""

    window_safe = True

    def __init__(self):
        self.seen: list[tuple[int, float]] = []

    def after_step(self, step, loss, parts) -> bool:
        self.seen.append((step, time.perf_counter()))
        return False


def graphed_step(run, policy, device, sync_every: int) -> tuple[float, str]:
    """Seconds per step of the real loop with graph=true (CUDA), over the run's second half: the capture (at the
    first window after AdamW has its state) and the first windows are left out. And where the whole run's host
    time went (bench/host_parts.py): eager steps, replays, snapshots, the windows' sync wait, their stand.

    The host sees a window's steps together, at its end: the figure runs from the end of the first window that
    ends past half-way to the end of the last, over the steps in between. (Until 2026-11-26 it ran from the
    first step past half-way, seen at the end of its window, and so divided the time of fewer steps than it
    counted: the H100 session's graphed figures were 31/26 too fast; docs/gpu.md.)"""
    import sweep.run.window as window
    from sweep.run.graph import StepGraph
    from sweep.run.lone import Lone
    from sweep.run.step import Steps

    run = dataclasses.replace(run, graph="true", monitor=dataclasses.replace(run.monitor, sync_every=sync_every))
    clock, parts = _Clock(), fresh_parts(run, policy, device)
    timed = {
        "alone: decide": (Steps, "decide"),  # a step run by itself (a logit step at sync_every=1): row, sync wait
        "forward+backward": (Lone, "forward_backward"),  # every step's, eager window steps' and captures' included
        "replay": (StepGraph, "__call__"),
        "snapshot": (window.Snapshot, "of"),
        "sync wait": (window, "judge_window"),
        "stand": (window.Windows, "_stand"),
    }
    with host_parts(timed) as spent:
        start = time.perf_counter()
        syncs = window.Syncs()
        train(run, parts, MetricsLog(), RunProgress(run.steps, Progress.none, 1), hooks=[clock], syncs=syncs)
        total = time.perf_counter() - start
    assert syncs.taken_back == 0, f"a window was taken back: {syncs.to_dict()}; the figure needs a stable run"
    ends, step = [], 0  # each window's last step
    while step < run.steps:
        step = window.window_end(run.monitor, run.steps, step, None, sync_every)
        ends.append(step - 1)
    seen = dict(clock.seen)
    s0, s1 = next(e for e in ends if e >= run.steps // 2), run.steps - 1
    return (seen[s1] - seen[s0]) / (s1 - s0), host_line(spent, total, run.steps)


def loop_graph_step(run, policy, device, steps: int) -> float:
    """Seconds per step of the loop's own window step (sweep.run.lone.Lone.device_step: the batch drawn and
    checked on the device, noise, forward, backward, the monitor's row, the scaler's decision, DeviceAdamW) as
    its CUDA graph (sweep.run.graph.StepGraph) replayed back to back, with no window around it. Against the bare
    graph: what the monitor and the loop's own step add on the device. Against the graphed loop: what the
    windows (snapshot, the sync, judging and standing) add on the host. (Not a logit step: their own graph.)"""
    from sweep.run.graph import WARMUP, StepGraph
    from sweep.run.lone import Lone
    from sweep.run.window import Snapshot

    monitor = dataclasses.replace(run.monitor, sync_every=8)  # > 1: batches drawn on the device, as windows do
    run = dataclasses.replace(run, graph="true", steps=steps + WARMUP + 2, monitor=monitor)
    parts = fresh_parts(run, policy, device)
    lone = Lone([run], [parts], windows=True)
    lone.clock.fill_(0)
    lone.device_step([0])  # step 0 eagerly: AdamW's state exists, as a capture waits for
    graph = StepGraph(lone, run.steps, lambda: Snapshot.of(lone))
    lone.zero_grad()
    graph()  # step 1: captured (its warm-up taken back), then replayed; the clock ends at steps + 1 < run.steps
    assert graph.graph is not None, graph.failed
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        lone.zero_grad()  # as a window does between its steps
        graph()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def bare_graph_step(run, parts, steps: int) -> float:
    """Seconds per step of the model's own step captured by hand as one CUDA graph: noise, forward, backward and
    torch's fused AdamW (capturable, lr a device tensor), nothing else: the reference a graphed loop is held to."""
    model, policy, device = parts.model, parts.policy, parts.device
    params = [p for p in model.parameters() if p.requires_grad]
    o = run.optim
    opt = torch.optim.AdamW(
        params, lr=torch.tensor(o.lr, device=device), betas=tuple(o.betas), eps=o.eps, fused=True, capturable=True
    )
    x0 = torch.stack([parts.dataset[i] for i in parts.order.indices(0)]).to(device)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(parts.noise_gen)
    scale = parts.scaler.scale_of()  # a Python float, read before the capture (reading it is a sync)

    def step():
        noisy, t, target = parts.objective.sample(x0, parts.noise_gen)
        with policy.autocast(device):
            loss = parts.objective.loss(model(noisy.to(policy.param_dtype), t), target)
        (loss * scale).backward()
        opt.step()

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def fresh_parts(run, policy, device):
    """The run's parts as a run builds them (seeded: every round trains the same steps)."""
    reset_process_state(run, policy)
    parts = build_parts(run, device, policy)
    if run.compile:
        compile_run(run, parts)
    return parts


if __name__ == "__main__":
    main()
