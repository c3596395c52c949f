"""Issue 45, red-team finding 8: inputs that ended in a traceback, each now one clear line or a correct result.

Each test says what it was before; each fails without its fix (checked when it was written)."""

from __future__ import annotations

import json

import pytest

from sweep.config import ConfigError, check_inputs

from .conftest import make_run


def test_a_resume_with_steps_at_or_below_the_checkpoints_step_is_a_config_error(tmp_path):
    """Before: every such run ended `error` with a traceback (`ValueError: checkpoint.resume_from is at step 2,
    steps=2: nothing left to run`), raised after the model, the data and the checkpoint were built."""
    ckpt = tmp_path / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(json.dumps({"format": "dit-sweep-checkpoint/1", "step": 2, "files": {}}))
    for steps in (1, 2):
        with pytest.raises(
            ConfigError, match=r"^steps: steps=%d, but checkpoint.resume_from .* saved at step 2" % steps
        ):
            check_inputs(make_run(f"checkpoint.resume_from={ckpt}", f"steps={steps}"))
    check_inputs(make_run(f"checkpoint.resume_from={ckpt}", "steps=3"))  # one step left: fine


def flipped_checkpoint(tmp_path):
    """A 2-step run's checkpoint at step 2 with one byte of its weights flipped (a checksum mismatch)."""
    from sweep.run.execute import execute

    execute(make_run("steps=2", "checkpoint.every=2", "ledger.enabled=false"), tmp_path / "base", {})
    ckpt = tmp_path / "base" / "checkpoints" / "step_000002"
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    return ckpt


def test_a_run_refused_at_the_load_of_its_checkpoint_is_diagnosed_without_a_run(tmp_path, capsys):
    """Before: `python -m sweep.diagnose` on a `corrupt_checkpoint` run replayed it, loaded the same file and died
    of CorruptCheckpoint (a traceback), and so did the sweep's own monitor.diagnose=auto. Now: its mechanism,
    a table whose rows say why none runs, and the known fix; no run is made."""
    from sweep.diagnose.__main__ import main

    from .conftest import multirun_in_process

    ckpt = flipped_checkpoint(tmp_path)
    overrides = ["steps=4", f"checkpoint.resume_from={ckpt}", "optim.lr=1e-3,2e-3", "ledger.enabled=false"]
    multirun_in_process(tmp_path / "s", *overrides, "monitor.diagnose=auto")
    first, second = sorted((tmp_path / "s").glob("*/result.json"))
    assert json.loads(first.read_text())["verdict"] == "corrupt_checkpoint"
    d = json.loads((first.parent / "diagnosis.json").read_text())  # the sweep's own diagnosis
    assert d["mechanism"] == "corrupt_checkpoint" and d["agrees"] and "good copy of the file" in d["known_fix"]
    rows = d["counterfactuals"]["rows"]
    assert len(rows) == 6 and all(r["outcome"] is None and r["not_applicable"] for r in rows)
    assert not (first.parent / "diagnosis").exists()  # no replay, no row, no fix ran
    capsys.readouterr()
    assert main([str(second.parent)]) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and "nothing to replay" in out.out
    assert json.loads((second.parent / "diagnosis.json").read_text())["mechanism"] == "corrupt_checkpoint"
