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


def test_valid_json_of_the_wrong_shape_is_named_and_left_out_by_the_report(tmp_path, capsys):
    """Before: a result.json whose `mechanism` is a string, or a diagnosis.json that is `null`, a list or has a
    string `fix`, stopped `python -m sweep.report` with an AttributeError traceback. Now the result.json is left
    out and named; a damaged diagnosis.json is named and its run kept (its diagnosis left out)."""
    from sweep.report.__main__ import main

    from .test_report_tables import diverged, write_run

    root = tmp_path / "s"
    write_run(root, 0, {"optim.lr": 1e-3}, {"status": "stable", "final_loss": 0.5})
    write_run(root, 1, {"optim.lr": 2e-3}, {**diverged("loss_spike", 3, "loss"), "mechanism": "boom"})
    for n, content in ((2, None), (3, [1]), (4, {"mechanism": "lr_too_high", "fix": "x"})):
        run_dir = write_run(root, n, {"optim.lr": n * 1e-3}, diverged("loss_spike", 3, "loss"))
        (run_dir / "diagnosis.json").write_text(json.dumps(content))
    assert main([str(root), "--no-html"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"{root}/1/result.json: mechanism is not an object or null" in err
    for n, why in (
        (2, "not a JSON object (a JSON null)"),
        (3, "not a JSON object (a JSON array)"),
        (4, "fix is not an object"),
    ):
        assert f"{root}/{n}/diagnosis.json: {why}" in err, err
    assert "4 runs from" in err and "(1 result.json, 3 diagnosis.json skipped" in err, err


@pytest.fixture(scope="module")
def spiked(tmp_path_factory):
    """A real 12-step run that spiked at lr 3e-2: its directory, and its result.json's text."""
    from .conftest import multirun_in_process

    root = tmp_path_factory.mktemp("spiked")
    multirun_in_process(root, "steps=12", "optim.lr=3e-2", "ledger.enabled=false")
    return root / "0", (root / "0" / "result.json").read_text()


@pytest.mark.parametrize(
    "change,words",
    [
        ({"cause": [1]}, "cause is not an object or null (a JSON array)"),
        ({"first_bad_step": "four"}, "first_bad_step is not a 64-bit integer or null (got 'four')"),
        ({"first_bad_step": 999}, "first_bad_step 999 is not a step of the run (steps 0 to 11)"),
        ({"seconds": "fast"}, "seconds is not a number or null (got 'fast')"),
        ({"headroom": "x"}, "headroom is not a list of objects or null"),
        ({"start_step": "x"}, "start_step is not a 64-bit integer or null"),
        ({"status": 3}, "status is not a string"),
    ],
)
def test_valid_json_of_the_wrong_shape_is_one_line_for_diagnose(spiked, capsys, change, words):
    """Before: each was a traceback from deep inside the diagnosis (AttributeError, ValueError, TypeError)."""
    from sweep.diagnose.__main__ import main

    run_dir, text = spiked
    (run_dir / "result.json").write_text(json.dumps({**json.loads(text), **change}))
    try:
        assert main([str(run_dir), "--no-fix"]) == 2
    finally:
        (run_dir / "result.json").write_text(text)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sweep.diagnose: ") and words in err[0], err
