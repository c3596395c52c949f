"""What one run leaves behind: `result.json` and `metrics.csv` in its Hydra job directory.

The fields of result.json are a contract (docs/design.md, "Files of one run"); the report, the ledger and
the acceptance checks read them. JSON has no NaN or Infinity, and result.json must be written whatever
a run held, so values are made JSON-safe on the way out (`json_safe`):
- a non-finite measured number (final_loss, min_loss, initial_loss, max_grad_norm, steps_per_second,
  max_attn_logit, min_attn_entropy, eval_loss) is null: the verdict already says the loss went non-finite;
- a non-finite float anywhere else (a param, a cause, a headroom entry) is the string "inf", "-inf"
  or "nan", so the value is not lost;
- an integer outside the signed 64-bit range is its decimal string (readers such as pandas, SQL or
  JavaScript cannot hold it as a number), and any other non-JSON value (a Path, an enum) its str().
"""

from __future__ import annotations

import csv
import fcntl
import functools
import json
import logging
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable, Protocol, Sequence

from sweep.config import Verdict

log = logging.getLogger("sweep")

RESULT_FILE = "result.json"
TRIAL_FILE = "trial.json"
"""The record of a run a diagnosis or a confirmation makes (result.json's fields): one result.json per run of a
sweep, so `find SWEEP -name result.json` counts the sweep's runs."""
METRICS_FILE = "metrics.csv"
QUALITY_KEYS = ("eval_loss", "final_loss")
"""A run's quality number (lower is better), in order of preference: its held-out eval loss, else its final
training loss. `quality_key` picks one by one rule for the ledger's trial value (a run: sweep/search/ledger.py
`stable_value`) and the report's quality column (a sweep's stable runs: sweep/report/noise.py `quality_column`),
so a trial's value is the number the recommendation compares its run by."""
RUNNING_LOCK = ".running.lock"
"""Locked (flock) by the process running a job, from its start until its result is recorded. A job
directory without result.json whose lock no process holds was interrupted (kill -9, a crash, a lost
node), not running: the kernel drops the lock when its process dies, however it dies."""
METRIC_COLUMNS = (
    "step",
    "loss",
    "grad_norm",
    "lr",
    "loss_scale",
    "skipped",
    "unchanged_fraction",
    "zero_grad_fraction",
    "attn_max_logit",
    "attn_min_entropy",
    "eval_loss",
)


INT64 = 2**63


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def json_safe(value):
    """`value` with every part strict JSON can hold as it is, and the rest as text (module docstring)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # "inf", "-inf", "nan"
    if isinstance(value, int):
        return value if -INT64 <= value < INT64 else str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return str(value)


@dataclass
class RunResult:
    """The outcome of one run."""

    status: str  # stable | diverged | skipped | error | interrupted
    verdict: Verdict | None = None
    """Null unless diverged; result.json holds its word."""
    first_bad_step: int | None = None
    cause: dict | None = None
    final_loss: float | None = None
    min_loss: float | None = None
    initial_loss: float | None = None
    steps_run: int = 0
    max_grad_norm: float | None = None
    seconds: float = 0.0
    steps_per_second: float | None = None
    params: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    seed: int | None = None
    reason: str | None = None
    """Why a run was skipped, or the error of a crashed one."""
    kernels: dict = field(default_factory=dict)
    """The kernels that actually ran: attention backend, modulate implementation."""
    device: str | None = None
    n_params: int | None = None
    headroom: list = field(default_factory=list)
    """Forensics of a non-finite run: the modules closest to their dtype's max at the bad step."""
    max_attn_logit: float | None = None
    """The largest attention logit seen (recorded every monitor.logit_every steps)."""
    min_attn_entropy: float | None = None
    """The lowest mean attention entropy (nats) seen; a collapse towards 0 follows logit growth."""
    loaded: str | None = None
    """The checkpoint or weights file this run started from."""
    start_step: int = 0
    """The step a resumed run started at."""
    packed: int | None = None
    """Trial packing: how many runs trained together in this run's pack (sweep/run/packed.py); null when alone."""
    pruned_at_step: int | None = None
    """The step after which the sweeper's pruner stopped this run (status skipped; sweep/search/pruning.py)."""
    eval_loss: float | None = None
    """The loss on the held-out eval set (sweep/run/evaluate.py): after the last step of a stable run (and of a
    slow_divergence or no_progress one, decided after it); for another diverged run the last evaluation before its
    first bad step; null when none was made."""
    eval: dict | None = None
    """The eval settings (enabled, every, samples, seed, batch_size), the clips, and `reason` when disabled."""
    logging: dict = field(default_factory=dict)
    """Each tracker of `logger` (docs/loggers.md): "ok", or "failed: <reason>" (the run itself is unaffected)."""
    interrupted_at_step: int | None = None
    """The last step run before SIGINT/SIGTERM stopped this run (status interrupted; sweep/run/interrupt.py)."""
    mechanism: dict | None = None
    """Why a diverged run diverged, from its recorded signals (sweep/diagnose/mechanism.py): {"name", "summary"};
    null for every other run. `python -m sweep.diagnose` tests it against counterfactual runs (diagnosis.json)."""
    trend: dict | None = None
    """The whole curve's numbers at the end of a run that reached its last step (sweep/run/trend.py): smoothed
    minimum and end, the rise after the minimum, the weights' travel, logits, gradient norms, and the verdict
    they gave (slow_divergence, no_progress or null); null for a run that stopped early or monitor.trend=false."""
    optimizer: dict | None = None
    """The optimizer that ran (sweep/run/optimizers.py): name, library, whether it ran eagerly or capture-safe, the
    dtype of its state per tensor (counted), and at the end the state's health (non-finite or saturated values)."""
    fp8: dict | None = None
    """precision.fp8 (sweep/run/fp8.py): the recipe, emulated or native, the layers that computed in fp8, those kept
    high (and the glob that kept each) and those torchao cannot take (and why); null without fp8."""
    base_storage: dict | None = None
    """finetune.base_dtype (sweep/run/fp8_storage.py): how each frozen base layer was stored; null without it."""
    sync: dict = field(default_factory=dict)
    """How the steps met the host (sweep.run.window.Syncs): monitor.sync_every as run, the syncs, the windows
    and those taken back, and the steps run past the first bad one before the host saw it (none of them kept)."""

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in (
            "final_loss",
            "min_loss",
            "initial_loss",
            "max_grad_norm",
            "steps_per_second",
            "max_attn_logit",
            "min_attn_entropy",
            "eval_loss",
        ):
            d[key] = _finite_or_none(d[key])
        return d

    def headline(self) -> str:
        """One line for the log: the verdict and where."""
        if self.status == "diverged":
            where = (self.cause or {}).get("where")
            return f"diverged: {self.verdict} at step {self.first_bad_step}" + (f" ({where})" if where else "")
        if self.status == "stable":
            speed = f"{self.steps_per_second:.1f} steps/s"
            return f"stable: final loss {self.final_loss:.4f} after {self.steps_run} steps ({speed})"
        return f"{self.status}: {self.reason}"


def package_versions() -> dict:
    """Versions that decide numerics, recorded with every run (a copy: callers may change it)."""
    return dict(_versions())


@functools.lru_cache(maxsize=1)
def _versions() -> dict:
    """Read once per process: importlib.metadata scans site-packages on every call (~15 ms, as long as a tiny
    run's step), and a process's packages do not change while it runs."""
    out = {"python": platform.python_version()}
    for name in ("torch", "diffusers", "hydra-core", "optuna", "numpy"):
        try:
            out[name.replace("-core", "")] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name.replace("-core", "")] = None
    return out


def write_result(out_dir: Path, result: RunResult, name: str = RESULT_FILE) -> Path:
    """`result` as `out_dir`/`name`, written whole or not at all (result.json; TRIAL_FILE for a diagnosis's or a
    confirmation's own runs)."""
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_record(path, result.to_dict())


def write_record(path: Path, record: dict) -> Path:
    """`record` as strict JSON at `path`, written whole or not at all: to a .tmp file, then renamed."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(json_safe(record), indent=2, allow_nan=False) + "\n")
        tmp.replace(path)  # a reader never sees half a file
    except OSError:  # a full disk: no half-written .tmp left behind; an earlier result.json stays as it was
        tmp.unlink(missing_ok=True)
        raise
    return path


def quality_key(has: Callable[[str], bool]) -> str:
    """The first of QUALITY_KEYS that `has` (a run holds it, or some stable run of a sweep does); the last one
    when none."""
    return next((key for key in QUALITY_KEYS if has(key)), QUALITY_KEYS[-1])


def recorded_mechanism(result: dict) -> str | None:
    """The mechanism a run's own signals named when it ended (result.json `mechanism.name`), also after a
    diagnosis wrote its own over it (sweep/diagnose/record.py `write_mechanism` keeps it as `mechanism.recorded`):
    what groups a run's distinct failure and what a scenario expects."""
    mechanism = result.get("mechanism")
    if isinstance(mechanism, dict) and mechanism.get("source") == "diagnosis":
        mechanism = mechanism.get("recorded")
    return mechanism.get("name") if isinstance(mechanism, dict) else None


def run_record(run_dir: Path) -> Path | None:
    """The record a run directory holds: its result.json, else the TRIAL_FILE of a diagnosis's or a confirmation's
    own run; None when it holds neither."""
    for name in (RESULT_FILE, TRIAL_FILE):
        if (Path(run_dir) / name).is_file():
            return Path(run_dir) / name
    return None


RECORD_INT_KEYS = (
    "first_bad_step",
    "steps_run",
    "seed",
    "pruned_at_step",
    "packed",
    "start_step",
    "interrupted_at_step",
)
RECORD_FLOAT_KEYS = (
    "final_loss",
    "initial_loss",
    "min_loss",
    "eval_loss",
    "steps_per_second",
    "seconds",
    "max_grad_norm",
    "max_attn_logit",
    "min_attn_entropy",
)


def record_problem(r) -> str | None:
    """Why a parsed result.json (or trial.json) does not have the contract's shape (docs/design.md, "Files of one
    run"), or None when it does: the one rule its readers (the report's runs table, sweep.diagnose) hold a file
    to, so that valid JSON of the wrong shape is named and left out, never a traceback deep in a reader.

    Checks what they rely on: an object; a string status and verdict; cause, params and mechanism as objects,
    cause.where/module/detail and mechanism.name as strings; headroom as a list of objects; the integer keys as
    integers a 64-bit column can hold and the measured numbers as numbers (a hand-edited 10**30 overflowed pandas)."""
    if not isinstance(r, dict):
        return f"not a JSON object (a JSON {json_type(r)})"
    if not isinstance(r.get("status", "error"), str):
        return "status is not a string"
    if r.get("verdict") is not None and not isinstance(r["verdict"], str):
        return "verdict is not a string or null"
    for key in ("cause", "params", "mechanism"):
        if r.get(key) is not None and not isinstance(r[key], dict):
            return f"{key} is not an object or null (a JSON {json_type(r[key])})"
    for node, key in (("cause", "where"), ("cause", "module"), ("cause", "detail"), ("mechanism", "name")):
        value = (r.get(node) or {}).get(key)
        if value is not None and not isinstance(value, str):
            return f"{node}.{key} is not a string or null"
    headroom = r.get("headroom")
    if headroom is not None and not (isinstance(headroom, list) and all(isinstance(h, dict) for h in headroom)):
        return "headroom is not a list of objects or null"
    for key in RECORD_INT_KEYS:
        if not _is_int64_or_none(r.get(key)):
            return f"{key} is not a 64-bit integer or null (got {_short(r.get(key))})"
    for key in RECORD_FLOAT_KEYS:
        if not _is_float_or_none(r.get(key)):
            return f"{key} is not a number or null (got {_short(r.get(key))})"
    return None


def _is_int64_or_none(v) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63)


def _is_float_or_none(v) -> bool:
    """None, a float, or an int that has a float (one past 1.8e308 has none)."""
    if v is None or isinstance(v, float):
        return True
    if not isinstance(v, int) or isinstance(v, bool):
        return False
    try:
        float(v)
    except OverflowError:
        return False
    return True


def _short(v) -> str:
    """A value for a one-line message: a huge integer by its size, anything else cut at 40 characters."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**30:
        return f"an integer of {len(str(abs(v)))} digits"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def json_type(v) -> str:
    """A parsed JSON value's type in JSON's words (array, not list)."""
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}
    names[type(None)] = "null"
    return names.get(type(v), type(v).__name__)


def unwritable(directory: Path) -> str | None:
    """Why a command cannot write its files into `directory` (made if missing): the OS's reason ("Read-only file
    system", "Permission denied", "No space left on device"), or None when a file can be made there. Tried for
    real, not read from the mode bits, which root ignores and a read-only mount does not show."""
    import tempfile

    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


_HELD: dict[str, int] = {}
"""Lock files this process holds, by path: their open descriptors."""


def hold_run_dir(run_dir: Path) -> None:
    """Mark the job directory as being written by this process until `release_run_dir` (or its death)."""
    path = Path(run_dir) / RUNNING_LOCK
    if str(path) in _HELD:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:  # a read-only or odd file system: the run matters more than its liveness mark
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # another live process writes this directory: it keeps the mark
        os.close(fd)
        return
    _HELD[str(path)] = fd


def release_run_dir(run_dir: Path) -> None:
    """The job's result is written and recorded: nobody writes its directory any more."""
    path = Path(run_dir) / RUNNING_LOCK
    fd = _HELD.pop(str(path), None)
    if fd is None:
        return
    try:
        path.unlink()
    except OSError:
        pass
    os.close(fd)  # drops the lock


def is_being_written(run_dir: Path) -> bool:
    """Whether a live process holds the job directory's lock (see RUNNING_LOCK)."""
    return lock_held(Path(run_dir) / RUNNING_LOCK, fcntl.LOCK_SH)


def lock_held(path: Path, probe: int) -> bool:
    """Whether a live process holds a flock on `path` that conflicts with `probe` (LOCK_SH or LOCK_EX);
    a missing file is no lock. The probe itself is released at once."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, probe | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


class TrackerError(RuntimeError):
    """A tracker's failure, already said in one line with its cause's type (MetricsLog adds no type name)."""


class MetricSink(Protocol):
    """Somewhere a run's rows go as it trains (a tracker: sweep/run/tensorboard_sink.py, mlflow_sink.py).

    Called by MetricsLog only, which turns any exception into a warning and `result.logging[name]`."""

    name: str

    def start(self) -> None:
        """Before the first step (open a file, create the tracker's run)."""

    def write(self, rows: list[dict]) -> None:
        """Final rows, in step order, in batches."""

    def finish(self, result: RunResult, out_dir: Path) -> None:
        """The run is over and its files written (metrics.csv, result.json): the verdict, then close."""


class MetricsLog:
    """Per-step rows: streamed to metrics.csv and to the trackers in batches as the run goes, written whole at
    the end (`write`).

    A row is final once the next row is logged or the run ends (train writes a step's eval loss into its row
    after logging it). Final rows go out every `flush_every` rows or `flush_s` seconds, whichever comes
    first, so a killed run leaves metrics.csv up to its last batch, and a tracker gets a few requests per
    run, not one per step. A sink that raises is dropped with a warning: `logging` says which and why.
    """

    def __init__(
        self, out_dir: Path | None = None, sinks: Sequence[MetricSink] = (), flush_every: int = 50, flush_s: float = 10
    ) -> None:
        self.rows: list[dict] = []
        self.flush_every, self.flush_s = flush_every, flush_s
        self.sent = 0
        """Rows already handed to the sinks."""
        self._last_flush = time.monotonic()
        self._stream = CsvStream(Path(out_dir) / METRICS_FILE) if out_dir is not None else None
        self.sinks: list[MetricSink] = []
        self.logging: dict[str, str] = {}
        """Each tracker's state for result.json: "ok" or "failed: <reason>"."""
        for sink in sinks:
            self.logging[sink.name] = "ok"
            if self._call(sink, "start"):
                self.sinks.append(sink)

    def log(self, **row) -> None:
        self.rows.append(row)
        final = len(self.rows) - 1 - self.sent
        if final >= self.flush_every or (final and time.monotonic() - self._last_flush >= self.flush_s):
            self.flush(len(self.rows) - 1)

    def flush(self, upto: int | None = None) -> None:
        """Send rows [sent, upto) (default: every row) to metrics.csv and the sinks."""
        upto = len(self.rows) if upto is None else upto
        batch = self.rows[self.sent : upto]
        self.sent, self._last_flush = upto, time.monotonic()
        if not batch:
            return
        if self._stream is not None:
            try:
                self._stream.append(batch)
            except OSError as e:  # a full disk: the final write says so (execute.fail), training goes on
                log.warning("metrics.csv: could not append (%s); it is written once more at the end", e)
                self._stream = None
        for sink in list(self.sinks):
            if not self._call(sink, "write", batch):
                self.sinks.remove(sink)

    def write(self, out_dir: Path) -> Path:
        """metrics.csv with every row, as it is once the run is over (replaces what was streamed)."""
        self.flush()
        path = Path(out_dir) / METRICS_FILE
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=METRIC_COLUMNS, extrasaction="ignore", restval="")
            w.writeheader()
            w.writerows(self.rows)
        return path

    def finish(self, result: RunResult, out_dir: Path) -> bool:
        """The trackers log the verdict and the files and close; True when one of them failed doing so."""
        self.flush()
        failed = False
        for sink in self.sinks:
            failed |= not self._call(sink, "finish", result, Path(out_dir))
        self.sinks = []
        return failed

    def _call(self, sink: MetricSink, method: str, *args) -> bool:
        """sink.method(*args); False (with a warning, and the reason in `logging`) when it raised."""
        try:
            getattr(sink, method)(*args)
            return True
        except Exception as e:  # noqa: BLE001  (a tracker never fails a run: server down, disk full, a bug)
            reason = (str(e).strip().splitlines() or [""])[0]
            reason = reason if isinstance(e, TrackerError) else f"{type(e).__name__}: {reason}"
            self.logging[sink.name] = f"failed: {reason[:300]}"
            log.warning("logger %s failed, the run goes on without it: %s", sink.name, self.logging[sink.name])
            return False


class CsvStream:
    """metrics.csv as the run goes: the header with the first rows, then rows appended and flushed per batch."""

    def __init__(self, path: Path) -> None:
        self.path, self.started = path, False

    def append(self, rows: list[dict]) -> None:
        if not self.started:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a" if self.started else "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=METRIC_COLUMNS, extrasaction="ignore", restval="")
            if not self.started:
                w.writeheader()
            w.writerows(rows)
        self.started = True
