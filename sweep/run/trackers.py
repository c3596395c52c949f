"""Which trackers a run logs to (`logger=`, docs/loggers.md): the sinks its MetricsLog streams rows to.

logger=none opens nothing and imports no tracker; each sink imports its tracker's package when it starts.
"""

from __future__ import annotations

from pathlib import Path

from sweep.config import LoggerConfig
from sweep.run.results import MetricSink


def open_sinks(cfg: LoggerConfig, run_dir: Path, sweep_dir: Path, params: dict, name: str) -> list[MetricSink]:
    """The sinks `cfg` asks for, not started yet (MetricsLog starts them and survives their failures)."""
    sinks: list[MetricSink] = []
    if cfg.tensorboard.enabled:
        from sweep.run.tensorboard_sink import TensorBoardSink

        sinks.append(TensorBoardSink(Path(run_dir) / cfg.tensorboard.dir, params))
    if cfg.mlflow.enabled:
        from sweep.run.mlflow_sink import MlflowSink

        sinks.append(MlflowSink(cfg.mlflow, Path(run_dir), Path(sweep_dir), params, name))
    return sinks
