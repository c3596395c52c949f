"""Why a run diverged and the smallest change that fixes it.

    python -m sweep.diagnose outputs/sweeps/2026-11-25/10-00-00/3
    python -m sweep.diagnose RUN_DIR --bisect        # + the modules that must stay in fp32 (a run per trial)
    python -m sweep.diagnose RUN_DIR --past 10 --no-fix

Reads the run's result.json, metrics.csv and .hydra/config.yaml; names its mechanism from what it
recorded; replays it bit for bit to its last healthy step and runs the bad steps again with one change at
a time (same config, fp32, reference kernels, without extreme samples, lr/10, update clipping); runs the
proposed fix from step 0. Writes RUN_DIR/diagnosis.json and keeps its runs under RUN_DIR/diagnosis/ (--out DIR:
there instead, for a run dir you cannot write). For a run of a sweep, the sweep's summary.md, its tables and
report.html are written again with the diagnosis, where its end wrote them (sweep/report/refresh.py).
Exit status 0 when diagnosed, 2 on bad input (not a run dir, a run that did not diverge, an older run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sweep.config import ConfigError
from sweep.diagnose.counterfactual import PAST
from sweep.diagnose.diagnosis import diagnose, render
from sweep.diagnose.record import DiagnoseError
from sweep.run.interrupt import Stopped, stopping_on_signals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m sweep.diagnose",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("run_dir", type=Path, help="a diverged run's directory (result.json, metrics.csv, .hydra/)")
    ap.add_argument("--bisect", action="store_true", help="search the modules that must compute in fp32")
    ap.add_argument("--past", type=int, default=PAST, help=f"steps run past the bad ones (default {PAST})")
    ap.add_argument("--no-fix", action="store_true", help="do not run the proposed fix")
    ap.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="write diagnosis.json and the diagnosis's runs (diagnosis/) into DIR (default: the run dir; for a run "
        "dir you cannot write)",
    )
    args = ap.parse_args(argv)
    if args.past < 0:
        print("sweep.diagnose: --past must be >= 0", file=sys.stderr)
        return 2
    try:
        # Ctrl-C/SIGTERM: the diagnosis's run in progress stops after its step (recorded as interrupted), and the
        # diagnosis stops there, diagnosis.json not written (before: a KeyboardInterrupt traceback, and the run in
        # progress recorded as `error`)
        with stopping_on_signals(when="after the step of the diagnosis's run in progress"):
            d = diagnose(
                args.run_dir,
                bisect=args.bisect,
                past=args.past,
                fix=not args.no_fix,
                progress=lambda line: print(line, flush=True),
                out=args.out,
            )
    except (DiagnoseError, ConfigError) as e:
        print(f"sweep.diagnose: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        where = args.out or args.run_dir
        print(
            f"sweep.diagnose: {e.name}: stopped; {where}/diagnosis.json is not written (the runs made so far are in "
            f"{where}/diagnosis/, the one stopped recorded as interrupted); run the same command again to diagnose",
            file=sys.stderr,
        )
        return 128 + e.signum
    print()
    print(render(d))
    if args.out is None:
        rewrite_sweep(args.run_dir)
    return 0


def rewrite_sweep(run_dir: Path) -> None:
    """The files of the sweep `run_dir` is a run of (a job: its parent holds the sweep's multirun.yaml; a
    confirmation's seed: <sweep>/confirm/<setting>/seed_<s>), with the diagnosis just written; nothing for a lone
    run."""
    from sweep.confirm.multirun import CONFIRM_DIR

    run_dir = run_dir.resolve()
    confirmed = run_dir.parent.parent.name == CONFIRM_DIR
    sweep_dir = run_dir.parent.parent.parent if confirmed else run_dir.parent
    if not (sweep_dir / "multirun.yaml").is_file():
        return
    from sweep.report.refresh import rewrite_answer, rewritten_line  # pandas: only for a run of a sweep

    _, written, problems = rewrite_answer(sweep_dir)
    for line in problems:
        print(f"sweep.diagnose: {line}", file=sys.stderr)
    if written:
        print(rewritten_line(sweep_dir, written), flush=True)


if __name__ == "__main__":
    from sweep.exit import exit_after

    exit_after(main)
