"""sweep/config/compose_speed.py: compositions give the same configs with its two speed-ups as without them."""

from __future__ import annotations

import copy
from pathlib import Path

import hydra
import pytest
import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from sweep.config import compose_speed

from .conftest import CONF_DIR, hydra_cfg

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
