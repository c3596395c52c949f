"""Windows of steps with one sync (monitor.sync_every > 1) give what one sync per step gives, bit for bit.

sweep/run/window.py: a window whose steps the host would all have let through stands; any other is taken
back and run again one sync per step. So every verdict, first bad step, cause and metrics row must be the
same for any sync_every, including a bad step at a window's last step, at its first, and at step 0.
"""

from __future__ import annotations

import csv
import dataclasses
import io

import pytest

from sweep.config import RunConfig
from sweep.data.batches import BatchOrder
from sweep.run import lone as lone_module
from sweep.run import train as train_module
from sweep.run.build import _ORDER_STREAM, stream_seed
from sweep.run.execute import execute

from .conftest import SMALL_MODEL, make_run, read_result

ORDER = BatchOrder(32, 4, stream_seed(0, _ORDER_STREAM))
FRESH_AT_3 = next(i for i in ORDER.indices(3) if i not in ORDER.indices(0) + ORDER.indices(1) + ORDER.indices(2))

CASES = {
    # name: (overrides, sync_every, the verdict and first bad step with one sync per step)
    "bad_input_at_step_0": (
        [f"data.faults=[{{index:{ORDER.indices(0)[1]},kind:nan}}]", "steps=8"],
        4,
        ("bad_input", 0),
    ),
    "bad_input_last_of_window": ([f"data.faults=[{{index:{FRESH_AT_3},kind:inf}}]", "steps=8"], 4, ("bad_input", 3)),
    "nonfinite_last_of_window": (["precision=fp16_pure", "optim.lr=1e-3", "steps=8"], 2, ("nonfinite_loss", 1)),
    "nonfinite_first_of_window": (["precision=fp16_pure", "optim.lr=1e-3", "steps=8"], 1 + 0, ("nonfinite_loss", 1)),
    "loss_spike": (["precision=fp32", "optim.lr=0.3", "steps=40"], 6, ("loss_spike", None)),
    # five skips down to min_scale (each takes its window of 7 back), not eleven: the same collapse, half the steps
    "scale_collapse": (
        ["precision=fp16_amp", "precision.scaler.init_scale=1e10", "precision.scaler.min_scale=1e9", "steps=30"],
        7,
        ("scale_collapse", 4),
    ),
    "stalled": (["precision=bf16_pure", "optim.lr=1e-5", "steps=10", "monitor.stall_window=5"], 5, ("stalled", 4)),
    "underflow_stall": (
        ["precision=fp16_amp_noscale", "objective.loss_weight=1e-6", "steps=20", "monitor.stall_window=5"],
        8,
        ("stalled", None),
    ),
    # five skips (steps 0-4) take their windows back, then [5, 13) and [13, 16) stand
    "overflow_skips_then_stable": (["precision=fp16_amp", "objective.loss_weight=300", "steps=16"], 8, (None, None)),
    "clipped_and_stable": (["precision=fp32", "optim.lr=1e-3", "optim.grad_clip=0.05", "steps=24"], 8, (None, None)),
    # windows of 12 (the stall check every 12 ends them) holding four attention-logit steps each
    "logit_steps_inside": (
        ["precision=bf16_amp", "steps=24", "monitor.logit_every=3", "monitor.stall_window=12"],
        16,
        (None, None),
    ),
}


def synced(run: RunConfig, sync_every: int) -> RunConfig:
    """`run` composed again with monitor.sync_every=`sync_every` (an equal RunConfig: nothing in conf/ interpolates
    it), without a second Hydra composition (~0.15 CPU-s)."""
    return dataclasses.replace(run, monitor=dataclasses.replace(run.monitor, sync_every=sync_every))


def outcome(tmp_path, run, sync_every):
    out = tmp_path / f"sync{sync_every}"
    r = execute(synced(run, sync_every), out, params={})
    rows = out / "metrics.csv"
    return r, rows.read_bytes() if rows.exists() else b""  # a run bad from step 0 has no row


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_window_gives_every_verdict_and_row_of_one_sync_per_step(tmp_path, name, monkeypatch):
    overrides, sync_every, (verdict, bad_step) = CASES[name]
    if name == "nonfinite_first_of_window":  # windows [0,1) then [1,3): step 1 opens a window
        overrides = [*overrides, "monitor.logit_every=1000"]
        sync_every = 3
    run = make_run(*SMALL_MODEL, *overrides)
    alone, alone_rows = outcome(tmp_path, run, 1)
    assert alone.verdict == verdict and (bad_step is None or alone.first_bad_step == bad_step), alone
    host_steps, loops = [], []  # steps run alone, by any loop (forensics replays too) / the loops, as made
    batches, init = lone_module.Lone.batches, train_module.Loop.__init__
    monkeypatch.setattr(  # a step run by itself draws its batch with `batches` (a window on synthetic data: never)
        lone_module.Lone,
        "batches",
        lambda self, step, live: host_steps.append((self, step)) or batches(self, step, live),
    )
    monkeypatch.setattr(train_module.Loop, "__init__", lambda self, *a, **k: loops.append(self) or init(self, *a, **k))
    windowed, windowed_rows = outcome(tmp_path, run, sync_every)
    alone_in_run = [s for layout, s in host_steps if layout is loops[0].layout]  # the run's own loop, not a replay's
    host_steps = [s for _, s in host_steps]
    assert windowed_rows == alone_rows
    for key in ("status", "verdict", "first_bad_step", "cause", "steps_run", "final_loss", "eval_loss"):
        assert repr(getattr(windowed, key)) == repr(getattr(alone, key)), key  # repr: nan == nan
    # result.json's `sync` says how the steps met the host: a sync per step alone and per window
    sync = windowed.sync
    assert sync["every"] == sync_every and sync["syncs"] == len(alone_in_run) + sync["windows"], sync
    assert 0 <= sync["ran_past_first_bad"] <= sync_every - 1 and sync["taken_back"] <= sync["windows"], sync
    assert alone.sync == {
        "every": 1,
        "syncs": alone.steps_run,
        "windows": 0,
        "taken_back": 0,
        "ran_past_first_bad": 0,
        "replayed": 0,
    }
    if name == "bad_input_at_step_0":  # the window [0, 4) ran whole before its one sync showed step 0's batch
        assert sync == {"every": 4, "syncs": 2, "windows": 1, "taken_back": 1, "ran_past_first_bad": 3, "replayed": 0}
    if name == "overflow_skips_then_stable":  # a skipping step takes its window back; once the scale
        assert 0 < len(host_steps) < 16  # settles, windows stand
    elif verdict is None:
        assert host_steps == [] and sync["taken_back"] == 0  # every window stood: no step needed the host alone
    elif verdict != "stalled":  # a stall check is the last step of a window that stands; any other bad step
        assert alone.first_bad_step in host_steps  # is decided one sync at a time, its window taken back


def test_windows_stand_between_stall_checks_and_eval_steps_with_logit_steps_inside():
    from sweep.run.window import window_end

    run = make_run("steps=50", "monitor.stall_window=20", "monitor.logit_every=10", "monitor.sync_every=8")
    m, steps = run.monitor, run.steps
    assert [window_end(m, steps, s, None, 8) for s in (0, 8, 10, 18, 19, 20, 48)] == [8, 16, 18, 20, 20, 28, 50]
    assert window_end(m, steps, 0, None, 32) == 20  # the logit steps 0 and 10 inside, the stall check (19) last
    assert window_end(m, steps, 3, None, 1) == 4


@pytest.mark.slow
def test_a_pack_in_windows_gives_every_run_what_one_sync_per_step_gives(tmp_path, monkeypatch):
    """A pack mixing a stable run, fp16 overflow skips, a spike, a bad sample and a stall (its own window
    sizes, 3 and 5): each run's verdict, first bad step, cause and metrics rows equal the pack's with one
    sync per step, byte for byte."""
    from sweep.run import packed
    from sweep.run import window as window_module
    from sweep.run.packing import execute_pack

    outcomes, window = [], window_module.Windows._window

    def recorded(windows, *args):
        result, *rest = window(windows, *args)
        outcomes.append((result.taken_back_at is None, isinstance(windows.layout, packed.Stacked)))
        return result, *rest

    monkeypatch.setattr(window_module.Windows, "_window", recorded)

    # 12 steps: every bad step is decided by step 6 and windows stand after it; loss_weight 300 skips steps 0-4
    common = ["precision=fp16_amp", "steps=12", "threads=1", "data.batch_size=2", "monitor.forensics=false"]
    per_run = [
        ["optim.lr=1e-4"],
        ["optim.lr=1e-4", "objective.loss_weight=300", "seed=1"],
        ["optim.lr=0.5", "seed=2"],
        [f"data.faults=[{{index:{FRESH_AT_3},kind:nan}}]", "seed=0", "data.seed=0"],
        ["optim.lr=1e-9", "seed=3", "objective.loss_weight=1e-9", "monitor.stall_window=5"],
    ]
    got, composed = {}, [make_run(*SMALL_MODEL, *common, *extra) for extra in per_run]
    for sync in (1, 3):
        runs = [synced(run, sync if i % 2 else 5 * sync // 3) for i, run in enumerate(composed)]
        dirs = [tmp_path / f"sync{sync}" / str(i) for i in range(len(runs))]
        results = execute_pack(runs, dirs, [{}] * len(runs), [str(i) for i in range(len(runs))])
        rows = [(d / "metrics.csv").read_bytes() if (d / "metrics.csv").exists() else b"" for d in dirs]
        got[sync] = ([(r.status, r.verdict, r.first_bad_step, repr(r.cause), r.steps_run) for r in results], rows)
        syncs = [r.sync for r in results]
        if sync == 1:
            assert all(s["windows"] == 0 and s["syncs"] == r.steps_run for s, r in zip(syncs, results)), syncs
        else:  # the pack's window is its smallest: 3 steps, so at most 2 ran past a first bad step
            assert all(s["windows"] > 0 and s["ran_past_first_bad"] <= 2 for s in syncs), syncs
    assert got[3] == got[1]
    assert all(is_pack for _, is_pack in outcomes)
    assert any(stood for stood, _ in outcomes) and not all(stood for stood, _ in outcomes)  # both kinds ran
    verdicts = {v for _, v, *_ in got[1][0]}
    assert {None, "loss_spike", "bad_input"} <= verdicts, got[1][0]
    overflowing = csv.DictReader(io.StringIO(got[1][1][1].decode()))
    assert [row["skipped"] for row in overflowing][:6] == ["1"] * 5 + ["0"]  # skips, then steps


def test_a_packs_window_sees_a_bad_batch_only_the_data_check_sees(tmp_path):
    """An out-of-range batch that trains fine (step 6's is the first above data.range_limit=0.89): in a window
    the pack's device flag takes the window back and the host's check gives bad_input at step 6, as with one
    sync per step; the other run goes on."""
    from sweep.run.packing import execute_pack

    common = ["precision=fp16_amp", "steps=12", "threads=1", "data.batch_size=2", "monitor.forensics=false"]
    got = {}
    composed = [
        make_run(*SMALL_MODEL, *common, "optim.lr=1e-4"),
        make_run(*SMALL_MODEL, *common, "data.range_limit=0.89", "seed=4"),
    ]
    for sync in (1, 3):
        runs = [synced(run, sync) for run in composed]
        dirs = [tmp_path / f"sync{sync}" / str(i) for i in range(2)]
        results = execute_pack(runs, dirs, [{}] * 2, ["0", "1"])
        got[sync] = [
            (r.status, r.verdict, r.first_bad_step, (d / "metrics.csv").read_bytes()) for r, d in zip(results, dirs)
        ]
        if sync == 3:
            assert results[1].sync["taken_back"] == 1 and results[1].sync["ran_past_first_bad"] == 2
    assert got[3] == got[1]
    assert got[1][1][1:3] == ("bad_input", 6) and got[1][0][0] == "stable"


def test_checkpoints_turning_windows_off_is_said_in_the_log(tmp_path, caplog):
    """issue 33: checkpoint.every silently turned monitor.sync_every>1 windows off."""
    import logging

    with caplog.at_level(logging.WARNING, logger="sweep"):
        r = execute(make_run(*SMALL_MODEL, "steps=2", "checkpoint.every=1", "monitor.sync_every=4"), tmp_path, {})
    assert r.status == "stable"
    said = [m for m in caplog.messages if "windows are off" in m]
    assert len(said) == 1 and "monitor.sync_every=4" in said[0] and "checkpoint.every=1" in said[0], caplog.messages
    assert read_result(tmp_path)["sync"]["every"] == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sweep"):
        execute(make_run(*SMALL_MODEL, "steps=2", "monitor.sync_every=4"), tmp_path / "plain", {})
    assert not [m for m in caplog.messages if "windows are off" in m]
