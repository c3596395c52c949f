"""The Hydra task function: one composed config in, one recorded run out.

Hydra composes the config and picks the job directory; this module converts the config at the
boundary (sweep.config.to_run_config), works out the swept params under their dotted names, and hands
over to sweep.run.execute. A bad value raises ConfigError (a user mistake, shown as one line by the
entry point) and exits with status 2; anything that happens during the run is a result, never an exception.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from .config import ConfigError, to_run_config
from .run import execute

log = logging.getLogger("sweep")


def swept_params(cfg: DictConfig, overrides: list[str], choices: dict) -> dict:
    """The job's overrides as {dotted.key: value}: a config-group choice by its option name."""
    params = {}
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        if key.startswith("hydra") or override.is_delete():
            continue
        if key in choices:
            params[key] = choices[key]
        else:
            value = OmegaConf.select(cfg, key)
            params[key] = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    return params


def run_job(cfg: DictConfig) -> dict:
    """Run the composed config in Hydra's job directory; returns result.json's content."""
    try:
        run = to_run_config(cfg)
    except ConfigError as e:
        # Exit here: raised, Hydra would print "Error executing job with overrides" before our line.
        print(f"sweep: config error: {e}", file=sys.stderr)
        sys.exit(2)
    hc = HydraConfig.get()
    params = swept_params(cfg, list(hc.overrides.task), dict(hc.runtime.choices))
    label = " ".join(f"{k}={v}" for k, v in params.items())
    result = execute(run, Path(hc.runtime.output_dir), params, label=label)
    log.info("%s%s", f"[{hc.job.num}] {label}: " if hc.mode.name == "MULTIRUN" else "", result.headline())
    return result.to_dict()
