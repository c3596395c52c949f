"""Launchers compared on one 24-run grid, and the ledger's cost per run on SQLite and PostgreSQL.

    python bench/launchers.py [--steps 10] [--launchers sequential,joblib,slurm] [--records 40]

The grid is precision=fp32,bf16_amp x optim.lr=1e-4,1e-3,1e-2 x seed=0,1,2,3 (24 runs, small
data), run by `python -m sweep -m` (Hydra's grid sweeper, the default SQLite ledger) with:
sequential (the basic launcher, torch's default threads), joblib with 2 workers (1 thread each),
and Slurm on this node (hydra/launcher=slurm, 1 CPU per run, all 24 runs as one job array; the
cluster comes from scripts/slurm.sh). Runs per minute = 24 / wall time of the whole command
(interpreter start, every run, the ledger, the end summary).

Ledger overhead: the time `sweep.search.ledger.record_run` takes to record one finished run (open the
storage, load the study, add the trial with its attributes), as every job does, averaged over
--records runs, on a SQLite file and on the PostgreSQL server of scripts/postgres.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SMALL = ["data.frames=4", "data.height=8", "data.width=8", "data.num_samples=32", "progress=none"]
GRID = ["precision=fp32,bf16_amp", "optim.lr=1e-4,1e-3,1e-2", "seed=0,1,2,3"]
LAUNCHERS = {
    "sequential": [],
    "joblib": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
    "slurm": ["hydra/launcher=slurm", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1"],
}


def start(script: str) -> str:
    proc = subprocess.run(["bash", str(REPO / "scripts" / script)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench: scripts/{script} failed: {proc.stderr.strip()[-500:]}")
    return proc.stdout.strip().splitlines()[-1]


def run_grid(name: str, steps: int, out: Path) -> tuple[float, Path]:
    extra = list(LAUNCHERS[name])
    if name == "slurm":
        extra.append(f"hydra.launcher.partition={start('slurm.sh')}")
    sweep_dir = out / name
    cmd = [sys.executable, "-m", "sweep", "-m", *GRID, *SMALL, f"steps={steps}", *extra, f"hydra.sweep.dir={sweep_dir}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=out, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"bench: the {name} sweep failed:\n{proc.stderr[-2000:]}")
    n = len(list(sweep_dir.glob("*/result.json")))
    if n != 24:
        raise SystemExit(f"bench: the {name} sweep wrote {n} results, not 24")
    return wall, sweep_dir


def ledger_overhead(url: str, result: dict, run_dir: Path, records: int) -> list[float]:
    """Seconds per record_run into a fresh study at `url`."""
    from sweep.config import LedgerConfig
    from sweep.search.ledger import record_run

    cfg = LedgerConfig(storage=url, study_name=f"bench-ledger-{os.getpid()}-{time.time_ns()}")
    record_run(cfg, run_dir.parent, run_dir, result)  # creates the study and its tables: not timed
    times = []
    for _ in range(records):
        t0 = time.perf_counter()
        record_run(cfg, run_dir.parent, run_dir, result)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--launchers", default="sequential,joblib,slurm")
    parser.add_argument("--records", type=int, default=40)
    args = parser.parse_args()
    rows, sample = [], None
    with tempfile.TemporaryDirectory(prefix="bench-launchers-") as tmp:
        out = Path(tmp)
        for name in args.launchers.split(","):
            wall, sweep_dir = run_grid(name, args.steps, out)
            rows.append((name, wall, 24 * 60 / wall))
            print(f"{name}: 24 runs in {wall:.1f} s", flush=True)
            sample = sample or next(sweep_dir.glob("*/result.json"))
        if sample is None:  # no grid asked for: one real run gives the result to record
            wall, sweep_dir = run_grid("sequential", args.steps, out)
            sample = next(sweep_dir.glob("*/result.json"))
        result = json.loads(sample.read_text())
        per_trial = {
            "SQLite": ledger_overhead(f"sqlite:///{out / 'bench.db'}", result, sample.parent, args.records),
            "PostgreSQL": ledger_overhead(start("postgres.sh"), result, sample.parent, args.records),
        }

    print(f"\nGrid of 24 runs ({args.steps} steps each, small data) on {os.cpu_count()} cores:\n")
    print("| launcher | wall time (s) | runs per minute |\n|---|---:|---:|")
    for name, wall, rpm in rows:
        print(f"| {name} | {wall:.1f} | {rpm:.1f} |")
    print(f"\nLedger: time to record one run (record_run: open storage, load study, add trial), {args.records} runs:\n")
    print("| storage | median (ms) | mean (ms) | max (ms) |\n|---|---:|---:|---:|")
    for name, times in per_trial.items():
        ms = [t * 1000 for t in times]
        print(f"| {name} | {statistics.median(ms):.1f} | {statistics.mean(ms):.1f} | {max(ms):.1f} |")


if __name__ == "__main__":
    main()
