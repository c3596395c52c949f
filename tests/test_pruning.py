"""Pruning through the ledger: jobs report their loss to their trial and stop when the sweeper's pruner says so."""

from __future__ import annotations

import csv

import optuna
import pytest
from optuna.trial import TrialState

from sweep.config import ConfigError, PrunerConfig, validate_pruner
from sweep.report.study import runs_from_study
from sweep.report.tables import divergence_map
from sweep.search.pruning import PruningHook, make_pruner, pruner_overrides

from .conftest import SMALL_MODEL, multirun_in_process, read_result, read_results

UPPER = 1.5  # the loss starts at ~1.0; a run above 1.5 is heading for a spike
THRESHOLD = [
    "hydra/sweeper=optuna_sweep",
    "hydra.sweeper.sampler.name=grid",
    "optim.lr=choice(1e-3,3e-2)",
    "steps=12",
    "hydra.sweeper.pruner.name=threshold",
    f"hydra.sweeper.pruner.upper={UPPER}",
    "hydra.sweeper.pruner.report_every=2",
]


def study(sweep_dir):
    return optuna.load_study(study_name=str(sweep_dir), storage=f"sqlite:///{sweep_dir / 'ledger.db'}")


def losses(run_dir) -> dict[int, float]:
    with open(run_dir / "metrics.csv") as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f)}


def check_threshold_sweep(sweep_dir) -> tuple[int, dict]:
    """The high-lr trial is pruned by the threshold before its spike; returns (pruned step, its trial's values)."""
    trials = {t.params["optim.lr"]: t for t in study(sweep_dir).trials}
    assert len(trials) == 2
    stable, pruned = trials[1e-3], trials[3e-2]
    assert stable.state is TrialState.COMPLETE and stable.user_attrs["status"] == "stable"
    assert sorted(stable.intermediate_values) == [1, 3, 5, 7, 9, 11]  # every 2nd step, the last one too

    run_dir = sweep_dir / str(pruned.number)
    result = read_result(run_dir)
    step = result["pruned_at_step"]
    assert result["status"] == "skipped" and result["verdict"] is None and result["first_bad_step"] is None
    assert result["reason"] == f"pruned by ThresholdPruner at step {step} (loss {losses(run_dir)[step]:.3g})"
    assert result["steps_run"] == step + 1 < 12 and step % 2 == 1
    loss = losses(run_dir)
    assert list(loss) == list(range(step + 1)) and loss[step] > UPPER  # stopped right after the bad report
    assert all(loss[s] <= UPPER for s in range(1, step, 2))  # ... and not at an earlier one

    assert pruned.state is TrialState.PRUNED and pruned.user_attrs["pruned_at_step"] == step
    assert pruned.user_attrs["status"] == "skipped" and pruned.user_attrs["reason"] == result["reason"]
    assert pruned.intermediate_values == {s: loss[s] for s in range(1, step + 1, 2)}
    assert pruned.value == loss[step]  # Optuna's rule: a PRUNED trial's value is its last report
    return step, pruned.intermediate_values


@pytest.mark.slow
def test_threshold_pruner_stops_a_diverging_run_and_records_where(tmp_path, capsys):
    sweep_dir = tmp_path / "sweep"
    multirun_in_process(sweep_dir, *THRESHOLD)
    step, _ = check_threshold_sweep(sweep_dir)
    assert f"pruned@{step}" in capsys.readouterr().out  # the end-of-sweep divergence map (from run dirs)
    runs, _ = runs_from_study(f"sqlite:///{sweep_dir / 'ledger.db'}", str(sweep_dir))
    table, _ = divergence_map(runs)
    assert table.loc[3e-2].tolist() == [f"pruned@{step}"] and table.loc[1e-3].tolist() == ["stable"]

    # Without the pruner the same run is a loss spike a step or more later: pruning cut it short.
    multirun_in_process(
        tmp_path / "unpruned",
        "hydra/sweeper=optuna_sweep",
        "hydra.sweeper.sampler.name=grid",
        "optim.lr=choice(3e-2)",
        "steps=12",
        "~hydra.callbacks.summary",
    )
    (unpruned,) = read_results(tmp_path / "unpruned")
    assert unpruned["status"] == "diverged" and unpruned["first_bad_step"] > step


@pytest.mark.slow
def test_median_pruner_prunes_a_later_trial_that_learns_nothing(tmp_path):
    """Two good trials complete; the third (lr 1e-6: the loss does not move) is worse than their median."""
    sweep_dir = tmp_path / "sweep"
    multirun_in_process(
        sweep_dir,
        *SMALL_MODEL,
        "hydra/sweeper=optuna_sweep",
        "hydra.sweeper.sampler.name=grid",
        "optim.lr=choice(3e-3,1e-3,1e-6)",
        "steps=16",
        "hydra.sweeper.pruner.name=median",
        "hydra.sweeper.pruner.n_startup_trials=2",
        "hydra.sweeper.pruner.n_warmup_steps=4",
        "hydra.sweeper.pruner.report_every=4",
        "~hydra.callbacks.summary",
    )
    trials = study(sweep_dir).trials
    assert [t.params["optim.lr"] for t in trials] == [3e-3, 1e-3, 1e-6]
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.PRUNED]
    assert all(sorted(t.intermediate_values) == [3, 7, 11, 15] for t in trials[:2])
    bad = trials[2]
    step = bad.user_attrs["pruned_at_step"]
    assert step == 7  # the first report after the warm-up
    median = sorted(t.intermediate_values[step] for t in trials[:2])
    assert min(bad.intermediate_values.values()) > sum(median) / 2  # MedianPruner's own rule, checked here
    result = read_result(sweep_dir / str(bad.number))
    assert (result["status"], result["pruned_at_step"], result["steps_run"]) == ("skipped", 7, 8)
    assert result["reason"].startswith("pruned by MedianPruner at step 7 (loss ")


@pytest.mark.slow
def test_pruning_works_from_joblib_worker_processes(tmp_path, monkeypatch):
    """Jobs in other processes load the study with the pruner the sweeper passed them: same outcome."""
    sweep_dir = tmp_path / "sweep"

    # A hook that ran in this process would now crash its run (status error); the workers have their own.
    def in_this_process(*args):
        raise RuntimeError("a job ran in the sweeper's process")

    monkeypatch.setattr(PruningHook, "after_step", in_this_process)
    (batch,) = multirun_in_process(
        sweep_dir,
        *THRESHOLD,
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "hydra.sweeper.n_jobs=2",
        "~hydra.callbacks.summary",
    )
    assert all(ret.hydra_cfg.hydra.launcher._target_.endswith("JoblibLauncher") for ret in batch)
    check_threshold_sweep(sweep_dir)
    overrides = (sweep_dir / "1" / ".hydra" / "overrides.yaml").read_text()
    assert "ledger.pruner.name=threshold" in overrides and f"ledger.pruner.upper={UPPER}" in overrides


def test_pruner_config_is_validated_and_passed_on_as_overrides():
    p = PrunerConfig(name="median", n_startup_trials=2, report_every=4)
    assert pruner_overrides(p) == [
        "ledger.pruner.name=median",
        "ledger.pruner.report_every=4",
        "ledger.pruner.n_startup_trials=2",
    ]
    assert pruner_overrides(PrunerConfig()) == []
    assert isinstance(make_pruner(p), optuna.pruners.MedianPruner) and make_pruner(PrunerConfig()) is None
    for name in ("percentile", "successive_halving", "hyperband"):
        assert make_pruner(PrunerConfig(name=name)) is not None
    with pytest.raises(ConfigError, match=r"^hydra.sweeper.pruner.upper: the threshold pruner needs upper or lower$"):
        validate_pruner(PrunerConfig(name="threshold"), "hydra.sweeper.pruner")
    with pytest.raises(ConfigError, match=r"^ledger.pruner.name: must be one of none, median, .*got 'medain'$"):
        validate_pruner(PrunerConfig(name="medain"), "ledger.pruner")
    with pytest.raises(ConfigError, match=r"^ledger.pruner.report_every: must be > 0, got 0$"):
        validate_pruner(PrunerConfig(name="median", report_every=0), "ledger.pruner")
