"""The Optuna sweeper composes each trial's config once (sweep/search/composed.py), as the grid composes each cell
once (tests/test_grid_sweeper.py): its batch check composes a trial, the launcher runs that config."""

from __future__ import annotations

from hydra._internal.config_loader_impl import ConfigLoaderImpl

from .conftest import multirun_in_process, read_result


def test_each_trial_of_an_optuna_sweep_is_composed_once_and_runs_its_own_overrides(tmp_path, monkeypatch):
    composed = []
    real = ConfigLoaderImpl.load_sweep_config

    def counting(self, master, overrides):
        composed.append(tuple(overrides))
        return real(self, master, overrides)

    monkeypatch.setattr(ConfigLoaderImpl, "load_sweep_config", counting)
    axes = ["hydra/sweeper=optuna_sweep", "hydra.sweeper.sampler.name=grid", "optim.lr=choice(1e-4,1e-3)"]
    multirun_in_process(tmp_path, *axes, "hydra.sweeper.n_jobs=2", "seed=3", "steps=1")
    # (the sweep's job-dir check composes two configs without the swept value: OptunaSweeperImpl._check_trial_dirs)
    trials = sorted(o for cell in composed for o in cell if o.startswith("optim.lr="))
    assert trials == ["optim.lr=0.0001", "optim.lr=0.001"], composed  # once each: the launcher composed none again
    lrs = sorted(read_result(tmp_path / str(i))["params"]["optim.lr"] for i in range(2))
    assert lrs == [1e-4, 1e-3] and [read_result(tmp_path / str(i))["seed"] for i in range(2)] == [3, 3]
