"""Two costs Hydra 1.3 pays on every composition that give nothing back, taken out (installed on import of
sweep.config, which every composition of ours follows).

Hydra composes a config 2-3 times per `python -m sweep` run and once per cell of a sweep, and each composition
started from scratch: ~130 ms of CPU on a 2-core AMD EPYC (AVX-512-BF16), of which ~20 % went here. In the test
suite, composition was ~250 of ~1180 CPU-seconds (a py-spy profile, docs/suite_durations.md).

- **Each YAML text is parsed once per process.** Hydra's config sources read every file of the defaults list
  on every composition and hand the text to `OmegaConf.load`, a pure-Python YAML parse. `load` here keeps the
  config built from each text it has seen (keyed by the text itself, so a file that changes on disk is parsed
  again), pickled, and hands out an unpickled copy: the config OmegaConf's own `load` builds from a fresh parse.
- **The ConfigStore is not deep-copied.** `CachingConfigRepository` deep-copies its delegate repository on
  every composition, and with it the structured-config source's ConfigStore (every registered schema node:
  ~10 ms). The store is a process-wide singleton that `ConfigStore.load` already copies a node out of on each
  read, so the copy is never written to; sharing it changes nothing.

`install` also puts compose_memo.py's in place: the defaults list and the merge of its files, kept per distinct
group choices and config files, so a composition that differs from an earlier one only in values reuses them.

The composed configs are the same with and without (tests/test_compose_speed.py: every YAML file, and
compositions with their `hydra` node, kept and fresh, both ways).
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from typing import IO, Any, Union

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf._utils import get_yaml_loader

from sweep.config.compose_memo import install as install_memo
from sweep.config.compose_memo import uninstall as uninstall_memo

_LOADED: dict[str, bytes] = {}
"""Each text's config, pickled: a copy is unpickled for each load (~0.06 ms a file against ~0.6 ms to build it
again from the parse, conf/config.yaml 3.9 ms: a 2-core AMD EPYC, AVX-512-BF16)."""
_KEEP = 1024
"""Texts kept (a test session loads a few hundred distinct files; a long process never grows without bound)."""

_omegaconf_load = OmegaConf.load


def load(file_: Union[str, pathlib.Path, IO[Any]]) -> Union[DictConfig, ListConfig]:
    """OmegaConf.load, each distinct text parsed once: the same checks and the same config as OmegaConf's."""
    if isinstance(file_, (str, pathlib.Path)):
        name = os.path.abspath(file_)
        with io.open(name, "r", encoding="utf-8") as f:
            text = f.read()
    elif getattr(file_, "read", None):
        name, text = getattr(file_, "name", "<file>"), file_.read()
    else:
        return _omegaconf_load(file_)  # OmegaConf's TypeError
    if text not in _LOADED:
        stream = io.StringIO(text)
        stream.name = name  # what a YAML error names, as when OmegaConf parses the file itself
        obj = yaml.load(stream, Loader=get_yaml_loader())
        if obj is not None and not isinstance(obj, (list, dict, str)):
            raise IOError(f"Invalid loaded object type: {type(obj).__name__}")
        loaded = OmegaConf.create() if obj is None else OmegaConf.create(obj)  # what raises here raises each time
        if len(_LOADED) >= _KEEP:
            _LOADED.clear()
        _LOADED[text] = pickle.dumps(loaded, protocol=pickle.HIGHEST_PROTOCOL)
        return loaded
    return pickle.loads(_LOADED[text])


def _store_itself(store: ConfigStore, memo: dict) -> ConfigStore:
    return store


def install() -> None:
    """Put both in place, and compose_memo's (idempotent)."""
    OmegaConf.load = staticmethod(load)  # type: ignore[method-assign]
    ConfigStore.__deepcopy__ = _store_itself  # type: ignore[attr-defined]
    install_memo()


def uninstall() -> None:
    """Hydra's and OmegaConf's own behaviour again (the parity test composes both ways)."""
    OmegaConf.load = staticmethod(_omegaconf_load)  # type: ignore[method-assign]
    if "__deepcopy__" in vars(ConfigStore):
        del ConfigStore.__deepcopy__
    _LOADED.clear()
    uninstall_memo()
