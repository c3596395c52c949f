"""Replay a finished run to its first bad step (or its last step) with hooks on every module.

    python -m sweep.replay outputs/runs/2026-11-22/10-00-00

Rebuilds the run from its saved config (.hydra/config.yaml), re-trains it deterministically to the
step, and prints where the values first went non-finite (forward or backward, which module) and the
modules closest to their dtype's overflow edge. Writes forensics.json into the run directory (`--json FILE`
elsewhere; into the current directory when the run directory cannot be written, as the data doctor does).

A run that did not diverge has nothing to replay unless `--step N` asks for a step, and then the
replay says whether the values stayed finite. `--step` must be a step the run ran (0 to steps_run - 1):
anything else is one line and exit status 2, never a retrain of that many steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sweep.config import ConfigError, RunConfig
from sweep.config.recorded import load_recorded
from sweep.run.build import resolve_device
from sweep.run.forensics import locate
from sweep.run.results import run_record

FORENSICS_FILE = "forensics.json"


def load_run(run_dir: Path) -> RunConfig:
    """The RunConfig a run directory was made with (sweep.config.recorded.load_recorded)."""
    return load_recorded(run_dir)[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sweep.replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="a run directory (holds result.json and .hydra/config.yaml)")
    ap.add_argument("--step", type=int, default=None, help="probe this step instead of the first bad (or last) one")
    ap.add_argument(
        "--json",
        type=Path,
        metavar="FILE",
        help=f"where to write the findings (default: RUN_DIR/{FORENSICS_FILE}, or ./{FORENSICS_FILE} when the run "
        "directory is not writable)",
    )
    args = ap.parse_args(argv)
    run_dir: Path = args.run_dir
    record = run_record(run_dir)  # result.json; trial.json for a confirmation's own run
    if record is None or not (run_dir / ".hydra" / "config.yaml").is_file():
        print(
            f"sweep.replay: {run_dir} is not a run directory (needs result.json and .hydra/config.yaml)",
            file=sys.stderr,
        )
        return 2
    try:
        run = load_run(run_dir)
    except ConfigError as e:
        print(f"sweep.replay: config error: {e}", file=sys.stderr)
        return 2
    result = json.loads(record.read_text())
    steps_run = result.get("steps_run") or 0
    if args.step is not None and not 0 <= args.step < steps_run:
        print(
            f"sweep.replay: --step {args.step}: {run_dir} ran steps 0 to {steps_run - 1}"
            if steps_run
            else f"sweep.replay: --step {args.step}: {run_dir} ran no step",
            file=sys.stderr,
        )
        return 2
    diverged = result.get("status") == "diverged"
    if args.step is None and not diverged:
        print(
            f"{run_dir}: {result.get('status')} after {steps_run} steps - nothing went non-finite, nothing to "
            "replay (--step N probes a step's overflow headroom)"
        )
        return 0
    step = (
        args.step
        if args.step is not None
        else (result.get("first_bad_step") if result.get("first_bad_step") is not None else max(0, steps_run - 1))
    )
    # A stable run has no verdict: the replay blames only what it sees go non-finite.
    cause, headroom = locate(run, result.get("verdict") if diverged else None, step, resolve_device(run.device))
    print(f"{run_dir}: {result['status']} {result.get('verdict') or ''} - probed step {step}")
    print(
        f"cause: {cause.where} / {cause.module} / {cause.detail}"
        if cause
        else "cause: nothing non-finite at that step (the values stayed finite)"
    )
    print("closest to overflow (max |activation| / dtype max):")
    for h in headroom:
        print(f"  {h['module']:<32} {h['headroom']:>9.3g}  amax {h['amax']:.3g} ({h['dtype']})")
    out = {"step": step, "cause": None if cause is None else cause.__dict__, "headroom": headroom}
    return write_findings(json.dumps(out, indent=2) + "\n", args.json, run_dir)


def write_findings(text: str, given: Path | None, run_dir: Path) -> int:
    """forensics.json: to --json FILE, else into the run dir, else (a run dir that cannot be written: a read-only
    mount, another user's files) into the current directory, said on stderr. Before, a read-only run dir ended
    the replay, its findings printed, with a traceback. Exit status 0, or 1 with one line when none takes it."""
    tried = [given] if given is not None else [run_dir / FORENSICS_FILE, Path.cwd() / FORENSICS_FILE]
    errors = []
    for path in tried:
        try:
            path.write_text(text)
        except OSError as e:
            errors.append(f"{path}: {e.strerror or type(e).__name__}")
            continue
        if errors:
            print(f"sweep.replay: {'; '.join(errors)}: wrote {path} instead", file=sys.stderr)
        return 0
    print(
        f"sweep.replay: could not write the findings ({'; '.join(errors)}); they are printed above, and "
        "--json FILE writes them where you can write",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    from sweep.exit import exit_after

    exit_after(main)
