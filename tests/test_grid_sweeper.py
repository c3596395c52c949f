"""The grid sweeper composes every cell once: its cell check's config is the one the launcher runs."""

from __future__ import annotations

import json
import pickle

import pytest
from hydra._internal.config_loader_impl import ConfigLoaderImpl

from .conftest import multirun_in_process


def test_each_cell_is_composed_once_and_runs_its_own_overrides(tmp_path, monkeypatch):
    composed = []
    real = ConfigLoaderImpl.load_sweep_config

    def counting(self, master, overrides):
        composed.append(tuple(overrides))
        return real(self, master, overrides)

    monkeypatch.setattr(ConfigLoaderImpl, "load_sweep_config", counting)
    multirun_in_process(tmp_path, "optim.lr=1e-4,1e-3", "seed=3", "steps=1", "ledger.enabled=false")
    assert len(composed) == 2  # the cell check's two; the launcher composed nothing again
    assert sorted(o for cell in composed for o in cell if o.startswith("optim.lr=")) == [
        "optim.lr=0.0001",
        "optim.lr=0.001",
    ]
    params = sorted(json.loads((tmp_path / str(i) / "result.json").read_text())["params"]["optim.lr"] for i in range(2))
    assert params == [1e-4, 1e-3]
    assert [json.loads((tmp_path / str(i) / "result.json").read_text())["seed"] for i in range(2)] == [3, 3]


def test_the_loader_ships_to_workers_without_its_kept_configs():
    from hydra_plugins.dit_sweep.grid_sweeper import ComposedOnce

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

    from .conftest import multirun_in_process

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

    from .conftest import multirun_in_process

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
