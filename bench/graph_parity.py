"""graph=true against today's eager default, run by run, on the demo grid, every scenario and the newer axes.

    python bench/graph_parity.py [--only demo,qk_norm_logit_growth] [--sync-every 8] [--jobs 4] [--out DIR]

Each target runs through the CLI, as a user runs it: `graph=false monitor.sync_every=1` (the default) and
`graph=true monitor.sync_every=N` (twice with --again: bit-identical too), each into its own directory,
diagnosis off; --jobs of these sweeps at a time (each its own process on the one GPU: the numbers do not
depend on what else runs, only the wall times do). Then, run by run: status, verdict, first bad step and
metrics.csv byte for byte, each side's wall time, and the first error a side's runs ended with.
graph=auto may turn graphs on for CUDA only where every row says `same`. On the CPU graph=true is a
skipped run: this needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = sorted(p.stem for p in (ROOT / "conf" / "scenario").glob("*.yaml"))
COMMON = ["monitor.diagnose=off", "progress=none"]
LR = "optim.lr=1e-3,3e-2"  # one lr that trains, one that diverges on the CPU (the graph must keep both outcomes)
AXES = {
    # the verdicts judged at a run's end (sweep/run/trend.py): slow_divergence and no_progress on the CPU
    "trend": ["steps=48", "optim.lr=0.03,0.05", "optim.warmup_steps=40,60"],
    # torchao's float8 linears inside the captured step (CUDA capability >= 8.9)
    "fp8": ["steps=40", "precision=fp8_tensorwise,fp8_rowwise,fp8_rowwise_gw_hp", LR],
    # the precisions no scenario runs
    "precisions": ["steps=40", "precision=tf32,bf16_pure,fp16_amp_noscale", LR],
    # StableAdamW's update clipping: a factor per tensor computed on the device
    "update_clip": ["steps=40", "optim.update_clip=1.0", "precision=fp32,bf16_amp", LR],
    # µP packed: StackedAdamW with two param groups, each at its own lr, in the graphed pack
    "mup_packed": [
        "steps=40",
        "model.param=mup",
        "model.base_width=64",
        "model.width=64,128",
        LR,
        "hydra/launcher=packed",
        "hydra.launcher.pack=4",
    ],
}
"""Sweeps of the axes and verdicts that landed after the scenarios (issue #48 item 1), on the default tiny model,
without the confirmation (AXIS_ONLY: the demo's and the scenarios' sweeps have theirs)."""
AXIS_ONLY = ["confirm.mode=off"]


def command(target: str, out: Path, graph: list[str]) -> list[str]:
    """The CLI line of a target (a scenario is a sweep of its own: its cause and its fix, with replicates)."""
    if target == "demo":
        target = ["-m", "+experiment=demo"]
    else:
        target = ["-m", *AXES[target], *AXIS_ONLY] if target in AXES else [f"+scenario={target}"]
    return ["-m", "sweep", *target, *COMMON, *graph, f"hydra.run.dir={out}", f"hydra.sweep.dir={out}"]


def first_error(root: Path) -> str | None:
    """The first line of the reason of the first run under root that ended in `error`, or None."""
    for path in sorted(root.rglob("result.json"), key=lambda p: str(p.parent.relative_to(root)).zfill(8)):
        r = json.loads(path.read_text())
        if r.get("status") == "error":
            return f"{path.parent.relative_to(root)}: " + (r.get("reason") or "").strip().split("\n")[0]
    return None


def results(root: Path) -> dict[str, tuple]:
    """Per run directory under root: (status, verdict, first bad step, metrics.csv bytes)."""
    got = {}
    for path in sorted(root.rglob("result.json")):
        r = json.loads(path.read_text())
        metrics = path.parent / "metrics.csv"
        got[str(path.parent.relative_to(root))] = (
            r.get("status"),
            r.get("verdict"),
            r.get("first_bad_step"),
            metrics.read_bytes() if metrics.exists() else b"",
        )
    return got


def compare(a: dict[str, tuple], b: dict[str, tuple]) -> list[str]:
    """How the runs of two sides differ, one line per run that does."""
    differ = []
    for run in sorted(set(a) | set(b)):
        x, y = a.get(run), b.get(run)
        if x is None or y is None:
            differ.append(f"{run}: only on one side")
        elif x != y:
            what = [n for n, u, v in zip(("status", "verdict", "first bad step", "metrics"), x, y) if u != v]
            differ.append(f"{run}: {', '.join(what)} ({x[:3]} vs {y[:3]})")
    return differ


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--only", default=",".join(["demo", *SCENARIOS, *AXES]), help=f"demo, scenario names, {', '.join(AXES)}"
    )
    ap.add_argument("--sync-every", type=int, default=8, help="monitor.sync_every of the graph=true side")
    ap.add_argument("--again", action="store_true", help="run the graph=true side twice: bit-identical too")
    ap.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--jobs", type=int, default=1, help="sweeps run at a time, each its own process (default 1)")
    args = ap.parse_args()
    targets = [t for t in args.only.split(",") if t]
    unknown = [t for t in targets if t != "demo" and t not in SCENARIOS and t not in AXES]
    if unknown:
        known = ", ".join([*SCENARIOS, *AXES])
        sys.exit(f"bench/graph_parity.py: unknown target {', '.join(unknown)}: demo or one of {known}")
    if args.jobs < 1:
        sys.exit(f"bench/graph_parity.py: --jobs must be at least 1, not {args.jobs}")
    sides = {"eager": ["graph=false", "monitor.sync_every=1"]}
    sides["graph"] = ["graph=true", f"monitor.sync_every={args.sync_every}"]
    if args.again:
        sides["again"] = sides["graph"]
    base = args.out or Path(tempfile.mkdtemp(prefix="graph_parity_"))

    def sweep(target: str, side: str) -> float:
        """Run one side of a target; its wall seconds (a sweep that exits non-zero is said so, and compared)."""
        start = time.perf_counter()
        out = base / target / side
        proc = subprocess.run(
            [sys.executable, *command(target, out, sides[side])], cwd=ROOT, capture_output=True, text=True
        )
        if proc.returncode != 0:
            print(f"{target:<30} {side} exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
        return time.perf_counter() - start

    print(f"{'target':<30}{'runs':>6}{'same':>6}" + "".join(f"{side + ' s':>9}" for side in sides) + "  differences")
    all_same = True
    with ThreadPoolExecutor(args.jobs) as pool:
        jobs = {(t, side): pool.submit(sweep, t, side) for t in targets for side in sides}
        for target in targets:  # in order, each as soon as its sides are done
            seconds = {side: jobs[target, side].result() for side in sides}
            got = {side: results(base / target / side) for side in sides}
            runs = sorted(set(got["eager"]) | set(got["graph"]))
            differ = compare(got["eager"], got["graph"])
            if args.again:
                differ += [f"again: {d}" for d in compare(got["graph"], got["again"])]
            all_same &= not differ and bool(runs)
            times = "".join(f"{seconds[side]:>9.1f}" for side in sides)
            shown = "; ".join(differ[:3]) + (f"; and {len(differ) - 3} more" if len(differ) > 3 else "")
            print(f"{target:<30}{len(runs):>6}{len(runs) - len(differ):>6}{times}  " + (shown or "-"), flush=True)
            for side in sides:
                if (error := first_error(base / target / side)) is not None:
                    print(f"{'':<30}first error, {side}: {error}", flush=True)
    print("every run the same" if all_same else "NOT the same: graph=auto must stay eager")
    sys.exit(0 if all_same else 1)


if __name__ == "__main__":
    main()
