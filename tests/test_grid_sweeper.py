"""The grid sweeper composes every cell once: its cell check's config is the one the launcher runs."""
from __future__ import annotations

import json
import pickle

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
    assert sorted(o for cell in composed for o in cell if o.startswith("optim.lr=")) == ["optim.lr=0.0001", "optim.lr=0.001"]
    params = sorted(json.loads((tmp_path / str(i) / "result.json").read_text())["params"]["optim.lr"] for i in range(2))
    assert params == [1e-4, 1e-3]
    assert [json.loads((tmp_path / str(i) / "result.json").read_text())["seed"] for i in range(2)] == [3, 3]


def test_the_loader_ships_to_workers_without_its_kept_configs():
    from hydra_plugins.dit_sweep.grid_sweeper import ComposedOnce

    loader = ComposedOnce(["the real loader"])
    loader.kept[("a=1",)] = "a composed config"
    shipped = pickle.loads(pickle.dumps(loader))
    assert shipped.kept == {} and shipped.loader == ["the real loader"] and shipped.count("the real loader") == 1
