"""sweep/config/compose_speed.py: compositions give the same configs with its two speed-ups as without them."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import hydra
import pytest
import yaml
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from sweep.config import compose_memo, compose_speed

from .conftest import CONF_DIR, FAST, compose_cfg, hydra_cfg

HYDRA_CONF = Path(hydra.__file__).parent / "conf"


@pytest.fixture
def hydra_as_shipped():
    """Hydra's and OmegaConf's own behaviour inside the `with`, the speed-ups again after."""

    class Shipped:
        def __enter__(self):
            compose_speed.uninstall()

        def __exit__(self, *exc):
            compose_speed.install()

    yield Shipped()
    compose_speed.install()


def test_every_yaml_file_loads_to_the_config_omegaconf_loads(hydra_as_shipped):
    files = sorted([*Path(CONF_DIR).rglob("*.yaml"), *HYDRA_CONF.rglob("*.yaml")])
    assert len(files) > 50
    fast = [OmegaConf.to_yaml(OmegaConf.load(f)) for f in files for _ in range(2)]  # the second from the cache
    with hydra_as_shipped:
        shipped = [OmegaConf.to_yaml(OmegaConf.load(f)) for f in files for _ in range(2)]
    assert fast == shipped


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("+experiment=demo",),
        ("+scenario=videochat2_fp16_overflow", "hydra/sweeper=optuna_sweep"),
        ("model=diffusers_dit_tiny", "precision=fp8_rowwise", "optim=came", "logger=[tensorboard,mlflow]"),
    ],
)
def test_a_composition_with_its_hydra_node_is_the_same_as_hydra_composes_it(hydra_as_shipped, overrides):
    fast = [OmegaConf.to_yaml(hydra_cfg(*overrides)) for _ in range(2)]
    with hydra_as_shipped:
        shipped = OmegaConf.to_yaml(hydra_cfg(*overrides))
    assert fast == [shipped, shipped]


def test_a_file_changed_on_disk_is_read_again(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("lr: 1\n")
    assert OmegaConf.load(f).lr == 1
    f.write_text("lr: 2\n")
    assert OmegaConf.load(f).lr == 2


def test_a_loaded_config_is_its_own_and_the_next_load_is_untouched(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optim: {betas: [0.9, 0.999]}\n")
    first = OmegaConf.load(f)
    first.optim.betas[1] = 0.5
    first.optim.extra = 1
    with open(f) as stream:
        again = OmegaConf.load(stream)
    assert OmegaConf.to_container(again) == {"optim": {"betas": [0.9, 0.999]}}


def test_a_bad_file_fails_as_omegaconf_fails_it_every_time(tmp_path, hydra_as_shipped):
    f = tmp_path / "dup.yaml"
    f.write_text("a: 1\na: 2\n")
    errors = []
    for _ in range(2):
        with pytest.raises(yaml.constructor.ConstructorError) as e:
            OmegaConf.load(f)
        errors.append(str(e.value))
    with hydra_as_shipped, pytest.raises(yaml.constructor.ConstructorError) as shipped:
        OmegaConf.load(f)
    assert errors == [str(shipped.value)] * 2
    with pytest.raises(TypeError):
        OmegaConf.load(42)


def test_the_config_store_is_shared_but_a_loaded_node_is_still_a_copy():
    store = ConfigStore.instance()
    assert copy.deepcopy(store) is store
    node = store.load("run_schema.yaml")
    node.node.steps = 7
    assert store.load("run_schema.yaml").node.steps != 7


# compose_memo: the defaults list and the merge kept per group choices, handed out as copies.


@pytest.fixture
def loads(monkeypatch):
    """The config files Hydra loads to merge from here on (none where compose_memo reuses a merge); the memo starts
    empty."""
    compose_memo.uninstall()
    compose_memo.install()
    calls = []
    load = ConfigLoaderImpl._load_single_config

    def counted(self, default, repo):
        calls.append(default.config_path)
        return load(self, default=default, repo=repo)

    monkeypatch.setattr(ConfigLoaderImpl, "_load_single_config", counted)
    return calls


@pytest.mark.parametrize(
    "first, then, merged",
    [
        (("precision=bf16_amp",), ("precision=bf16_amp", "optim.lr=3e-3", "model.depth=3", "seed=7"), 0),
        (("+experiment=demo",), ("optim.betas=[0.8,0.95]", "+experiment=demo", "hydra.job.chdir=true"), 0),
        (("logger=[tensorboard,mlflow]",), ("logger=[tensorboard,mlflow]", "~confirm"), 0),  # a value deleted
        (("logger=[tensorboard,mlflow]",), ("logger=[tensorboard,mlflow]", "~monitor"), 1),  # a group deleted
        (("precision=bf16_amp",), ("precision=fp16_amp", "optim.lr=3e-3"), 1),
    ],
)
def test_a_kept_composition_given_other_values_is_the_config_hydra_composes(
    loads, hydra_as_shipped, first, then, merged
):
    hydra_cfg(*first)
    before = len(loads)
    reused = hydra_cfg(*then)
    assert bool(len(loads) - before) == merged  # the same group choices: Hydra's merge kept, not done again
    with hydra_as_shipped:
        shipped = hydra_cfg(*then)
    assert OmegaConf.to_yaml(reused) == OmegaConf.to_yaml(shipped)
    assert reused.hydra.runtime.choices == shipped.hydra.runtime.choices


def test_a_config_file_edited_or_added_between_compositions_is_read_again(tmp_path, loads):
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    assert compose_cfg([*FAST, "optim=came"], conf).optim.lr == 2e-4
    assert compose_cfg([*FAST, "optim=came", "seed=3"], conf).optim.lr == 2e-4
    assert loads.count("optim/came") == 1  # the second kept
    came = conf / "optim" / "came.yaml"
    came.write_text(came.read_text().replace("lr: 2.0e-4", "lr: 3.0e-4"))
    assert compose_cfg([*FAST, "optim=came"], conf).optim.lr == 3e-4
    (conf / "optim" / "came2.yaml").write_text(came.read_text().replace("lr: 3.0e-4", "lr: 4.0e-4"))
    assert compose_cfg([*FAST, "optim=came2"], conf).optim.lr == 4e-4
    assert compose_cfg([*FAST, "optim=came", "seed=5"], conf).optim.lr == 3e-4
    assert loads.count("optim/came") == 3  # any file changed under conf/ is a new key for every composition


def test_a_linked_group_directory_edited_between_compositions_is_read_again(tmp_path, loads):
    conf, optim = tmp_path / "conf", tmp_path / "optim_elsewhere"
    shutil.copytree(CONF_DIR, conf, ignore=shutil.ignore_patterns("optim"))
    shutil.copytree(Path(CONF_DIR) / "optim", optim)
    (conf / "optim").symlink_to(optim, target_is_directory=True)
    assert compose_cfg([*FAST, "optim=came"], conf).optim.lr == 2e-4
    came = optim / "came.yaml"
    came.write_text(came.read_text().replace("lr: 2.0e-4", "lr: 3.0e-4"))
    assert compose_cfg([*FAST, "optim=came"], conf).optim.lr == 3e-4


def test_a_node_stored_after_a_composition_is_the_one_composed(loads):
    store = ConfigStore.instance()
    try:
        store.store(group="optim", name="memo_probe", node={"lr": 0.5})
        assert compose_cfg([*FAST, "optim=memo_probe"]).optim.lr == 0.5
        store.store(group="optim", name="memo_probe", node={"lr": 0.25})
        assert compose_cfg([*FAST, "optim=memo_probe"]).optim.lr == 0.25
    finally:
        store.repo["optim"].pop("memo_probe.yaml", None)


def test_a_failed_composition_fails_the_same_way_again():
    for overrides in (("precision=fp99",), ("+precision=bf16_amp",), ("~optim=came",)):
        errors = []
        for _ in range(2):
            with pytest.raises(Exception) as e:
                hydra_cfg(*overrides)
            errors.append(f"{type(e.value).__name__}: {e.value}")
        assert errors[0] == errors[1], overrides


def test_a_search_path_too_large_to_key_is_composed_by_hydra_each_time(monkeypatch, loads):
    monkeypatch.setattr(compose_memo, "_MAX_FILES", 3)
    for _ in range(2):
        assert hydra_cfg("precision=bf16_amp").precision.name == "bf16_amp"
    assert loads.count("precision/bf16_amp") == 2 and not compose_memo._merged
