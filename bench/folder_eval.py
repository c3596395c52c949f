"""What folder data's held-out eval loss buys: the spread between seeds against the differences between settings.

    PYTHONPATH=. python bench/folder_eval.py [--files 48] [--steps 50] [--seeds 3] [--out /tmp/folder_eval]

Writes a latent folder (`--files` .safetensors files of shape (4, 4, 8, 8), clips of the synthetic generator
with 4 channels), then runs the grid of a user's trial on it, precision=bf16_amp,fp32 x
optim.lr=1e-4,1e-3,3e-3,1e-2 x `--seeds` seeds at `--steps` steps (tiny video DiT), twice:
- before: `data.eval_files=0`, every file trains and there is no eval loss, so the quality of a run is its
  final training loss (one minibatch at random timesteps), what folder data had;
- after: the default `data.eval_files=0.1`, the quality is the eval loss on the held-out files.
The after sweep's final training loss is shown too (the same runs, scored the old way).

For each quality it prints every setting's mean ± sd over its seeds, then: the within-setting sd (the seed
noise; pooled, i.e. the root of the mean variance, and the median of the settings' sds), the sd of the
setting means (the signal), their ratio, how many settings tie with the best, and how many pairs of
settings are told apart, both under the tables' rule (sweep/report/noise.py `within_noise`: two standard
errors of the difference of the means).
Only settings whose every seed is stable are compared. Results: docs/eval_loss.md.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from safetensors.torch import save_file

from sweep.config import to_run_config
from sweep.data.synthetic import SyntheticClips
from sweep.report.noise import Spread, within_noise
from sweep.run.execute import execute

CONF = str(Path(__file__).resolve().parents[1] / "conf")
PRECISIONS = ("bf16_amp", "fp32")
LRS = (1e-4, 1e-3, 3e-3, 1e-2)
SHAPE = {"channels": 4, "frames": 4, "height": 8, "width": 8}


def write_folder(root: Path, files: int) -> Path:
    """`files` latents (4, 4, 8, 8) in [-0.9, 0.9]: synthetic clips (moving shapes over drifting textures)."""
    root.mkdir(parents=True, exist_ok=True)
    clips = SyntheticClips(num_samples=files, seed=123, **SHAPE)
    for i in range(files):
        save_file({"latents": clips[i].contiguous()}, str(root / f"clip_{i:03d}.safetensors"))
    return root


def run_grid(folder: Path, out: Path, steps: int, seeds: int, eval_files: float) -> dict:
    """{(precision, lr): [result.json dicts, one per seed]}."""
    results = {}
    for precision, lr in itertools.product(PRECISIONS, LRS):
        for seed in range(seeds):
            overrides = [
                "data=latent_folder",
                f"data.path={folder}",
                *(f"data.{k}={v}" for k, v in SHAPE.items()),
                f"data.eval_files={eval_files}",
                f"precision={precision}",
                f"optim.lr={lr}",
                f"seed={seed}",
                f"steps={steps}",
                "threads=1",
                "progress=none",
                "ledger.enabled=false",
            ]
            with initialize_config_dir(config_dir=CONF, version_base=None):
                run = to_run_config(compose("config", overrides=overrides))
            params = {"precision": precision, "optim.lr": lr, "seed": seed}
            result = execute(run, out / f"{precision}_lr{lr:g}_s{seed}", params)
            results.setdefault((precision, lr), []).append(result.to_dict())
    return results


def compare(results: dict, quality: str) -> dict:
    """Per-setting spreads of `quality` over seeds, pooled within sd, between sd, ratio, ties with the best."""
    spreads = {
        setting: Spread.of(r[quality] for r in runs)
        for setting, runs in results.items()
        if all(r["status"] == "stable" and r[quality] is not None for r in runs)
    }
    within = math.sqrt(statistics.fmean(s.sd**2 for s in spreads.values()))
    between = statistics.stdev(s.mean for s in spreads.values())
    best = min(spreads, key=lambda k: spreads[k].mean)
    ties = [k for k in spreads if within_noise(spreads[best], spreads[k])]
    pairs = list(itertools.combinations(spreads.values(), 2))
    apart = sum(within_noise(a, b) is False for a, b in pairs)
    median = statistics.median(s.sd for s in spreads.values())
    return {
        "spreads": spreads,
        "within": within,
        "median_within": median,
        "between": between,
        "best": best,
        "ties": ties,
        "apart": (apart, len(pairs)),
    }


def report(name: str, c: dict) -> None:
    print(f"\n{name}")
    for (precision, lr), s in c["spreads"].items():
        mark = " best" if (precision, lr) == c["best"] else (" tie" if (precision, lr) in c["ties"] else "")
        print(f"  {precision:>9} lr {lr:<7g} {s.mean:.4f} ± {s.sd:.4f}{mark}")
    n = len(c["spreads"])
    print(
        f"  within-setting sd {c['within']:.4f} (pooled; median {c['median_within']:.4f}), between-setting sd"
        f" {c['between']:.4f}, ratio {c['between'] / c['within']:.1f} (to the median: "
        f"{c['between'] / c['median_within']:.0f})"
    )
    print(
        f"  {len(c['ties'])} of {n} settings tie with the best ({c['best'][0]} lr {c['best'][1]:g});"
        f" {c['apart'][0]} of {c['apart'][1]} pairs of settings told apart"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=48)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default="/tmp/folder_eval")
    args = ap.parse_args()
    out = Path(args.out)
    folder = write_folder(out / "latents", args.files)
    start = time.perf_counter()
    before = run_grid(folder, out / "before", args.steps, args.seeds, 0)
    after = run_grid(folder, out / "after", args.steps, args.seeds, 0.1)
    runs = 2 * len(PRECISIONS) * len(LRS) * args.seeds
    print(f"{runs} runs of {args.steps} steps in {time.perf_counter() - start:.0f} s; folder {folder}")
    held = next(iter(after.values()))[0]["eval"]
    print(f"held out ({len(held['files'])} of {args.files} files, {held['pairs']} eval pairs): {held['files']}")
    statuses = {k: [r["status"] for r in v] for k, v in after.items() if any(r["status"] != "stable" for r in v)}
    print(f"settings with a run that was not stable (left out): {statuses or 'none'}")
    report("before: every file trains, quality = final training loss", compare(before, "final_loss"))
    report("after: 10% held out, quality = eval loss", compare(after, "eval_loss"))
    report("after, scored the old way: final training loss of the same runs", compare(after, "final_loss"))


if __name__ == "__main__":
    main()
