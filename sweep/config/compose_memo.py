"""Hydra's two costliest composition steps, each done once per distinct input in a process and then reused.

Composing a config (~80 ms of CPU on a 2-core AMD EPYC, AVX-512-BF16) spends ~70 % in two steps whose result
depends only on the config group choices and the config files, not on value overrides such as `optim.lr=1e-3`:
- **the defaults list** (`create_defaults_list`): which config file of which group goes where;
- **the merge** (`_compose_config_from_defaults_list`): those files loaded and merged, in order, into one config.

A sweep's cells differ mostly in values (or repeat a few group choices), and a `python -m sweep` run composes the
same command line 2-3 times, so both are kept here (pickled) and handed out as copies (unpickled). Hydra then
applies the value overrides and its runtime fields to the copy as it always does. In the test suite, 1,294
compositions had 258 distinct group choices (docs/suite_durations.md).

What a kept result is keyed by, so that it is reused only where Hydra would compute the same:
- the config name, `prepend_hydra`, `skip_missing` (a multirun's), and the group choices, appends and deletions
  of the command line in their order (value overrides are not part of it);
- every config source of the search path: a directory's (or an installed package's) file names and texts, read
  again each time (a file edited between two compositions is a different key), and the ConfigStore's count of
  stored nodes. A source of any other kind, or a directory of over `_MAX_FILES` entries, is not kept: Hydra
  composes it afresh every time.

Failures are never kept: a composition that raises raises the same way the next time.
tests/test_compose_speed.py checks a kept composition given other values, value and group deletions and appends
against Hydra's own (the config and `hydra.runtime.choices`), that an edited, added or linked file and a re-stored
ConfigStore node are composed afresh, that failures fail again the same way, and that an unkeyable search path
goes to Hydra every time.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional

import hydra._internal.config_loader_impl as loader_impl
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.defaults_list import DefaultsList, Overrides
from hydra.core.config_store import ConfigStore

_MAX_FILES = 2000
"""Entries of a directory source walked for its key; a larger one (a --config-dir at a project root) is not kept."""
_KEEP = 256
"""Results kept of each kind (least recently used dropped): ~130 distinct group choices in a test worker. A
group choice's defaults list and merge hold ~230 KB (tracemalloc, 16 precision x attention choices), so at most
~60 MB."""

_hydra_create_defaults_list = loader_impl.create_defaults_list
_hydra_compose = ConfigLoaderImpl._compose_config_from_defaults_list
_hydra_store = ConfigStore.store

_defaults_lists: OrderedDict[tuple, tuple] = OrderedDict()
_merged: OrderedDict[tuple, Any] = OrderedDict()
_stored = [0]
"""ConfigStore.store calls so far: a structured source's part of the key."""


def _directory_key(root: Path) -> Optional[str]:
    """A digest of the names and texts of the YAML files and the directories under root, or None if too many."""
    digest, seen = hashlib.blake2b(digest_size=16), 0
    for here, dirs, files in os.walk(root, followlinks=True):  # as Hydra reads a linked group; a loop ends at the cap
        dirs.sort()
        seen += len(dirs) + len(files)
        if seen > _MAX_FILES:
            return None
        digest.update(f"{os.path.relpath(here, root)}\0{len(dirs)}\0".encode())
        for name in sorted(dirs):
            digest.update(f"d{name}\0".encode())
        for name in sorted(files):
            if name.endswith((".yaml", ".yml")):
                with open(os.path.join(here, name), "rb") as f:
                    digest.update(f"f{name}\0".encode() + f.read() + b"\0")
    return digest.hexdigest()


def _source_key(source: Any) -> Optional[tuple]:
    scheme = source.scheme()
    if scheme == "structured":
        return (scheme, source.path, _stored[0])
    if scheme == "file":
        root: Any = Path(source.path)
    elif scheme == "pkg":
        try:
            root = importlib.resources.files(source.path)
        except (ImportError, TypeError, ValueError):
            return None
    else:
        return None
    if not isinstance(root, Path):  # a zipped package: not walked, not kept
        return None
    content = _directory_key(root) if root.is_dir() else "absent"
    return None if content is None else (scheme, source.path, content)


def _sources_key(repo: Any) -> Optional[tuple]:
    """The key of every source of repo's search path, once per composition (repo is the composition's own)."""
    if not hasattr(repo, "_dit_sources_key"):
        keys = tuple(_source_key(source) for source in repo.get_sources())
        repo._dit_sources_key = None if None in keys else keys
    return repo._dit_sources_key


def _choices_key(overrides: Overrides) -> tuple:
    """What of a command line shapes the defaults list: group choices, appends and deletions, in order."""
    choices = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in overrides.override_choices.items())
    appends = tuple((g.group, g.package, str(g.value)) for g in overrides.append_group_defaults)
    deletions = tuple((k, d.name) for k, d in overrides.deletions.items())
    return choices, appends, deletions


def _kept(memo: OrderedDict, key: tuple) -> Any:
    """A copy of what is kept under key (None if nothing is), made afresh from its pickle."""
    value = memo.get(key)
    if value is None:
        return None
    try:
        memo.move_to_end(key)
    except KeyError:  # dropped meanwhile by a composition on another thread: the value is still whole
        pass
    return pickle.loads(value)


def _keep(memo: OrderedDict, key: tuple, value: Any) -> None:
    """Keep value's pickle under key: each reuse unpickles a copy, ~6x faster than a deep copy of an OmegaConf
    config (1.3 against 8.0 ms for a merged config.yaml, bench/compose.py) and as whole: the same nodes, flags,
    metadata and parents (OmegaConf's containers pickle their full state; their flags caches are rebuilt)."""
    memo[key] = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    if len(memo) > _KEEP:
        memo.popitem(last=False)


def create_defaults_list(repo, config_name, overrides_list, prepend_hydra, skip_missing) -> DefaultsList:
    """hydra's create_defaults_list, its result kept per (sources, config, group choices)."""
    sources = _sources_key(repo)
    if sources is None:
        return _hydra_create_defaults_list(repo, config_name, overrides_list, prepend_hydra, skip_missing)
    overrides = Overrides(repo=repo, overrides_list=overrides_list)
    key = (sources, config_name, prepend_hydra, skip_missing, _choices_key(overrides))
    kept = _kept(_defaults_lists, key)
    if kept is None:
        made = _hydra_create_defaults_list(repo, config_name, overrides_list, prepend_hydra, skip_missing)
        _keep(_defaults_lists, key, (made.defaults, made.defaults_tree, made.overrides.known_choices))
        return made
    defaults, tree, known_choices = kept
    overrides.known_choices = known_choices  # what hydra.runtime.choices records
    for meta in overrides.override_metadata.values():
        meta.used = True  # the same choices were all used when it was made (it was kept, so nothing raised)
    for deletion in overrides.deletions.values():
        deletion.used = True
    return DefaultsList(
        defaults=defaults, config_overrides=overrides.config_overrides, defaults_tree=tree, overrides=overrides
    )


def compose_config_from_defaults_list(self: ConfigLoaderImpl, defaults: list, repo: Any):
    """Hydra's merge of the defaults list's files, kept per (sources, defaults list); each caller gets a copy."""
    sources = _sources_key(repo)
    if sources is None:
        return _hydra_compose(self, defaults, repo)
    key = (sources, tuple((d.config_path, d.parent, d.package, d.is_self, d.primary, d.override_key) for d in defaults))
    kept = _kept(_merged, key)
    if kept is None:
        kept = _hydra_compose(self, defaults, repo)
        _keep(_merged, key, kept)
    return kept


def _counted_store(self: ConfigStore, *args: Any, **kwargs: Any) -> None:
    _stored[0] += 1
    return _hydra_store(self, *args, **kwargs)


def install() -> None:
    loader_impl.create_defaults_list = create_defaults_list
    ConfigLoaderImpl._compose_config_from_defaults_list = compose_config_from_defaults_list  # type: ignore[method-assign]
    ConfigStore.store = _counted_store  # type: ignore[method-assign]


def uninstall() -> None:
    loader_impl.create_defaults_list = _hydra_create_defaults_list
    ConfigLoaderImpl._compose_config_from_defaults_list = _hydra_compose  # type: ignore[method-assign]
    ConfigStore.store = _hydra_store  # type: ignore[method-assign]
    _defaults_lists.clear()
    _merged.clear()
