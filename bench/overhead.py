"""Where the wall time of a grid sweep goes: training steps versus everything a run costs beyond them.

    python bench/overhead.py [--steps 100] [--grid full|fp32|quick] [--threads 1] [--json out.json] [override ...]

Runs `python -m sweep -m precision=fp32,bf16_amp optim.lr=1e-4,1e-3,1e-2 seed=0,1,2,3 steps=100`
(24 runs of the default model and data; `--grid fp32`: 24 fp32 runs over 8 seeds; `--grid quick`:
4 runs) the way the command does: a fresh
interpreter, Hydra's multirun in that one process, the default grid sweeper and basic launcher, the
default SQLite ledger and the end-of-sweep summary. The child interpreter is this file with
`--child`: it imports `sweep.__main__`, wraps the real functions on the run's path with timers, and
calls `sweep.__main__.main()` with the sweep's arguments, so nothing is estimated. Each phase is
timed exclusive of the phases nested in it (data generation happens at the first batch, inside
training: it is counted as data, not training), and the phases plus "unaccounted" add up to the
wall time the parent measured from spawn to exit.

Per phase: total seconds, share of the wall time, calls, the first call (it pays lazy imports)
and the median of the others (the steady per-run cost). `threads=1` by default: the machine's cores
are shared, and two torch jobs with all cores' OpenMP threads each slow each other down many times.
"""

from __future__ import annotations

import time

_CHILD_T0 = time.time()  # first statement: the interpreter's start-up ends here (child mode)

import argparse  # noqa: E402
import atexit  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GRIDS = {
    "full": ["precision=fp32,bf16_amp", "optim.lr=1e-4,1e-3,1e-2", "seed=0,1,2,3"],  # 24 runs
    "quick": ["precision=fp32,bf16_amp", "optim.lr=1e-4,1e-2"],  # 4 runs
    # 24 runs in fp32 only: on a loaded 2-core CPU with 1 thread, bf16_amp steps of the default model
    # took ~5 s against fp32's ~0.6 s, and the full grid would run for well over an hour.
    "fp32": ["precision=fp32", "optim.lr=1e-4,1e-3,1e-2", "seed=0,1,2,3,4,5,6,7"],
}
# (phase, what it covers), in the order a run meets them; times are exclusive of nested phases.
PHASES = [
    ("process start", "interpreter start-up to the first line of the script"),
    ("imports", "import sweep.__main__ (hydra, torch, models, sweep.*)"),
    ("hydra: plugin scan", "Hydra's discovery of its plugins (hydra_plugins/ included)"),
    ("hydra: compose + sweep", "primary compose, sweeper, launcher loop, callbacks (the rest of hydra.main)"),
    ("hydra: cell validation", "grid sweeper: to_run_config of every cell before the first run"),
    ("hydra: compose per job", "ConfigLoader.load_sweep_config (validation and launch)"),
    ("hydra: job setup", "hydra.core.utils.run_job: job dir, .hydra/*.yaml, logging, HydraConfig"),
    ("job: config + params", "sweep.job.run_job itself: to_run_config, swept params, pruning hooks"),
    ("run: setup", "sweep.run.execute.execute_runs itself: device, policy, state reset, progress, result"),
    ("run: package versions", "sweep.run.results.package_versions"),
    ("model build", "sweep.run.build.build_parts: model, optimizer, objective, monitor (data lazily)"),
    ("data generation", "SyntheticClips rendering, at the first batch"),
    ("training steps", "sweep.run.train.Loop.run (the loop; data generation excluded)"),
    ("forensics", "sweep.run.forensics.locate: replay of a non-finite run"),
    ("result files", "result.json and metrics.csv"),
    ("ledger write", "sweep.job.record: open the storage, load the study, add the trial"),
    ("end-of-sweep summary", "SweepSummary.on_multirun_end: tables and summary files"),
    ("exit: atexit handlers", "the handlers registered with atexit, run once main() returned"),
    ("process exit", "the rest, to the parent seeing the exit: interpreter teardown (modules, threads)"),
]


class Phases:
    """Exclusive wall time per phase: a timed call's time minus that of timed calls nested in it."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = {}
        self._nested: list[float] = []

    def add(self, name: str, seconds: float) -> None:
        self.calls.setdefault(name, []).append(seconds)

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            self._nested.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                nested = self._nested.pop()
                self.add(name, elapsed - nested)
                if self._nested:
                    self._nested[-1] += elapsed

        return timed

    def patch(self, owner, attr: str, name: str) -> None:
        setattr(owner, attr, self.wrap(name, getattr(owner, attr)))


def child(report: Path, sweep_argv: list[str]) -> None:
    """Run `python -m sweep <sweep_argv>` in this interpreter with timers on the run's path."""
    phases = Phases()
    t0 = time.perf_counter()
    sys.path.insert(0, str(REPO))
    import sweep.__main__ as entry

    phases.add("imports", time.perf_counter() - t0)

    import hydra
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.plugins import Plugins

    import sweep.callbacks
    import sweep.data.synthetic
    import sweep.job
    import sweep.run.build
    import sweep.run.execute
    import sweep.run.results
    import sweep.run.train

    # Hydra execs plugin modules itself (outside sys.modules): patch the classes it registered.
    t0 = time.perf_counter()
    plugins = Plugins.instance().class_name_to_class
    phases.add("hydra: plugin scan", time.perf_counter() - t0)
    grid_sweeper = plugins["hydra_plugins.dit_sweep.grid_sweeper.GridSweeper"]
    launcher_globals = plugins["hydra._internal.core_plugins.basic_launcher.BasicLauncher"].launch.__globals__

    # Hydra holds the task function it was given: give it the timed one (the job's name stays __main__, in conf/).
    timed_job = phases.wrap("job: config + params", sweep.job.run_job)
    entry._hydra_main = hydra.main(config_path=entry.CONF_DIR, config_name="config", version_base="1.3")(timed_job)
    phases.patch(entry, "_hydra_main", "hydra: compose + sweep")
    phases.patch(grid_sweeper, "validate_batch_is_legal", "hydra: cell validation")
    phases.patch(ConfigLoaderImpl, "load_sweep_config", "hydra: compose per job")
    launcher_globals["run_job"] = phases.wrap("hydra: job setup", launcher_globals["run_job"])
    phases.patch(sweep.run.execute, "execute_runs", "run: setup")
    phases.patch(sweep.run.execute, "package_versions", "run: package versions")
    phases.patch(sweep.run.execute, "build_parts", "model build")
    cache, timed_cache = (
        sweep.data.synthetic.SyntheticClips._cache,
        phases.wrap("data generation", sweep.data.synthetic.SyntheticClips._cache),
    )
    # Timed only when it renders: afterwards every __getitem__ calls it to index the cached tensor.
    sweep.data.synthetic.SyntheticClips._cache = lambda self: (
        cache(self) if self._data is not None else timed_cache(self)
    )
    phases.patch(sweep.run.train.Loop, "run", "training steps")
    phases.patch(sweep.run.execute, "locate", "forensics")
    phases.patch(sweep.run.execute, "write_result", "result files")
    phases.patch(sweep.run.results.MetricsLog, "write", "result files")
    phases.patch(sweep.job, "record", "ledger write")
    phases.patch(sweep.callbacks.SweepSummary, "on_multirun_end", "end-of-sweep summary")

    sys.argv = ["sweep", *sweep_argv]
    status = 0
    try:
        entry.main()
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    t0 = time.perf_counter()
    atexit._run_exitfuncs()  # what the interpreter runs at exit anyway (logging, SQLAlchemy, torch, ...)
    phases.add("exit: atexit handlers", time.perf_counter() - t0)
    report.write_text(
        json.dumps(
            {
                "t0": _CHILD_T0,
                "t_end": time.time(),
                "status": status,
                "calls": phases.calls,
                "code": str(Path(entry.__file__).parents[1]),
            }
        )
    )
    sys.exit(status)


def run_sweep(args, out: Path) -> tuple[float, float, dict, Path]:
    sweep_dir = out / "sweep"
    report = out / "phases.json"
    sweep_argv = [
        "-m",
        *GRIDS[args.grid],
        f"steps={args.steps}",
        f"threads={args.threads}",
        "progress=none",
        f"hydra.sweep.dir={sweep_dir}",
        *args.overrides,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "CI": "1"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    t_spawn = time.time()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(report), "--", *sweep_argv],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
    )
    t_exit = time.time()
    if proc.returncode != 0 or not report.exists():
        raise SystemExit(f"bench: the sweep failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    data = json.loads(report.read_text())
    calls = data["calls"]
    calls["process start"] = [data["t0"] - t_spawn]
    calls["process exit"] = [t_exit - data["t_end"]]
    if Path(data["code"]) != REPO:
        raise SystemExit(f"bench: the sweep ran the code in {data['code']}, not {REPO}")
    return t_exit - t_spawn, data["t_end"] - data["t0"], calls, sweep_dir


def breakdown(wall: float, calls: dict) -> list[tuple]:
    rows = []
    for name, _ in PHASES:
        times = calls.get(name, [])
        total = sum(times)
        rest = times[1:]
        rows.append(
            (
                name,
                total,
                total / wall,
                len(times),
                times[0] if times else 0.0,
                statistics.median(rest) if rest else None,
            )
        )
    accounted = sum(r[1] for r in rows)
    rows.append(("unaccounted", wall - accounted, (wall - accounted) / wall, 0, 0.0, None))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--grid", choices=sorted(GRIDS), default="full")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (0 = torch's default)")
    parser.add_argument("--json", type=Path, help="also write the breakdown here")
    parser.add_argument("overrides", nargs="*", help="more sweep overrides, e.g. data.num_samples=64")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        wall, _, calls, sweep_dir = run_sweep(args, Path(tmp))
        runs = len(list(sweep_dir.glob("*/result.json")))
        statuses = [json.loads(p.read_text())["status"] for p in sweep_dir.glob("*/result.json")]
    rows = breakdown(wall, calls)
    steps_share = next(r[2] for r in rows if r[0] == "training steps")
    cmd = " ".join(
        [
            "python bench/overhead.py",
            f"--steps {args.steps}",
            f"--grid {args.grid}",
            f"--threads {args.threads}",
            *args.overrides,
        ]
    )
    print(
        f"$ {cmd}\n{runs} runs ({', '.join(f'{statuses.count(s)} {s}' for s in sorted(set(statuses)))}), "
        f"{args.steps} steps each, {os.cpu_count()} cores, wall {wall:.1f} s\n"
    )
    print(f"{'phase':<24} {'total s':>8} {'share':>7} {'calls':>5} {'first s':>8} {'median s':>9}")
    for name, total, share, n, first, median in rows:
        med = f"{median:9.3f}" if median is not None else f"{'':>9}"
        print(f"{name:<24} {total:8.2f} {share:7.1%} {n:5d} {first:8.3f} {med}")
    print(
        f"\ntraining steps: {steps_share:.1%} of the wall time; overhead {1 - steps_share:.1%} "
        f"({(1 - steps_share) * wall / max(runs, 1):.2f} s per run)"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "command": cmd,
                    "wall_s": wall,
                    "runs": runs,
                    "statuses": statuses,
                    "phases": {
                        r[0]: {"total_s": r[1], "share": r[2], "calls": r[3], "first_s": r[4], "median_s": r[5]}
                        for r in rows
                    },
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(Path(sys.argv[2]), sys.argv[4:])
    else:
        main()
