"""The same config gives the same loss curve bit for bit, also after other jobs ran in the same process."""

from __future__ import annotations

from sweep.run.execute import execute

from .conftest import SMALL_MODEL, make_run


def curve(tmp_path, name: str, *overrides: str) -> str:
    out = tmp_path / name
    execute(make_run(*SMALL_MODEL, *overrides), out, params={})
    return (out / "metrics.csv").read_text()


def test_same_config_same_curve_bit_for_bit(tmp_path):
    cfg = ["precision=bf16_amp", "attention=flash", "modulate=fused", "steps=8", "optim.lr=1e-3"]
    first = curve(tmp_path, "a", *cfg)
    # Another job in between changes global state (seed, TF32 flags, deterministic mode) ...
    curve(tmp_path, "other", "precision=fp16_amp", "seed=7", "deterministic=false", "steps=3")
    # ... and the replay is still identical, every digit of every loss and gradient norm.
    assert curve(tmp_path, "b", *cfg) == first
    assert first.count("\n") == 9


def test_seed_changes_the_curve(tmp_path):
    assert curve(tmp_path, "a", "steps=3") != curve(tmp_path, "b", "steps=3", "seed=1")


def test_diverged_run_replays_to_the_same_first_bad_step(tmp_path):
    runs = [execute(make_run(*SMALL_MODEL, "optim.lr=0.3", "steps=40"), tmp_path / str(i), params={}) for i in range(2)]
    assert runs[0].verdict == runs[1].verdict == "loss_spike"
    assert runs[0].first_bad_step == runs[1].first_bad_step
