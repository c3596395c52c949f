"""What the confirmation at a longer horizon costs on a sweep: continued from the grid runs' final states, against
from step 0 alone and packed from step 0, in one process, on the same sweep.

    python bench/confirmation.py                                  # the demo grid (+experiment=demo), 4x its steps
    python bench/confirmation.py --out /tmp/c -- data.frames=4 data.height=8 data.width=8 steps=10 replicates=2 \\
        optim.lr=1e-2,1.5e-2                                       # any grid: its overrides after --

It runs the grid in this process as `python -m sweep -m` would (monitor.diagnose=off, so that only the grid and
the confirmation are timed; confirm.budget=1000, so that every variant confirms every setting), with
confirm.mode=auto: that confirmation continues the kept final states. Then, on
copies of the sweep directory without its confirmation, `confirm_sweep` again with no state kept (every seed from
step 0, alone) and packed (every setting's seeds as one pack from step 0). It prints, for each: the settings and
whether they held, the runs, the steps trained and the seconds (confirmation.json's: its settings' seconds added
up, the same measure for each), beside the grid's own steps and seconds. Run it on
an idle machine, or read the steps: the seconds of a shared one are the others' too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from sweep.confirm.multirun import CONFIRM_DIR, confirm_sweep
from sweep.job import run_job
from sweep.report.confirmation import CONFIRMATION_FILE

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def grid(sweep_dir: Path, overrides: list[str]) -> float:
    """The multirun in this process (its confirmation included); its wall seconds."""
    start = time.perf_counter()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            GlobalHydra.instance().hydra.multirun(
                config_name="config",
                task_function=run_job,
                with_log_configuration=False,
                overrides=["hydra.mode=MULTIRUN", f"hydra.sweep.dir={sweep_dir}", *overrides],
            )
    finally:
        GlobalHydra.instance().clear()
    return time.perf_counter() - start


def again(sweep_dir: Path, copy: Path, packed: bool, record: dict) -> dict:
    """The same confirmation on a copy of the sweep without it, with no kept state; its record."""
    shutil.copytree(sweep_dir, copy, ignore=shutil.ignore_patterns(CONFIRM_DIR, CONFIRMATION_FILE))
    with contextlib.redirect_stdout(io.StringIO()):
        return confirm_sweep(copy, record["steps"], record["factor"], record["budget"], packed=packed)


def line(name: str, record: dict) -> str:
    held = ", ".join(
        f"{s['combination']}@{s['lr']:g} {'held' if s['held'] else 'failed' if s['held'] is False else '-'}"
        for s in record["settings"]
    )
    return (
        f"{name:<22} {len(record['settings']):>3} settings {record['runs']:>4} runs {record['steps_trained']:>6} steps"
        f" {record['seconds']:>8.1f} s   {held}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("outputs/bench_confirmation"), help="a new folder for the sweeps")
    ap.add_argument("--skip", default="", help="comma list of variants not to run: zero,packed")
    ap.add_argument("overrides", nargs="*", help="the grid (default: +experiment=demo)")
    args = ap.parse_args()
    if args.out.exists():
        sys.exit(f"{args.out} exists: give a new folder")
    overrides = [*(args.overrides or ["+experiment=demo"]), "monitor.diagnose=off", "confirm.mode=auto"]
    overrides += [] if any(o.startswith("confirm.budget=") for o in overrides) else ["confirm.budget=1000"]
    sweep_dir = args.out / "sweep"
    wall = grid(sweep_dir, overrides)
    results = [json.loads(p.read_text()) for p in sweep_dir.glob("*/result.json")]
    record = json.loads((sweep_dir / CONFIRMATION_FILE).read_text())
    runs_s = sum(r["seconds"] for r in results)
    print(
        f"\ngrid                   {len(results):>3} runs {sum(r['steps_run'] for r in results):>6} steps "
        f"{runs_s:>8.1f} s of runs; the multirun took {wall:.1f} s, its confirmation included"
    )
    print(line("continued (the sweep's)", record))
    for name, packed in (("zero", False), ("packed", True)):
        if name in args.skip.split(","):
            continue
        out = again(sweep_dir, args.out / name, packed, record)
        print(line({"zero": "from step 0", "packed": "packed from step 0"}[name], out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
