"""How often the diagnosis names a diverged run's mechanism right, that it names none for healthy runs, and its cost.

    python bench/diagnosis.py                 # every case: the run, its mechanism from the recorded signals
    python bench/diagnosis.py --full          # + python -m sweep.diagnose on each diverged case (counterfactuals, fix)
    python bench/diagnosis.py --only dit_fp16_pure,demo_spike --full

Each case is one run, started as a user starts it (`python -m sweep <overrides> hydra.run.dir=...`), with a
cause injected into one of several models (the native DiT and video DiT, diffusers transformers): bad
samples, fp16 overflow, eps underflow, lost updates, flushed gradients, a too-high lr, an overflowing loss,
attention-logit growth, corrupt checkpoints (resumed from a 10-step pretraining); and healthy runs, which must
get no mechanism. It prints, per case, the expected and the named mechanism (from
result.json, and with --full from diagnosis.json after the counterfactual runs), whether the fix was
confirmed, and the diagnosis's cost against the run's own, two ways: `cost`, the `python -m sweep.diagnose`
command's wall time over the `python -m sweep` command's (what a user waits for each, start-up included), and
`inside`, diagnose()'s own seconds over the run's execute() seconds (diagnosis.json `seconds` over result.json
`seconds`: no interpreter start-up on either side); then the share named right.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMALL = [
    "data.frames=4",
    "data.height=8",
    "data.width=8",
    "data.num_samples=32",
    "progress=none",
    "ledger.enabled=false",
]

IMAGE = ["model=dit_tiny", "data=synthetic_image", "data.frames=1"]
PIXART = ["model=pixart_tiny", "data=synthetic_image", "data.frames=1"]
OPENDIT = ["precision=fp16_amp", "attention=flash", "data.batch_size=4", "optim.lr=5e-3", "seed=1", "steps=500"]
RESUME = "checkpoint.resume_from={pretrained}/checkpoints/step_000010"

# name: (expected mechanism, or None for a healthy run; overrides)
CASES: dict[str, tuple[str | None, list[str]]] = {
    "video_nan_sample": (
        "bad_input",
        ["steps=16", "optim.lr=1e-3", "+data.faults=[{index:7,kind:nan}]", "data.check=false"],
    ),
    "dit_range_sample": (
        "bad_input",
        [
            "model=dit_tiny",
            "data=synthetic_image",
            "data.frames=1",
            "steps=16",
            "optim.lr=1e-3",
            "+data.faults=[{index:3,kind:range}]",
        ],
    ),
    "video_fp16_overflow": (
        "activation_overflow",
        ["precision=fp16_amp", "attention=eager", "model.qk_gain=100", "steps=20", "optim.lr=1e-4"],
    ),
    "dit_fp16_pure": (
        "update_underflow",
        ["model=dit_tiny", "data=synthetic_image", "data.frames=1", "precision=fp16_pure", "steps=10"],
    ),
    # lr 1e-5: fp32 and bf16_amp train (at 1e-6 fp32 stalls too: AdamW's eps outweighs the adaLN-Zero blocks'
    # tiny gradients, and the run is not a precision case)
    "video_bf16_pure_small_lr": ("update_underflow", ["precision=bf16_pure", "optim.lr=1e-5", "steps=25"]),
    # loss weight 1e-5: fp32 and scaled fp16 train (at 1e-7 every precision stalls)
    "video_fp16_noscale_tiny_loss": (
        "gradient_underflow",
        ["precision=fp16_amp_noscale", "objective.loss_weight=1e-5", "steps=25", "optim.lr=1e-3"],
    ),
    # every precision stalls (AdamW's eps outweighs the gradients): the fix needs a smaller eps, not only a precision
    "video_bf16_pure_lr_1e-6": ("update_underflow", ["precision=bf16_pure", "optim.lr=1e-6", "steps=25"]),
    "video_fp16_noscale_loss_1e-7": (
        "gradient_underflow",
        ["precision=fp16_amp_noscale", "objective.loss_weight=1e-7", "steps=25", "optim.lr=1e-3"],
    ),
    "dit_fp16_overflow": (
        "activation_overflow",
        [*IMAGE, "precision=fp16_amp", "attention=eager", "model.qk_gain=100", "steps=20", "optim.lr=1e-4"],
    ),
    "video_fp16_huge_loss": (  # a loss summed where it should be averaged: its gradients overflow fp16 at any scale
        "loss_scale_collapse",
        ["precision=fp16_amp", "objective.loss_weight=1e6", "steps=30", "optim.lr=1e-3"],
    ),
    "dit_logit_growth": (
        "attention_logit_growth",
        [*IMAGE, "optim.lr=3e-2", "optim.warmup_steps=20", "monitor.logit_every=5", "steps=50"],
    ),
    "diffusers_inf_sample": (
        "bad_input",
        [
            "model=diffusers_dit_tiny",
            "data=synthetic_image",
            "data.frames=1",
            "steps=16",
            "optim.lr=1e-3",
            "+data.faults=[{index:5,kind:inf}]",
            "data.check=false",
        ],
    ),
    "pixart_bitflip_checkpoint": (
        "corrupt_checkpoint",
        [*PIXART, "steps=30", "optim.lr=1e-4", "checkpoint.inject=bitflip", "checkpoint.verify=false", RESUME],
    ),
    "video_nan_checkpoint_fp16": (
        "corrupt_checkpoint",
        ["precision=fp16_amp", "steps=40", "checkpoint.inject=nan", "checkpoint.verify=false", RESUME],
    ),
    "demo_spike": ("lr_too_high", ["optim.lr=3e-2", "steps=20"]),
    "dit_spike": (
        "lr_too_high",
        ["model=dit_tiny", "data=synthetic_image", "data.frames=1", "optim.lr=1e-1", "steps=20"],
    ),
    "pixart_fp16_pure": (
        "update_underflow",
        ["model=pixart_tiny", "data=synthetic_image", "data.frames=1", "precision=fp16_pure", "steps=6"],
    ),
    "diffusers_dit_spike": (
        "lr_too_high",
        ["model=diffusers_dit_tiny", "data=synthetic_image", "data.frames=1", "optim.lr=3e-1", "steps=20"],
    ),
    "flow_spike": ("lr_too_high", ["objective=flow", "optim.lr=3e-2", "steps=20"]),
    "video_qk_norm_spike": ("lr_too_high", ["model.qk_norm=true", "optim.lr=1e-1", "steps=20"]),
    "dit_clipped_spike": ("lr_too_high", [*IMAGE, "optim.lr=1e-1", "optim.grad_clip=1.0", "steps=20"]),
    "video_bf16_inf_sample": (
        "bad_input",
        ["precision=bf16_amp", "steps=16", "optim.lr=1e-3", "+data.faults=[{index:7,kind:inf}]", "data.check=false"],
    ),
    "pixart_fp16_huge_loss": (
        "loss_scale_collapse",
        [*PIXART, "precision=fp16_amp", "objective.loss_weight=1e6", "steps=30", "optim.lr=1e-3"],
    ),
    "pixart_bf16_pure_small_lr": ("update_underflow", [*PIXART, "precision=bf16_pure", "optim.lr=1e-5", "steps=25"]),
    "video_buggy_modulate_spike": (
        "kernel",
        ["modulate=fused_buggy", "precision=fp16_amp", "attention=flash", "optim.lr=3e-2", "steps=20"],
    ),
    # OpenDiT's modulate as written (models/modulate.py): its backward moves the adaLN weights where the forward
    # cannot see, and a few hundred steps later the run spikes; eager modulate at the same seed trains on
    "video_opendit_modulate_drift": ("kernel", [*OPENDIT, "modulate=fused_buggy"]),
    "healthy_opendit_eager": (None, [*OPENDIT, "modulate=eager"]),
    "video_fp16_amp_lr_high": ("lr_too_high", ["precision=fp16_amp", "optim.lr=1e-1", "steps=30"]),
    "dit_nan_checkpoint": (
        "corrupt_checkpoint",
        [*IMAGE, "steps=30", "checkpoint.inject=nan", "checkpoint.verify=false", RESUME],
    ),
    "diffusers_fp16_pure": (
        "update_underflow",
        ["model=diffusers_dit_tiny", "data=synthetic_image", "data.frames=1", "precision=fp16_pure", "steps=10"],
    ),
    "video_bf16_lr_high_update_clip": (
        "lr_too_high",
        ["precision=bf16_amp", "optim.lr=3e-1", "optim.update_clip=1.0", "steps=20"],
    ),
    "healthy_fp32": (None, ["optim.lr=1e-3", "steps=20"]),
    "healthy_bf16_amp": (None, ["precision=bf16_amp", "optim.lr=1e-3", "steps=20"]),
    "healthy_fp16_amp": (None, ["precision=fp16_amp", "optim.lr=1e-4", "steps=20"]),
    "healthy_dit_fused": (
        None,
        ["model=dit_tiny", "data=synthetic_image", "data.frames=1", "modulate=fused", "steps=20"],
    ),
    "healthy_flow": (None, ["objective=flow", "optim.lr=1e-3", "steps=20"]),
    "healthy_bf16_pure": (None, ["precision=bf16_pure", "optim.lr=1e-3", "steps=20"]),
    "healthy_pixart": (
        None,
        ["model=pixart_tiny", "data=synthetic_image", "data.frames=1", "optim.lr=1e-4", "steps=10"],
    ),
    "healthy_pixart_resumed": (None, [*PIXART, "steps=30", "optim.lr=1e-4", RESUME]),
}
# A case that resumes (RESUME) first runs its model's pretraining: 10 steps that save a checkpoint.
PRETRAIN = ["steps=10", "checkpoint.every=10", "optim.lr=1e-4"]


def run_case(overrides: list[str], run_dir: Path) -> tuple[dict, float]:
    """The case's run, started as a user starts it: (result.json, the command's wall time)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CI": "1"}
    cmd = [sys.executable, "-m", "sweep", *SMALL, *overrides, f"hydra.run.dir={run_dir}", "device=cpu"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    took = time.perf_counter() - start
    if not (run_dir / "result.json").is_file():
        raise RuntimeError(f"no result.json: {proc.stderr[-2000:]}")
    return json.loads((run_dir / "result.json").read_text()), took


def diagnose(run_dir: Path) -> tuple[dict, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CI": "1"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "sweep.diagnose", str(run_dir)], cwd=REPO, env=env, capture_output=True, text=True
    )
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads((run_dir / "diagnosis.json").read_text()), took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="also run python -m sweep.diagnose on each diverged case")
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run dirs under this folder")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"bench/diagnosis.py: unknown case {unknown[0]!r}; cases: {', '.join(CASES)}", file=sys.stderr)
        return 2
    root = args.keep or Path(tempfile.mkdtemp(prefix="diag-bench-"))
    head = f"{'case':<30}{'expected':<24}{'outcome':<22}{'recorded':<24}"
    head += f"{'diagnosed':<24}{'agrees':<8}{'fix':<10}{'cost':>8}{'inside':>10}" if args.full else ""
    print(head, flush=True)
    right = right_full = diverged = healthy_ok = healthy = 0
    costs = []
    for name in names:
        expected, overrides = CASES[name]
        run_dir = root / name
        shutil.rmtree(run_dir, ignore_errors=True)
        try:
            if RESUME in overrides:
                pretrained = root / f"{name}.pretrained"
                model = [o for o in overrides if o.startswith(("model=", "data=", "data.frames="))]
                run_case([*model, *PRETRAIN], pretrained)
                overrides = [o.format(pretrained=pretrained) for o in overrides]
            r, run_took = run_case(overrides, run_dir)
        except RuntimeError as e:  # a case that cannot run here is said, and the others go on
            print(f"{name:<30}{str(expected):<24}not run: {str(e).splitlines()[-1][:120]}", flush=True)
            continue
        named = (r.get("mechanism") or {}).get("name")
        outcome = r["status"] if r["status"] != "diverged" else f"{r['verdict']}@{r['first_bad_step']}"
        line = f"{name:<30}{str(expected):<24}{outcome:<22}{str(named):<24}"
        if expected is None:
            healthy += 1
            healthy_ok += r["status"] == "stable" and named is None
        else:
            diverged += 1
            right += named == expected
        if args.full and r["status"] == "diverged":
            d, took = diagnose(run_dir)
            right_full += d["mechanism"] == expected
            ratio = took / run_took  # command against command, each one process with its start-up
            inside = d["seconds"] / max(r["seconds"], 1e-9)  # diagnose() against the run's execute(), in-process
            costs.append((ratio, inside))
            fix = "confirmed" if d["fix"]["confirmed"] else ("no" if d["fix"]["tried"] else "-")
            line += f"{d['mechanism']:<24}{'yes' if d['agrees'] else 'NO':<8}{fix:<10}{ratio:>7.1f}x{inside:>9.1f}x"
        print(line, flush=True)
    print(
        f"\nrecorded mechanism right: {right}/{diverged} diverged cases; "
        f"healthy runs without one: {healthy_ok}/{healthy}"
    )
    if args.full and costs:
        walls, insides = sorted(c[0] for c in costs), sorted(c[1] for c in costs)
        print(
            f"after the counterfactuals: {right_full}/{diverged}; cost = the diagnosis command's wall time / the "
            f"run command's (one process each, start-up included): median {walls[len(walls) // 2]:.1f}x, max "
            f"{walls[-1]:.1f}x; inside = diagnose() / the run's execute() in-process (no start-up on either "
            f"side): median {insides[len(insides) // 2]:.1f}x, max {insides[-1]:.1f}x"
        )
    print(f"runs in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
