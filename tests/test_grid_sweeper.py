"""The grid sweeper composes every cell once (and the Optuna sweeper every trial): its check's config is the one the
launcher runs."""

from __future__ import annotations

import json
import os
import pickle

import pytest
from hydra._internal.config_loader_impl import ConfigLoaderImpl

from .conftest import FAST, multirun_in_process, read_result, read_results, run_cli, sweep_forked


@pytest.fixture
def compositions(monkeypatch) -> list[tuple]:
    """The overrides of every job config Hydra's loader composes during the test, in order."""
    composed = []
    real = ConfigLoaderImpl.load_sweep_config

    def counting(self, master, overrides):
        composed.append(tuple(overrides))
        return real(self, master, overrides)

    monkeypatch.setattr(ConfigLoaderImpl, "load_sweep_config", counting)
    return composed


@pytest.mark.parametrize("batches", [[], ["hydra.sweeper.max_batch_size=1"]])
def test_each_cell_is_composed_once_and_runs_its_own_overrides(tmp_path, compositions, batches):
    """In batches too: the later batches' job dirs are checked before the first run, their configs kept."""
    multirun_in_process(tmp_path, "optim.lr=1e-4,1e-3", "seed=3", "steps=1", "ledger.enabled=false", *batches)
    assert len(compositions) == 2  # the cell check's two; the launcher composed nothing again
    assert sorted(o for cell in compositions for o in cell if o.startswith("optim.lr=")) == [
        "optim.lr=0.0001",
        "optim.lr=0.001",
    ]
    params = sorted(read_result(tmp_path / str(i))["params"]["optim.lr"] for i in range(2))
    assert params == [1e-4, 1e-3]
    assert [read_result(tmp_path / str(i))["seed"] for i in range(2)] == [3, 3]


def test_each_trial_of_an_optuna_sweep_is_composed_once_and_runs_its_own_overrides(tmp_path, compositions):
    """The Optuna sweeper's batch check composes a trial and the launcher runs that config (sweep/search/composed.py).
    Its job-dir check composes two configs without the swept value first (OptunaSweeperImpl._check_trial_dirs)."""
    axes = ["hydra/sweeper=optuna_sweep", "hydra.sweeper.sampler.name=grid", "optim.lr=choice(1e-4,1e-3)"]
    multirun_in_process(tmp_path, *axes, "hydra.sweeper.n_jobs=2", "seed=3", "steps=1")
    trials = sorted(o for cell in compositions for o in cell if o.startswith("optim.lr="))
    assert trials == ["optim.lr=0.0001", "optim.lr=0.001"], compositions  # once each
    lrs = sorted(read_result(tmp_path / str(i))["params"]["optim.lr"] for i in range(2))
    assert lrs == [1e-4, 1e-3] and [read_result(tmp_path / str(i))["seed"] for i in range(2)] == [3, 3]


def test_the_loader_ships_to_workers_without_its_kept_configs():
    from sweep.search.composed import ComposedOnce

    loader = ComposedOnce(["the real loader"])
    loader.kept[("a=1",)] = "a composed config"
    shipped = pickle.loads(pickle.dumps(loader))
    assert shipped.kept == {} and shipped.loader == ["the real loader"] and shipped.count("the real loader") == 1


def test_a_sweep_dir_holding_another_sweep_is_refused_before_any_run(tmp_path, capsys):
    """Two sweeps in one hydra.sweep.dir overwrote each other's <n>/result.json; the same command again
    (a resume) still runs there, a different one is one line and exit 2, whether the other sweep has
    started a run there or is still starting (live)."""
    import fcntl
    import os

    sweep_dir = tmp_path / "s"
    multirun_in_process(sweep_dir, "steps=2", "optim.lr=1e-4")
    first = (sweep_dir / "0" / "result.json").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        multirun_in_process(sweep_dir, "steps=2", "optim.lr=1e-3")
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hydra.sweep.dir" in err[0] and "optim.lr=1e-4" in err[0], err
    assert (sweep_dir / "0" / "result.json").read_text() == first and not (sweep_dir / "1").exists()

    multirun_in_process(sweep_dir, "steps=2", "optim.lr=1e-4", "threads=1")  # the same sweep: resumes
    # Another sweep, live but with no job directory yet (two sweeps started at once).
    other = tmp_path / "t"
    other.mkdir()
    (other / "multirun.yaml").write_text("hydra:\n  overrides:\n    task: [optim.lr=1e-2]\n")
    fd = os.open(other / ".sweep.alive", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        with pytest.raises(SystemExit):
            multirun_in_process(other, "steps=2", "optim.lr=1e-3")
    finally:
        os.close(fd)
    assert not (other / "0").exists()
    multirun_in_process(other, "steps=2", "optim.lr=1e-3")  # it died before any run: the directory is free
    assert (other / "0" / "result.json").is_file()


@pytest.mark.parametrize("saved", [None, "hydra: [unclosed\n", "- just a list\n"])
def test_a_sweep_dir_with_runs_but_no_readable_multirun_yaml_is_refused(tmp_path, capsys, saved):
    """Runs whose multirun.yaml is missing or damaged belong to a sweep no one can name: one line, exit 2,
    before any run overwrites them (the report reads run directories only and does not need the file)."""
    from sweep.report.runs import runs_from_dirs

    sweep_dir = tmp_path / "s"
    (sweep_dir / "0" / ".hydra").mkdir(parents=True)
    (sweep_dir / "0" / ".hydra" / "overrides.yaml").write_text("- optim.lr=0.01\n")
    if saved is not None:
        (sweep_dir / "multirun.yaml").write_text(saved)
    with pytest.raises(SystemExit) as exit_:
        multirun_in_process(sweep_dir, "steps=2", "optim.lr=1e-3")
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "multirun.yaml" in err[0] and "Traceback" not in err[0], err
    assert not (sweep_dir / "0" / "result.json").exists()
    assert list(runs_from_dirs(sweep_dir, starting_s=0).status) == ["interrupted"]


_AT_ONCE = """
import os, sys, time
from pathlib import Path
barrier = Path(sys.argv[1])
sys.argv = ["sweep", *sys.argv[2:]]
from sweep.__main__ import main  # the heavy imports first, so that every process reaches the claim at once
(barrier / f"ready.{os.getpid()}").touch()
while not (barrier / "go").exists():
    time.sleep(0.01)
time.sleep(max(0.0, float((barrier / "go").read_text()) - time.time()))
main()
"""


def test_sweeps_started_at_the_same_moment_into_one_new_dir_run_one(tmp_path):
    """Two of five sweeps started at once into one new sweep dir both ran (issue 33): each saw no
    multirun.yaml yet. Now the claim names its sweep before the directory's lock is let go: exactly one runs,
    the others exit 2 with one line, and the ledger holds one trial per job directory."""
    import sqlite3
    import time

    barrier = tmp_path / "barrier"
    barrier.mkdir()
    sweep_dir = tmp_path / "s"
    base = ["-m", *FAST, "threads=1", "steps=2", f"hydra.sweep.dir={sweep_dir}", "optim.lr=1e-3,2e-3"]
    commands = [base, base, [*base, "seed=1"]]  # the same grid twice, and another sweep
    procs = [
        run_cli("-c", _AT_ONCE, str(barrier), *c, cwd=tmp_path, env={"HYDRA_FULL_ERROR": None}, background=True)
        for c in commands
    ]
    deadline = time.time() + 120
    while len(list(barrier.glob("ready.*"))) < len(procs) and time.time() < deadline:
        time.sleep(0.05)
    (barrier / "go").write_text(str(time.time() + 0.3))
    outs = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2, 2], [(p.returncode, err[-1500:]) for p, (_, err) in zip(procs, outs)]
    for p, (_, err) in zip(procs, outs):
        if p.returncode == 2:
            lines = [ln for ln in err.splitlines() if ln.strip()]
            assert len(lines) == 1 and "hydra.sweep.dir" in lines[0] and "in use" in lines[0], err
    con = sqlite3.connect(sweep_dir / "ledger.db")
    try:
        dirs = [
            json.loads(v) for (v,) in con.execute("select value_json from trial_user_attributes where key='run_dir'")
        ]
    finally:
        con.close()
    assert sorted(dirs) == sorted(set(dirs)) and len(dirs) == 2, dirs
    assert sorted(read_result(sweep_dir / str(i))["status"] for i in range(2)) == ["stable", "stable"]


def test_a_live_claim_without_multirun_yaml_refuses_another_sweep(tmp_path, capsys):
    """The race above, staged: a live sweep that has claimed the directory but written nothing else yet."""
    import fcntl

    sweep_dir = tmp_path / "s"
    sweep_dir.mkdir()
    fd = os.open(sweep_dir / ".sweep.alive", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        with pytest.raises(SystemExit) as exit_:
            multirun_in_process(sweep_dir, "steps=2", "optim.lr=1e-3", "ledger.enabled=false")
    finally:
        os.close(fd)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "still running or starting" in err[0], err
    assert not (sweep_dir / "0").exists()


@pytest.mark.parametrize(
    "axis",
    ["optim.lr=1e-3,1e-3,3e-2", "optim.lr=1e-3,0.001", "precision=fp32,bf16_amp,fp32", "seed=1,1.0"],
)
def test_a_repeated_value_in_a_sweep_axis_is_refused_before_any_run(tmp_path, axis):
    """issue 33: `optim.lr=1e-3,1e-3,3e-2` ran one cell twice with the same seed, and the tables counted it
    as "2 replicates" with zero spread. Values are compared after parsing: 1e-3 and 0.001 are one value."""
    from sweep.config import ConfigError

    with pytest.raises(ConfigError, match=r"is listed twice in the sweep .* not a replicate"):
        multirun_in_process(tmp_path / "s", "steps=2", "ledger.enabled=false", axis)
    assert not list((tmp_path / "s").glob("*/result.json"))


def test_a_repeated_choice_in_an_optuna_sweep_is_refused(tmp_path):
    from sweep.config import ConfigError

    with pytest.raises(ConfigError, match=r"optim.lr: the value .* is listed twice"):
        multirun_in_process(
            tmp_path / "s",
            "hydra/sweeper=optuna_sweep",
            "hydra.sweeper.sampler.name=grid",
            "optim.lr=choice(1e-3,0.001)",
            "steps=2",
        )


def test_a_repeated_value_is_one_line_and_exit_2(tmp_path):
    proc = sweep_forked("-m", *FAST, "optim.lr=1e-3,1e-3,3e-2", f"hydra.sweep.dir={tmp_path}/s", cwd=tmp_path)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "optim.lr: the value 0.001 is listed twice" in lines[0], (
        proc.stderr
    )
    assert not list((tmp_path / "s").glob("*/result.json"))


def test_a_single_value_replaces_a_params_axis_in_the_grid(tmp_path):
    """Hydra's grid replaces an axis of hydra.sweeper.params by a single value on the command line (the frontier
    search, which ignored it, refuses it instead: test_ladder.py)."""
    one = ("precision=fp32", "optim.lr=5e-4", "attention=math")  # each replaces a demo axis (4, 3 and 2 values)
    multirun_in_process(tmp_path / "s", "+experiment=demo", *one, "steps=1", "ledger.enabled=false")
    results = read_results(tmp_path / "s")
    assert len(results) == 2 and sorted(r["seed"] for r in results) == [0, 1]  # the demo's 2 replicates of one cell
    assert all((r["params"]["precision"], r["params"]["optim.lr"]) == ("fp32", 5e-4) for r in results)


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["optim.lr=1e-3,2e-3", "replicates=2", "hydra.sweep.subdir=lr${optim.lr}"], "seed=0"),
        (["optim.lr=1e-3,2e-3", "hydra.sweep.subdir=same"], "optim.lr=0.002"),
        (["optim.lr=1e-3,2e-3", "hydra.sweep.max_batch_size=1", "hydra.sweep.subdir=one"], "optim.lr=0.001"),
    ],
)
def test_cells_that_share_a_job_dir_are_refused_before_any_run(tmp_path, overrides, named):
    """issue 45: `hydra.sweep.subdir=lr${optim.lr}` with replicates=2 ran 4 cells into 2 directories, each
    overwriting the other's result.json; the summary said "2 runs". Every cell's job dir is now computed first,
    and two cells with one dir are one line naming both cells and the key."""
    from sweep.config import ConfigError

    overrides = [o.replace("hydra.sweep.max_batch_size", "hydra.sweeper.max_batch_size") for o in overrides]
    with pytest.raises(ConfigError) as err:
        multirun_in_process(tmp_path / "s", "steps=2", "ledger.enabled=false", *overrides)
    line = str(err.value)
    assert line.startswith("hydra.sweep.subdir: ") and "share the job directory" in line, line
    assert named in line and "\n" not in line, line
    assert not list((tmp_path / "s").rglob("result.json"))


@pytest.mark.parametrize("subdir", ["../out${hydra.job.num}", "{tmp}/elsewhere${hydra.job.num}"])
def test_a_job_dir_outside_the_sweep_dir_is_refused(tmp_path, subdir):
    """A subdir that leaves the sweep dir puts runs where its summary, report and resume never look."""
    from sweep.config import ConfigError

    subdir = subdir.replace("{tmp}", str(tmp_path))
    with pytest.raises(ConfigError, match=r"^hydra.sweep.subdir: .* outside the sweep directory"):
        multirun_in_process(
            tmp_path / "s", "steps=2", "ledger.enabled=false", "optim.lr=1e-3", f"hydra.sweep.subdir={subdir}"
        )
    assert not list(tmp_path.rglob("result.json"))


def test_a_subdir_that_tells_the_cells_apart_runs(tmp_path):
    multirun_in_process(
        tmp_path / "s", "steps=1", "ledger.enabled=false", "optim.lr=1e-3,2e-3", "hydra.sweep.subdir=lr${optim.lr}"
    )
    assert sorted(p.parent.name for p in (tmp_path / "s").glob("*/result.json")) == ["lr0.001", "lr0.002"]


@pytest.mark.parametrize("subdir", ["lr${optim.lr}", "fixed"])
def test_an_optuna_subdir_without_the_trial_number_is_refused(tmp_path, subdir):
    """The Optuna sweeper numbers job directories by trial: a subdir that does not use the number gives two trials
    of one lr (replicates, a resumed study, a sampler that repeats a value) one directory."""
    from sweep.config import ConfigError

    with pytest.raises(ConfigError, match=r"^hydra.sweep.subdir: .*\$\{hydra.job.num\}"):
        multirun_in_process(
            tmp_path / "s",
            "hydra/sweeper=optuna_sweep",
            "hydra.sweeper.sampler.name=grid",
            "optim.lr=choice(1e-3,2e-3)",
            "replicates=2",
            "steps=2",
            f"hydra.sweep.subdir={subdir}",
        )
    assert not list(tmp_path.rglob("result.json"))


def test_an_optuna_subdir_of_the_override_dirname_runs(tmp_path):
    """${hydra.job.override_dirname} holds each job's ledger.trial_number: two trials of one lr get two dirs."""
    multirun_in_process(
        tmp_path / "s",
        "hydra/sweeper=optuna_sweep",
        "hydra.sweeper.sampler.name=grid",
        "optim.lr=choice(1e-3)",
        "replicates=2",
        "steps=1",
        "hydra.sweep.subdir=${hydra.job.override_dirname}",
    )
    assert len(list((tmp_path / "s").glob("*/result.json"))) == 2


@pytest.mark.parametrize(
    "setting,message",
    [
        ({"max_batch_size": 0}, r"^hydra.sweeper.max_batch_size: must be >= 1 \(or null: one batch\), got 0$"),
        ({"mode": "bisect"}, r"^hydra.sweeper.mode: must be grid or frontier, got 'bisect'$"),
    ],
)
def test_bad_grid_sweeper_settings_are_config_errors(setting, message):
    """hydra.sweeper.max_batch_size=0 was Hydra's AssertionError, a traceback with status 1."""
    from hydra_plugins.dit_sweep.grid_sweeper import GridSweeper
    from sweep.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        GridSweeper(**setting)
