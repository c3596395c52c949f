"""Confirm a sweep's answer at a longer horizon: its recommended setting and each combination's largest stable lr,
every seed, rerun to more steps; where one fails, the next lower stable lr of its combination.

    python -m sweep.confirm outputs/sweeps/2026-11-27/10-00-00
    python -m sweep.confirm SWEEP_DIR --steps 200          # to 200 steps (default: confirm.steps, or 4x steps)
    python -m sweep.confirm SWEEP_DIR --budget 3           # within 3x the sweep's run time (default: confirm.budget)

Writes SWEEP_DIR/confirmation.json and keeps its runs under SWEEP_DIR/confirm/ (each with trial.json, not
result.json: they are not runs of the sweep). Settings confirmed before for the same runs and horizon are not
rerun. A seed that failed is diagnosed where the sweep ran with monitor.diagnose=auto, as its end does (its
diagnosis.json beside its trial.json). Then the sweep's summary.md (and its summary_<table>.csv), report.html and
its study's answer are written again, where its end wrote them, and the recommendation is printed: the frontier's
`held` column, and a recommendation that names only a setting that held (`python -m sweep.report SWEEP_DIR` shows
the same). A multirun does this itself at its end (confirm.mode=auto; docs/confirmation.md).
Exit status 0 when confirmed (whatever held), 2 on bad input, 128 + the signal's number when Ctrl-C or SIGTERM
stopped it (what was confirmed is recorded; the same command finishes it).
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
from pathlib import Path

from sweep.config import ConfigError

PROG = "python -m sweep.confirm"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("sweep_dir", type=Path, help="a multirun's directory (its <n>/result.json, <n>/.hydra/)")
    ap.add_argument(
        "--steps",
        type=int,
        help="the longer horizon (default: the sweep's confirm.steps, or confirm.factor x its steps)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        help="confirm the settings besides the recommended one within this "
        "many times the sweep's run time (default: the sweep's confirm.budget; 0: the recommended alone)",
    )
    ap.add_argument(
        "--target",
        choices=("cpu", "cuda"),
        help="the device the recommendation is for, as python -m sweep.report --target (default: the sweep's "
        "report.target, else the device the sweep ran on, cuda for a sweep on the CPU); the sweep's own files keep "
        "its report.target",
    )
    args = ap.parse_args(argv)
    name = PROG.split()[-1]
    if args.budget is not None and not (math.isfinite(args.budget) and args.budget >= 0):
        print(f"{name}: --budget must be a finite number >= 0, got {args.budget:g}", file=sys.stderr)
        return 2
    if not args.sweep_dir.is_dir():
        print(f"{name}: {args.sweep_dir}: no such directory", file=sys.stderr)
        return 2
    from sweep.confirm.multirun import confirm_sweep  # torch and pandas: once the input is known to be there
    from sweep.confirm.plan import grid_runs

    if grid_runs(args.sweep_dir).empty:
        print(f"{name}: {args.sweep_dir} holds no runs of a sweep (no <n>/result.json)", file=sys.stderr)
        return 2
    from sweep.report.target import recorded_target

    target = args.target if args.target is not None else recorded_target(args.sweep_dir)
    try:
        record = confirm_sweep(
            args.sweep_dir,
            steps=args.steps,
            budget=args.budget,
            progress=lambda s: print(s, flush=True),
            target=target,
        )
    except ConfigError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    interrupted = (record or {}).get("interrupted")
    if record is not None and not interrupted:
        diagnose_failed(args.sweep_dir, grid_runs(args.sweep_dir).run_dir.iloc[0])
    if record is not None:
        show_answer(args.sweep_dir, target, name)
    return 128 + signal.Signals[interrupted].value if interrupted else 0


def diagnose_failed(sweep_dir: Path, grid_run: str) -> None:
    """The seeds that failed at the longer horizon diagnosed, as the end of a multirun does, where the sweep ran with
    monitor.diagnose=auto (its first grid run's recorded config: its monitor.diagnose_budget too)."""
    from sweep.config.recorded import load_recorded
    from sweep.diagnose.multirun import diagnose_confirmation

    _, run = load_recorded(Path(grid_run))
    if run.monitor.diagnose.value == "auto":
        diagnose_confirmation(sweep_dir, run.monitor.diagnose_budget, progress=lambda s: print(s, flush=True))


def show_answer(sweep_dir: Path, target: str | None, name: str) -> None:
    """The sweep's files rewritten with what was confirmed (sweep/report/refresh.py), and the recommendation for
    `target` printed, as the end of a multirun prints it."""
    import textwrap

    from sweep.report.refresh import rewrite_answer, rewritten_line, summary_of
    from sweep.report.text import WIDTH

    summary, written, problems = rewrite_answer(sweep_dir)
    if summary is not None and target is not None and target != summary.recommendation.target:
        summary, _ = summary_of(sweep_dir, target)  # --target other than the sweep's: its files keep the sweep's
    for line in problems:
        print(f"{name}: {line}", file=sys.stderr)
    if summary is None:
        return
    print(f"\nRecommendation\n{textwrap.fill(summary.recommendation.line, WIDTH, subsequent_indent='  ')}")
    saved = (
        rewritten_line(sweep_dir, written)
        if written
        else (f"The sweep wrote no summary yet: python -m sweep.report {sweep_dir} --write writes it")
    )
    print(textwrap.fill(saved, WIDTH, subsequent_indent="  "), flush=True)


if __name__ == "__main__":
    from sweep.exit import exit_after

    exit_after(main)
