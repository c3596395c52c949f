"""What logging a run to TensorBoard or MLflow costs per training step (issue #20: at most 2% of a step).

    python bench/logger_overhead.py [--repeats 2] [--tracking-uri URI] [override ...]

Runs the default run (`python -m sweep`'s config: tiny video DiT, 50 steps; threads=1) through
`sweep.run.execute.execute` with logger=none, tensorboard and mlflow in turn (interleaved, `--repeats`
rounds; the first round is a warm-up that pays the lazy imports and is not counted). The MetricsLog
methods a run calls are wrapped with timers, so the cost is measured, not inferred from two noisy wall
times:
- in-loop: `MetricsLog.log` inside the training loop, batch flushes to metrics.csv and the trackers included;
- start: creating the trackers' run (SummaryWriter; MLflow experiment lookup, create_run, params);
- end: the last batch, the verdict, the artifacts and closing (`MetricsLog.write` + `finish`).
Per step = (start + in-loop + end) / steps, against the mean training step of the same runs.
Without `--tracking-uri` an `mlflow server` (SQLite backend, 127.0.0.1, a free port) is started for
the bench and killed at its end.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def start_server(root: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    cmd += ["--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "art")]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                return proc, uri
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"mlflow server did not start: see {root / 'server.log'}")


class Timers:
    """Wraps MetricsLog's methods: seconds spent in each, per run."""

    def __init__(self) -> None:
        from sweep.run import results

        self.t = {"start": 0.0, "loop": 0.0, "end": 0.0}
        cls = results.MetricsLog
        self.originals = {name: getattr(cls, name) for name in ("__init__", "log", "write", "finish")}
        phase = {"__init__": "start", "log": "loop", "write": "end", "finish": "end"}
        for name, fn in self.originals.items():
            setattr(cls, name, self._timed(fn, phase[name]))

    def _timed(self, fn, phase):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.t[phase] += time.perf_counter() - t0

        return wrapper

    def reset(self) -> None:
        self.t = dict.fromkeys(self.t, 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2, help="counted rounds (after one warm-up round)")
    ap.add_argument("--tracking-uri", default=None, help="an MLflow server to log to (default: start one)")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. steps=100")
    args = ap.parse_args()

    from hydra import compose, initialize_config_dir

    from sweep.config import to_run_config
    from sweep.run.execute import execute
    from sweep.run.trackers import open_sinks

    root = Path(tempfile.mkdtemp(prefix="logger_overhead_"))
    proc, uri = (None, args.tracking_uri) if args.tracking_uri else start_server(root)
    loggers = {"none": [], "tensorboard": ["logger=tensorboard"], "mlflow": ["logger=mlflow"]}
    base = ["threads=1", "progress=none", f"logger.mlflow.tracking_uri={uri}", *args.overrides]
    runs = {}
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for name, extra in loggers.items():
            runs[name] = to_run_config(compose(config_name="config", overrides=base + extra))
    timers = Timers()
    rows: dict[str, list[dict]] = {name: [] for name in loggers}
    try:
        for round_ in range(args.repeats + 1):
            for name, run in runs.items():
                out = root / f"{name}-{round_}"
                timers.reset()
                sinks = open_sinks(run.logger, out, root, {}, f"{name} {round_}")
                result = execute(run, out, {}, sinks=sinks)
                assert result.status == "stable" and all(v == "ok" for v in result.logging.values()), result
                if round_ == 0:  # warm-up: lazy imports of torch's kernels, tensorboard, mlflow
                    continue
                step_s = 1.0 / result.steps_per_second
                rows[name].append({**timers.t, "step": step_s, "steps": result.steps_run})
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGKILL)

    import torch

    print(
        f"default run ({runs['none'].steps} steps, {runs['none'].model.arch.value} {runs['none'].model.size}), "
        f"threads=1, {args.repeats} counted rounds; torch {torch.__version__}, "
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}"
    )
    print(
        f"{'logger':<12} {'step ms':>8} {'start ms':>9} {'in-loop ms/step':>16} {'end ms':>8} "
        f"{'total ms/step':>14} {'% of a step':>12}"
    )
    for name, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("start", "loop", "end", "step", "steps")}
        per_step = (med["start"] + med["loop"] + med["end"]) / med["steps"]
        print(
            f"{name:<12} {med['step'] * 1e3:8.1f} {med['start'] * 1e3:9.1f} {med['loop'] / med['steps'] * 1e3:16.3f} "
            f"{med['end'] * 1e3:8.1f} {per_step * 1e3:14.3f} {100 * per_step / med['step']:11.2f}%"
        )


if __name__ == "__main__":
    main()
