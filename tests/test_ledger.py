"""Every run is a trial: states, values, constraints and attributes; concurrent writers lose nothing."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from sweep.config import LedgerConfig
from sweep.search.ledger import CONSTRAINTS_KEY, mask_url, record_run, storage_url, url_has_password

from .conftest import FAST, SMALL_MODEL, multirun_in_process, read_result, run_cli_refusals, sweep_forked


def result(status, **kw):
    base = {
        "status": status,
        "verdict": None,
        "first_bad_step": None,
        "cause": None,
        "final_loss": 0.5,
        "initial_loss": 1.0,
        "min_loss": 0.4,
        "steps_run": 10,
        "params": {"precision": "fp32", "optim.lr": 1e-3},
    }
    return {**base, **kw}


def only_study(url):
    (summary,) = optuna.get_all_study_summaries(url)
    return optuna.load_study(study_name=summary.study_name, storage=url)


def test_each_status_maps_to_its_trial_state(tmp_path):
    cfg = LedgerConfig()
    runs = {
        "stable": result("stable"),
        "diverged": result(
            "diverged",
            verdict="nonfinite_loss",
            first_bad_step=3,
            final_loss=None,
            cause={"where": "optimizer", "module": "blocks.0.attn", "detail": "x"},
        ),
        "skipped": result("skipped", reason="tf32 needs CUDA", final_loss=None),
        "error": result("error", reason="RuntimeError: boom", final_loss=None),
    }
    for name, r in runs.items():
        record_run(cfg, tmp_path, tmp_path / name, r, lambda key: ["fp32", "bf16_amp"] if key == "precision" else None)
    trials = {t.user_attrs["status"]: t for t in only_study(storage_url(cfg, tmp_path)).trials}
    assert trials["stable"].state is TrialState.COMPLETE and trials["stable"].value == 0.5
    assert trials["stable"].system_attrs[CONSTRAINTS_KEY] == [-1.0]
    d = trials["diverged"]
    assert d.state is TrialState.COMPLETE and d.value == 10.0  # spike_factor x initial loss, never NaN
    assert d.system_attrs[CONSTRAINTS_KEY] == [1.0]
    assert (d.user_attrs["verdict"], d.user_attrs["first_bad_step"]) == ("nonfinite_loss", 3)
    assert (d.user_attrs["cause_where"], d.user_attrs["cause_module"]) == ("optimizer", "blocks.0.attn")
    assert trials["skipped"].state is TrialState.PRUNED
    assert trials["error"].state is TrialState.FAIL
    for t in trials.values():
        assert t.params == {"precision": "fp32", "optim.lr": 1e-3}
        assert t.user_attrs["run_dir"].endswith(t.user_attrs["status"])


def test_diverged_penalty_ranks_below_any_stable_run(tmp_path):
    cfg = LedgerConfig()
    record_run(cfg, tmp_path, tmp_path / "a", result("stable", final_loss=9.0), penalty_factor=10.0)
    record_run(cfg, tmp_path, tmp_path / "b", result("diverged", verdict="loss_spike"), penalty_factor=10.0)
    study = only_study(storage_url(cfg, tmp_path))
    assert study.best_trial.user_attrs["status"] == "stable"


def test_journal_file_storage(tmp_path):
    cfg = LedgerConfig(storage=str(tmp_path / "journal.log"), study_name="s")
    record_run(cfg, tmp_path, tmp_path / "r", result("stable"))
    from optuna.storages.journal import JournalFileBackend

    study = optuna.load_study(study_name="s", storage=optuna.storages.JournalStorage(JournalFileBackend(cfg.storage)))
    assert len(study.trials) == 1


def _writer(args):
    url, worker, n = args
    cfg = LedgerConfig(storage=url, study_name="concurrent")
    for i in range(n):
        record_run(cfg, "unused", f"/runs/{worker}/{i}", result("stable", params={"optim.lr": float(worker * 100 + i)}))


@pytest.mark.slow
def test_four_processes_writing_at_once_lose_nothing(tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    with mp.get_context("spawn").Pool(4) as pool:
        pool.map(_writer, [(url, w, 10) for w in range(4)])
    trials = optuna.load_study(study_name="concurrent", storage=url).trials
    assert len(trials) == 40
    assert sorted(t.params["optim.lr"] for t in trials) == sorted(
        float(w * 100 + i) for w in range(4) for i in range(10)
    )
    assert len({t.number for t in trials}) == 40


def test_mask_url_hides_the_password():
    assert mask_url("postgresql://alice:s3cret@db.local:5432/sweeps") == "postgresql://alice:***@db.local:5432/sweeps"
    assert "s3cret" not in mask_url("mysql+pymysql://bob:s3cret@h/db")
    assert mask_url("sqlite:///tmp/ledger.db") == "sqlite:///tmp/ledger.db"


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://ann@db/sweeps?sslpassword=s3cret",
        "postgresql://ann@db/sweeps?sslmode=require&SSLPASSWORD=s3cret",
        "http://mlflow:5000?token=s3cret",
        "https://mlflow/api/2.0?x=1&access_token=s3cret",
        "http://mlflow:5000/?API_KEY=s3cret",
        "mysql+pymysql://bob@h/db?passwd=s3cret",
        "postgresql://ann@db/x?credentials=s3cret",
        "https://store/path?sig=s3cret",
        "postgresql://ann@db/x?pass=s3cret",  # issue 45
        "https://mlflow/api?passphrase=s3cret",
        "postgresql://ann@db/x?sslPassPhrase=s3cret",
    ],
)
def test_a_secret_query_key_is_a_password_and_is_masked(url):
    """issue 33: ?sslpassword= (libpq) and ?token= were neither refused nor masked."""
    assert url_has_password(url)
    masked = mask_url(url)
    assert "s3cret" not in masked and "***" in masked


def test_a_url_without_a_secret_is_left_alone():
    for url in (
        "postgresql://u@h/db?sslmode=require&application_name=x",
        "http://127.0.0.1:5000",
        "http://h?passive=1",
    ):
        assert not url_has_password(url) and mask_url(url).split("?")[0] == url.split("?")[0]


def test_mask_url_hides_a_password_in_the_query_or_with_a_slash():
    assert mask_url("postgresql://ann@db/sweeps?password=s3cret") == "postgresql://ann@db/sweeps?password=***"
    assert mask_url("postgresql://ann:s3/cret@db/sweeps") == "postgresql://ann:***@db/sweeps"
    assert "s3cret" not in mask_url("mysql://ann@h/db?sslmode=require&PASSWORD=s3cret")


@pytest.mark.parametrize(
    "arg,key",
    [
        ("ledger.storage=postgresql://u:s3cret@localhost/db", "ledger.storage"),
        (
            "ledger.storage=postgresql://u@localhost/db?password=s3cret",
            "ledger.storage",
        ),  # not valid grammar, still logged
        ("'ledger.storage=\"postgresql://u@localhost/db?password=s3cret\"'", "ledger.storage"),
        ('ledger={storage:"postgresql://u:s3cret@localhost/db"}', "ledger"),
        ("ledger.storage=postgresql://u:s3/cret@localhost/db", "ledger.storage"),
        ("+ledger.storage=sqlite:///a.db,postgresql://u:s3cret@h/db", "+ledger.storage"),
        # issue 33: libpq's sslpassword, a token, any secret-bearing query key, in any case
        ("ledger.storage=postgresql://u@localhost/db?sslpassword=s3cret", "ledger.storage"),
        ("ledger.storage='postgresql://u@h/db?sslmode=require&SSLPassword=s3cret'", "ledger.storage"),
        ("logger.mlflow.tracking_uri=http://mlflow:5000?token=s3cret", "logger.mlflow.tracking_uri"),
        ("logger.mlflow.tracking_uri='https://h/api?Access_Token=s3cret'", "logger.mlflow.tracking_uri"),
        ("logger.mlflow.tracking_uri=http://h:5000/?api_key=s3cret", "logger.mlflow.tracking_uri"),
        ("ledger.storage=mysql://u@h/db?client_secret=s3cret", "ledger.storage"),
        ("ledger.storage=postgresql://u@h/db?auth_token=s3cret", "ledger.storage"),
    ],
)
def test_every_spelling_of_a_password_on_the_command_line_is_found(arg, key):
    from sweep.__main__ import literal_password_arg

    assert literal_password_arg(["-m", "optim.lr=1e-3", arg]) == key


@pytest.mark.parametrize(
    "arg",
    [
        "ledger.storage=postgresql://u@localhost/db",
        "ledger.storage=${oc.env:SWEEP_LEDGER_URL}",
        "ledger.storage=sqlite:///x.db",
        "ledger.storage=runs/ledger.log",
        "optim.lr=1e-3",
    ],
)
def test_a_storage_without_a_password_is_not_refused(arg):
    from sweep.__main__ import literal_password_arg

    assert literal_password_arg([arg]) is None


PASSWORD_ARGS = [
    "ledger.storage=postgresql://u:s3cret@localhost/db",
    "ledger.storage='postgresql://u@localhost/db?password=s3cret'",
    "ledger.storage=postgresql://u@localhost/db?sslpassword=s3cret",
    "logger.mlflow.tracking_uri=http://mlflow:5000?token=s3cret",
]


@pytest.mark.xdist_group("ledger_refusals")  # the module's `refused` batch, run once: on one worker
@pytest.mark.parametrize("arg", PASSWORD_ARGS)
def test_password_on_the_command_line_is_refused_before_hydra_writes_it(refused, arg):
    proc, tmp_path = refused[arg]
    assert proc.returncode == 2 and "s3cret" not in proc.stdout + proc.stderr
    assert ("MLFLOW_TRACKING_URI" if "logger" in arg else "oc.env") in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


EXPERIMENT_SECRETS = {
    "user:pw@": "ledger:\n  storage: postgresql://me:s3cret@127.0.0.1:9/x\n",
    "?password=": "ledger:\n  storage: postgresql://me@127.0.0.1:9/x?password=s3cret\n",
    "mlflow ?token=": "logger:\n  mlflow:\n    tracking_uri: http://127.0.0.1:9/?token=s3cret\n",
    "?pass=": "ledger:\n  storage: postgresql://me@127.0.0.1:9/x?pass=s3cret\n",
    "a URL in model.kwargs": "model:\n  kwargs:\n    weights: https://me:s3cret@hub/x\n",
    "env_set password": "hydra:\n  job:\n    env_set:\n      MLFLOW_TRACKING_PASSWORD: s3cret\n",
    "a swept URL": "hydra:\n  sweeper:\n    params:\n      ledger.storage: sqlite:///a.db,postgresql://me:s3cret@db/x\n",
}


SECRET_FILES = [(c, False) for c in sorted(EXPERIMENT_SECRETS) if c != "a swept URL"] + [
    ("user:pw@", True),
    ("a swept URL", True),
    ("env_set password", True),
]


def config_file_case(tmp_path: Path, case: str, multirun: bool) -> list[str]:
    """`python -m sweep`'s arguments for EXPERIMENT_SECRETS[case] as an experiment file under tmp_path/mine."""
    (tmp_path / "mine" / "experiment").mkdir(parents=True)
    (tmp_path / "mine" / "experiment" / "leak.yaml").write_text("# @package _global_\n" + EXPERIMENT_SECRETS[case])
    where = [f"hydra.sweep.dir={tmp_path}/s", "optim.lr=1e-3,2e-3", "-m"] if multirun else []
    return [
        "--config-dir",
        str(tmp_path / "mine"),
        "+experiment=leak",
        *FAST,
        "steps=2",
        f"hydra.run.dir={tmp_path}/run",
        *where,
    ]


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict:
    """Every command line of this module that `python -m sweep` refuses before any run (PASSWORD_ARGS, SECRET_FILES),
    each from a directory of its own, each in a fork of one warmed interpreter (conftest.run_cli_refusals: no
    interpreter start-up each): by its arg or (case, multirun), its CompletedProcess and its directory.
    No case may print a secret on its stdout either."""
    dirs = {key: tmp_path_factory.mktemp("refused") for key in [*PASSWORD_ARGS, *SECRET_FILES]}
    argvs = {arg: [arg, f"hydra.run.dir={dirs[arg]}/run"] for arg in PASSWORD_ARGS}
    argvs.update({key: config_file_case(dirs[key], *key) for key in SECRET_FILES})
    procs = run_cli_refusals(*((argv, dirs[key]) for key, argv in argvs.items()))
    return {key: (proc, dirs[key]) for key, proc in zip(argvs, procs)}


@pytest.mark.xdist_group("ledger_refusals")
@pytest.mark.parametrize("case,multirun", SECRET_FILES)
def test_a_secret_in_a_config_file_is_refused_before_hydra_writes_it(refused, case, multirun):
    """issue 45: a password in a --config-dir experiment file was copied in clear into every .hydra/config.yaml
    (only the command line was checked). The composed config is checked too, before any file is written."""
    proc, tmp_path = refused[case, multirun]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "oc.env" in lines[0], proc.stderr[-2000:]
    assert "s3cret" not in proc.stdout + proc.stderr
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and b"s3cret" in p.read_bytes() and "mine" not in p.parts]
    assert not leaked, leaked


@pytest.mark.parametrize(
    "value",
    [
        "postgresql://me:${oc.env:DB_PASSWORD}@127.0.0.1:9/x",
        "postgresql://me@127.0.0.1:9/x?sslpassword=${oc.env:PW,nope}",
        "${oc.env:SWEEP_LEDGER_URL,sqlite:///l.db}",
        "sqlite:///ledger.db",
    ],
)
def test_a_secret_through_the_environment_in_a_config_file_is_fine(value):
    from omegaconf import OmegaConf

    from sweep.config.secrets import literal_secret_keys

    assert literal_secret_keys(OmegaConf.create({"ledger": {"storage": value}})) == []


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """grid(eval_on): the sweep dir of precision fp32,fp16_pure x lr 1e-4,1e-3 at 3 steps (two of them diverge),
    swept in this process once per eval setting for the tests that read it."""
    swept = {}

    def sweep_dir(eval_on: bool) -> Path:
        if eval_on not in swept:
            swept[eval_on] = tmp_path_factory.mktemp(f"grid-eval-{eval_on}")
            multirun_in_process(
                swept[eval_on],
                *SMALL_MODEL,
                "steps=3",
                "precision=fp32,fp16_pure",
                "optim.lr=1e-4,1e-3",
                f"eval.enabled={eval_on}",
            )
        return swept[eval_on]

    return sweep_dir


@pytest.mark.slow
@pytest.mark.xdist_group("ledger_grid")  # the module's `grid` sweeps, run once: on one worker
def test_multirun_fills_the_ledger_in_the_sweep_dir(grid):
    sweep_dir = grid(False)
    trials = only_study(f"sqlite:///{sweep_dir / 'ledger.db'}").trials
    assert len(trials) == 4
    for t in trials:
        on_disk = read_result(sweep_dir / t.user_attrs["run_dir"].rsplit("/", 1)[1])
        assert t.user_attrs["status"] == on_disk["status"]
        assert t.params["precision"] == on_disk["params"]["precision"]
        assert t.params["optim.lr"] == on_disk["params"]["optim.lr"]
        assert t.state is TrialState.COMPLETE
        assert t.system_attrs[CONSTRAINTS_KEY] == ([1.0] if on_disk["status"] == "diverged" else [-1.0])


@pytest.mark.parametrize(
    "args,env",
    [
        (
            ["ledger.storage=${oc.env:SWEEP_LEDGER_URL}", "ledger.lock_timeout_s=2"],
            {"SWEEP_LEDGER_URL": "postgresql://alice@127.0.0.1:9/sweeps?sslpassword=s3cret"},
        ),
        (
            ["logger=mlflow", "logger.mlflow.tracking_uri=${oc.env:MY_URI}", "logger.mlflow.retries=0"],
            {"MY_URI": "http://127.0.0.1:9/?token=s3cret"},
        ),
    ],
    ids=["ledger-sslpassword", "mlflow-token"],
)
def test_a_secret_query_key_from_the_environment_appears_in_no_output_file(tmp_path, args, env):
    """issue 33: a ?sslpassword= or ?token= URL reached .ledger_pending.json, .hydra/, the log, stderr and
    result.json; every place that writes a URL masks it through sweep.run.urls."""
    run_dir = tmp_path / "run"
    proc = sweep_forked(*args, "steps=2", "threads=1", *FAST, f"hydra.run.dir={run_dir}", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "127.0.0.1" in proc.stdout + proc.stderr  # the unreachable server is reported, masked
    assert "s3cret" not in proc.stdout + proc.stderr
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and b"s3cret" in p.read_bytes()]
    assert not leaked, leaked
    assert read_result(run_dir)["status"] == "stable"


@pytest.mark.slow
def test_password_from_the_environment_appears_in_no_output_file(tmp_path):
    """The documented way in: an env interpolation stays unresolved in .hydra/, and errors are masked."""
    run_dir = tmp_path / "run"
    proc = sweep_forked(
        "ledger.storage=${oc.env:SWEEP_LEDGER_URL}",
        "steps=2",
        *FAST,
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        env={"SWEEP_LEDGER_URL": "postgresql://alice:s3cret@127.0.0.1:9/sweeps"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "alice:***@127.0.0.1" in proc.stdout + proc.stderr  # the unreachable ledger is reported, masked
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert "s3cret" not in path.read_text(errors="ignore"), path
    assert "s3cret" not in proc.stdout + proc.stderr
    assert read_result(run_dir)["status"] == "stable"


def test_storage_is_opened_once_per_process_and_url(tmp_path):
    from sweep.search.ledger import open_storage

    a, b = f"sqlite:///{tmp_path / 'a' / 'ledger.db'}", f"sqlite:///{tmp_path / 'b' / 'ledger.db'}"
    assert open_storage(a) is open_storage(a)
    assert open_storage(a) is not open_storage(b)
    assert open_storage(a, heartbeat_s=5, stale_after_s=20) is not open_storage(a)


def test_cached_storage_keeps_two_sweeps_apart_and_sees_other_writers(tmp_path):
    cfg = LedgerConfig()
    for sweep in ("s1", "s2", "s1"):
        record_run(cfg, tmp_path / sweep, tmp_path / sweep / "0", result("stable"))
    url1 = storage_url(cfg, tmp_path / "s1")
    assert len(only_study(url1).trials) == 2
    assert len(only_study(storage_url(cfg, tmp_path / "s2")).trials) == 1
    # Another writer (its own engine, as another process has) adds a trial: the next record sees it.
    optuna.load_study(study_name=str(tmp_path / "s1"), storage=url1).add_trial(optuna.trial.create_trial(value=1.0))
    number = record_run(cfg, tmp_path / "s1", tmp_path / "s1" / "1", result("stable"))
    assert number == 3 and len(only_study(url1).trials) == 4


def test_a_deleted_ledger_file_is_opened_anew(tmp_path):
    cfg = LedgerConfig()
    record_run(cfg, tmp_path, tmp_path / "0", result("stable"))
    (tmp_path / "ledger.db").unlink()  # the sweep dir wiped, then the same sweep again in this process
    record_run(cfg, tmp_path, tmp_path / "0", result("stable"))
    assert len(only_study(storage_url(cfg, tmp_path)).trials) == 1


def test_a_process_keeps_only_its_newest_storages_open(tmp_path, monkeypatch):
    from sweep.search import ledger

    monkeypatch.setattr(ledger, "_KEEP_OPEN", 2)  # the rule, not the product's 8: 3 new SQLite schemas, not 9
    first = ledger.open_storage(f"sqlite:///{tmp_path / 'first.db'}")
    for i in range(ledger._KEEP_OPEN):
        ledger.open_storage(f"sqlite:///{tmp_path / f'{i}.db'}")
    assert len(ledger._OPENED) <= ledger._KEEP_OPEN
    assert ledger.open_storage(f"sqlite:///{tmp_path / 'first.db'}") is not first  # evicted, opened anew


@pytest.mark.parametrize("psycopg3", [False, True])
def test_a_bare_postgresql_url_gets_the_installed_driver(monkeypatch, psycopg3):
    """SQLAlchemy 2.1 reads postgresql:// as psycopg 3; with only psycopg2 installed it must be psycopg2."""
    import importlib.util

    from sqlalchemy import create_engine

    from sweep.report import study
    from sweep.search import ledger

    real = importlib.util.find_spec
    installed = {"psycopg": psycopg3, "psycopg2": True}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if installed.get(name) else real(name, *a)
    )
    handed = []
    monkeypatch.setattr(optuna.storages, "RDBStorage", lambda url, **kw: handed.append(url))
    ledger._open_storage("postgresql://ann:s3cret@db.example:5433/sweeps?sslmode=require", None, None, 30.0)
    ledger._open_storage("postgresql+pg8000://ann@db/sweeps", None, None, 30.0)  # an explicit driver is kept
    study.open_storage("postgresql://ann@db/sweeps")  # python -m sweep.report STORAGE
    expected = "postgresql" if psycopg3 else "postgresql+psycopg2"
    assert handed == [
        f"{expected}://ann:s3cret@db.example:5433/sweeps?sslmode=require",
        "postgresql+pg8000://ann@db/sweeps",
        f"{expected}://ann@db/sweeps",
    ]
    if not psycopg3:
        assert create_engine(handed[0]).dialect.driver == "psycopg2"


def test_a_rerun_cell_marks_its_earlier_trial_superseded_and_the_report_counts_it_once(tmp_path):
    """issue 33: a cell re-run after its result.json was deleted left two trials for one job directory."""
    from sweep.report.study import runs_from_study
    from sweep.search.ledger import SUPERSEDED_ATTR

    sweep_dir = tmp_path / "s"
    grid = ("steps=2", "optim.lr=1e-3,2e-3")
    multirun_in_process(sweep_dir, *SMALL_MODEL, *grid)
    (sweep_dir / "0" / "result.json").unlink()
    multirun_in_process(sweep_dir, *SMALL_MODEL, *grid)  # the resume re-runs cell 0 only
    url = f"sqlite:///{sweep_dir / 'ledger.db'}"
    trials = only_study(url).trials
    assert len(trials) == 3
    by_number = {t.number: t for t in trials}
    (old,) = [t for t in trials if t.user_attrs.get(SUPERSEDED_ATTR) is not None]
    new = by_number[old.user_attrs[SUPERSEDED_ATTR]]
    assert new.number > old.number and new.user_attrs["run_dir"] == old.user_attrs["run_dir"]
    assert old.user_attrs["status"] == "stable" and old.state is TrialState.COMPLETE  # the contract's attrs stand
    runs, _ = runs_from_study(url)
    assert len(runs) == 2 and sorted(runs.run_dir) == sorted({t.user_attrs["run_dir"] for t in trials})


def test_one_study_per_sweep_whatever_the_spelling_of_its_path(tmp_path, monkeypatch):
    """issue 45 (red team, 2): trials recorded late went to a study named by the resolved path and the rest to the
    path as given; a resume under another spelling of the same directory split the study too."""
    import json
    from pathlib import Path

    from sweep.search.pending import mark_pending, record_pending

    cfg, real = LedgerConfig(), tmp_path / "s"
    (tmp_path / "x").mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    spellings = [tmp_path / "x" / ".." / "s", Path("s"), Path("./x/../s"), tmp_path / "link", real]
    for i, sweep_dir in enumerate(spellings):
        record_run(cfg, sweep_dir, real / str(i), result("stable"))
    late = real / "late"  # recorded at the sweep's end (a locked ledger), from another working directory
    late.mkdir()
    (late / "result.json").write_text(json.dumps(result("stable")))
    assert mark_pending(cfg, Path("x/../s"), late, 10.0, "database is locked")
    monkeypatch.chdir(tmp_path / "x")
    assert record_pending(real) == ([late], [])
    url = storage_url(cfg, real)
    assert optuna.get_all_study_names(url) == [str(real)]
    assert len(only_study(url).trials) == len(spellings) + 1


def test_a_study_an_older_version_named_by_the_path_as_given_stays_the_sweeps(tmp_path, monkeypatch):
    """Before the resolved path named the study, the path as given did (`x/../s`, `outputs/...`): a resume, a
    late trial and a report still use that study, whatever the spelling."""
    import json
    from pathlib import Path

    from sweep.search.pending import mark_pending, record_pending

    cfg, real = LedgerConfig(), tmp_path / "s"
    (tmp_path / "x").mkdir()
    monkeypatch.chdir(tmp_path)
    url = storage_url(cfg, real)
    real.mkdir()
    optuna.create_study(study_name="x/../s", storage=url).add_trial(optuna.trial.create_trial(value=1.0))
    record_run(cfg, Path("x/../s"), real / "0", result("stable"))  # resumed as it was started
    record_run(cfg, real, real / "1", result("stable"))  # resumed under another spelling
    (real / "2").mkdir()
    (real / "2" / "result.json").write_text(json.dumps(result("stable")))
    assert mark_pending(cfg, Path("x/../s"), real / "2", 10.0, "database is locked")
    monkeypatch.chdir(tmp_path / "x")  # recorded late from elsewhere: the marker says how the sweep was spelled
    assert record_pending(real) == ([real / "2"], [])
    assert optuna.get_all_study_names(url) == ["x/../s"]
    assert len(only_study(url).trials) == 4


def test_a_sweep_moved_or_copied_with_its_own_ledger_keeps_its_study(tmp_path):
    """The study is named by the sweep's resolved path; a copy of the directory (its ledger.db inside) is still
    that study's sweep: a later trial, the answer of `sweep.confirm`, `sweep.diagnose` or `sweep.report --write`
    go there (before: existing_study found none and the answer was recorded nowhere, without a word). A ledger
    elsewhere (ledger.storage) is shared by sweeps: there the copy's name stays its own path."""
    import shutil

    from sweep.search.answer import existing_study

    cfg, real, copy = LedgerConfig(), tmp_path / "s", tmp_path / "copy"
    record_run(cfg, real, real / "0", result("stable"))
    shutil.copytree(real, copy)
    study = existing_study(cfg, copy, time.monotonic() + 5)
    assert study is not None and study.study_name == str(real.resolve())
    record_run(cfg, copy, copy / "1", result("stable"))
    url = storage_url(cfg, copy)
    assert optuna.get_all_study_names(url) == [str(real.resolve())] and len(only_study(url).trials) == 2
    shared = LedgerConfig(storage=f"sqlite:///{tmp_path / 'shared.db'}")
    record_run(shared, real, real / "0", result("stable"))
    assert existing_study(shared, copy, time.monotonic() + 5) is None


def test_every_diverged_verdict_is_infeasible_whatever_its_name():
    """Feasibility follows the status: each verdict of today, and those a later version adds as status diverged
    (slow_divergence, no_progress), is an infeasible COMPLETE trial with the penalty, never NaN."""
    from sweep.config import Verdict
    from sweep.search.ledger import INFEASIBLE, penalty, trial_outcome

    for verdict in [*map(str, Verdict), "slow_divergence", "no_progress"]:
        r = result("diverged", verdict=verdict, first_bad_step=3, eval_loss=0.2)
        assert trial_outcome(r, 10.0) == (TrialState.COMPLETE, penalty(r, 10.0), (INFEASIBLE,)), verdict


@pytest.mark.xdist_group("ledger_grid")
@pytest.mark.parametrize("eval_on", [True, False])
def test_a_trials_value_is_the_quality_number_the_recommendation_compares_its_run_by(grid, eval_on):
    """One rule (sweep.run.results.quality_key) for a trial's value and the report's quality column: the eval
    loss where the runs have one, else the final training loss; a diverged run is infeasible."""
    from sweep.report.noise import quality_column
    from sweep.report.runs import runs_from_dirs
    from sweep.report.study import runs_from_study
    from sweep.search.ledger import INFEASIBLE

    tmp_path = grid(eval_on)
    runs = runs_from_dirs(tmp_path)
    column = quality_column(runs)
    assert column == ("eval_loss" if eval_on else "final_loss")
    assert sorted(runs.status) == ["diverged", "diverged", "stable", "stable"]
    url = storage_url(LedgerConfig(), tmp_path)
    trials = {t.user_attrs["run_dir"]: t for t in only_study(url).trials}
    for r in runs.to_dict("records"):
        trial = trials[r["run_dir"]]
        if r["status"] == "stable":
            assert trial.value == r[column] and trial.value != r["eval_loss" if not eval_on else "final_loss"]
        else:
            assert trial.system_attrs[CONSTRAINTS_KEY] == [INFEASIBLE]
    from_study, _ = runs_from_study(url)
    assert quality_column(from_study) == column
    assert from_study[column].equals(runs[column])  # the report from the study compares the same numbers


@pytest.mark.parametrize("journal", [True, False])
def test_a_finished_trial_cannot_change_so_the_study_carries_a_later_diagnosis(tmp_path, journal):
    """Optuna's API refuses to change a finished trial in either storage (UpdateFinishedTrialError); a diagnosis
    made after the trial was recorded goes into the study's `diagnosed`, which the report from the study applies.
    An RDB storage also gets the trial's own `mechanism` rewritten (through Optuna's models), a journal cannot."""
    from optuna.exceptions import UpdateFinishedTrialError

    from sweep.report.study import runs_from_study
    from sweep.search.answer import record_diagnosed

    cfg = LedgerConfig(storage=str(tmp_path / "ledger.log")) if journal else LedgerConfig()
    spike = result("diverged", verdict="loss_spike", first_bad_step=4, mechanism={"name": "unexplained"})
    record_run(cfg, tmp_path, tmp_path / "0", result("stable"))
    number = record_run(cfg, tmp_path, tmp_path / "1", spike)
    study = only_study(storage_url(cfg, tmp_path) if not journal else open_journal(cfg.storage))
    with pytest.raises(UpdateFinishedTrialError):
        study._storage.set_trial_user_attr(study.trials[number]._trial_id, "mechanism", "lr_too_high")
    assert record_diagnosed(cfg, tmp_path, tmp_path / "1", "lr_too_high", "unexplained") is None
    study = only_study(storage_url(cfg, tmp_path) if not journal else open_journal(cfg.storage))
    assert study.user_attrs["diagnosed"] == {str(number): "lr_too_high"}
    attrs = study.trials[number].user_attrs
    assert attrs["mechanism"] == ("unexplained" if journal else "lr_too_high")
    assert attrs.get("mechanism_recorded") == (None if journal else "unexplained")
    runs, _ = runs_from_study(cfg.storage or storage_url(cfg, tmp_path))
    assert runs.mechanism.fillna("-").tolist() == ["-", "lr_too_high"]
    assert record_diagnosed(cfg, tmp_path, tmp_path / "never-recorded", "kernel", None) is None  # nothing to write


def open_journal(path):
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(path))
