"""How many ops one window step dispatches, by part: on a GPU each op that computes is a kernel launch, and
inside a CUDA graph a tiny kernel still costs a few microseconds, so a step's op count bounds how near a
graphed loop can come to the bare step (issue #31).

    python bench/step_ops.py [--model video_dit_tiny] [OVERRIDE ...]

Counts the ops torch dispatches (a TorchDispatchMode) in one lone window step (sweep.run.lone.Lone.
device_step: batch, noise, forward, backward, the monitor's row, AdamW), in the optimizer's step alone, in
the monitor's record alone, and in torch's own AdamW (fused where the device has it, else foreach) over the
same weights; "compute" leaves out the ops that only make views (no kernel). Runs on any device: the counts
are the dispatcher's, not timings.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from throughput import run_config

from sweep.run.execute import prepare
from sweep.run.lone import Lone
from sweep.run.results import RunResult
from sweep.run.step import LoneGrads

VIEWS = {
    "view",
    "_unsafe_view",
    "select",
    "slice",
    "unsqueeze",
    "squeeze",
    "expand",
    "alias",
    "as_strided",
    "t",
    "transpose",
    "permute",
    "detach",
    "reshape",
    "_reshape_alias",
    "split",
    "unbind",
    "lift_fresh",
}


class Ops(TorchDispatchMode):
    """Counts the ops dispatched inside it: all of them, and those that compute (not views)."""

    def __init__(self):
        super().__init__()
        self.all = self.compute = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.all += 1
        self.compute += func.__name__.split(".")[0] not in VIEWS
        return func(*args, **(kwargs or {}))


def stepped_once(model: str, overrides: list[str]) -> Lone:
    """A lone run of `model` in windows (its window step, sweep.run.lone.Lone.device_step), after one step:
    AdamW's state made, as in every later step."""
    run = run_config([f"model={model}", "steps=4", "monitor.sync_every=4", "progress=none", *overrides])
    parts = prepare(run, Path(tempfile.mkdtemp(prefix="bench_")), RunResult(status="error"))
    loop = Lone([run], [parts], windows=True)
    loop.clock.fill_(0)
    loop.device_step([0])
    loop.zero_grad()
    return loop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="video_dit_tiny")
    ap.add_argument("overrides", nargs="*", help="more config overrides (precision=bf16_amp, attention=flash, ...)")
    args = ap.parse_args()
    loop = stepped_once(args.model, args.overrides)
    parts = loop.parts
    with Ops() as step:
        loop.device_step([0])
    loop.zero_grad()
    loop.forward_backward(loop.batches(2, [0])[0], [0])
    grads = LoneGrads([p.grad for p in loop.params if p.grad is not None])
    with Ops() as record:
        loop.steps.record(torch.zeros(1, device=parts.device), grads)
    with Ops() as ours:
        parts.optimizer.step()
    params = [p for p in loop.params if p.grad is not None]
    fused = parts.device.type == "cuda"
    theirs_opt = torch.optim.AdamW(params, lr=1e-4, fused=fused or None, foreach=None if fused else True)
    theirs_opt.step()  # its state made
    with Ops() as theirs:
        theirs_opt.step()
    print(f"device {parts.device}, torch {torch.__version__}, model {args.model}, {len(params)} weights; ops (compute)")
    print(f"  one window step (Lone.device_step)   {step.all:>6} ({step.compute})")
    print(f"  of which DeviceAdamW.step            {ours.all:>6} ({ours.compute})")
    print(f"  the monitor's record                 {record.all:>6} ({record.compute})")
    print(f"  torch.optim.AdamW({'fused' if fused else 'foreach'}), same weights {theirs.all:>6} ({theirs.compute})")


if __name__ == "__main__":
    main()
