"""Real runs for a diagnosis: the run's own config with overrides, trained in a scratch folder of the run dir.

Every counterfactual, bisection trial and fix is one of these: `execute` on the config the run was made
with (.hydra/config.yaml) plus `key=value` overrides, a group name (precision=fp32, attention=math,
modulate=eager) taking that group's file from conf/ as a sweep would. Nothing here records a trial in
the ledger: the diagnosis is about one run, and diagnosis.json holds every outcome. Each trial's record is
trial.json (TRIAL_FILE), not result.json: a sweep's tree holds one result.json per run of the sweep.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sweep.config import ConfigError, Progress, RunConfig, to_run_config
from sweep.diagnose.record import DiagnoseError
from sweep.diagnose.signals import RunRecord
from sweep.run.execute import execute
from sweep.run.interrupt import StopOnSignal, active_request, stop_if_asked
from sweep.run.results import TRIAL_FILE

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUPS = ("precision", "attention", "modulate")
"""Config groups a diagnosis swaps whole (the axes it changes); anything else is a dotted key."""


def parse_value(text: str):
    """An override's value: JSON first (1e-05, [0.9, 0.95], true), then YAML ([blocks.*.attn]), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def with_overrides(config: DictConfig, overrides: list[str]) -> RunConfig:
    """The run's composed config with `overrides` applied, validated (ConfigError on a bad one)."""
    cfg = copy.deepcopy(config)
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep:
            raise ConfigError(f"{override!r}: an override is key=value")
        if key in GROUPS:
            path = CONF / key / f"{value}.yaml"
            if not path.is_file():
                raise ConfigError(f"{key}={value}: no such option (conf/{key}/)")
            kept = {"fp32_modules": cfg[key].get("fp32_modules")} if key == "precision" else {}
            cfg[key] = OmegaConf.merge(OmegaConf.load(path), {k: v for k, v in kept.items() if v is not None})
        else:
            OmegaConf.update(cfg, key, parse_value(value), merge=False, force_add=True)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
    except OmegaConfBaseException as e:  # a value of the wrong type: one line naming the override, not a traceback
        raise ConfigError(f"{' '.join(overrides)}: {str(e).splitlines()[0]}") from None
    return to_run_config(merged)


FROM_START_HORIZON = 4
"""A diagnosis's run from the run's start (a fix, a bisection trial) trains to this many times the steps the run
took to fail (from step 0 to its last bad step), and at least FROM_START_MIN steps, or to the run's end if that
comes first: a fix that holds four times as long as the run did is confirmed, and a 1e6-step run that failed at
step 50 is not trained again for 1e6 steps per candidate (before, each fix ran the run's whole length, whatever the
budget). With the counterfactual rows (from the last healthy step to `past` steps after the bad one) and the replay
(to the last healthy step), a diagnosis costs a bounded multiple of the failed run's own steps."""

FROM_START_MIN = 1000
"""Steps a run from the start trains at least (when the run has them): every run of up to 1,000 steps, every
scenario's among them, is confirmed over its whole length as before."""


def from_start_last(record: RunRecord) -> int | None:
    """The last step a diagnosis's run from the run's start trains (FROM_START_HORIZON); None: the run's end."""
    last = max(FROM_START_HORIZON * (record.last_step + 1), FROM_START_MIN) - 1
    return None if last >= record.run.steps - 1 else last


class StopAfter:
    """A StepHook that ends the run (not a verdict) once `last` has run."""

    window_safe = True

    def __init__(self, last: int) -> None:
        self.last = last

    def after_step(self, step: int, loss: float, parts) -> bool:
        return step >= self.last


@dataclass
class Outcome:
    """How one trial ended: healthy (no verdict through its last step) or diverged with a verdict at a step."""

    run_dir: str
    status: str
    verdict: str | None
    first_bad_step: int | None
    steps_run: int
    seconds: float
    reason: str | None = None

    @property
    def healthy(self) -> bool:
        return self.status == "stable"

    def short(self) -> str:
        if self.healthy:
            return "healthy"
        if self.status == "diverged":
            return f"{self.verdict}@{self.first_bad_step}"
        return f"{self.status}: {self.reason}"


def run_trial(run: RunConfig, out_dir: Path, last: int | None = None, quick: bool = True) -> Outcome:
    """Train `run` into `out_dir`; with `last`, stop after that step. `quick` turns off what only slows a trial
    (forensics' replay, the eval loss, progress output). Under `stopping_on_signals` (the diagnosis's commands),
    a stop signal stops the trial after its step (its record says `interrupted`, never a misleading `error`) and
    then raises sweep.run.interrupt.Stopped, as it does before a trial starts once one came."""
    run = dataclasses.replace(run, progress=Progress.none)
    if quick:
        run = dataclasses.replace(
            run,
            monitor=dataclasses.replace(run.monitor, forensics=False),
            eval=dataclasses.replace(run.eval, enabled=False),
        )
    start = time.perf_counter()
    stop_if_asked()  # Ctrl-C/SIGTERM under a command of several runs: no new run starts (sweep/run/interrupt.py)
    hooks: list = [StopAfter(last)] if last is not None else []
    if (request := active_request()) is not None:  # the run stops after its step, recorded as interrupted
        hooks.append(StopOnSignal(request, run.steps))
    result = execute(run, out_dir, {}, hooks=hooks, record=TRIAL_FILE)
    try:
        r = json.loads((Path(out_dir) / TRIAL_FILE).read_text())
    except (OSError, ValueError):  # its files could not be written (a full disk): the result says why
        raise DiagnoseError(f"{out_dir}: the diagnosis's run could not record itself: {result.reason}") from None
    stop_if_asked()  # this run was interrupted (its record says so): its outcome is not the config's
    return Outcome(
        str(out_dir),
        r["status"],
        r.get("verdict"),
        r.get("first_bad_step"),
        r.get("steps_run") or 0,
        time.perf_counter() - start,
        r.get("reason"),
    )
