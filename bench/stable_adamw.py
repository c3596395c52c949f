"""The numbers of a `+experiment=stable_adamw` sweep: does update clipping remove the beta2 loss spike?

    python -m sweep -m +experiment=stable_adamw hydra.sweep.dir=DIR
    python bench/stable_adamw.py DIR            # one row per run, then one per (betas, update_clip)
    python bench/stable_adamw.py DIR1 DIR2 ... --markdown   # several sweeps (other pretrainings), cells pooled

A sweep's replicate seeds share its one pretraining; another pretraining is another sweep:
`+scenario.pretrain_overrides.seed=S` (the pretraining's seed; the runs keep theirs).

Per run: the verdict and first bad step; the peak of the monitor's smoothed loss after the resume over its
running minimum (the number the spike test holds to `monitor.spike_factor`, 10: above it is `loss_spike`),
replayed from metrics.csv with the monitor state the checkpoint carried, so the pretraining's minimum counts;
the mean training loss over the last 50 steps (the experiment runs every run to its end,
`monitor.stop_on_divergence=false`; the seeds' batches and timesteps do not depend on the optimizer, so runs
of one seed see the same samples); and the eval loss (held-out set, stable runs only: none is taken after a
verdict). A batch-1 run's last loss is one sample at one timestep, so it is not shown.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

from omegaconf import OmegaConf

from sweep.config import MonitorConfig
from sweep.run.monitor import DivergenceMonitor
from sweep.run.precision import ScalerEvent

TAIL = 50


def peak_ratio(run_dir: Path, result: dict) -> float:
    """max over the run's steps of smoothed loss / its running minimum, the monitor's own test replayed."""
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml").monitor
    monitor = DivergenceMonitor(MonitorConfig(spike_factor=saved.spike_factor, ema_beta=saved.ema_beta))
    trainer = json.loads((Path(result["loaded"]) / "trainer.json").read_text())
    monitor.load_state_dict(trainer["monitor"], {})
    peak = 0.0
    for row in rows(run_dir):
        floor = min(monitor.ema_min, monitor.initial_loss)  # what the step is held against, before it counts
        monitor.observe(int(row["step"]), float(row["loss"]), float(row["grad_norm"]), ScalerEvent.step)
        peak = max(peak, monitor.ema / floor)
    return peak


def rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def run_row(run_dir: Path) -> dict:
    r = json.loads((run_dir / "result.json").read_text())
    p = r["params"]
    losses = [float(x["loss"]) for x in rows(run_dir)]
    pretrain = json.loads((Path(r["loaded"]).parents[1] / "pretrain.json").read_text())
    return {
        "beta2": p["optim.betas"][1],
        "update_clip": float(p["optim.update_clip"]),
        "pretrain_seed": pretrain["seed"],
        "seed": r["seed"],
        "outcome": "stable" if r["status"] == "stable" else f"{r['verdict']}@{r['first_bad_step']}",
        "mechanism": (r.get("mechanism") or {}).get("name") or "-",
        "peak_ratio": peak_ratio(run_dir, r),
        "tail_loss": statistics.fmean(losses[-TAIL:]),
        "eval_loss": r.get("eval_loss"),
        "steps": len(losses),
        "start": r.get("start_step"),
    }


def cell_rows(runs: list[dict]) -> list[dict]:
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        cells.setdefault((r["beta2"], r["update_clip"]), []).append(r)
    out = []
    for (beta2, clip), rs in sorted(cells.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        spiked = [r for r in rs if r["outcome"] != "stable"]
        evals = [r["eval_loss"] for r in rs if r["eval_loss"] is not None]
        peaks = sorted(r["peak_ratio"] for r in rs)
        out.append(
            {
                "beta2": beta2,
                "update_clip": clip,
                "diverged": f"{len(spiked)}/{len(rs)}",
                "first_bad_steps": ", ".join(sorted(r["outcome"].split("@")[1] for r in spiked)) or "-",
                "peak_ratio": f"{statistics.median(peaks):.1f} ({peaks[0]:.1f}-{peaks[-1]:.1f})",
                "tail_loss": statistics.fmean(r["tail_loss"] for r in rs),
                "eval_loss_stable": f"{statistics.fmean(evals):.3f} (n={len(evals)})" if evals else "-",
            }
        )
    return out


def render(table: list[dict], markdown: bool) -> str:
    cols = list(table[0])
    cell = {float: lambda v: f"{v:.4g}", type(None): lambda v: "-"}
    text = [[cell.get(type(r[c]), str)(r[c]) for c in cols] for r in table]
    if markdown:
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        return "\n".join(lines + ["| " + " | ".join(t) + " |" for t in text])
    widths = [max(len(c), *(len(t[i]) for t in text)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    return "\n".join(lines + ["  ".join(v.ljust(w) for v, w in zip(t, widths)) for t in text])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dirs", type=Path, nargs="+")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    dirs = [p.parent for sweep in args.sweep_dirs for p in sweep.glob("*/result.json")]
    if not dirs:
        print(f"no runs in {' '.join(map(str, args.sweep_dirs))}", file=sys.stderr)
        return 1
    runs = [run_row(d) for d in dirs]
    runs.sort(key=lambda r: (-r["beta2"], r["update_clip"], r["pretrain_seed"], r["seed"]))
    print(render(runs, args.markdown))
    print()
    print(render(cell_rows(runs), args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
