"""A single run's directory holds one run (issue 33, item 2): the same config reruns it, another config or a
sweep's root is refused before anything is written."""

from __future__ import annotations

import pytest

from sweep.callbacks import check_run_dir
from sweep.config import ConfigError

from .conftest import FAST, hydra_cfg, run_cli_refusals

RUN = ["-m", "sweep", *FAST, "threads=1"]  # python -m sweep, one small run


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, tuple]:
    """Three `python -m sweep` single runs refused before they train, each in a fork of one warmed interpreter
    (run_cli_refusals: no interpreter start-up each), by name: its CompletedProcess and its hydra.run.dir.
    `other`: into the directory of a finished 2-step run at lr 1e-3 (made in this process, as `python -m sweep`
    makes it: run_job_in_process), at lr 3e-2; `bad`: a typo'd value (optim.lr=-1); `sweep_root`: into the root
    of a finished sweep (multirun_in_process)."""
    from .cli_fuzz import run_job_in_process
    from .conftest import multirun_in_process

    root = tmp_path_factory.mktemp("refused")
    run_dir, sweep_dir = root / "run", root / "s"
    assert run_job_in_process(run_dir, ["steps=2", "optim.lr=1e-3"]) == 0
    multirun_in_process(sweep_dir, "steps=2", "optim.lr=1e-3")
    cases = {
        "other": (["steps=2", "optim.lr=3e-2", "ledger.enabled=false"], run_dir),
        "bad": (["steps=2", "optim.lr=-1", "ledger.enabled=false"], root / "bad"),
        "sweep_root": (["steps=2"], sweep_dir),
    }
    before = {"result": (run_dir / "result.json").read_text(), "trials": sorted(p.name for p in sweep_dir.iterdir())}
    argvs = [[*RUN[2:], *args, f"hydra.run.dir={d}"] for args, d in cases.values()]
    procs = run_cli_refusals(*((argv, root) for argv in argvs))
    return {name: (proc, d) for (name, (_, d)), proc in zip(cases.items(), procs)} | {"before": before}


@pytest.mark.xdist_group("run_dir_refusals")  # the module's `refused` batch, run once: on one worker
def test_a_run_dir_holding_a_run_of_another_config_is_refused_and_the_same_config_reruns(refused):
    other, run_dir = refused["other"]
    lines = [ln for ln in other.stderr.splitlines() if ln.strip()]
    assert other.returncode == 2 and len(lines) == 1, other.stderr[-2000:]
    assert "hydra.run.dir" in lines[0] and "optim.lr=0.001 there, 0.03 here" in lines[0], lines
    assert (run_dir / "result.json").read_text() == refused["before"]["result"]

    # The same config again (threads/progress/log_every/logger aside, as for a sweep) passes: a rerun.
    check_run_dir(
        hydra_cfg("steps=2", "optim.lr=0.001", "ledger.enabled=false", "threads=2", f"hydra.run.dir={run_dir}")
    )
    # Resuming that run from its own checkpoint is the same run too.
    check_run_dir(
        hydra_cfg(
            "steps=2",
            "optim.lr=0.001",
            "ledger.enabled=false",
            f"checkpoint.resume_from={run_dir}",
            f"hydra.run.dir={run_dir}",
        )
    )
    with pytest.raises(ConfigError, match="optim.lr=0.001 there, 0.03 here"):
        check_run_dir(hydra_cfg("steps=2", "optim.lr=3e-2", "ledger.enabled=false", f"hydra.run.dir={run_dir}"))


@pytest.mark.xdist_group("run_dir_refusals")  # the module's `refused` batch, run once: on one worker
def test_a_run_refused_at_composition_leaves_its_dir_to_the_corrected_run(refused):
    """Hydra writes .hydra/ before the run's own config check; a run refused there (a typo'd value) trained nothing,
    so the corrected command into the same hydra.run.dir runs (it was refused as "a run of another config")."""
    bad, run_dir = refused["bad"]
    assert bad.returncode == 2 and (run_dir / ".hydra" / "config.yaml").is_file(), bad.stderr[-2000:]
    check_run_dir(hydra_cfg("steps=2", "optim.lr=1e-3", "ledger.enabled=false", f"hydra.run.dir={run_dir}"))


@pytest.mark.parametrize("mark", ["multirun.yaml", ".sweep.lock", "0/.hydra/overrides.yaml"])
def test_a_sweep_root_is_refused_as_a_run_dir(tmp_path, mark):
    sweep_dir = tmp_path / "s"
    (sweep_dir / mark).parent.mkdir(parents=True, exist_ok=True)
    (sweep_dir / mark).write_text("- optim.lr=0.01\n")
    with pytest.raises(ConfigError, match=r"^hydra.run.dir: .* is the directory of a sweep"):
        check_run_dir(hydra_cfg("steps=2", f"hydra.run.dir={sweep_dir}"))


@pytest.mark.xdist_group("run_dir_refusals")  # the module's `refused` batch, run once: on one worker
def test_a_sweep_root_as_run_dir_is_one_line_and_writes_nothing(refused):
    proc, sweep_dir = refused["sweep_root"]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "directory of a sweep" in lines[0], proc.stderr[-2000:]
    trials = refused["before"]["trials"]
    assert not (sweep_dir / "result.json").exists() and sorted(p.name for p in sweep_dir.iterdir()) == trials


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory):
    """A finished 1-cell grid (its root holds multirun.yaml and .sweep.lock, its job dir 0/)."""
    from .conftest import multirun_in_process

    sweep_dir = tmp_path_factory.mktemp("finished") / "s"
    multirun_in_process(sweep_dir, "steps=1", "optim.lr=1e-3", "ledger.enabled=false")
    return sweep_dir


@pytest.mark.parametrize("inside", ["7", "0", "0/deeper", "summary/x"])
def test_a_single_run_inside_a_sweeps_tree_is_refused(finished_sweep, inside):
    """issue 45: a single run into <sweep>/7 was accepted, and the sweep's report then counted it as one of its
    runs. Any directory below a sweep's root (found by walking up for SWEEP_MARKS) is refused."""
    with pytest.raises(ConfigError, match=r"^hydra.run.dir: .* is inside the sweep .*finished.*/s "):
        check_run_dir(hydra_cfg("steps=2", f"hydra.run.dir={finished_sweep / inside}"))


def test_a_sweep_inside_another_sweeps_dir_is_refused_before_anything_is_written(finished_sweep, capsys):
    """issue 45: hydra.sweep.dir=<finished sweep>/sub ran, and the parent's report counted its runs."""
    from .conftest import multirun_in_process

    inner = finished_sweep / "sub"
    with pytest.raises(SystemExit) as exit_:
        multirun_in_process(inner, "steps=1", "optim.lr=2e-3", "ledger.enabled=false")
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert exit_.value.code == 2 and len(err) == 1, err
    assert "hydra.sweep.dir" in err[0] and "is inside the sweep" in err[0] and str(finished_sweep) in err[0], err
    assert not inner.exists()


def test_a_run_or_sweep_beside_a_sweep_is_fine(finished_sweep, tmp_path):
    """Siblings of a sweep, and the sweep's own dir (a resume), are not inside another sweep."""
    check_run_dir(hydra_cfg("steps=2", f"hydra.run.dir={finished_sweep.parent / 'run'}"))
    from sweep.callbacks import enclosing_sweep

    assert enclosing_sweep(finished_sweep) is None and enclosing_sweep(finished_sweep.parent / "t" / "0") is None
    assert enclosing_sweep(finished_sweep / "3") == (finished_sweep, "multirun.yaml")


@pytest.mark.parametrize("where", ["run", "."])
def test_a_sweep_into_a_dir_holding_a_single_run_says_so(tmp_path, capsys, where):
    """issue 45: a sweep refused beside a single run was told about "a sweep whose multirun.yaml is missing"."""
    from .cli_fuzz import run_job_in_process  # `python -m sweep` in this process: no interpreter start-up
    from .conftest import multirun_in_process

    assert run_job_in_process(tmp_path / "run", ["steps=1"]) == 0  # ledger.enabled=false, as the command had
    with pytest.raises(SystemExit):
        multirun_in_process(tmp_path / where, "steps=1", "optim.lr=2e-3", "ledger.enabled=false")
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "holds a single run" in err[0] and "multirun.yaml" not in err[0], err
    assert str(tmp_path / "run") in err[0], err


def test_an_in_process_multirun_gives_the_process_logging_back(tmp_path, capsys):
    """The test above failed in CI when it ran after another in-process multirun on its worker: Hydra's logging
    configuration had left root a console handler on that test's closed capsys stream, and the first log line here
    printed "--- Logging error ---" into stderr. multirun_in_process now gives root's handlers and level back (a
    single run in process, run_job_in_process, configures no logging: with_log_configuration=False)."""
    import logging

    from .conftest import multirun_in_process

    root = logging.getLogger()
    before = (root.handlers[:], root.level)
    multirun_in_process(tmp_path / "s", "steps=1", "ledger.enabled=false")
    assert (root.handlers, root.level) == before
    capsys.readouterr()  # the run's lines went to this test's streams while it ran
    logging.getLogger("sweep").warning("after the multirun")
    assert "Logging error" not in capsys.readouterr().err


def test_a_sweep_into_the_parent_of_a_sweep_names_that_sweep(finished_sweep, capsys):
    from .conftest import multirun_in_process

    with pytest.raises(SystemExit):
        multirun_in_process(finished_sweep.parent, "steps=1", "optim.lr=2e-3", "ledger.enabled=false")
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and f"holds the sweep {finished_sweep}" in err[0] and "missing" not in err[0], err
