"""Grid vs frontier search: runs and wall time to locate the max stable lr of 4 combinations within 2x.

    python bench/frontier_vs_grid.py [--steps 20] [--low 1e-4] [--high 1.0]

Both sweeps run `python -m sweep -m` on precision=fp32,bf16_amp x attention=flash,math. The grid
is a log grid at 2x spacing over [low, high] (run with the validating grid sweeper); the frontier
search bisects per combination (hydra/sweeper=optuna_sweep hydra.sweeper.mode=frontier). Prints the
runs, wall time and each combination's bracket from both, so they can be compared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SMALL = ["data.frames=4", "data.height=8", "data.width=8", "data.num_samples=32", "progress=none"]
AXES = ["precision=fp32,bf16_amp", "attention=flash,math"]


def run(args: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "sweep", "-m", *AXES, *SMALL, *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "CI": "1"},
    )
    return time.perf_counter() - start


def grid_brackets(sweep_dir: Path) -> dict[str, tuple]:
    """Per combination: (largest stable lr, smallest diverged lr) from the grid's result.json files."""
    out: dict[str, list] = {}
    for path in sweep_dir.glob("*/result.json"):
        r = json.loads(path.read_text())
        p = r["params"]
        b = out.setdefault(f"{p['precision']}/{p['attention']}", [None, None])
        if r["status"] == "stable":
            b[0] = max(b[0] or 0.0, p["optim.lr"])
        elif r["status"] == "diverged":
            b[1] = min(b[1] or math.inf, p["optim.lr"])
    return {k: tuple(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--low", type=float, default=1e-4)
    ap.add_argument("--high", type=float, default=1.0)
    args = ap.parse_args()
    n = math.ceil(math.log(args.high / args.low) / math.log(2) - 1e-9) + 1
    grid = [args.low * 2**i for i in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        grid_s = run(
            [
                f"optim.lr={','.join(f'{x:.6g}' for x in grid)}",
                f"steps={args.steps}",
                f"hydra.sweep.dir={tmp / 'grid'}",
            ],
            tmp,
        )
        front_s = run(
            [
                "hydra/sweeper=optuna_sweep",
                "hydra.sweeper.mode=frontier",
                "hydra.sweeper.n_jobs=4",
                f"optim.lr=tag(log,interval({args.low},{args.high}))",
                f"steps={args.steps}",
                f"hydra.sweep.dir={tmp / 'frontier'}",
            ],
            tmp,
        )
        g = grid_brackets(tmp / "grid")
        f = pd.read_csv(tmp / "frontier" / "frontier.csv")
        f.index = f.precision + "/" + f.attention
    print(f"4 combinations, lr in [{args.low:g}, {args.high:g}], 2x resolution, {args.steps} steps per run")
    print(f"{'':<10}{'runs':>6}{'wall s':>9}")
    print(f"{'grid':<10}{4 * n:>6}{grid_s:>9.1f}")
    print(f"{'frontier':<10}{int(f.runs.sum()):>6}{front_s:>9.1f}")
    print("\nbrackets [max stable, min diverged):")
    for combo in sorted(g):
        print(
            f"  {combo:<16} grid [{g[combo][0]:.3g}, {g[combo][1]:.3g})"
            f"   frontier [{f.loc[combo].max_stable:.3g}, {f.loc[combo].min_diverged:.3g})"
        )


if __name__ == "__main__":
    main()
