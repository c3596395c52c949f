"""Hydra's own sweeper test suite against our sweepers (hydra.test_utils.launcher_common_tests).

The grid sweeper runs the suite unchanged. The Optuna sweeper runs an adaptation of the suite's
2-jobs-per-batch test: it adds `ledger.trial_number=N` to every job and orders grid cells by key,
which are the two things the suite hard-codes from the basic sweeper.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.test_utils.launcher_common_tests import BatchedSweeperTestSuite
from hydra.test_utils.test_utils import TSweepRunner
from hydra.version import _UNSPECIFIED_, VersionBase


@pytest.fixture(autouse=True)
def _hydra_legacy_version_base():
    """Hydra's suites assume its default version base (jobs chdir into their dirs); other tests of
    ours compose with version_base="1.3", which Hydra keeps in a process-wide singleton."""
    saved = VersionBase.instance().getbase()
    VersionBase.instance().version_base = _UNSPECIFIED_
    yield
    VersionBase.instance().version_base = saved


@pytest.mark.parametrize(
    "launcher_name, overrides", [("basic", ["hydra/sweeper=grid", "hydra.sweeper.max_batch_size=2"])]
)
class TestGridSweeperBatched(BatchedSweeperTestSuite):
    """Our validating grid sweeper is Hydra's basic sweeper to Hydra's own tests."""


def test_optuna_sweeper_batches_through_the_launcher(hydra_sweep_runner: TSweepRunner, tmpdir: Path) -> None:
    sweep = hydra_sweep_runner(
        calling_file=None,
        calling_module="hydra.test_utils.a_module",
        task_function=None,
        config_path="configs",
        config_name="compose.yaml",
        temp_dir=tmpdir,
        overrides=[
            "hydra/sweeper=optuna_sweep",
            "hydra.sweeper.sampler.name=grid",
            "hydra.sweeper.n_jobs=2",
            "hydra/launcher=basic",
            "group1=file1,file2",
            "bar=100,200,300",
        ],
    )
    with sweep:
        assert sweep.returns is not None and [len(b) for b in sweep.returns] == [2, 2, 2]
        flat = [r for batch in sweep.returns for r in batch]
        cells = sorted((r.cfg["foo"], r.cfg["bar"]) for r in flat)
        assert cells == [(10, 100), (10, 200), (10, 300), (20, 100), (20, 200), (20, 300)]
        assert len({r.working_dir for r in flat}) == 6
        assert sorted(sorted(r.overrides) for r in flat) == sorted(
            [f"bar={b}", f"group1={g}"] for g in ("file1", "file2") for b in (100, 200, 300)
        )
