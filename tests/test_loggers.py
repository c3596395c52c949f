"""logger=tensorboard|mlflow (docs/loggers.md): every run's curves and verdict where users already look.

A real `mlflow server` (SQLite backend, 127.0.0.1, a free port; tests/mlflow_server.py) starts in the
background as soon as this module is collected, and serves the whole module. Grids run in this process
(multirun_in_process).
The last test kills the server in the middle of a sweep: keep it last.
"""

from __future__ import annotations

import csv
import math
import socket
import sys
from pathlib import Path

import numpy
import pytest

import sweep.job
import sweep.run.execute
from sweep.config import ConfigError
from sweep.run.execute import execute
from sweep.run.results import METRIC_COLUMNS, METRICS_FILE, MetricsLog, RunResult
from sweep.run.trackers import open_sinks

from .conftest import SMALL_MODEL, compose_cfg, make_run, multirun_in_process, read_result
from .mlflow_server import MlflowServer, stop_early, take_early

pytestmark = pytest.mark.xdist_group("mlflow")  # with pytest -n: one worker, one server, the kill test last

GRID = ["precision=fp32,fp16_pure", "optim.lr=1e-4,1e-3", "steps=6"]  # 2 stable, 2 diverged (nan at step 1)
COLUMNS = [c for c in METRIC_COLUMNS if c != "step"]


@pytest.fixture(scope="module", autouse=True)
def server():
    """Started by conftest when this module was collected (tests/mlflow_server.py); `uri` waits for it."""
    s = take_early()
    yield s
    stop_early()


@pytest.fixture(scope="module")
def uri(server):
    return server.wait()


def client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def csv_columns(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.csv as {column: [(step, value), ...]}, blank cells left out (as the trackers leave them out)."""
    with (run_dir / METRICS_FILE).open() as f:
        rows = list(csv.DictReader(f))
    return {c: [(int(r["step"]), float(r[c])) for r in rows if r[c] != ""] for c in COLUMNS}


def same(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    """Equal (step, value) pairs, bit for bit; NaN equals NaN."""
    return len(a) == len(b) and all(
        s == t and (x == y or (math.isnan(x) and math.isnan(y))) for (s, x), (t, y) in zip(a, b)
    )


def tensorboard_columns(log_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, TENSORS, EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0, TENSORS: 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {c: [(e.step, e.value) for e in acc.Scalars(c)] if c in tags["scalars"] else [] for c in COLUMNS}
    return scalars, tags["scalars"] + tags["tensors"] + list(acc.PluginTagToContent("hparams"))


def as_float32(column: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """TensorBoard's scalars are float32 (its default loader drops doubles): metrics.csv's values rounded once."""
    return [(step, float(numpy.float32(value))) for step, value in column]


# --- no server needed: these run while it starts ---


class Recording:
    name = "recording"

    def __init__(self, fail_in: str | None = None) -> None:
        self.fail_in, self.batches, self.finished = fail_in, [], None
        if fail_in:
            self.name = f"failing_{fail_in}"

    def start(self):
        if self.fail_in == "start":
            raise ConnectionError("server down")

    def write(self, rows):
        if self.fail_in == "write":
            raise OSError("No space left on device")
        self.batches.append([r["step"] for r in rows])

    def finish(self, result, out_dir):
        self.finished = result.status


def test_metrics_go_out_in_batches_and_a_failing_sink_is_dropped_with_its_reason(tmp_path):
    sink, broken, dead = Recording(), Recording("write"), Recording("start")
    metrics = MetricsLog(tmp_path, [sink, broken, dead], flush_every=2, flush_s=1e9)
    assert metrics.logging["failing_start"] == "failed: ConnectionError: server down"
    for step in range(5):
        metrics.log(step=step, loss=1.0 / (step + 1), grad_norm=float("nan"), lr=1e-3, eval_loss="")
        if step == 2:  # rows 0 and 1 are final and sent; 2 may still get its eval loss
            assert (tmp_path / METRICS_FILE).read_text().count("\n") == 3  # streamed: header + 2 rows
    metrics.rows[-1]["eval_loss"] = 0.5  # train writes the eval loss into the last logged row
    metrics.write(tmp_path)
    assert sink.batches == [[0, 1], [2, 3], [4]]
    assert metrics.logging == {
        "recording": "ok",
        "failing_write": "failed: OSError: No space left on device",
        "failing_start": "failed: ConnectionError: server down",
    }
    assert metrics.finish(RunResult(status="stable"), tmp_path) is False and sink.finished == "stable"
    plain = MetricsLog()  # what metrics.csv was before streaming: written once, at the end
    plain.rows = metrics.rows
    (tmp_path / "plain").mkdir()
    plain.write(tmp_path / "plain")
    assert (tmp_path / METRICS_FILE).read_bytes() == (tmp_path / "plain" / METRICS_FILE).read_bytes()


def test_logger_none_opens_and_imports_no_tracker(tmp_path, monkeypatch):
    for name in ("mlflow", "tensorboard", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)  # any import of them raises
    run = make_run("steps=1", "eval.enabled=false")
    assert open_sinks(run.logger, tmp_path, tmp_path, {}, "x") == []
    result = execute(run, tmp_path, {})
    assert result.status == "stable" and read_result(tmp_path)["logging"] == {}


def test_logger_choices_compose_and_stay_out_of_the_params(tmp_path):
    both = make_run("logger=[tensorboard,mlflow]").logger
    assert both.tensorboard.enabled and both.mlflow.enabled
    tb = make_run("logger=tensorboard").logger
    assert tb.tensorboard.enabled and not tb.mlflow.enabled
    assert not make_run().logger.tensorboard.enabled and not make_run().logger.mlflow.enabled
    with pytest.raises(ConfigError, match="^logger.flush_every: must be > 0"):
        make_run("logger.flush_every=0")
    cfg = compose_cfg(["logger=tensorboard", "optim.lr=1e-3"])
    assert sweep.job.swept_params(cfg, ["logger=tensorboard", "optim.lr=1e-3"], {"logger": "tensorboard"}) == {
        "optim.lr": 1e-3
    }


def test_a_password_in_the_tracking_uri_never_reaches_the_result_or_the_log(tmp_path, caplog):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    secret_uri = f"http://ann:s3cret@127.0.0.1:{port}"
    run = make_run("logger=mlflow", f"logger.mlflow.tracking_uri={secret_uri}", "logger.mlflow.retries=0")
    metrics = MetricsLog(tmp_path, open_sinks(run.logger, tmp_path, tmp_path, {}, "x"))
    assert metrics.logging["mlflow"].startswith("failed: ") and "127.0.0.1" in metrics.logging["mlflow"]
    assert "s3cret" not in metrics.logging["mlflow"] and "s3cret" not in caplog.text
    from sweep.__main__ import literal_password_arg  # and on the command line it is refused before Hydra saves it

    assert literal_password_arg([f"logger.mlflow.tracking_uri={secret_uri}"]) == "logger.mlflow.tracking_uri"


# --- with the server ---


@pytest.fixture(scope="module")
def grid(uri, tmp_path_factory):
    """The 4-run grid logged to both trackers; returns its sweep directory."""
    sweep_dir = tmp_path_factory.mktemp("grid") / "sweep"
    multirun_in_process(
        sweep_dir, *SMALL_MODEL, "logger=[tensorboard,mlflow]", f"logger.mlflow.tracking_uri={uri}", *GRID
    )
    return sweep_dir


@pytest.mark.slow
def test_mlflow_holds_every_run_of_the_grid_under_the_sweep_run(grid, uri):
    c = client(uri)
    exp = c.get_experiment_by_name(str(grid.resolve()))  # one sweep, one experiment
    runs = c.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(runs) == 5 and len(children) == 4
    assert parent.info.status == "FINISHED" and parent.data.tags["runs"] == "4"
    assert parent.data.tags["runs_stable"] == "2" and parent.data.tags["runs_diverged"] == "2"
    assert [a.path for a in c.list_artifacts(parent.info.run_id)] == ["summary.md"]
    verdicts = set()
    for run in children:
        run_dir = Path(run.data.tags["run_dir"])
        result = read_result(run_dir)
        assert result["logging"] == {"tensorboard": "ok", "mlflow": "ok"}
        assert run.data.params == {k: str(v) for k, v in result["params"].items()}
        assert {"precision", "optim.lr", "steps"} <= set(run.data.params) and "logger" not in run.data.params
        tags = run.data.tags
        assert tags["status"] == result["status"] and run.info.status == "FINISHED"
        if result["status"] == "diverged":
            assert tags["verdict"] == result["verdict"] == "nonfinite_loss"
            assert tags["first_bad_step"] == str(result["first_bad_step"]) == "1"
            assert (tags["cause_where"], tags["cause_module"]) == (result["cause"]["where"], result["cause"]["module"])
        else:
            assert "verdict" not in tags and "first_bad_step" not in tags
        verdicts.add(tags["status"])
        expected = csv_columns(run_dir)
        for column in ("loss", "grad_norm", "lr", "eval_loss"):
            history = sorted((m.step, m.value) for m in c.get_metric_history(run.info.run_id, column))
            assert same(history, expected[column]), column
        assert len(expected["loss"]) == result["steps_run"]
        assert sorted(a.path for a in c.list_artifacts(run.info.run_id)) == ["metrics.csv", "result.json"]
    assert verdicts == {"stable", "diverged"}


def test_a_rewritten_answer_is_logged_again_on_the_sweeps_parent_run(grid, uri, tmp_path):
    """`python -m sweep.confirm` or `sweep.diagnose` by hand rewrites summary.md (sweep/report/refresh.py); the
    parent run's summary.md is the new one too (before, MLflow kept the summary of the sweep's end, the one place
    that then disagreed). Here the parent's copy is made stale, and the rewrite puts the sweep's back."""
    from sweep.report.refresh import rewrite_answer

    c = client(uri)
    (parent,) = [
        r
        for r in c.search_runs([c.get_experiment_by_name(str(grid.resolve())).experiment_id])
        if "mlflow.parentRunId" not in r.data.tags
    ]
    stale = tmp_path / "summary.md"
    stale.write_text("stale\n")
    c.log_artifact(parent.info.run_id, str(stale))
    _, written, problems = rewrite_answer(grid)
    assert problems == [] and grid / "summary.md" in written
    got = Path(c.download_artifacts(parent.info.run_id, "summary.md", str(tmp_path / "got")))
    assert got.read_text() == (grid / "summary.md").read_text() != "stale\n"


@pytest.mark.slow
def test_tensorboard_event_files_hold_metrics_csv_and_the_verdict(grid):
    run_dirs = sorted(p.parent for p in grid.glob("*/result.json"))
    assert len(run_dirs) == 4, run_dirs  # every run of the grid: a glob that found nothing would check nothing
    for run_dir in run_dirs:
        scalars, tags = tensorboard_columns(run_dir / "tensorboard")
        expected = csv_columns(run_dir)
        for column in COLUMNS:
            assert same(scalars[column], as_float32(expected[column])), (run_dir.name, column)
        for column in ("loss", "grad_norm", "attn_max_logit"):  # computed in fp32: the very numbers of metrics.csv
            assert same(scalars[column], expected[column]), (run_dir.name, column)
        assert expected["loss"] and "verdict/text_summary" in tags
        assert "_hparams_/session_start_info" in tags  # the HParams tab's row of this run


@pytest.mark.slow
def test_packed_runs_log_as_runs_of_their_own(uri, tmp_path):
    sweep_dir = tmp_path / "sweep"
    multirun_in_process(
        sweep_dir,
        *SMALL_MODEL,
        "hydra/launcher=packed",
        "hydra.launcher.pack=2",
        "logger=mlflow",
        f"logger.mlflow.tracking_uri={uri}",
        "optim.lr=1e-4,1e-2",
        "steps=4",
    )
    c = client(uri)
    runs = c.search_runs([c.get_experiment_by_name(str(sweep_dir.resolve())).experiment_id])
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 2
    curves = []
    for run in children:
        run_dir = Path(run.data.tags["run_dir"])
        assert read_result(run_dir)["packed"] == 2
        history = sorted((m.step, m.value) for m in c.get_metric_history(run.info.run_id, "loss"))
        assert same(history, csv_columns(run_dir)["loss"]) and len(history) == 4
        curves.append(history)
    assert curves[0] != curves[1]


class KillServer:
    """A step hook that kills the tracking server after `step` (sweep.run.train.StepHook)."""

    def __init__(self, server: MlflowServer, step: int) -> None:
        self.server, self.step = server, step

    def after_step(self, step, loss, parts) -> bool:
        if step == self.step:
            self.server.kill()
        return False


@pytest.mark.slow
def test_the_server_killed_mid_sweep_loses_nothing_but_the_tracking(grid, server, uri, tmp_path, monkeypatch):
    """Keep last: kills the module's server. Job 1 loses it mid-run, 2 and 3 at start."""
    import optuna

    real, calls = sweep.run.execute.execute_runs, []

    def execute_killing(runs, out_dirs, params, labels, hooks=(), *args, **kwargs):
        calls.append(out_dirs[0])
        if len(calls) == 2:
            hooks = [*hooks, KillServer(server, step=2)]
        return real(runs, out_dirs, params, labels, hooks, *args, **kwargs)

    monkeypatch.setattr(sweep.run.execute, "execute_runs", execute_killing)
    sweep_dir = tmp_path / "sweep"
    overrides = ["logger=[tensorboard,mlflow]", f"logger.mlflow.tracking_uri={uri}", "logger.mlflow.retries=0"]
    multirun_in_process(sweep_dir, *SMALL_MODEL, *overrides, "logger.flush_every=2", *GRID)
    assert server.proc.poll() is not None and len(calls) == 4
    for n in range(4):
        mine, before = read_result(sweep_dir / str(n)), read_result(grid / str(n))
        for key in ("status", "verdict", "first_bad_step", "cause", "final_loss", "steps_run", "eval_loss", "params"):
            assert mine[key] == before[key], (n, key)
        # metrics.csv as the undisturbed grid wrote it, bit for bit; the event files as complete as before
        assert (sweep_dir / str(n) / METRICS_FILE).read_bytes() == (grid / str(n) / METRICS_FILE).read_bytes()
        scalars, _ = tensorboard_columns(sweep_dir / str(n) / "tensorboard")
        assert all(same(scalars[c], as_float32(csv_columns(grid / str(n))[c])) for c in COLUMNS)
        assert mine["logging"]["tensorboard"] == "ok"
        assert (mine["logging"]["mlflow"] == "ok") == (n == 0), mine["logging"]
        assert n == 0 or mine["logging"]["mlflow"].startswith("failed: ")
    assert (sweep_dir / "summary.md").is_file()  # the sweep went on to its end
    study = optuna.load_study(study_name=str(sweep_dir), storage=f"sqlite:///{sweep_dir / 'ledger.db'}")
    assert len(study.trials) == 4
    # job 1 lost the server while logging its rows (mid-run), jobs 2 and 3 when creating their runs
    assert "runs/log-batch" in read_result(sweep_dir / "1")["logging"]["mlflow"]
    assert "runs/create" in read_result(sweep_dir / "2")["logging"]["mlflow"]


def test_a_tracking_uri_token_never_reaches_the_terminal_or_the_log_through_urllib3(tmp_path):
    """issue 45: an MLflow `?token=` in a URI from the environment still reached stdout and __main__.log through
    urllib3's "Retrying ... : /?token=..." warning when the server was down. Every log record is scrubbed at the
    root handlers (sweep.run.urls.SecretFilter), whoever logs it."""
    from .conftest import FAST, run_cli

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_cli(
        "-m",
        "sweep",
        *FAST,
        *SMALL_MODEL,
        "threads=1",
        "steps=2",
        "ledger.enabled=false",
        "logger=mlflow",
        "logger.mlflow.tracking_uri=${oc.env:MY_URI}",
        "logger.mlflow.timeout_s=2",
        f"hydra.run.dir={tmp_path}/run",
        env={"MY_URI": f"http://127.0.0.1:{port}/?token=s3cr3t&pass=p4ssw&passphrase=ph4se"},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Retrying" in proc.stdout + proc.stderr  # the record urllib3 logs is there, scrubbed
    for secret in ("s3cr3t", "p4ssw", "ph4se"):
        assert secret not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-2000:]
        assert not [p for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def test_the_secret_filter_scrubs_any_record_and_its_traceback():
    import logging

    from sweep.run.urls import SecretFilter

    record = logging.LogRecord(
        "urllib3.connectionpool", logging.WARNING, __file__, 1, "after %s: %s", ("broken", "/?x=1&token=s3cr3t"), None
    )
    try:
        raise ValueError("cannot reach postgresql://me:hunter22@db/x?sslpassword=w0rd")
    except ValueError:
        record.exc_info = sys.exc_info()
    assert SecretFilter().filter(record)
    text = logging.Formatter().format(record)
    assert "s3cr3t" not in text and "hunter22" not in text and "w0rd" not in text, text
    assert "token=***" in text and "postgresql://me:***@db" in text, text
