"""Hash the curves and verdicts of 37 lone, windowed and packed runs, to hold a refactor of the loop to "no number
moved" (issue #47): run it at two checkouts on one machine, then compare.

    python bench/curves.py /tmp/before.json                   # at the old checkout
    python bench/curves.py /tmp/after.json                    # at the new one
    python bench/curves.py --compare /tmp/before.json /tmp/after.json

The runs: every case of tests/test_window.py at one sync per step and at its window size, three more lone runs
(eval and attention-logit steps, an fp16 spike with forensics, the trend verdicts) at 1 and 4, and
test_window's pack of five (a stable run, overflow skips, a spike, a bad sample, a stall) at 1 and 3 (one run
with eval). Per run: sha256 of metrics.csv and the repr of status, verdict, first bad step, cause, steps run,
eval loss, sync counts, final loss and trend. Float rounding differs between CPUs: compare files made on the
same machine only. About 2 minutes on one core of a 2-core EPYC.

The window cases are imported from tests/test_window.py, so both checkouts must hold the same CASES: the suite's
second pass (issue #47) made the overflow and scale-collapse cases shorter, so a file made before it differs
there for that reason alone (copy today's tests/test_window.py into the old checkout before measuring it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FIELDS = ("status", "verdict", "first_bad_step", "cause", "steps_run", "eval_loss", "sync", "final_loss", "trend")
EXTRA = {
    "eval_logits": ["steps=30", "eval.every=10", "monitor.logit_every=5", "precision=bf16_amp"],
    "fp16_spike_forensics": ["precision=fp16_amp", "optim.lr=0.5", "steps=30"],
    "trend": ["steps=40", "monitor.trend=true"],
}


def record(result, out_dir: Path) -> dict:
    rows = out_dir / "metrics.csv"
    digest = hashlib.sha256(rows.read_bytes()).hexdigest() if rows.exists() else None
    return {"csv": digest, **{k: repr(getattr(result, k)) for k in FIELDS}}


def measure() -> dict:
    from sweep.run.execute import execute
    from sweep.run.packing import execute_pack
    from tests.conftest import make_run
    from tests.test_window import CASES, FRESH_AT_3

    out, tmp = {}, Path(tempfile.mkdtemp(prefix="curves_"))
    lone = {name: (overrides, sorted({1, sync})) for name, (overrides, sync, _) in CASES.items()}
    lone.update({name: (overrides, [1, 4]) for name, overrides in EXTRA.items()})
    for name, (overrides, syncs) in lone.items():
        for s in syncs:
            d = tmp / f"{name}{s}"
            out[f"{name}@{s}"] = record(execute(make_run(*overrides, f"monitor.sync_every={s}"), d, {}), d)
    common = ["precision=fp16_amp", "steps=24", "threads=1", "data.batch_size=2", "monitor.forensics=false"]
    per_run = [
        ["optim.lr=1e-4", "eval.every=8"],
        ["optim.lr=1e-4", "objective.loss_weight=1e5", "seed=1"],
        ["optim.lr=0.5", "seed=2"],
        [f"data.faults=[{{index:{FRESH_AT_3},kind:nan}}]", "seed=0", "data.seed=0"],
        ["optim.lr=1e-9", "seed=3", "objective.loss_weight=1e-9", "monitor.stall_window=5"],
    ]
    for sync in (1, 3):
        runs = [
            make_run(*common, *extra, f"monitor.sync_every={sync if i % 2 else 5 * sync // 3}")
            for i, extra in enumerate(per_run)
        ]
        dirs = [tmp / f"pack{sync}" / str(i) for i in range(len(runs))]
        for i, (r, d) in enumerate(
            zip(execute_pack(runs, dirs, [{}] * len(runs), [str(i) for i in range(len(runs))]), dirs)
        ):
            out[f"pack{sync}/{i}"] = record(r, d)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="OUT.json to write, or with --compare the two to compare")
    ap.add_argument("--compare", action="store_true")
    args = ap.parse_args()
    if args.compare:
        a, b = (json.loads(Path(f).read_text()) for f in args.files[:2])
        differ = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        for k in differ:
            print(
                f"{k}: " + ", ".join(f for f in FIELDS + ("csv",) if (a.get(k) or {}).get(f) != (b.get(k) or {}).get(f))
            )
        print(f"{len(a)} runs, {len(differ)} differ")
        sys.exit(1 if differ else 0)
    out = measure()
    Path(args.files[0]).write_text(json.dumps(out, indent=1, sort_keys=True))
    print(f"{len(out)} runs -> {args.files[0]}")


if __name__ == "__main__":
    main()
