"""What the confirmation at a longer horizon costs on a sweep: continued from the grid runs' final states, against
from step 0 alone and packed from step 0, in one process, on the same sweep.

    python bench/confirmation.py                                  # the demo grid (+experiment=demo), 4x its steps
    python bench/confirmation.py --ab -- +experiment=demo threads=1   # + continued vs from step 0, interleaved
    python bench/confirmation.py --out /tmp/c -- data.frames=4 data.height=8 data.width=8 steps=10 replicates=2 \\
        optim.lr=1e-2,1.5e-2                                       # any grid: its overrides after --

It runs the grid in this process as `python -m sweep -m` would (monitor.diagnose=off, so that only the grid and
the confirmation are timed; confirm.budget=1000, so that every variant confirms every setting), with
confirm.mode=auto: that confirmation continues the kept final states. Then, on
copies of the sweep directory without its confirmation, `confirm_sweep` again with no state kept (every seed from
step 0, alone) and packed (every setting's seeds as one pack from step 0). It prints, for each: the settings and
whether they held, the runs, the steps trained and the seconds (confirmation.json's: its settings' seconds added
up, the same measure for each), beside the grid's own steps and seconds. On a shared machine those variants run
minutes apart under another load; `--ab` compares like with like instead: for every seed the confirmation ran, its
grid run again (to hold its state), then that seed continued and from step 0 back to back, the order alternating,
with the steps, seconds and whether the two eval losses are bit for bit equal. Run it on an idle machine, or read
the steps and the interleaved ratio.
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


def interleaved(sweep_dir: Path, out: Path, record: dict) -> None:
    """Per confirmed seed: continued and from step 0 back to back (order alternating); their totals."""
    import dataclasses

    from sweep.confirm import state
    from sweep.confirm.trial import run_alone, seed_runs
    from sweep.run.execute import execute
    from sweep.run.interrupt import StopRequest

    totals = {"continued": [0, 0.0], "from step 0": [0, 0.0]}
    same, k = True, 0
    for entry in record["settings"]:
        horizon = entry["steps"]
        for x in entry["seeds"]:
            grid_run = sweep_dir / x["grid_run"]
            (r,) = seed_runs([(x["seed"], grid_run)], out / str(k), lambda run, h=horizon: h)
            grid = dataclasses.replace(r.run, steps=r.grid_steps)  # the grid run again, to hold its final state
            execute(grid, out / str(k) / "grid", {}, hooks=[state.KeepFinalState(grid_run, r.grid_steps)])
            kept = state.take(grid_run)
            evals = {}
            for mode in ("continued", "from step 0") if k % 2 == 0 else ("from step 0", "continued"):
                if mode == "continued":
                    state._KEPT[state.key(grid_run)] = kept
                o = run_alone(dataclasses.replace(r, out_dir=out / str(k) / mode.replace(" ", "_")), StopRequest())
                totals[o["how"]][0] += o["steps_run"] - o["start_step"]
                totals[o["how"]][1] += o["seconds"]
                evals[mode] = o["eval_loss"]
            same &= evals["continued"] == evals["from step 0"]
            k += 1
    (sc, tc), (sz, tz) = totals["continued"], totals["from step 0"]
    print(
        f"interleaved, {k} seeds: continued {sc} steps {tc:.1f} s, from step 0 {sz} steps {tz:.1f} s: "
        f"{tc / max(tz, 1e-9):.3f} of the time for {sc / max(sz, 1):.3f} of the steps; eval losses bit for bit "
        f"equal: {same}",
        flush=True,
    )


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
    ap.add_argument("--ab", action="store_true", help="also continued against from step 0, seed by seed, interleaved")
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
    if args.ab:
        interleaved(sweep_dir, args.out / "ab", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
