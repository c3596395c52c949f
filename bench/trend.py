"""The end-of-run trend statistics of a set of runs, and the verdict each would get: to choose and audit the
thresholds of slow_divergence and no_progress (sweep/run/trend.py, docs/verdicts.md).

    python bench/trend.py --run all --out /tmp/trend             # run every set below, then print them
    python bench/trend.py --run demo,healthy --out /tmp/trend    # some sets
    python bench/trend.py /tmp/trend                             # read what is there (every result.json under it)
    python bench/trend.py /tmp/trend --set trend_end_factor=2.5  # what other thresholds would say
    python bench/trend.py /tmp/trend/late_spike --before 5       # the spiking runs as if they had ended 5 steps early

Sets (each run as a user runs it, `python -m sweep ...`, into OUT/<set>):
- demo: the demo grid (`+experiment=demo`), 48 runs of 30 steps, 24 of them stable: all must stay stable;
- healthy: bench/diagnosis.py's healthy cases (expected mechanism None): all must stay stable;
- scenario: every conf/scenario/*.yaml as `python -m sweep +scenario=NAME` (their expectations must hold);
- wortsman: the Wortsman qk-norm grid at 60 steps (56 runs, `+experiment=wortsman_qk_norm steps=60`);
- wortsman200: its 200-step runs without qk-norm at lr 1e-2 and 3e-2 (8 runs), and the width-256 lr 1e-2 pair;
- high_lr: the tiny video DiT in bf16_amp at lr 3e-3..3e-2, 200 steps, 2 seeds, with and without warmup;
- late_spike: fp32 and bf16_amp at lr 1e-2..2e-2 after a 20-step warmup, 120 steps, 3 seeds: runs that spike tens
  of steps in (`--before K` judges each as if it had ended K steps before its spike);
- warmup_too_high: fp32 and bf16_amp warmed up over all their 60 steps to lr 3e-3..5e-2, 2 seeds;
- objectives: flow matching and v-prediction (their loss floors sit higher) at lr 1e-3..1e-2, 200 steps.

Per run it prints the set, the swept values, the recorded outcome, the trend numbers (end/min: the smoothed final
loss over its smoothed minimum; rise and t: the fitted rise after the minimum and its t statistic; end/init: the
smoothed final loss over the initial loss; path: how far the weights travelled, in initial norms; the largest
attention logit), the eval loss over the best eval loss of its group (the same swept values but lr and seed), and
the verdict the thresholds give, re-judged from metrics.csv. Then, per set, each statistic's range over the runs
the monitor called stable, and the false alarms: trend verdicts on a run of the demo's or the healthy set.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from sweep.config import MonitorConfig  # noqa: E402
from sweep.config.recorded import load_recorded  # noqa: E402
from sweep.run.build import build_parts, reset_process_state  # noqa: E402
from sweep.run.evaluate import make_evaluator  # noqa: E402
from sweep.run.execute import untrained_eval_loss  # noqa: E402
from sweep.run.precision import PrecisionPolicy  # noqa: E402
from sweep.run.trend import END_OF_RUN, Context, Weights, judge  # noqa: E402

SMALL = ["data.frames=4", "data.height=8", "data.width=8", "data.num_samples=32"]
QUIET = ["progress=none", "ledger.enabled=false", "monitor.diagnose=off", "confirm.mode=off", "threads=1"]
WORTSMAN = ["+experiment=wortsman_qk_norm", "progress=none", "ledger.enabled=false", "confirm.mode=off", "threads=1"]
HEALTHY = [
    "healthy_fp32",
    "healthy_bf16_amp",
    "healthy_fp16_amp",
    "healthy_dit_fused",
    "healthy_flow",
    "healthy_bf16_pure",
    "healthy_pixart",
    "healthy_pixart_resumed",
    "healthy_opendit_eager",
]
"""bench/diagnosis.py's CASES whose expected mechanism is None."""
SETS = (
    "demo",
    "healthy",
    "scenario",
    "wortsman",
    "wortsman200",
    "high_lr",
    "late_spike",
    "warmup_too_high",
    "objectives",
)
MUST_STAY_STABLE = ("demo", "healthy")


def sweep(out: Path, *overrides: str) -> None:
    cmd = [sys.executable, "-m", "sweep", "-m", *overrides, f"hydra.sweep.dir={out}"]
    _call(cmd)


def _call(cmd: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CI": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    print(f"# {time.perf_counter() - start:6.0f} s  {' '.join(cmd[1:])}", flush=True)
    if proc.returncode != 0:
        print(proc.stderr[-1500:], file=sys.stderr)


def run_set(name: str, out: Path) -> None:
    """Run one set into out/name."""
    where = out / name
    if name == "demo":
        sweep(where, "+experiment=demo", "monitor.diagnose=off", "confirm.mode=off")
    elif name == "healthy":
        _call([sys.executable, str(REPO / "bench" / "diagnosis.py"), "--only", ",".join(HEALTHY), "--keep", str(where)])
    elif name == "scenario":
        for path in sorted((REPO / "conf" / "scenario").glob("*.yaml")):
            sweep(where / path.stem, f"+scenario={path.stem}", "progress=none", "confirm.mode=off")
    elif name == "wortsman":
        sweep(where, *WORTSMAN, "steps=60", "optim.warmup_steps=3,15")
    elif name == "wortsman200":
        sweep(where / "w128", *WORTSMAN, "model.qk_norm=false", "optim.lr=1e-2,3e-2")
        width = ["model.width=256", "optim.warmup_steps=10", "optim.lr=1e-2"]
        sweep(where / "w256", *WORTSMAN, "model.qk_norm=false", *width)
    elif name == "high_lr":
        grid = [*SMALL, *QUIET, "precision=bf16_amp", "optim.lr=3e-3,1e-2,2e-2,3e-2", "steps=200", "replicates=2"]
        sweep(where / "warmup0", *grid)
        sweep(where / "warmup20", *grid, "optim.warmup_steps=20")
    elif name == "late_spike":  # constant lr after a warmup: runs that spike tens of steps in (--before reads them)
        sweep(
            where,
            *SMALL,
            *QUIET,
            "precision=fp32,bf16_amp",
            "optim.lr=1e-2,1.5e-2,2e-2",
            "optim.warmup_steps=20",
            "steps=120",
            "replicates=3",
        )
    elif name == "warmup_too_high":  # warmed up over the whole run to a too-high lr: learns, then the lr undoes it
        grid = [*SMALL, *QUIET, "precision=fp32,bf16_amp", "optim.lr=3e-3,2e-2,3e-2,5e-2", "replicates=2"]
        sweep(where, *grid, "steps=60", "optim.warmup_steps=60")
    elif name == "objectives":  # the losses whose floor is not near 0: flow matching, v-prediction
        grid = [*SMALL, *QUIET, "optim.lr=1e-3,3e-3,1e-2", "steps=200"]
        sweep(where / "flow", *grid, "objective=flow")
        sweep(where / "v", *grid, "objective.prediction=v_prediction")
    else:
        raise SystemExit(f"bench/trend.py: unknown set {name!r}; sets: {', '.join(SETS)}")


def read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [{k: _float(v) for k, v in r.items()} for r in csv.DictReader(f)]


def _float(v):
    try:
        return float(v) if v != "" else ""
    except ValueError:
        return v


def runs_under(root: Path) -> list[tuple[str, Path, dict]]:
    """(set, run dir, result.json) of every run under root (the diagnosis's own runs left out)."""
    found = []
    for path in sorted(root.rglob("result.json")):
        if "diagnosis" in path.parts:
            continue
        rel = path.parent.relative_to(root).parts
        found.append((rel[0] if len(rel) > 1 else root.name, path.parent, json.loads(path.read_text())))
    return found


def group_key(r: dict) -> str:
    params = {k: v for k, v in (r.get("params") or {}).items() if k not in ("optim.lr", "seed")}
    return json.dumps(params, sort_keys=True, default=str)


def label(set_name: str, run_dir: Path, r: dict) -> str:
    p = dict(r.get("params") or {})
    bits = [f"{k.split('.')[-1]}={v}" for k, v in p.items() if k not in ("seed",)]
    return f"{set_name}/{run_dir.name}: " + " ".join(bits) + f" s{r.get('seed')}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="*", type=Path, help="folders holding runs (default: --out)")
    ap.add_argument("--run", default="", help=f"comma-separated sets to run first ({', '.join(SETS)}, or all)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/trend"))
    ap.add_argument("--set", action="append", default=[], help="a MonitorConfig trend field, e.g. trend_rise_t=3")
    ap.add_argument(
        "--before",
        type=int,
        default=None,
        help="judge each loss_spike run as if it had ended this many steps before its first bad step (exact for a "
        "constant lr after warmup: the shorter run's rows are these rows)",
    )
    args = ap.parse_args()
    todo = list(SETS) if args.run == "all" else [s for s in args.run.split(",") if s]
    for name in todo:
        run_set(name, args.out)
    cfg = MonitorConfig()
    for item in args.set:
        key, _, value = item.partition("=")
        cfg = replace(cfg, **{key.removeprefix("monitor."): type(getattr(cfg, key.removeprefix("monitor.")))(value)})
    runs = [x for d in (args.dirs or [args.out]) for x in runs_under(d)]
    best: dict[str, float] = {}
    for _, _, r in runs:
        if r.get("eval_loss") is not None:
            key = group_key(r)
            best[key] = min(best.get(key, float("inf")), r["eval_loss"])
    print(
        f"{'run':<70} {'recorded':<22} {'n':>4} {'end/min':>7} {'rise':>6} {'t':>6} {'progress':>8} {'path':>7} "
        f"{'logit':>7} {'eval':>7} {'/best':>6}  verdict"
    )
    tally = Tally()
    cache = EvalCache(args.out / "untrained_eval.json")
    for set_name, run_dir, r in runs:
        recorded = "stable" if r["status"] == "stable" else f"{r.get('verdict')}@{r.get('first_bad_step')}"
        if r["status"] not in ("stable", "diverged"):
            recorded = r["status"]
        line = f"{label(set_name, run_dir, r)[:70]:<70} {recorded:<22}"
        rows = read_rows(run_dir / "metrics.csv")
        _, run = load_recorded(run_dir)
        if r.get("verdict") == "loss_spike" and args.before is not None:  # as if it had ended before its spike
            cut = [row for row in rows if row["step"] < r["first_bad_step"] - args.before]
            t = judge(cut, Weights(None, None, 0.0), cfg, Context(run.data.batch_size, fresh=False))
            print(f"{line} {_stats(t, None)}  (ended {args.before} steps before its spike)", flush=True)
            tally.add(f"{set_name} pre-spike", t)
            continue
        if r["status"] != "stable" and r.get("verdict") not in END_OF_RUN:
            print(line)  # stopped by the monitor: no trend
            continue
        tr = r.get("trend") or {}  # a run made before result.json had `trend`: its curve only (no weights' travel)
        moved = tr.get("weight_path") is not None
        weights = Weights(1.0, tr.get("weight_growth"), tr["weight_path"]) if moved else Weights(None, None, 0.0)
        ev = r.get("eval_loss")
        fresh = not r.get("loaded") and not r.get("start_step")
        # the untrained weights' eval loss of every fresh run, so that any threshold can be tried
        ev0 = cache.get(run_dir, run) if fresh and ev is not None else None
        t = judge(rows, weights, cfg, Context(run.data.batch_size, fresh, ev, ev0))
        rel = ev / best[group_key(r)] if ev is not None and best.get(group_key(r)) else None
        print(f"{line} {_stats(t, ev, rel)}", flush=True)
        tally.add(set_name, t, alarm=set_name in MUST_STAY_STABLE, where=run_dir)
    cache.save()
    tally.print(cfg)
    return 0


class EvalCache:
    """The untrained weights' eval loss of each run (sweep.run.execute.untrained_eval_loss's number), kept in a file
    beside the runs: a model build and one eval each."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.known = json.loads(path.read_text()) if path.is_file() else {}

    def get(self, run_dir: Path, run) -> float | None:
        key = str(run_dir)
        if key not in self.known:
            device = torch.device("cpu")
            policy = PrecisionPolicy.from_config(run.precision, device)
            reset_process_state(run, policy)
            parts = build_parts(run, device, policy)
            evaluator = make_evaluator(run, parts)
            self.known[key] = untrained_eval_loss(run, parts, evaluator) if evaluator else None
        return self.known[key]

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.known, indent=1))


class Tally:
    """Per set: each statistic's values and the verdicts, and the false alarms of the sets that must stay stable."""

    def __init__(self) -> None:
        self.stats: dict[str, dict[str, list[float]]] = {}
        self.counts: dict[str, dict[str, int]] = {}
        self.alarms: dict[str, list[str]] = {}

    def add(self, set_name: str, t, alarm: bool = False, where: Path | None = None) -> None:
        s = self.stats.setdefault(set_name, {})
        rising = t.rise if t.rise_t is not None and t.rise_t >= 2 else None
        for key, value in (
            ("end/min", t.end_over_min),
            ("t", t.rise_t),
            ("rise (t>=2)", rising),
            ("end/init", t.end_over_initial),
            ("eval/untrained", t.eval_over_initial),
            ("path", t.weight_path),
        ):
            if value is not None:
                s.setdefault(key, []).append(value)
        c = self.counts.setdefault(set_name, {})
        name = str(t.verdict or ("stable" if t.judged else "not judged"))
        c[name] = c.get(name, 0) + 1
        if alarm:
            self.alarms.setdefault(set_name, [])
            if t.verdict:
                self.alarms[set_name].append(f"{where}: {t.verdict}")

    def print(self, cfg: MonitorConfig) -> None:
        print("\nPer set, over the runs judged: min / median / max of each statistic")
        for set_name, s in self.stats.items():
            parts = [f"{k} {min(v):.3g}/{statistics.median(v):.3g}/{max(v):.3g}" for k, v in s.items()]
            print(f"  {set_name:<20} {self.counts[set_name]}\n  {'':<20} " + "; ".join(parts))
        print(f"thresholds: { ({k: v for k, v in vars(cfg).items() if k.startswith('trend')}) }")
        for set_name, alarms in self.alarms.items():
            print(f"false alarms in {set_name}: {len(alarms)}")
            for a in alarms:
                print(f"  {a}")


def _stats(t, ev, rel=None) -> str:
    logit = (t.logits or {}).get("max")
    verdict = t.verdict or ("-" if t.judged else "not judged")
    return (
        f"{t.steps:>4} {_f(t.end_over_min):>7} {_f(t.rise):>6} {_f(t.rise_t):>6} {_f(t.progress):>8} "
        f"{_f(t.weight_path):>7} {_f(logit):>7} {_f(ev):>7} {_f(rel):>6}  {verdict}"
    )


def _f(x) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}"


if __name__ == "__main__":
    sys.exit(main())
