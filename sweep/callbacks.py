"""Hydra callback: print and save the summary tables when a multirun ends.

Wired in conf/config.yaml (`hydra.callbacks.summary`). It reads the run directories of the sweep, so
it sees every run whatever launcher ran it, and stays fast (no plotting): report.html is one command
away, `python -m sweep.report <sweep dir>`.
"""
from __future__ import annotations

import logging
import textwrap
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger("sweep")


class OutputDirCheck(Callback):
    """Before anything is written: the run or sweep directory must be creatable (sweep.config.check_output_dir).

    Hydra creates the job directory before the task function runs, so this cannot wait for sweep.job.
    Listed first in conf/config.yaml: start hooks run in order, so it comes before a scenario's pretraining
    writes into the sweep directory. The grid sweeper checks each cell's own subdirectory.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(str(config.hydra.run.dir), "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(str(config.hydra.sweep.dir), "hydra.sweep.dir")

    @staticmethod
    def _check(path: str, key: str) -> None:
        from .config import ConfigError, check_output_dir
        from .job import exit_config_error

        try:
            check_output_dir(path, key)
        except ConfigError as e:  # raised, Hydra would only warn and go on to fail on mkdir
            exit_config_error(e)


class SweepSummary(Callback):
    """At the end of every multirun: the tables on the terminal, summary.md/.csv/.parquet in the sweep dir."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from .report.runs import runs_from_dirs
        from .report.summary import summarize
        from .report.text import WIDTH, render_text, write_summary

        sweep_dir = Path(config.hydra.sweep.dir)
        runs = runs_from_dirs(sweep_dir, starting_s=0)  # every job of this sweep has returned
        for line in runs.attrs.get("skipped", []):
            log.warning("summary: skipped %s", line)
        if runs.empty:
            log.warning("no run of this sweep wrote a result.json (%s)", sweep_dir)
            return
        try:
            summary = summarize(runs)
            text = render_text(summary)
            written = write_summary(sweep_dir, summary)
        except Exception:  # noqa: BLE001  (every run is recorded; a report bug must not fail the sweep)
            log.exception("could not summarize %s; the runs are recorded, try: python -m sweep.report %s",
                          sweep_dir, sweep_dir)
            return
        saved = textwrap.fill(f"Saved in {sweep_dir}: {', '.join(p.name for p in written)}", WIDTH,
                              subsequent_indent="  ")
        print(f"\n{text}\n\n{saved}\nHTML report: python -m sweep.report {sweep_dir}", flush=True)


class ScenarioCheck(Callback):
    """For `+scenario=NAME` sweeps: pretrain before the runs if asked, and say after them whether the
    scenario reproduced (sweep/scenario.py). Does nothing for other sweeps."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.get("scenario") is None or not config.scenario.get("name"):
            return
        from hydra.core.hydra_config import HydraConfig

        from .scenario import pretrain, pretrain_config

        HydraConfig.instance().set_config(config)  # so ${hydra:sweep.dir} in the scenario resolves
        name = config.scenario.name
        try:
            run = pretrain_config(config)
            if run.scenario.pretrain_steps:
                print(f"Scenario {name}: pretraining {run.scenario.pretrain_steps} steps first", flush=True)
                pretrain(run, Path(config.hydra.sweep.dir))
        except (ValueError, RuntimeError) as e:  # Hydra would only warn and run every cell without its weights
            raise SystemExit(f"Scenario {name}: {e}") from None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.get("scenario") is None or not config.scenario.get("name"):
            return
        import json

        from .config import to_run_config
        from .scenario import check, render, write

        sweep_dir = Path(config.hydra.sweep.dir)
        scenario = to_run_config(config).scenario
        results = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/result.json"))]
        outcomes = check(scenario.expect, results)
        write(sweep_dir, scenario, outcomes)
        print(f"\n{render(scenario, outcomes)}", flush=True)
