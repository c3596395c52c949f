"""Fuzz the command line of `python -m sweep` with many more draws than CI's property test.

    python bench/fuzz_cli.py --examples 10000 [--seed 0] [--runs 20] [--run-accepted 100] [--cli 20] [--show 5]

Draws override lists from the config schema (tests/cli_fuzz.py, the same strategies as
tests/test_cli_property.py) and sends each through the path `python -m sweep` takes before its first
step (password check, Hydra compose, `to_run_config`, `check_inputs`, `swept_params`), in this
process. Prints how many would exit 0 (run), exit 2 with one line, and crash with a traceback, and
the distinct tracebacks (type and first line) with an example command line each. `--runs N` also
runs N valid draws for real (2 steps, in-process, as Hydra runs the job) and checks their result.json;
`--run-accepted N` runs the first N fuzzed draws the path accepted (small sizes and 2 steps appended,
`CAPS`): a status `error` is a value validation let through that the run cannot take;
`--cli N` sends the first N refused command lines through real `python -m sweep` processes, to
check that the in-process path reads them as the command does (exit 2, one line on stderr).
Exit status 1 when anything crashed or printed more than one line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import seed as hseed  # noqa: E402

from tests.cli_fuzz import COMMAND, Composer, outcome, run_job_in_process, runnable_command  # noqa: E402


def fuzz_in_process(
    examples: int, seed: int, keep: int = 0, keep_ok: int = 0
) -> tuple[collections.Counter, dict, list, list, list]:
    counts: collections.Counter = collections.Counter()
    refused: list[list[str]] = []
    accepted: list[list[str]] = []
    crashes: dict[str, list[str]] = {}
    multiline: list = []
    with Composer() as composer:

        @hseed(seed)
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(overrides=COMMAND)
        def one(overrides):
            kind, text = outcome(composer, overrides)
            counts[kind] += 1
            if kind == "exit2" and len(refused) < keep:
                refused.append(overrides)
            if kind == "ok" and len(accepted) < keep_ok:
                accepted.append(overrides)
            if kind == "traceback":
                crashes.setdefault(text.splitlines()[0][:200] if text else "?", []).append(overrides)
            elif kind == "exit2" and text.count("\n") != 1:
                multiline.append((overrides, text))

        one()
    return counts, crashes, multiline, refused, accepted


def real_runs(n: int, seed: int) -> collections.Counter:
    statuses: collections.Counter = collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:

        @hseed(seed)
        @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(overrides=runnable_command())
        def one(overrides):
            run_dir = Path(tempfile.mkdtemp(dir=tmp))
            code = run_job_in_process(run_dir, ["steps=2", "eval.enabled=false", *overrides])
            result = run_dir / "result.json"
            statuses[
                json.loads(result.read_text())["status"] if code == 0 and result.is_file() else f"exit {code}"
            ] += 1

        one()
    return statuses


# Appended to an accepted fuzzed draw before it runs for real (the last value of a key wins): small and
# quick whatever the draw asked, so a thousand of them run in minutes; every other value stays fuzzed.
CAPS = ["steps=2", "data.num_samples=8", "data.batch_size=2", "eval.enabled=false", "compile=false"]
CAPS += ["checkpoint.every=0", "log_every=1", "monitor.logit_every=1"]


def run_accepted(commands: list[list[str]]) -> collections.Counter:
    """Accepted fuzzed draws run for real (CAPS appended): a run that ends in status `error` is a value
    the validation let through and the run could not take (its reason is printed)."""
    statuses: collections.Counter = collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, args in enumerate(commands):
            run_dir = Path(tmp) / str(i)
            try:
                code = run_job_in_process(run_dir, [*args, *CAPS])
            except Exception as e:  # noqa: BLE001  (a draw that deleted a key CAPS sets: ~compile)
                statuses["not run: clashes with CAPS"] += 1
                print(f"  not run {args}: {type(e).__name__}: {str(e).splitlines()[0]}")
                continue
            result = run_dir / "result.json"
            r = json.loads(result.read_text()) if code == 0 and result.is_file() else {"status": f"exit {code}"}
            statuses[r["status"]] += 1
            if r["status"] not in ("stable", "diverged", "skipped"):
                print(f"  run {args}: {r['status']}: {r.get('reason')}")
    return statuses


def real_cli(commands: list[list[str]]) -> collections.Counter:
    """Refused command lines through real `python -m sweep` processes: exit 2, one line, as in-process."""
    counts: collections.Counter = collections.Counter()
    env = {**os.environ, "PYTHONPATH": str(REPO), "CI": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        for i, args in enumerate(commands):
            cmd = [sys.executable, "-m", "sweep", *args, "progress=none", f"hydra.run.dir={tmp}/{i}"]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp, env=env)
            one = p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
            counts["exit 2, one line" if one else "other"] += 1
            if not one:
                print(f"  CLI {args}: exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}")
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=1000, help="fuzzed command lines, checked in-process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=0, help="valid draws also run for real (2 steps)")
    ap.add_argument("--cli", type=int, default=0, help="refused command lines also sent through real processes")
    ap.add_argument("--run-accepted", type=int, default=0, help="accepted fuzzed draws also run for real (2 steps)")
    ap.add_argument("--show", type=int, default=3, help="example command lines per distinct traceback")
    args = ap.parse_args()
    t0 = time.time()
    counts, crashes, multiline, refused, accepted = fuzz_in_process(
        args.examples, args.seed, keep=args.cli, keep_ok=args.run_accepted
    )
    print(
        f"{sum(counts.values())} command lines in {time.time() - t0:.0f} s: "
        f"exit 0 (would run): {counts['ok']}, exit 2 (one line): {counts['exit2'] - len(multiline)}, "
        f"exit 2 with several lines: {len(multiline)}, traceback: {counts['traceback']}"
    )
    for what, examples in sorted(crashes.items(), key=lambda kv: -len(kv[1])):
        print(f"  traceback x{len(examples)}: {what}")
        for ex in examples[: args.show]:
            print(f"    python -m sweep {' '.join(repr(a) if ' ' in a else a for a in ex)}")
    for ex, text in multiline[: args.show]:
        print(f"  several lines: {ex}: {text!r}")
    if args.runs:
        t0 = time.time()
        statuses = real_runs(args.runs, args.seed)
        print(f"{args.runs} valid draws run for real in {time.time() - t0:.0f} s: {dict(statuses)}")
    if accepted:
        t0 = time.time()
        statuses = run_accepted(accepted)
        print(
            f"{len(accepted)} accepted fuzzed draws run for real (2 steps)"
            f" in {time.time() - t0:.0f} s: {dict(statuses)}"
        )
    if refused:
        t0 = time.time()
        cli = real_cli(refused)
        print(f"{len(refused)} refused command lines through python -m sweep in {time.time() - t0:.0f} s: {dict(cli)}")
    return 1 if crashes or multiline else 0


if __name__ == "__main__":
    sys.exit(main())
