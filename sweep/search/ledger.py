"""The ledger: every run is a trial in the sweep's Optuna study, whatever sweeper or launcher ran it.

One study per sweep. Storage defaults to a SQLite file `ledger.db` in the sweep directory (nothing to
set up); `ledger.storage` takes any Optuna RDB URL (postgresql://, mysql://, sqlite:///) or a path
ending in `.log`/`.jsonl` for Optuna's journal file. How a run becomes a trial (docs/design.md, "The ledger"):

- stable: COMPLETE, value = its eval loss (held-out clips, sweep/run/evaluate.py), or its final loss
  when it has none (eval off, a folder with no held-out file), feasible (constraint -1).
- diverged: COMPLETE with a penalty value, `spike_factor` x the run's initial loss, and an infeasible
  constraint (+1). A stable run's training loss never exceeded that (the monitor would have called it
  a spike); its eval loss is not watched by the monitor, so a stable value is capped just below its
  own run's penalty (`stable_value`; the true eval_loss stays in user_attrs). So the penalty ranks
  every diverged run below every stable one of the same setup. Never NaN: the sampler must learn
  that the region diverges, and Optuna's TPE ignores FAIL trials.
- skipped (cannot run on this device): PRUNED, no value. A run our sweeper's pruner stopped is skipped
  too, with `pruned_at_step`; its trial keeps the losses it reported, the last one as its value.
- error (a bug or a crash): FAIL.

`user_attrs` carry the verdict (status, verdict, first_bad_step, cause_where, cause_module,
final_loss, steps_run, run_dir, ...). A run started by our Optuna sweeper finishes the trial the
sweeper asked for (`ledger.trial_number`); any other run adds a finished trial of its own.

Several processes may write at once: SQLite gets a long busy timeout and every write is retried.
A storage URL's password never reaches a log or a file: `mask_url` is what gets printed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TypeVar

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from sweep.config import LedgerConfig
from sweep.run.results import quality_key, recorded_mechanism
from sweep.run.urls import SECRET_QUERY_KEYS, mask_url, url_has_password  # noqa: F401  (re-exported)
from sweep.search.optuna_schema import parse_migrations_once

log = logging.getLogger("sweep")
optuna.logging.set_verbosity(optuna.logging.WARNING)  # one "Using an existing study" line per run is noise
parse_migrations_once()  # every storage this process opens shares one parse of Optuna's migration scripts
T = TypeVar("T")

STALE_ATTR = "stale"
"""System attr on trials the Optuna sweeper failed as stale (killed): they do not count as done."""
CONSTRAINTS_KEY = "constraints"  # where Optuna's constrained samplers read a trial's constraints
LEDGER_FILE = "ledger.db"
SQLITE_BUSY_S = 60.0
"""How long a SQLite statement waits for another writer's lock, unless a run's ledger.lock_timeout_s says otherwise."""
INFEASIBLE, FEASIBLE = 1.0, -1.0


def driver_url(url: str) -> str:
    """A bare `postgresql://` URL with the driver that is installed spelled out.

    SQLAlchemy 2.1 reads a bare postgresql:// as psycopg 3 and asks for it even when psycopg2 is
    installed; with psycopg2 only, the URL gets `+psycopg2`. An explicit driver is kept as written.
    """
    if not url.startswith("postgresql://"):
        return url
    import importlib.util

    if importlib.util.find_spec("psycopg") is not None or importlib.util.find_spec("psycopg2") is None:
        return url
    from sqlalchemy.engine import make_url

    return make_url(url).set(drivername="postgresql+psycopg2").render_as_string(hide_password=False)


def storage_url(cfg: LedgerConfig, sweep_dir: Path) -> str:
    return cfg.storage or f"sqlite:///{Path(sweep_dir).resolve() / LEDGER_FILE}"


# Storages this process opened: (pid, url, heartbeat_s, stale_after_s, lock wait) -> (storage, identity of its file).
_OPENED: dict[tuple, tuple[optuna.storages.BaseStorage, Optional[tuple[int, int]]]] = {}
_KEEP_OPEN = 8


def open_storage(
    url: str,
    heartbeat_s: Optional[int] = None,
    stale_after_s: Optional[int] = None,
    lock_timeout_s: float = SQLITE_BUSY_S,
) -> optuna.storages.BaseStorage:
    """An Optuna storage for a URL or a journal file path, safe for concurrent writers.

    With `heartbeat_s`, an RDB storage can tell stale RUNNING trials (no heartbeat for `stale_after_s`).
    A SQLite statement waits up to `lock_timeout_s` for a lock another process holds.
    Opened once per process: a new SQLAlchemy engine plus Optuna's schema check cost about half of
    recording a run (docs/cluster.md), and multirun jobs share a process. The storage holds no trials
    of its own (each study wraps it in a fresh cache), so other writers stay visible. A forked child,
    or a database or journal file deleted or replaced since, gets a storage of its own.
    """
    key = (os.getpid(), url, heartbeat_s, stale_after_s, lock_timeout_s)
    opened = _OPENED.get(key)
    if opened is not None and opened[1] == _file_identity(url):
        return opened[0]
    storage = _open_storage(url, heartbeat_s, stale_after_s, lock_timeout_s)
    _OPENED.pop(key, None)
    _OPENED[key] = (storage, _file_identity(url))
    while len(_OPENED) > _KEEP_OPEN:  # a long process (a test session) opens many: keep the newest
        _OPENED.pop(next(iter(_OPENED)))
    return storage


def _file_identity(url: str) -> Optional[tuple[int, int]]:
    """(device, inode) of a SQLite or journal file, None for a server URL or a missing file."""
    path = url if "://" not in url else url.split(":///", 1)[1] if url.startswith("sqlite") else None
    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if st else None


def _open_storage(
    url: str, heartbeat_s: Optional[int], stale_after_s: Optional[int], lock_timeout_s: float
) -> optuna.storages.BaseStorage:
    if "://" not in url:
        if not url.endswith((".log", ".jsonl", ".journal")):
            raise ValueError(f"ledger.storage {url!r} is neither a database URL nor a journal file (.log)")
        Path(url).parent.mkdir(parents=True, exist_ok=True)
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(url))
    url = driver_url(url)
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        Path(url.split(":///", 1)[1]).parent.mkdir(parents=True, exist_ok=True)
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": lock_timeout_s}}
    # Retried: processes creating the same new database at once race on its schema tables.
    return with_retries(
        lambda: optuna.storages.RDBStorage(url, heartbeat_interval=heartbeat_s, grace_period=stale_after_s, **kwargs),
        "open storage",
        deadline=time.monotonic() + lock_timeout_s,
    )


def with_retries(fn: Callable[[], T], what: str, attempts: int = 8, deadline: Optional[float] = None) -> T:
    """Retry a storage operation that lost a race with another writer (SQLite 'database is locked'),
    `attempts` times at most and not past `deadline` (time.monotonic()). A server that refuses the connection
    is not retried: nothing is racing, and the run is left pending for the sweep's end (sweep/search/pending.py)
    instead of waiting ~10 s per run on a server that is down or a URL that is wrong."""
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as e:
            late = deadline is not None and time.monotonic() >= deadline
            final = "password" in str(e).lower() or _says(e, DAMAGED) or _says(e, UNREACHABLE)
            if attempt == attempts - 1 or late or final:
                raise
            time.sleep(0.05 * 2**attempt * (1 + random.random()))
            log.debug("retrying %s after %s", what, type(e).__name__)
    raise AssertionError("unreachable")


def study_name(
    cfg: LedgerConfig,
    sweep_dir: Path,
    storage: optuna.storages.BaseStorage,
    aliases: Sequence[str] = (),
    deadline: Optional[float] = None,
) -> str:
    """The name of the sweep's study in `storage`: `ledger.study_name`, else the sweep directory's resolved path,
    so that every spelling of one directory (relative, absolute, through `..` or a symlink) names one study: the
    jobs', the sweeper's, a trial recorded late (sweep/search/pending.py) and a resume's under another spelling.

    Compatibility: a version before this one named the study by the path as given. Where `storage` holds a study
    named by a spelling of the same directory (`sweep_dir` as given, `aliases`), that study is the sweep's; then
    the resolved path; then any other name that resolves to the same directory from this process's working
    directory (a relative name); then, in the sweep's own ledger file (no `ledger.storage`), its only study: the
    directory was moved or copied since (before, a copy's `sweep.confirm`, `sweep.diagnose` and `sweep.report
    --write` recorded its answer nowhere, and a resume of it started a second study); else the resolved path, for a
    new study."""
    if cfg.study_name:
        return cfg.study_name
    resolved = Path(sweep_dir).resolve()
    names = with_retries(lambda: optuna.get_all_study_names(storage), "get_all_study_names", deadline=deadline)
    for name in (str(sweep_dir), *aliases, str(resolved)):
        if name in names:
            return name
    for name in sorted(names):
        if _spells(name, resolved):
            return name
    if not cfg.storage and len(names) == 1:  # the sweep's own ledger.db, moved or copied with it: its one study
        return names[0]
    return str(resolved)


def _spells(name: str, directory: Path) -> bool:
    """Whether a study name is a path to `directory` (from this process's working directory, when relative)."""
    if not name or "://" in name or "\0" in name:
        return False
    try:
        return Path(name).resolve() == directory
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a name the file system refuses
        return False


def open_study(
    cfg: LedgerConfig, sweep_dir: Path, aliases: Sequence[str] = (), deadline: Optional[float] = None
) -> optuna.Study:
    """The sweep's study (created when new) in its storage (`storage_url`), under `study_name`."""
    url = storage_url(cfg, sweep_dir)
    name = study_name(cfg, sweep_dir, open_storage(url, lock_timeout_s=cfg.lock_timeout_s), aliases, deadline)
    return load_study(url, name, cfg.lock_timeout_s)


def load_study(url: str, study_name: str, lock_timeout_s: float = SQLITE_BUSY_S) -> optuna.Study:
    storage = open_storage(url, lock_timeout_s=lock_timeout_s)
    return with_retries(
        lambda: optuna.create_study(storage=storage, study_name=study_name, direction="minimize", load_if_exists=True),
        "create_study",
        deadline=time.monotonic() + lock_timeout_s,
    )


def _causes(e: Optional[BaseException]) -> list[BaseException]:
    """`e` and what it wraps: Optuna wraps the driver's error ("An exception is raised during the commit")."""
    chain: list[BaseException] = []
    while e is not None and len(chain) < 8 and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def _says(e: BaseException, phrases: tuple[str, ...]) -> bool:
    return any(p in str(c) for c in _causes(e) for p in phrases)


def is_locked(e: BaseException) -> bool:
    """Whether a storage error is another process holding the database locked (SQLite), not a fault."""
    return _says(e, ("database is locked", "database table is locked"))


DAMAGED = ("file is not a database", "database disk image is malformed")
"""What SQLite says of a ledger file that is not (or no longer) a database: retrying cannot help."""
UNREACHABLE = ("Connection refused",)
"""What a driver says when nothing listens at the server's address: retrying within a run cannot help."""


def storage_error_line(e: BaseException) -> str:
    """One line naming what went wrong with the storage: the innermost error, whatever wrapped it."""
    inner = _causes(e)[-1]
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[0]}" if text else type(inner).__name__


def trial_user_attrs(result: dict, run_dir: Path) -> dict:
    """The verdict and its context, as trial user attributes (JSON-safe, no NaN)."""
    cause = result.get("cause") or {}
    attrs = {
        "status": result["status"],
        "verdict": result.get("verdict"),
        "first_bad_step": result.get("first_bad_step"),
        "cause_where": cause.get("where"),
        "cause_module": cause.get("module"),
        "cause_detail": cause.get("detail"),
        "mechanism": (result.get("mechanism") or {}).get("name"),
        "final_loss": result.get("final_loss"),
        "eval_loss": result.get("eval_loss"),
        "initial_loss": result.get("initial_loss"),
        "min_loss": result.get("min_loss"),
        "steps_run": result.get("steps_run"),
        "steps_per_second": result.get("steps_per_second"),
        "seed": result.get("seed"),
        "reason": result.get("reason"),
        "device": result.get("device"),
        "pruned_at_step": result.get("pruned_at_step"),
        "interrupted_at_step": result.get("interrupted_at_step"),
        "loaded": result.get("loaded"),  # the weights it started from (a report tells a fine-tune from a fresh run)
        "run_dir": str(Path(run_dir).resolve()),
        "params": result.get("params") or {},
    }
    if (result.get("mechanism") or {}).get("source") == "diagnosis":  # recorded late, after a diagnosis (answer.py)
        attrs["mechanism_recorded"] = recorded_mechanism(result)
    return attrs


def trial_outcome(result: dict, penalty_factor: float = 10.0) -> tuple[TrialState, Optional[float], Optional[tuple]]:
    """(state, value, constraints) of a run's trial."""
    status = result["status"]
    if status == "stable":
        return TrialState.COMPLETE, stable_value(result, penalty_factor), (FEASIBLE,)
    if status == "diverged":
        return TrialState.COMPLETE, penalty(result, penalty_factor), (INFEASIBLE,)
    if status == "skipped":
        return TrialState.PRUNED, None, None
    return TrialState.FAIL, None, None


def penalty(result: dict, penalty_factor: float = 10.0) -> float:
    """A diverged run's value: `penalty_factor` (monitor.spike_factor) x its initial loss, 1e6 without one."""
    initial = result.get("initial_loss")
    return penalty_factor * initial if initial is not None else 1e6


def stable_value(result: dict, penalty_factor: float = 10.0) -> float:
    """A stable run's value: its quality number (`quality_key`: its eval loss, else its final loss; inf without
    either), the one the report's quality column takes, kept strictly below the penalty the same run would have
    had diverged (its eval loss is not bounded by the spike test)."""
    value = result.get(quality_key(lambda key: result.get(key) is not None))
    if value is None:
        return math.inf
    return min(value, math.nextafter(penalty(result, penalty_factor), -math.inf))


def distribution_for(value: Any, choices: Optional[list] = None) -> Optional[BaseDistribution]:
    """A distribution that contains `value`, compatible across the cells of a grid."""
    if isinstance(value, bool):
        return CategoricalDistribution((False, True))
    if isinstance(value, int):
        return IntDistribution(value, value)
    if isinstance(value, float) and math.isfinite(value):
        return FloatDistribution(value, value)
    if isinstance(value, str) and choices:
        return CategoricalDistribution(tuple(sorted(set(map(str, choices)))))
    return None  # lists, None, free strings: kept in user_attrs["params"] only


def record_run(
    cfg: LedgerConfig,
    sweep_dir: Path,
    run_dir: Path,
    result: dict,
    choices_of: Callable[[str], Optional[list]] = lambda key: None,
    penalty_factor: float = 10.0,
    aliases: Sequence[str] = (),
) -> Optional[int]:
    """Record one finished run as a trial in the sweep's study (`study_name`; `aliases`: other spellings of the
    sweep directory); returns its trial number (None when the ledger is off).

    Waits about `cfg.lock_timeout_s` at most for a locked ledger, then raises (is_locked tells)."""
    if not cfg.enabled:
        return None
    deadline = time.monotonic() + cfg.lock_timeout_s
    study = open_study(cfg, sweep_dir, aliases, deadline)
    state, value, constraints = trial_outcome(result, penalty_factor)
    attrs = trial_user_attrs(result, run_dir)
    if cfg.trial_number is not None:
        return _finish_asked_trial(study, cfg.trial_number, state, value, constraints, attrs, deadline)
    params, dists = {}, {}
    for key, v in (result.get("params") or {}).items():
        dist = distribution_for(v, choices_of(key))
        if dist is not None:
            params[key], dists[key] = v, dist
    trial = optuna.trial.create_trial(
        state=state,
        value=value if state is TrialState.COMPLETE else None,
        params=params,
        distributions=dists,
        user_attrs=attrs,
        system_attrs={CONSTRAINTS_KEY: constraints} if constraints else {},
    )
    try:
        number = _add_trial(study, trial, deadline)
    except ValueError as e:  # a param recorded with another distribution kind earlier in this study
        log.warning("ledger: %s; recording this run's params in user_attrs only", e)
        trial = optuna.trial.create_trial(
            state=state, value=trial.value, user_attrs=attrs, system_attrs=trial.system_attrs
        )
        number = _add_trial(study, trial, deadline)
    try:
        supersede(study, number, attrs["run_dir"])
    except Exception as e:  # noqa: BLE001  (the run is recorded; the report still takes the latest trial per run dir)
        log.warning("ledger: could not mark the earlier trials of %s superseded: %s", run_dir, storage_error_line(e))
    return number


SUPERSEDED_ATTR = "superseded_by"
"""User attribute of a trial whose job directory a later trial re-ran (a grid cell re-run after its result.json
was deleted, or after it was interrupted): the number of that later trial. The report leaves such a trial out
(sweep/report/study.py); its other attributes keep their meaning (what that run did)."""


def supersede(study: optuna.Study, number: int, run_dir: str) -> list[int]:
    """Mark every earlier trial of the study recorded for `run_dir` with SUPERSEDED_ATTR = `number`; returns
    their numbers. Optuna's API cannot set an attribute of a finished trial, so in an RDB storage (SQLite,
    PostgreSQL, MySQL) the row is written through Optuna's own models; in another storage (a journal file)
    nothing is marked, and the report still keeps only the latest trial per run directory."""
    from optuna.storages import RDBStorage
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session

    backend = getattr(study._storage, "_backend", study._storage)
    if not isinstance(backend, RDBStorage):
        return []
    marked = []
    with _create_scoped_session(backend.scoped_session, True) as session:
        rows = (
            session.query(models.TrialModel)
            .join(models.TrialUserAttributeModel, models.TrialUserAttributeModel.trial_id == models.TrialModel.trial_id)
            .filter(
                models.TrialModel.study_id == study._study_id,
                models.TrialModel.number < number,
                models.TrialUserAttributeModel.key == "run_dir",
                models.TrialUserAttributeModel.value_json == json.dumps(run_dir),
            )
            .all()
        )
        for old in rows:
            if not old.state.is_finished():
                continue  # a RUNNING trial is its sweeper's to close
            exists = (
                session.query(models.TrialUserAttributeModel)
                .filter_by(trial_id=old.trial_id, key=SUPERSEDED_ATTR)
                .one_or_none()
            )
            if exists is None:
                session.add(
                    models.TrialUserAttributeModel(
                        trial_id=old.trial_id, key=SUPERSEDED_ATTR, value_json=json.dumps(number)
                    )
                )
                marked.append(old.number)
    return marked


def counted_trials(trials: Sequence[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """The trials that are runs of the sweep, one per run directory: stale trials that recorded nothing (a job
    that died; the sweeper asked for its cell again) and superseded ones left out, and of several trials naming
    one run directory the latest finished one; trials without a `run_dir` (another app's) all count."""
    latest: dict[str, optuna.trial.FrozenTrial] = {}
    anonymous = []
    for trial in trials:
        if trial.system_attrs.get(STALE_ATTR) and "status" not in trial.user_attrs:
            continue
        if trial.user_attrs.get(SUPERSEDED_ATTR) is not None:
            continue
        run_dir = trial.user_attrs.get("run_dir")
        if run_dir is None:
            anonymous.append(trial)
        elif run_dir not in latest or _rank(trial) >= _rank(latest[run_dir]):
            latest[run_dir] = trial  # a re-run of the same job directory: its latest finished trial
    return [*latest.values(), *anonymous]


def _rank(trial: optuna.trial.FrozenTrial) -> tuple:
    return (trial.state.is_finished(), trial.number)


def set_finished_trial_attrs(study: optuna.Study, number: int, attrs: dict) -> bool:
    """Set user attributes of a finished trial (each written whole, replacing its value); False where the storage
    cannot. Optuna's API refuses any change to a finished trial (`UpdateFinishedTrialError`): in an RDB storage
    (SQLite, PostgreSQL, MySQL) the rows are written through Optuna's own models, as `supersede` does; a journal
    file replays its log through the same refusal (`JournalStorage._trial_exists_and_updatable` drops the update
    for every reader), so there it cannot be done, and the study's user attrs carry what the trial cannot
    (sweep/search/answer.py)."""
    from optuna.storages import RDBStorage
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session

    backend = getattr(study._storage, "_backend", study._storage)
    if not isinstance(backend, RDBStorage):
        return False
    with _create_scoped_session(backend.scoped_session, True) as session:
        trial = session.query(models.TrialModel).filter_by(study_id=study._study_id, number=number).one()
        for key, value in attrs.items():
            row = (
                session.query(models.TrialUserAttributeModel).filter_by(trial_id=trial.trial_id, key=key).one_or_none()
            )
            if row is None:
                session.add(
                    models.TrialUserAttributeModel(trial_id=trial.trial_id, key=key, value_json=json.dumps(value))
                )
            else:
                row.value_json = json.dumps(value)
    return True


def _add_trial(study: optuna.Study, trial: optuna.trial.FrozenTrial, deadline: Optional[float] = None) -> int:
    """study.add_trial, but returning the new trial's number."""
    trial._validate()
    storage = study._storage
    trial_id = with_retries(
        lambda: storage.create_new_trial(study._study_id, template_trial=trial), "add_trial", deadline=deadline
    )
    return storage.get_trial_number_from_id(trial_id)


def _finish_asked_trial(study, number, state, value, constraints, attrs, deadline=None) -> int:
    """Finish the RUNNING trial our sweeper asked for: attributes, constraints, then tell.

    Recorded late (sweep/search/pending.py), the sweeper has failed that trial meanwhile: the run becomes a
    new trial with the asked trial's params, in the sweeper's search space."""
    storage = study._storage
    trial_id = storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
    asked = storage.get_trial(trial_id)
    if asked.state.is_finished():
        late = optuna.trial.create_trial(
            state=state,
            value=value if state is TrialState.COMPLETE else None,
            params=asked.params,
            distributions=asked.distributions,
            user_attrs=attrs,
            system_attrs={CONSTRAINTS_KEY: constraints} if constraints else {},
        )
        return _add_trial(study, late, deadline)
    for k, v in attrs.items():
        with_retries(lambda: storage.set_trial_user_attr(trial_id, k, v), "set_trial_user_attr", deadline=deadline)  # noqa: B023  (called now)
    if constraints:
        with_retries(
            lambda: storage.set_trial_system_attr(trial_id, CONSTRAINTS_KEY, constraints),
            "set_trial_system_attr",
            deadline=deadline,
        )
    with_retries(
        lambda: study.tell(number, value if state is TrialState.COMPLETE else None, state=state, skip_if_finished=True),
        "tell",
        deadline=deadline,
    )
    return number


DIAGNOSED = "diagnosed"
"""The study user attr where a diagnosis leaves its mechanism, {trial number as a string: mechanism}: Optuna does not
let a finished trial be updated in every storage (sweep/search/answer.py)."""


def diagnosed_mechanisms(study: optuna.Study) -> dict[str, str]:
    """The study's `diagnosed` attr: {trial number as a string: mechanism}; {} when none (or not that shape)."""
    value = study.user_attrs.get(DIAGNOSED)
    return {str(k): v for k, v in value.items() if isinstance(v, str)} if isinstance(value, dict) else {}
