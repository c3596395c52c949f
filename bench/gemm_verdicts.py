"""Native against emulated bf16/fp16 GEMMs (precision.cpu_gemm): same verdicts, and how long each takes.

    python bench/gemm_verdicts.py                       # every scenario, then the demo grid, both ways
    python bench/gemm_verdicts.py --only scenarios      # or: demo
    python bench/gemm_verdicts.py --record              # also rewrite tests/data/native_verdicts.json

Each sweep runs as the user runs it (`python -m sweep ...` in a fresh interpreter, ledger off), once
with precision.cpu_gemm=native and once with emulated. A cell (its swept params) agrees when status
and verdict are equal and the first bad steps are within TOLERANCE steps. --record writes the native
outcomes, which tests/test_scenarios.py holds every emulated scenario run to.

On a CPU without bf16/fp16 matrix instructions the native half is slow (minutes per scenario): that is
the point of emulation, and why CI compares against the recorded native outcomes instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sweep.run.gemm import TOLERANCE, cell_outcomes, cpu_flags, verdict_differences  # noqa: E402
from sweep.scenario import available  # noqa: E402

RECORD = REPO / "tests" / "data" / "native_verdicts.json"


def sweep(args: list[str], out: Path) -> float:
    """Run `python -m sweep args` into `out`; its wall time in seconds."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CI": "1"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "sweep", *args, f"hydra.sweep.dir={out}", "ledger.enabled=false"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"bench/gemm_verdicts.py: {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=("scenarios", "demo"))
    ap.add_argument("--record", action="store_true", help=f"write the native outcomes to {RECORD.relative_to(REPO)}")
    args = ap.parse_args()
    jobs = {}
    if args.only != "demo":
        jobs.update({f"scenario {name}": [f"+scenario={name}"] for name in sorted(available())})
    if args.only != "scenarios":
        jobs["demo"] = ["-m", "+experiment=demo"]
    low = sorted(
        f for f in cpu_flags() if f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")
    )
    print(f"CPU flags: {' '.join(low) or 'unknown'}; tolerance: first bad step within {TOLERANCE} steps")
    print(f"{'sweep':<42}{'cells':>6}{'native s':>10}{'emulated s':>12}  verdicts")
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    all_same = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in jobs.items():
            outcomes, seconds = {}, {}
            for gemm in ("native", "emulated"):
                out = Path(tmp) / f"{name.replace(' ', '-')}-{gemm}"
                seconds[gemm] = sweep([*overrides, f"precision.cpu_gemm={gemm}"], out)
                outcomes[gemm] = cell_outcomes(out)
            diffs = verdict_differences(outcomes["native"], outcomes["emulated"])
            all_same &= not diffs
            print(
                f"{name:<42}{len(outcomes['native']):>6}{seconds['native']:>10.1f}{seconds['emulated']:>12.1f}  "
                + ("same" if not diffs else "DIFFERENT: " + "; ".join(diffs)),
                flush=True,
            )
            record[name] = outcomes["native"]
    if args.record:
        RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        print(f"wrote {RECORD.relative_to(REPO)}")
    sys.exit(0 if all_same else 1)


if __name__ == "__main__":
    main()
