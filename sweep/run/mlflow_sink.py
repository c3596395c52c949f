"""logger=mlflow: each run an MLflow run, nested under one parent run per sweep; one sweep, one experiment.

    MLFLOW_TRACKING_URI=http://127.0.0.1:5000 python -m sweep -m logger=mlflow optim.lr=1e-4,1e-3,1e-2

A run's MLflow run gets: params = the run's dotted overrides (result.json's `params`); every metrics.csv
column as a metric at its steps (blank cells left out), sent in batches (`log_batch`); at the end the tags
`status`, `verdict`, `first_bad_step`, `cause_where`, `cause_module` (null ones left out) and `run_dir`,
and the artifacts result.json and metrics.csv. The tracking URI is `logger.mlflow.tracking_uri`, else
$MLFLOW_TRACKING_URI, else a SQLite file in the sweep directory. The experiment is named
`logger.mlflow.experiment`, else after the sweep directory.

The sweep's parent run is made when the multirun starts (sweep.callbacks.TrackerSweep ->
`start_sweep_run`), and its ids are left in <sweep dir>/mlflow_parent.json for the jobs, whichever
process or node runs them; it ends with the sweep's counts as tags and summary.md as an artifact.

Batches go to the server from a sender thread of the run's own, so the training loop only queues them;
the run's end waits for them before it logs the verdict. A tracker that fails never fails a run:
MetricsLog turns the exception into a warning and result.json's `logging`. So that a dead server
costs seconds, not MLflow's default of 7 retries with exponential backoff and a 120 s timeout,
requests here run with `retries` and `timeout_s` unless the user's environment sets MLflow's own
variables. A URL's password is masked in every message (sweep.run.urls).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Iterator

from sweep.config import MlflowConfig
from sweep.run.results import METRIC_COLUMNS, METRICS_FILE, RESULT_FILE, RunResult, TrackerError
from sweep.run.urls import mask_url, scrub

log = logging.getLogger("sweep")

PARENT_FILE = "mlflow_parent.json"
"""In the sweep directory: {"experiment_id", "run_id"} of the sweep's parent run."""
TAGS = ("status", "verdict", "first_bad_step", "cause_where", "cause_module")
SCALARS = tuple(c for c in METRIC_COLUMNS if c != "step")
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100  # per log_batch request (MLflow's limits)
MAX_PARAM_CHARS = 6000


def tracking_uri(cfg: MlflowConfig, sweep_dir: Path) -> str:
    return (
        cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(sweep_dir).resolve()}/mlflow.db"
    )


def experiment_name(cfg: MlflowConfig, sweep_dir: Path) -> str:
    return cfg.experiment or str(Path(sweep_dir).resolve())


@contextlib.contextmanager
def requests_to(cfg: MlflowConfig, uri: str) -> Iterator[None]:
    """MLflow calls with our retry and timeout limits (unless the environment sets MLflow's own), and any
    error re-raised as one line with the URI's password masked."""
    limits = {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(cfg.retries),
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(cfg.timeout_s),
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",  # a line per run; the URL could hold a password
    }
    ours = [k for k in limits if k not in os.environ]
    os.environ.update({k: limits[k] for k in ours})
    try:
        yield
    except Exception as e:  # noqa: BLE001  (re-raised, masked)
        raise TrackerError(_masked(e, uri)) from None
    finally:
        for k in ours:
            os.environ.pop(k, None)


def _masked(e: Exception, uri: str) -> str:
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    line = scrub(line, uri)  # the URL masked, and its secrets wherever the message repeats them
    if "@" in uri and "://" in uri:  # the user info, however a message spells the URL (no scheme, re-quoted)
        line = line.replace(uri.split("://", 1)[1].rsplit("@", 1)[0], "***")
    return f"{type(e).__name__}: {line}" if not line.startswith(type(e).__name__) else line


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def experiment_id(client, name: str, sweep_dir: Path, uri: str) -> str:
    """The sweep's experiment, made if missing (two jobs may race to make it)."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        return exp.experiment_id
    # A local store keeps its artifacts beside it; a server decides for itself.
    local = uri.startswith(("sqlite:", "file:")) or "://" not in uri
    location = (Path(sweep_dir).resolve() / "mlartifacts").as_uri() if local else None
    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException as e:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise e from None
        return exp.experiment_id


def read_parent(sweep_dir: Path) -> dict | None:
    try:
        parent = json.loads((Path(sweep_dir) / PARENT_FILE).read_text())
        return parent if {"experiment_id", "run_id"} <= set(parent) else None
    except (OSError, ValueError):
        return None


def start_sweep_run(cfg: MlflowConfig, sweep_dir: Path, command: str) -> str:
    """The sweep's parent run (made, or reopened when the sweep resumes); its ids go to PARENT_FILE."""
    from mlflow.entities import RunStatus

    uri = tracking_uri(cfg, sweep_dir)
    with requests_to(cfg, uri):
        client = _client(uri)
        parent = read_parent(sweep_dir)
        if parent is not None:
            try:
                client.update_run(parent["run_id"], status=RunStatus.to_string(RunStatus.RUNNING))
                return parent["run_id"]
            except Exception as e:  # noqa: BLE001  (deleted, or another tracking server now: a new parent)
                log.warning(
                    "logger mlflow: the sweep's earlier parent run is gone (%s); starting a new one", _masked(e, uri)
                )
        exp = experiment_id(client, experiment_name(cfg, sweep_dir), sweep_dir, uri)
        tags = {"sweep_dir": str(Path(sweep_dir).resolve()), "command": command[:5000]}
        run = client.create_run(exp, run_name=f"sweep {Path(sweep_dir).name}", tags=tags)
    path = Path(sweep_dir) / PARENT_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"experiment_id": exp, "run_id": run.info.run_id}) + "\n")
    tmp.replace(path)
    return run.info.run_id


def end_sweep_run(cfg: MlflowConfig, sweep_dir: Path) -> None:
    """The parent run ends with the sweep's counts by status as tags and summary.md as an artifact."""
    parent = read_parent(sweep_dir)
    if parent is None:
        return
    counts: dict[str, int] = {}
    for path in Path(sweep_dir).glob(f"*/{RESULT_FILE}"):
        try:
            status = json.loads(path.read_text()).get("status", "unknown")
        except (OSError, ValueError):
            status = "unreadable"
        counts[status] = counts.get(status, 0) + 1
    uri = tracking_uri(cfg, sweep_dir)
    with requests_to(cfg, uri):
        from mlflow.entities import RunTag

        client = _client(uri)
        tags = [RunTag("runs", str(sum(counts.values())))] + [RunTag(f"runs_{k}", str(n)) for k, n in counts.items()]
        client.log_batch(parent["run_id"], tags=tags)
        summary = Path(sweep_dir) / "summary.md"
        if summary.is_file():
            client.log_artifact(parent["run_id"], str(summary))
        client.set_terminated(parent["run_id"], "FINISHED")
    log.info(
        "logger mlflow: sweep run %s of experiment %s in %s", parent["run_id"], parent["experiment_id"], mask_url(uri)
    )


def relog_summary(cfg: MlflowConfig, sweep_dir: Path) -> str | None:
    """summary.md logged again on the sweep's parent run after a later command rewrote it (`python -m sweep.confirm`
    or `sweep.diagnose` by hand: sweep/report/refresh.py, which reads `cfg`, the sweep's own logger.mlflow, from its
    multirun.yaml), so that MLflow says what the sweep's files say (before, it kept the summary of the sweep's end).
    None when logged, or when the sweep logged to no parent run; else one line saying why not."""
    parent = read_parent(sweep_dir)
    summary = Path(sweep_dir) / "summary.md"
    if parent is None or not summary.is_file():
        return None
    uri = tracking_uri(cfg, sweep_dir)
    try:
        with requests_to(cfg, uri):
            _client(uri).log_artifact(parent["run_id"], str(summary))
    except TrackerError as e:
        return f"logger mlflow: the sweep's parent run keeps its earlier summary.md ({e})"
    return None


class MlflowSink:
    """One run as an MLflow run (sweep.run.results.MetricSink)."""

    name = "mlflow"

    def __init__(self, cfg: MlflowConfig, run_dir: Path, sweep_dir: Path, params: dict, run_name: str) -> None:
        self.cfg, self.run_dir, self.sweep_dir, self.params = cfg, Path(run_dir), Path(sweep_dir), params
        self.run_name = run_name[:250] or self.run_dir.name
        self.uri = tracking_uri(cfg, sweep_dir)
        self.client = None
        self.run_id: str | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._error: Exception | None = None

    def start(self) -> None:
        from mlflow.entities import Param

        with requests_to(self.cfg, self.uri):
            self.client = _client(self.uri)
            parent = read_parent(self.sweep_dir)
            if parent is not None:
                exp = parent["experiment_id"]
            else:
                exp = experiment_id(self.client, experiment_name(self.cfg, self.sweep_dir), self.sweep_dir, self.uri)
            tags = {"run_dir": str(self.run_dir.resolve())}
            if parent is not None:
                tags["mlflow.parentRunId"] = parent["run_id"]
            self.run_id = self.client.create_run(exp, run_name=self.run_name, tags=tags).info.run_id
            params = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in self.params.items()]
            for i in range(0, len(params), MAX_PARAMS):
                self.client.log_batch(self.run_id, params=params[i : i + MAX_PARAMS])

    def write(self, rows: list[dict]) -> None:
        """Queue the rows' metrics for the sender thread: the training loop never waits for the server."""
        from mlflow.entities import Metric

        self._raise_if_failed()
        now = int(time.time() * 1000)
        metrics = [
            Metric(key, float(row[key]), now, row["step"])
            for row in rows
            for key in SCALARS
            if row.get(key, "") != "" and row.get(key) is not None
        ]
        if self._sender is None:
            self._sender = threading.Thread(target=self._send, name=f"mlflow {self.run_name[:40]}", daemon=True)
            self._sender.start()
        self._queue.put(metrics)

    def _send(self) -> None:
        """The sender thread: one log_batch per 1000 metrics; after a failure it only drains the queue."""
        while (metrics := self._queue.get()) is not None:
            if self._error is not None:
                continue
            try:
                with requests_to(self.cfg, self.uri):
                    for i in range(0, len(metrics), MAX_METRICS):
                        self.client.log_batch(self.run_id, metrics=metrics[i : i + MAX_METRICS])
            except Exception as e:  # noqa: BLE001  (raised in the run's thread by the next write or finish)
                self._error = e

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _drain(self) -> None:
        """Wait until every queued metric is sent (or failed)."""
        if self._sender is not None:
            self._queue.put(None)
            self._sender.join()
            self._sender = None
        self._raise_if_failed()

    def finish(self, result: RunResult, out_dir: Path) -> None:
        from mlflow.entities import RunTag

        self._drain()

        cause = result.cause or {}
        values = {
            "status": result.status,
            "verdict": result.verdict,
            "first_bad_step": result.first_bad_step,
            "cause_where": cause.get("where"),
            "cause_module": cause.get("module"),
        }
        tags = [RunTag(k, str(v)) for k, v in values.items() if v is not None]
        with requests_to(self.cfg, self.uri):
            self.client.log_batch(self.run_id, tags=tags[:MAX_TAGS])
            for name in (METRICS_FILE, RESULT_FILE):
                if (Path(out_dir) / name).is_file():
                    self.client.log_artifact(self.run_id, str(Path(out_dir) / name))
            self.client.set_terminated(self.run_id, "FAILED" if result.status == "error" else "FINISHED")
