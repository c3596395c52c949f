"""Issue 45, red-team finding 9: `steps` had no upper bound, its per-step tables were built before step 0, and a
stop signal during that set-up was ignored. Each test fails without its fix (checked when it was written)."""

from __future__ import annotations

import os
import signal

from .conftest import SMALL_MODEL, make_run, read_result


def test_a_signal_during_the_set_up_stops_the_run_before_step_0(tmp_path, monkeypatch):
    """Before: a signal while the run was built only set the stop request, which was read after a step: a run
    whose set-up took long (steps=1e11 building its tables) ignored SIGTERM; here the run trained its steps and
    ended stable. Now the set-up stops at once and the run is `interrupted` before step 0."""
    from sweep.run import execute as ex
    from sweep.run.interrupt import stopping_on_signals

    real = ex.prepare

    def prepare(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered here, in the middle of the set-up
        return real(*args, **kwargs)

    monkeypatch.setattr(ex, "prepare", prepare)
    with stopping_on_signals() as request:
        r = ex.execute(make_run("steps=4"), tmp_path, {})
    assert request.signum == signal.SIGTERM
    assert r.status == "interrupted" and r.reason == "SIGTERM during the set-up, before step 0", r.reason
    assert r.interrupted_at_step is None and not r.steps_run
    assert read_result(tmp_path)["status"] == "interrupted" and not (tmp_path / "metrics.csv").exists()


def metrics(run_dir) -> str:
    return (run_dir / "metrics.csv").read_text()


def test_per_step_tables_a_window_at_a_time_train_bit_for_bit_as_whole_ones(tmp_path, monkeypatch):
    """The lr table (sweep/run/adamw.py) and the device batch-index table (sweep/data/device.py) hold a window of
    steps (sweep/data/step_table.py), refilled in place as the run moves on. With windows of 4 steps and tables of
    8 steps (refilled twice in 14 steps: each window and a graph's warm-up of 3 must fit), a lone run and a pack of
    two train bit for bit as with tables of every step: same losses, grad norms, lrs (a cosine schedule with
    warmup) and verdicts."""
    import sweep.run.graph as graph
    from sweep.run.execute import execute
    from sweep.run.packing import execute_pack

    def both(tag: str):
        common = [*SMALL_MODEL, "steps=14", "monitor.sync_every=4", "optim.schedule=cosine", "optim.warmup_steps=5"]
        lone = execute(make_run(*common, "optim.lr=3e-3"), tmp_path / tag / "lone", {})
        runs = [make_run(*common, f"optim.lr={lr}", "data.seed=3") for lr in (1e-3, 3e-2)]
        dirs = [tmp_path / tag / f"pack{k}" for k in range(2)]
        pack = execute_pack(runs, dirs, [{}, {}], ["a", "b"])
        return [lone, *pack], [tmp_path / tag / d for d in ("lone", "pack0", "pack1")]

    whole, whole_dirs = both("whole")  # SPAN 4096: one table of every step
    monkeypatch.setattr(graph, "SPAN", 1)  # table_span: max(1, sync_every + WARMUP + 1) = 8 steps
    assert graph.table_span(4) == 8
    windowed, windowed_dirs = both("windowed")
    assert [r.sync["windows"] for r in windowed] == [r.sync["windows"] for r in whole] and windowed[0].sync["windows"]
    for a, b, da, db in zip(whole, windowed, whole_dirs, windowed_dirs):
        assert (a.status, a.verdict, a.first_bad_step, a.steps_run) == (
            b.status,
            b.verdict,
            b.first_bad_step,
            b.steps_run,
        )
        assert metrics(da) == metrics(db)


def test_the_set_up_of_a_long_run_builds_no_table_of_its_steps():
    """Before: a run built its lr and bias-correction tables (steps + 1 entries each) and, with windows, a
    (steps, batch) index table before step 0: 3M steps took 27 s and 736 MB here, 30M 2.1 GB. Now the lr and index
    tables hold SPAN steps and the bias corrections stop where 1 - beta**n is 1.0 in double."""
    import torch

    from sweep.data.step_table import SPAN
    from sweep.run.build import build_parts
    from sweep.run.lone import Lone
    from sweep.run.precision import PrecisionPolicy

    run = make_run("steps=5000000", "monitor.sync_every=4", "optim.schedule=cosine")
    cpu = torch.device("cpu")
    parts = build_parts(run, cpu, PrecisionPolicy.from_config(run.precision, cpu))
    lone = Lone([run], [parts], windows=True)
    (h,) = parts.optimizer.hyper
    assert h.lr.table.shape == (SPAN,) and lone.device_batches.table.table.shape == (SPAN, run.data.batch_size)
    assert len(h.bias_correction1) == 357 and len(h.bias_correction2_sqrt) == 37_413  # betas 0.9, 0.999
    assert h.bias_correction1[-1] == 1.0 and h.bias_correction1[-2] < 1.0 and h.bias_correction2_sqrt[-1] == 1.0


def test_steps_past_the_bound_are_one_line_at_composition():
    """Before: nothing bounded `steps`; steps=100000000000 composed, and its run hung before step 0 building
    per-step tables. The bound (sweep/run/sizes.py check_steps): the metrics rows a run keeps in memory (600 B a
    step: 4 GiB at 7,158,278 steps), and for a model whose size is known, 30 days at an H100's dense bf16 peak."""
    import pytest

    from sweep.config import ConfigError
    from sweep.run.sizes import STEPS_LIMIT

    assert STEPS_LIMIT == 7_158_278
    rows = r"^steps: 100,000,000,000 is over the 7,158,278 steps a run may have: it keeps a metrics row per step"
    with pytest.raises(ConfigError, match=rows):
        make_run("steps=100000000000")
    make_run(f"steps={STEPS_LIMIT}")  # the bound itself composes
    big = ["model.size=B", "data.frames=16", "data.height=256", "data.width=256", "data.batch_size=8"]
    with pytest.raises(ConfigError, match=r"^steps: 5,000,000 steps of this model \(129.5M parameters, 2,097,152 tok"):
        make_run(*big, "data.num_samples=8", "steps=5000000")
    make_run(*big, "data.num_samples=8", "steps=1500000")


def test_a_diagnosis_trains_its_fix_for_a_bounded_multiple_of_the_steps_the_run_took_to_fail(tmp_path, monkeypatch):
    """Before: a diagnosis ran each candidate fix (and each bisection trial) from step 0 for the run's whole
    `steps`: a 1e6-step run that spiked at step 50 was trained again for 1e6 steps per candidate. Now a run from the
    start trains to 4x the steps the run took to fail (at least 1,000 steps; the run's end if sooner), and the
    diagnosis says through which step its fix held."""
    from omegaconf import OmegaConf

    from sweep.diagnose import fix
    from sweep.diagnose.signals import RunRecord
    from sweep.diagnose.trials import Outcome, from_start_last

    def record(steps: int, bad: int) -> RunRecord:
        run = make_run(f"steps={steps}")
        result = {"status": "diverged", "verdict": "loss_spike", "first_bad_step": bad}
        return RunRecord(tmp_path, result, [{"step": float(bad)}], OmegaConf.structured(run), run)

    assert from_start_last(record(1_000_000, 50)) == 999  # at least 1,000 steps
    assert from_start_last(record(1_000_000, 100_000)) == 400_003  # 4 x 100,001 steps, less one
    assert from_start_last(record(1_000_000, 900_000)) is None  # 4x reaches past the run's end: all of it
    assert from_start_last(record(800, 50)) is None  # a run of up to 1,000 steps: all of it, as before
    seen = []

    def run_trial(run, out_dir, last=None, quick=True):
        seen.append((run.steps, last))
        return Outcome(str(out_dir), "stable", None, None, (last or run.steps - 1) + 1, 0.0)

    monkeypatch.setattr(fix, "run_trial", run_trial)
    d = fix.confirm(record(1_000_000, 50), [["optim.lr=0.001"]], tmp_path, lambda _: None)
    assert seen == [(1_000_000, 999)] and d["confirmed"] and d["through_step"] == 999
