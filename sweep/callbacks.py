"""Hydra callback: print and save the summary tables when a multirun ends."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger("sweep")


class SweepSummary(Callback):
    """At the end of every multirun: the divergence map on the terminal, summary.md/.csv in the sweep dir."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from .summary import load_runs, render, write_summary

        sweep_dir = Path(config.hydra.sweep.dir)
        runs = load_runs(sweep_dir)
        if runs.empty:
            log.warning("no run of this sweep wrote a result.json (%s)", sweep_dir)
            return
        written = write_summary(sweep_dir, runs)
        print("\n" + render(runs) + f"\n\nSaved: {', '.join(str(p) for p in written)}", flush=True)
