"""Training steps/second of each tiny diffusers transformer, per precision, at the default tiny size.

    OMP_NUM_THREADS=1 python bench/diffusers_models.py [--steps 10] [--threads 1] [--models cogvideox,sana]
        [--precisions fp32,bf16_amp,fp16_amp]

Each cell is one real run (sweep.run.execute.execute: the training loop with its monitor, attention=math,
modulate=eager) on the default data: synthetic_video (4 x 3 x 8 x 16 x 16) for the video models,
synthetic_image (4 x 3 x 16 x 16) for the image models. A 2-step run first warms up the process
(imports, allocator); the figure is steps_per_second of the timed run. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from models.diffusers_zoo import DIFFUSERS_MODELS, ZOO
from sweep.config import to_run_config
from sweep.run.execute import execute

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def run_config(overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=overrides))


def overrides(name: str, precision: str, steps: int, threads: int) -> list[str]:
    model = "diffusers_dit_tiny" if name == "dit" else f"{name}_tiny"
    data = ["data=synthetic_image"] if ZOO[name].is_image else []
    return [
        f"model={model}",
        *data,
        f"precision={precision}",
        f"steps={steps}",
        f"threads={threads}",
        "progress=none",
        "monitor.forensics=false",
    ]


def measure(name: str, precision: str, steps: int, threads: int) -> tuple[float | None, int, str]:
    with tempfile.TemporaryDirectory() as out:
        r = execute(run_config(overrides(name, precision, steps, threads)), Path(out), {})
    return r.steps_per_second, r.n_params or 0, r.status


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", default=",".join(DIFFUSERS_MODELS))
    ap.add_argument("--precisions", default="fp32,bf16_amp,fp16_amp")
    args = ap.parse_args()
    precisions = args.precisions.split(",")
    print("| model | class | params | " + " | ".join(f"{p} steps/s (ms/step)" for p in precisions) + " |")
    print("|---|---|---:|" + "---:|" * len(precisions))
    for name in args.models.split(","):
        cells, n_params = [], 0
        for precision in precisions:
            measure(name, precision, 2, args.threads)  # warm-up
            sps, n_params, status = measure(name, precision, args.steps, args.threads)
            cells.append(f"{sps:.1f} ({1000 / sps:.0f})" if sps and status == "stable" else status)
        print(f"| {name} | {ZOO[name].cls_name} | {n_params / 1e6:.2f}M | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
