"""The size of report.html, and the time to write it, on a synthetic sweep of 100 runs of 1000 steps each.

    python bench/report_size.py /tmp/report_size          # writes the sweep there, then its report, twice
    python bench/report_size.py /tmp/report_size --runs 200 --steps 5000

The sweep: precision (5) x optim.lr (5) x attention (2) x seed (2) = 100 run directories as a multirun leaves
them (.hydra/overrides.yaml, result.json, metrics.csv with loss, grad_norm, loss_scale for the fp16 precisions,
and an eval loss every 50 steps). Every run at the largest lr diverges (a spike, then a NaN loss at a seeded step
in the second half: metrics.csv ends there); every stable run has one loss spike. Then `python -m sweep.report DIR`
(report.html beside plotly-<version>.min.js) and `python -m sweep.report DIR --self-contained --html
DIR/self_contained.html` (plotly inline), each timed; it prints both sizes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PRECISIONS = ("fp32", "bf16_amp", "fp16_amp", "fp16_pure", "bf16_pure")
LRS = (1e-4, 3e-4, 1e-3, 3e-3, 3e-2)
ATTENTIONS = ("flash", "math")
EVAL_EVERY = 50


def write_sweep(root: Path, n_runs: int, steps: int) -> None:
    rng = np.random.default_rng(0)
    cells = [(p, lr, a, s) for p in PRECISIONS for lr in LRS for a in ATTENTIONS for s in (0, 1)]
    for n in range(n_runs):
        precision, lr, attention, seed = cells[n % len(cells)]
        params = {"precision": precision, "optim.lr": lr, "attention": attention, "steps": steps, "seed": seed}
        run_dir = root / str(n)
        (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {k}={v}\n" for k, v in params.items()))
        step = np.arange(steps)
        loss = 0.3 + 0.7 * np.exp(-step / (steps / 5)) + rng.normal(0, 0.02, steps)
        grad = np.abs(1.0 + rng.normal(0, 0.2, steps))
        bad = int(rng.integers(steps // 2, steps)) if lr == LRS[-1] else None
        if bad is None:
            spike = int(rng.integers(steps // 10, steps))
            loss[spike] *= 8
        else:
            loss[bad - 5 : bad] *= np.geomspace(2, 50, 5)
            loss[bad] = np.nan
            step, loss, grad = step[: bad + 1], loss[: bad + 1], grad[: bad + 1]
        scale = 65536.0 / 2 ** (step // (steps // 4)) if precision.startswith("fp16") else None
        rows = ["step,loss,grad_norm,lr,loss_scale,eval_loss"]
        for i, s in enumerate(step):
            ev = f"{loss[i] + 0.01:.6f}" if s % EVAL_EVERY == 0 and np.isfinite(loss[i]) else ""
            rows.append(
                f"{s},{float(loss[i])!r},{float(grad[i])!r},{lr},{'' if scale is None else float(scale[i])},{ev}"
            )
        (run_dir / "metrics.csv").write_text("\n".join(rows) + "\n")
        result = {
            "status": "stable" if bad is None else "diverged",
            "verdict": None if bad is None else "nonfinite_loss",
            "first_bad_step": bad,
            "cause": None if bad is None else {"where": "loss", "module": None, "detail": "synthetic"},
            "final_loss": None if bad is not None else float(loss[-1]),
            "eval_loss": None if bad is not None else float(loss[-1] + 0.01),
            "min_loss": float(np.nanmin(loss)),
            "initial_loss": float(loss[0]),
            "steps_run": len(step),
            "max_grad_norm": float(grad.max()),
            "seconds": 10.0,
            "steps_per_second": 100.0,
            "params": params,
            "versions": {},
            "seed": seed,
            "device": "cpu",
        }
        (run_dir / "result.json").write_text(json.dumps(result, indent=1))


def timed_report(*args: str) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "sweep.report", *args, "--width", "200"], capture_output=True)
    if proc.returncode:
        raise SystemExit(proc.stderr.decode()[-2000:])
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--steps", type=int, default=1000)
    args = p.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"{args.out} is not empty")
    write_sweep(args.out, args.runs, args.steps)
    seconds = timed_report(str(args.out))
    page = args.out / "report.html"
    scripts = sorted(args.out.glob("plotly-*.js"))
    print(f"{args.runs} runs x {args.steps} steps: report.html {page.stat().st_size / 1e6:.2f} MB", end="")
    print("".join(f" + {s.name} {s.stat().st_size / 1e6:.2f} MB" for s in scripts), f"({seconds:.1f} s)")
    one = args.out / "self_contained.html"
    seconds = timed_report(str(args.out), "--self-contained", "--html", str(one))
    print(f"--self-contained: {one.name} {one.stat().st_size / 1e6:.2f} MB ({seconds:.1f} s)")


if __name__ == "__main__":
    main()
