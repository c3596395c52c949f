"""Forensics: for each injected cause, the recorded cause.where and cause.module are the true ones."""

from __future__ import annotations

import json

import torch

import sweep.run.model
from sweep.run.execute import execute

from .conftest import make_run, multirun_in_process, read_result, run_cli


def run_with_weights(tmp_path, monkeypatch, edit, *overrides):
    """A run whose freshly built model is edited (the same edit applies to the forensic replay)."""
    real = sweep.run.model.build_model

    def build(*a, **k):
        model = real(*a, **k)
        with torch.no_grad():
            edit(model)
        return model

    monkeypatch.setattr(sweep.run.model, "build_model", build)
    return execute(make_run(*overrides), tmp_path, params={})


def test_overflowing_attention_in_fp16_is_found_in_its_block(tmp_path, monkeypatch):
    """Huge q/k weights in blocks.1 only: QK^T overflows fp16 in eager attention there, nowhere else."""

    def edit(model):
        model.blocks[1].attn.qkv.weight.mul_(300.0)

    r = run_with_weights(tmp_path, monkeypatch, edit, "precision=fp16_amp_noscale", "attention=eager", "steps=3")
    assert (r.verdict, r.first_bad_step) == ("nonfinite_loss", 0)
    assert (r.cause["where"], r.cause["module"]) == ("forward", "blocks.1.attn"), r.cause
    assert r.headroom and all(h["dtype"] for h in r.headroom)


def test_corrupted_weight_is_blamed_on_the_weights_not_the_forward(tmp_path, monkeypatch):
    def edit(model):
        model.blocks[2].mlp.fc1.weight[3, 5] = float("nan")

    r = run_with_weights(tmp_path, monkeypatch, edit, "steps=3")
    assert (r.verdict, r.first_bad_step) == ("nonfinite_loss", 0)
    assert (r.cause["where"], r.cause["module"]) == ("checkpoint", "blocks.2.mlp.fc1"), r.cause


def test_exploding_lr_is_an_optimizer_spike(tmp_path):
    r = execute(make_run("optim.lr=0.3", "steps=40"), tmp_path, params={})
    assert (r.verdict, r.cause["where"]) == ("loss_spike", "optimizer")


def test_nan_sample_is_blamed_on_the_data(tmp_path):
    r = execute(
        make_run(
            "data.faults=[{index:0,kind:nan},{index:1,kind:nan},{index:2,kind:nan},{index:3,kind:nan}]",
            "data.num_samples=8",
            "data.batch_size=8",
            "steps=2",
        ),
        tmp_path,
        params={},
    )
    assert (r.verdict, r.cause["where"], r.first_bad_step) == ("bad_input", "data", 0)


def test_replay_command_on_a_finished_run(tmp_path, capsys):
    """`python -m sweep.replay RUN_DIR` as typed, on a run a multirun finished in this process (what is tested
    is the replay command, not how `python -m sweep` starts: one interpreter start-up fewer)."""
    from sweep import replay

    multirun_in_process(
        tmp_path / "sweep",
        "precision=fp16_amp_noscale",
        "optim.lr=0.3",
        "steps=40",
        "monitor.spike_factor=1e9",
        "ledger.enabled=false",
    )
    run_dir = tmp_path / "sweep" / "0"
    result = read_result(run_dir)
    assert result["verdict"] == "nonfinite_loss" and result["cause"]["where"] == "forward"
    proc = run_cli("-m", "sweep.replay", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    forensics = json.loads((run_dir / "forensics.json").read_text())
    assert forensics["step"] == result["first_bad_step"]
    assert forensics["cause"] == result["cause"]  # the replay is deterministic: the same place again
    assert "closest to overflow" in proc.stdout
    capsys.readouterr()
    assert replay.main([str(tmp_path / "nope")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_nonfinite_gradient_names_a_parameter_with_forensics_off(tmp_path, monkeypatch):
    """The cheap explanation alone (no replay) reads the gradients before they are cleared."""

    def edit(model):  # an Inf gradient for one weight, finite loss
        model.blocks[0].mlp.fc2.weight.register_hook(lambda g: g * float("inf"))

    r = run_with_weights(tmp_path, monkeypatch, edit, "steps=3", "monitor.forensics=false")
    assert r.verdict == "nonfinite_grad"
    assert (r.cause["where"], r.cause["module"]) == ("backward", "blocks.0.mlp.fc2"), r.cause


def test_replay_is_honest_about_a_stable_run_and_bad_steps(tmp_path, capsys):
    """A stable run has nothing non-finite to find; a step the run never reached, or a negative one,
    is a one-line mistake (exit 2) instead of a retrain of that many steps."""
    from sweep import replay

    multirun_in_process(tmp_path / "sweep", "steps=3", "ledger.enabled=false")
    run_dir = tmp_path / "sweep" / "0"
    assert read_result(run_dir)["status"] == "stable"
    capsys.readouterr()

    assert replay.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "nothing to replay" in out and "non-finite" not in out.replace("nothing went non-finite", "")
    assert not (run_dir / "forensics.json").exists()

    assert replay.main([str(run_dir), "--step", "1"]) == 0  # asked for: replayed, and it stayed finite
    out = capsys.readouterr().out
    assert "stayed finite" in out and "loss itself went non-finite" not in out
    assert json.loads((run_dir / "forensics.json").read_text())["cause"] is None

    for step in ("999", "3", "-3"):
        assert replay.main([str(run_dir), "--step", step]) == 2, step
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--step" in err[0], err
