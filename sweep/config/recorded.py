"""A recorded run's config (<run dir>/.hydra/config.yaml) read back.

A checkpoint is resumed only into a run whose RESUME_KEYS equal those of the run that saved it
(resume_mismatches, called by check_inputs). A key the schema has dropped (RETIRED_KEYS) is left out of a
recorded config before it meets today's schema (without_retired), so runs recorded before still replay
(sweep/replay.py), diagnose (sweep/diagnose/record.py) and rerun in their own run directory
(sweep/callbacks.py run_identity).
"""

from __future__ import annotations

import copy
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from sweep.config.schema import RunConfig

RETIRED_KEYS = ("optim.name",)
"""Keys the schema had and dropped because nothing read them: `optim.name` (always adamw, the one optimizer)."""


def without_retired(config: DictConfig) -> DictConfig:
    """A copy of a recorded config without its RETIRED_KEYS, so that it merges onto today's RunConfig schema
    (which refuses a key it does not know)."""
    config = copy.deepcopy(config)
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
)
"""What the saved weights and optimizer state depend on: a checkpoint is resumed only into the same."""


def resume_mismatches(run: RunConfig, checkpoint: Path) -> list[tuple[str, Any, Any]]:
    """(key, saved, now) for each RESUME_KEYS value that differs from the run that saved `checkpoint`
    (`<run dir>/checkpoints/step_N`: its run's .hydra/config.yaml). Empty when that config is not there
    (a checkpoint copied elsewhere: the load itself then says what does not fit)."""
    saved_path = checkpoint.parent.parent / ".hydra" / "config.yaml"
    try:
        saved = OmegaConf.load(saved_path)
    except Exception:  # noqa: BLE001  (missing or unreadable: nothing to compare with)
        return []
    now = OmegaConf.structured(run)
    differ = []
    for key in RESUME_KEYS:
        was = OmegaConf.select(saved, key, default=None, throw_on_missing=False)
        is_ = OmegaConf.select(now, key, default=None, throw_on_missing=False)
        was, is_ = (OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for v in (was, is_))
        was, is_ = (v.value if isinstance(v, Enum) else v for v in (was, is_))
        if (was or None) != (is_ or None) and not (was in (None, {}, []) and is_ in (None, {}, [])):
            differ.append((key, _plain(was), _plain(is_)))
    return differ


def _plain(value: Any) -> str:
    return "null" if value is None else str(value)
