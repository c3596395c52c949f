"""CMA-ES and QMC searches through our Optuna sweeper: every trial recorded, the sampler really used, seeded.

What Optuna 5 does with our search spaces (checked below, not assumed): CmaEsSampler samples the first
trial independently (n_startup_trials=1), then every numeric param from CMA-ES, one-dimensional spaces
included (each such trial carries `cma:generation`); a categorical param (precision) is always sampled
independently. QMCSampler samples the first trial independently, then walks an unscrambled Sobol
sequence over every param, categorical ones included, so from the second trial on its points do not
depend on the seed.
"""

from __future__ import annotations

import math

import optuna
import pytest
from optuna.trial import TrialState

from .conftest import SMALL_MODEL, multirun_in_process, read_result

SPACE = [
    "hydra/sweeper=optuna_sweep",
    "optim.lr=tag(log,interval(1e-4,1e-1))",
    "precision=fp32,bf16_amp",
    "steps=4",
    "hydra.sweeper.n_trials=4",
    "~hydra.callbacks.summary",
]


def search(sweep_dir, sampler: str, seed: int) -> list[optuna.trial.FrozenTrial]:
    multirun_in_process(
        sweep_dir, *SMALL_MODEL, *SPACE, f"hydra.sweeper.sampler.name={sampler}", f"hydra.sweeper.sampler.seed={seed}"
    )
    trials = optuna.load_study(study_name=str(sweep_dir), storage=f"sqlite:///{sweep_dir / 'ledger.db'}").trials
    assert len(trials) == 4 and all(t.state is TrialState.COMPLETE for t in trials)  # stable or diverged, never lost
    for t in trials:
        assert 1e-4 <= t.params["optim.lr"] <= 1e-1 and t.params["precision"] in ("fp32", "bf16_amp")
        assert math.isfinite(t.value) and t.user_attrs["status"] in ("stable", "diverged")
        result = read_result(sweep_dir / str(t.number))
        assert result["params"]["optim.lr"] == t.params["optim.lr"]  # the job ran what the sampler asked
        assert result["params"]["precision"] == t.params["precision"]
    return trials


@pytest.mark.slow
def test_cmaes_search_samples_lr_with_cma_and_is_seeded(tmp_path):
    trials = search(tmp_path / "a", "cmaes", seed=3)
    assert "cma:generation" not in trials[0].system_attrs  # the startup trial
    assert [t.system_attrs.get("cma:generation") for t in trials[1:]] == [0, 0, 0]  # CMA-ES, not a fallback
    again = search(tmp_path / "b", "cmaes", seed=3)
    assert [t.params for t in again] == [t.params for t in trials]


@pytest.mark.slow
def test_qmc_search_walks_a_sobol_sequence_and_is_seeded(tmp_path):
    trials = search(tmp_path / "a", "qmc", seed=3)
    # Sobol points 0, 1/2, 3/4 on log-lr over [1e-4, 1e-1] and 0, 1/2, 1/4 on the two precisions.
    lrs = [t.params["optim.lr"] for t in trials[1:]]
    assert lrs == pytest.approx([1e-4, 10**-2.5, 10**-1.75], rel=1e-9)
    assert [t.params["precision"] for t in trials[1:]] == ["fp32", "bf16_amp", "fp32"]
    again = search(tmp_path / "b", "qmc", seed=3)
    assert [t.params for t in again] == [t.params for t in trials]


def test_tpe_learns_the_diverged_region_from_the_ledgers_constraints_without_a_deprecation_warning():
    """The ledger writes each trial's constraints into its system attrs (a diverged run infeasible): TPE must propose
    away from an infeasible region even where its values are the lowest, and make_sampler must not print Optuna 5's
    FutureWarning for `constraints_func` on every sweep's terminal (it did)."""
    import warnings

    from sweep.search.conf import SamplerConf
    from sweep.search.ledger import CONSTRAINTS_KEY
    from sweep.search.sweeper import make_sampler

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler = make_sampler(SamplerConf(seed=0, n_startup_trials=5), {})
    x = optuna.distributions.FloatDistribution(0.0, 1.0)
    study = optuna.create_study(sampler=sampler)
    for i in range(20):  # the lower x, the lower the value, but x < 0.5 diverged
        v = (i + 0.5) / 20
        study.add_trial(
            optuna.trial.create_trial(
                params={"x": v},
                distributions={"x": x},
                value=v,
                system_attrs={CONSTRAINTS_KEY: [1.0 if v < 0.5 else -1.0]},
            )
        )
    proposed = [study.ask({"x": x}).params["x"] for _ in range(10)]
    assert sum(p >= 0.45 for p in proposed) >= 8, proposed  # unconstrained TPE proposes near 0
