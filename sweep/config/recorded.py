"""A recorded run's config (<run dir>/.hydra/config.yaml) read back.

A checkpoint is resumed only into a run whose RESUME_KEYS equal those of the run that saved it
(resume_mismatches, called by check_inputs). A key the schema has dropped (RETIRED_KEYS) is left out of a
recorded config before it meets today's schema (without_retired), so runs recorded before still replay
(sweep/replay.py), diagnose (sweep/diagnose/record.py) and rerun in their own run directory
(sweep/callbacks.py run_identity). `load_recorded` is how both read a run directory's config: its
`${hydra:...}` references resolved (`resolve_hydra`), its retired keys dropped, validated as today's RunConfig.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from sweep.config.schema import ConfigError, RunConfig
from sweep.config.validate import to_run_config

RETIRED_KEYS: tuple[str, ...] = ()
"""Keys the schema had and dropped because nothing read them. (`optim.name` was one while AdamW was the only
optimizer; it came back with the optimizer axis, and a recorded `optim.name: adamw` means what it meant.)"""


def without_retired(config: DictConfig) -> DictConfig:
    """A copy of a recorded config without its RETIRED_KEYS and its top-level keys that are no part of RunConfig
    (a user's `+tag=...`, which the run itself ignored), so that it merges onto today's RunConfig schema (which
    refuses a key it does not know: a sweep with `+tag` had its confirmation and diagnoses end in a traceback)."""
    config = copy.deepcopy(config)
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    with open_dict(config):
        for extra in [k for k in config if k not in fields]:
            config.pop(extra)
    for key in RETIRED_KEYS:
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(config, parent, default=None, throw_on_resolution_failure=False)
        if isinstance(node, DictConfig) and leaf in node:
            with open_dict(node):
                node.pop(leaf)
    return config


RESUME_KEYS = (
    "model.arch",
    "model.size",
    "model.name",
    "model.width",
    "model.depth",
    "model.patch_size",
    "model.qk_norm",
    "model.param",
    "model.base_width",
    "model.config",
    "model.target",
    "model.kwargs",
    "model.shrink",
    "data.channels",
    "data.frames",
    "data.height",
    "data.width",
    "precision.param_dtype",
    "precision.fp32_modules",
    "finetune.method",
    "finetune.rank",
    "finetune.target_modules",
    "finetune.base_dtype",  # the base's stored weights (fp8 with scales, or bf16): sweep/run/fp8_storage.py
)
"""What the saved weights and optimizer state depend on: a checkpoint is resumed only into the same."""

OPTIMIZER_KEYS = ("optim.name",)
"""What the saved optimizer state depends on besides: resumed with its state (checkpoint.resume_optimizer), a
checkpoint goes only into the same optimizer (AdamW's moments mean nothing to Prodigy)."""


def resume_mismatches(run: RunConfig, checkpoint: Path) -> list[tuple[str, Any, Any]]:
    """(key, saved, now) for each RESUME_KEYS value that differs from the run that saved `checkpoint`
    (`<run dir>/checkpoints/step_N`: its run's .hydra/config.yaml). Empty when that config is not there
    (a checkpoint copied elsewhere: the load itself then says what does not fit)."""
    saved_path = checkpoint.parent.parent / ".hydra" / "config.yaml"
    try:
        saved = OmegaConf.load(saved_path)
    except Exception:  # noqa: BLE001  (missing or unreadable: nothing to compare with)
        return []
    now, schema = OmegaConf.structured(run), OmegaConf.structured(RunConfig)
    differ = []
    keys = RESUME_KEYS + (OPTIMIZER_KEYS if run.checkpoint.resume_optimizer else ())
    for key in keys:  # a key the saving run's schema did not have yet had its default there
        default = OmegaConf.select(schema, key, default=None, throw_on_missing=False)
        was = OmegaConf.select(saved, key, default=default, throw_on_missing=False)
        is_ = OmegaConf.select(now, key, default=None, throw_on_missing=False)
        was, is_ = (OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for v in (was, is_))
        was, is_ = (v.value if isinstance(v, Enum) else v for v in (was, is_))
        if key == "optim.name" and (was, is_) == ("adamw_8bit", "adamw"):  # its moments dequantised (load_optimizer)
            continue
        if (was or None) != (is_ or None) and not (was in (None, {}, []) and is_ in (None, {}, [])):
            differ.append((key, _plain(was), _plain(is_)))
    return differ


def _plain(value: Any) -> str:
    return "null" if value is None else str(value)


class UnresolvedReference(ConfigError):
    """A recorded config refers to a `${hydra:...}` key its run's .hydra/hydra.yaml does not hold."""


def load_recorded(run_dir: Path) -> tuple[DictConfig, RunConfig]:
    """The config a run directory was made with (<run dir>/.hydra/config.yaml): as saved, its `${hydra:...}`
    references resolved and its retired keys dropped, and as today's validated RunConfig (ConfigError when it no
    longer composes)."""
    config = without_retired(resolve_hydra(OmegaConf.load(Path(run_dir) / ".hydra" / "config.yaml"), Path(run_dir)))
    return config, to_run_config(OmegaConf.merge(OmegaConf.structured(RunConfig), config))


_HYDRA_REF = re.compile(r"\$\{hydra:([^}]+)\}")


def resolve_hydra(config: DictConfig, run_dir: Path) -> DictConfig:
    """The saved config with its `${hydra:...}` references (a scenario's `${hydra:sweep.dir}/pretrained/...`)
    replaced by what they were for this run: outside Hydra nothing resolves them. Keys come from the run's
    .hydra/hydra.yaml (a relative folder made absolute against the directory the run was started in); the
    run's own folder is where the run dir is, and its sweep's the folder above it when hydra.yaml has it
    unresolved (`outputs/sweeps/${now:...}`)."""
    hydra_file = run_dir / ".hydra" / "hydra.yaml"
    node = OmegaConf.load(hydra_file).hydra if hydra_file.is_file() else OmegaConf.create({})
    started_in = Path(str(OmegaConf.select(node, "runtime.cwd", default=None) or "."))
    known = {"runtime.output_dir": run_dir, "run.dir": run_dir}

    def value(key: str) -> str:
        if key in known:
            return str(Path(known[key]).resolve())
        found = OmegaConf.select(node, key, default=None, throw_on_resolution_failure=False)
        if key == "sweep.dir" and (found is None or "${" in str(found)):  # a job dir sits in its sweep dir
            return str(run_dir.resolve().parent)
        if found is None or "${" in str(found):
            raise UnresolvedReference(
                f"{run_dir}: its config refers to ${{hydra:{key}}}, which its .hydra/hydra.yaml does not say"
            )
        return str(found) if not key.endswith("dir") or Path(str(found)).is_absolute() else str(started_in / str(found))

    def fix(v):
        if isinstance(v, str):
            return _HYDRA_REF.sub(lambda m: value(m.group(1)), v)
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, list):
            return [fix(x) for x in v]
        return v

    return OmegaConf.create(fix(OmegaConf.to_container(config, resolve=False)))
