"""The config sections of what a run or a sweep does around training: the confirmation at a longer horizon,
the report, the ledger (Optuna), the trackers, and a scenario's expectations. Part of the typed schema
(schema.py's RunConfig holds them); import them from `sweep.config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from sweep.config.enums import ConfirmMode, Verdict
from sweep.search.conf import PrunerConfig


@dataclass
class ConfirmConfig:
    """After a multirun: its answer rerun at a longer horizon, every replicate (sweep/confirm/)."""

    mode: ConfirmMode = ConfirmMode.auto
    """auto confirms after every multirun; off leaves the frontier and the recommendation unconfirmed."""
    steps: Optional[int] = None
    """The confirmation's horizon; null is `factor` x `steps`."""
    factor: float = 4.0
    """confirm.steps when it is null, as a multiple of the sweep's own steps."""
    budget: float = 1.0
    """The confirmation's time limit, as a multiple of the sweep's own run time (its runs' seconds added up); the
    recommended setting is confirmed whatever its cost, 0 confirms nothing else."""


@dataclass
class ReportConfig:
    """How a sweep's summary reads its runs (sweep/report/)."""

    target: Optional[str] = None
    """The device the recommendation is for: cpu or cuda; null is the device the sweep ran on, and cuda for a
    sweep that ran on the CPU (a proxy for the GPU a model trains on)."""
    html: bool = True
    """Write report.html (and plotly-<version>.min.js beside it, once) into the sweep dir at the end of every
    multirun; false: only the summary files (`python -m sweep.report DIR` writes it later)."""


@dataclass
class LedgerConfig:
    """Where runs are recorded as Optuna trials (sweep/search/ledger.py)."""

    enabled: bool = True
    storage: Optional[str] = None
    """Optuna storage URL (sqlite:///, postgresql://, mysql://) or a journal file path ending in .log;
    null = sqlite:///<sweep dir>/ledger.db."""
    study_name: Optional[str] = None
    """null = the sweep directory's resolved path, so every spelling of it names one study (a study an older
    version named by the path as given is still found: sweep.search.ledger.study_name)."""
    trial_number: Optional[int] = None
    """Set by our Optuna sweeper: the trial this run finishes (null: the run adds a trial of its own)."""
    pruner: PrunerConfig = field(default_factory=PrunerConfig)
    """Set by our Optuna sweeper (hydra.sweeper.pruner): report the loss to the trial, stop when pruned."""
    lock_timeout_s: float = 30.0
    """How long recording a run waits for a ledger another process holds locked (a SQLite write transaction)
    before it logs a warning and leaves the trial to be recorded later (sweep/search/pending.py)."""


@dataclass
class TensorBoardConfig:
    """Event files per run (sweep/run/tensorboard_sink.py): `tensorboard --logdir <sweep dir>` shows them all."""

    enabled: bool = False
    dir: str = "tensorboard"
    """The event files' folder, inside the run directory."""


@dataclass
class MlflowConfig:
    """Each run an MLflow run, nested under one parent run per sweep (sweep/run/mlflow_sink.py)."""

    enabled: bool = False
    tracking_uri: Optional[str] = None
    """null = $MLFLOW_TRACKING_URI, else sqlite:///<sweep dir>/mlflow.db. A password goes in the environment
    (MLFLOW_TRACKING_PASSWORD, or tracking_uri='${oc.env:MY_URI}'), never on the command line."""
    experiment: Optional[str] = None
    """The MLflow experiment of the sweep; null = the sweep directory's path (as the ledger's study)."""
    timeout_s: int = 10
    """Per HTTP request to the tracking server; a server that does not answer costs this once per run."""
    retries: int = 1
    """HTTP retries per request (MLflow's own default of 7 with backoff waits minutes on a dead server)."""


@dataclass
class LoggerConfig:
    """Trackers that get every run's curves and verdict (conf/logger/, docs/loggers.md): logger=none (default),
    tensorboard, mlflow, or several as a list: 'logger=[tensorboard,mlflow]'."""

    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    flush_every: int = 50
    """Rows sent to the trackers (and appended to metrics.csv) in one batch ..."""
    flush_s: float = 10.0
    """... or after this many seconds, whichever comes first; the rest at the end of the run."""


@dataclass
class ScenarioExpect:
    """One expected outcome of a scenario: the runs whose params match `when` must end like this."""

    when: Dict[str, Any] = field(default_factory=dict)
    """Swept params to match, e.g. {precision: fp16_amp}; {} matches every run."""
    status: str = "stable"
    verdict: Optional[Verdict] = None
    """The verdict of a diverged run (a misspelt one fails while Hydra composes)."""
    cause_where: Optional[str] = None
    cause_module: Optional[str] = None
    """A prefix of cause.module, e.g. blocks (any block) or blocks.1.attn."""
    same_step: bool = False
    """Every matching run diverges at the same first_bad_step (a data fault does not care about lr)."""
    max_attn_logit_above: Optional[float] = None
    """The run's largest attention logit exceeded this (logit growth)."""
    max_attn_logit_below: Optional[float] = None
    mechanism: Optional[str] = None
    """Why it diverged, as the run's result.json names it from its recorded signals (sweep/diagnose/mechanism.py)."""
    modulate_parity: Optional[str] = None
    """ok | mismatch: the kernel parity check (sweep.parity, batch 1-4, fp32/bf16/fp16) of the run's swept
    `modulate` impl. A wrong kernel can train without any verdict (OpenDiT's fused_buggy): parity catches it."""


@dataclass
class ScenarioConfig:
    """A known failure reproduced on a tiny model, and its fix (conf/scenario/*.yaml, sweep/scenario.py)."""

    name: Optional[str] = None
    case: str = ""
    """The real-world post-mortem this reproduces, in one sentence."""
    fix: str = ""
    """The documented fix, as the override that applies it."""
    pretrain_steps: int = 0
    """> 0: before the sweep, train the scenario's model this long and save it as <sweep dir>/pretrained
    (its checkpoint is <sweep dir>/pretrained/checkpoints/step_<pretrain_steps>), for runs that start from
    "pretrained" weights."""
    pretrain_overrides: Dict[str, Any] = field(default_factory=dict)
    """Dotted keys set for the pretraining run only, e.g. {data.batch_size: 16}: the earlier stage of
    training differed from the resumed one (more GPUs, a lower resolution)."""
    expect: List[ScenarioExpect] = field(default_factory=list)
