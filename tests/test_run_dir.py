"""A single run's directory holds one run (issue 33, item 2): the same config reruns it, another config or a
sweep's root is refused before anything is written."""

from __future__ import annotations

import pytest

from sweep.callbacks import check_run_dir
from sweep.config import ConfigError

from .conftest import FAST, hydra_cfg, run_cli

RUN = ["-m", "sweep", *FAST, "threads=1"]  # python -m sweep, one small run


def test_a_run_dir_holding_a_run_of_another_config_is_refused_and_the_same_config_reruns(tmp_path):
    run_dir = tmp_path / "run"
    first = run_cli(*RUN, "steps=2", "optim.lr=1e-3", "ledger.enabled=false", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    before = (run_dir / "result.json").read_text()

    other = run_cli(*RUN, "steps=2", "optim.lr=3e-2", "ledger.enabled=false", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    lines = [ln for ln in other.stderr.splitlines() if ln.strip()]
    assert other.returncode == 2 and len(lines) == 1, other.stderr[-2000:]
    assert "hydra.run.dir" in lines[0] and "optim.lr=0.001 there, 0.03 here" in lines[0], lines
    assert (run_dir / "result.json").read_text() == before

    # The same config again (threads/progress/log_every/logger aside, as for a sweep) passes: a rerun.
    check_run_dir(
        hydra_cfg("steps=2", "optim.lr=0.001", "ledger.enabled=false", "threads=2", f"hydra.run.dir={run_dir}")
    )
    # Resuming that run from its own checkpoint is the same run too.
    check_run_dir(
        hydra_cfg(
            "steps=2",
            "optim.lr=0.001",
            "ledger.enabled=false",
            f"checkpoint.resume_from={run_dir}",
            f"hydra.run.dir={run_dir}",
        )
    )
    with pytest.raises(ConfigError, match="optim.lr=0.001 there, 0.03 here"):
        check_run_dir(hydra_cfg("steps=2", "optim.lr=3e-2", "ledger.enabled=false", f"hydra.run.dir={run_dir}"))


@pytest.mark.parametrize("mark", ["multirun.yaml", ".sweep.lock", "0/.hydra/overrides.yaml"])
def test_a_sweep_root_is_refused_as_a_run_dir(tmp_path, mark):
    sweep_dir = tmp_path / "s"
    (sweep_dir / mark).parent.mkdir(parents=True, exist_ok=True)
    (sweep_dir / mark).write_text("- optim.lr=0.01\n")
    with pytest.raises(ConfigError, match=r"^hydra.run.dir: .* is the directory of a sweep"):
        check_run_dir(hydra_cfg("steps=2", f"hydra.run.dir={sweep_dir}"))


def test_a_sweep_root_as_run_dir_is_one_line_and_writes_nothing(tmp_path):
    from .conftest import multirun_in_process

    sweep_dir = tmp_path / "s"
    multirun_in_process(sweep_dir, "steps=2", "optim.lr=1e-3")
    trials = sorted(p.name for p in sweep_dir.iterdir())
    proc = run_cli(*RUN, "steps=2", f"hydra.run.dir={sweep_dir}", cwd=tmp_path)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "directory of a sweep" in lines[0], proc.stderr[-2000:]
    assert not (sweep_dir / "result.json").exists() and sorted(p.name for p in sweep_dir.iterdir()) == trials
