"""The optimizer axis (optim.name, sweep/run/optimizers.py): each library optimizer trains a run to a verdict and
says so in result.json; driven by the loop it takes exactly the steps the library takes driven by hand; a
checkpoint resumes it bit for bit, its host-side state (Prodigy's d, bitsandbytes' step counts) included; its
state's health is read; bad settings are one line."""

from __future__ import annotations

import csv

import pytest
import torch

from sweep.config import ConfigError
from sweep.run import optimizers
from sweep.run.execute import execute
from sweep.run.packing import refusal

from .conftest import SMALL_MODEL, make_run

LIBRARY = ["adamw_8bit", "adafactor", "came", "prodigy"]


def rows(run_dir):
    with open(run_dir / "metrics.csv") as f:
        return {int(r["step"]): (r["loss"], r["grad_norm"], r["lr"]) for r in csv.DictReader(f)}


@pytest.mark.parametrize("name", LIBRARY)
def test_each_library_optimizer_trains_to_a_verdict_and_is_recorded(tmp_path, name):
    lr = {"prodigy": "1.0", "adafactor": "1e-2"}.get(name, "1e-3")
    r = execute(
        make_run(*SMALL_MODEL, f"optim={name}", "steps=4", f"optim.lr={lr}", "ledger.enabled=false"),
        tmp_path,
        params={},
    )
    assert r.status == "stable", r.reason
    o = r.optimizer
    assert o["name"] == name and o["eager"] is True and o["health"]["nonfinite_count"] == 0
    assert o["library"].split()[0] == optimizers.OPTIM_LIBRARY[name][0]
    assert sum(o["state_dtypes"].values()) > 0
    if name == "adamw_8bit":  # the block and embedder matrices (>= 4096 values) have 8-bit moments, the rest fp32
        assert o["state_dtypes"]["uint8"] > 0 and o["state_dtypes"]["float32"] > 0
        assert 0 <= o["health"]["v_zero_m_nonzero"] < 1
    if name == "prodigy":
        assert "multiplies" in o["lr_means"] and o["d"][0] > 1e-6  # d grew from d0
    assert r.sync["every"] == 1


def test_our_adamw_is_recorded_as_capture_safe_with_its_moments_in_the_weights_dtype(tmp_path):
    r = execute(make_run(*SMALL_MODEL, "steps=2", "precision=bf16_pure", "ledger.enabled=false"), tmp_path, params={})
    assert r.optimizer["name"] == "adamw" and r.optimizer["eager"] is False
    assert set(r.optimizer["state_dtypes"]) == {"bfloat16"}


def test_the_loop_steps_the_library_exactly_as_a_hand_written_loop_would():
    """Reference: torch's Adafactor driven by hand with the same warmup lr per group (the LoRA-style lr_scale of a
    second group included): every weight equal bit for bit after 5 steps."""
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    b = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    b.load_state_dict(a.state_dict())

    def groups(m):
        return [
            {"params": list(m[0].parameters()), "lr_scale": 1.0},
            {"params": list(m[1].parameters()), "lr_scale": 0.5},
        ]

    lr_at = lambda step: 1e-2 * min(1.0, (step + 1) / 3)  # noqa: E731  (a warmup of 3 steps)
    ours = optimizers.LibraryOptimizer(optimizers.OptimName.adafactor, groups(a), lr_at, {"foreach": False}, "cpu")
    ref = torch.optim.Adafactor([{"params": g["params"], "lr": 1.0} for g in groups(b)], foreach=False)
    for step in range(5):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        for m in (a, b):
            m(x).square().mean().backward()
        ours.at(step)
        ours.step()
        for g, scale in zip(ref.param_groups, (1.0, 0.5)):
            g["lr"] = lr_at(step) * scale
        ref.step()
        ours.zero_grad(), ref.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), torch.nn.Linear(16, 32).parameters()))


@pytest.mark.parametrize("name", ["adamw_8bit", "prodigy"])
def test_a_checkpoint_resumes_a_library_optimizer_bit_for_bit(tmp_path, name):
    """Prodigy keeps its step-size estimate d in its param groups and bitsandbytes its step count as a Python int:
    without them in the checkpoint (numbers["optimizer"]) the resumed run restarts d at d0 and its bias
    correction at step 1, and its losses part from the full run's."""
    lr = "0.5" if name == "prodigy" else "1e-3"
    common = [f"optim={name}", f"optim.lr={lr}", "steps=8", "ledger.enabled=false", "eval.enabled=false"]
    full = tmp_path / "full"
    assert execute(make_run(*SMALL_MODEL, *common, "checkpoint.every=4"), full, params={}).status == "stable"
    ckpt = full / "checkpoints" / "step_000004"
    resumed = tmp_path / "resumed"
    r = execute(make_run(*SMALL_MODEL, *common, f"checkpoint.resume_from={ckpt}"), resumed, params={})
    assert (r.status, r.start_step) == ("stable", 4)
    assert rows(resumed) == {s: rows(full)[s] for s in range(4, 8)}


def test_a_checkpoint_resumes_only_into_the_optimizer_that_saved_it(tmp_path):
    from omegaconf import OmegaConf

    from sweep.config import check_inputs

    full, run = tmp_path / "full", make_run(*SMALL_MODEL, "steps=2", "checkpoint.every=2", "ledger.enabled=false")
    execute(run, full, params={})
    (full / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.structured(run), full / ".hydra" / "config.yaml")  # what Hydra saves beside it
    ckpt = full / "checkpoints" / "step_000002"
    with pytest.raises(ConfigError, match="optim.name=adamw there, prodigy here"):
        check_inputs(make_run(*SMALL_MODEL, "optim=prodigy", "steps=4", f"checkpoint.resume_from={ckpt}"))
    # without its optimizer state, the weights go into any optimizer
    check_inputs(
        make_run(
            *SMALL_MODEL,
            "optim=prodigy",
            "steps=4",
            f"checkpoint.resume_from={ckpt}",
            "checkpoint.resume_optimizer=false",
        )
    )


def test_health_finds_a_zeroed_second_moment_and_a_nonfinite_block():
    """A second moment whose 8-bit code dequantises to 0 beside a non-zero first moment makes the next update
    m / eps. (bitsandbytes 0.50's CPU quantiser did not produce one here: a value 1e-12 of its block's absmax got
    code 7, 1.6e-5 x absmax, an over-estimate; the check reads the codes whatever produced them.)"""
    bnb = pytest.importorskip("bitsandbytes")
    w = torch.nn.Parameter(torch.zeros(64, 64))
    opt = optimizers.LibraryOptimizer(optimizers.OptimName.adamw_8bit, [{"params": [w]}], lambda s: 1e-3, {}, "cpu")
    assert isinstance(opt.inner, bnb.optim.AdamW8bit)
    w.grad = torch.randn(64, 64)
    opt.at(0)
    opt.step()
    h = optimizers.health(opt)
    assert h == {"nonfinite": [], "nonfinite_count": 0, "v_zero_m_nonzero": 0.0}
    state = opt.state[w]
    state["state2"][:16] = int(state["qmap2"].abs().argmin())  # a quarter of the second moments read as 0
    assert optimizers.health(opt)["v_zero_m_nonzero"] == pytest.approx(0.25, abs=0.01)
    state["absmax2"][0] = float("inf")
    assert optimizers.health(opt)["nonfinite"] == ["0.absmax2"]


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["optim=came", "optim.betas=[0.9,0.999]"], "optim.betas: optim=came takes three"),
        (["optim=adafactor", "optim.eps=1e-8"], "optim.eps: optim=adafactor keeps its library's eps"),
        (["optim=prodigy", "optim.update_clip=1.0"], "optim.update_clip"),
        (["optim=adamw_8bit", "monitor.sync_every=4"], "monitor.sync_every: optim=adamw_8bit runs eagerly"),
        (["optim=prodigy", "optim.d_coef=0"], "optim.d_coef"),
        (["optim.name=sgd"], "sgd"),
        (["optim=prodigy", "finetune=lora", "optim.lora_lr=0.5"], "optim.lora_lr: optim=prodigy takes one lr"),
    ],
)
def test_bad_optimizer_settings_are_one_line(overrides, key):
    with pytest.raises(Exception, match=key.replace("[", r"\[")):
        make_run(*overrides)


def test_a_library_optimizer_is_never_packed():
    assert "runs eagerly" in refusal(make_run("optim=came"))
    assert refusal(make_run("optim=adamw")) is None


def test_a_missing_library_is_refused_at_composition_naming_the_extra(monkeypatch):
    """Before any run (one line, exit 2), as a missing torchao is for fp8: it was a run error in every cell."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "prodigyopt" else real(name, *a))
    with pytest.raises(ConfigError, match=r"optim.name: optim=prodigy needs prodigyopt, which is not installed: pip"):
        make_run("optim=prodigy")
    make_run("optim=came")  # the others' packages are there


def test_a_missing_library_is_one_line_naming_the_extra(monkeypatch):
    import importlib

    real = importlib.import_module

    def missing(name, *a):
        if name == "prodigyopt":
            raise ImportError("No module named 'prodigyopt'")
        return real(name, *a)

    monkeypatch.setattr(optimizers.importlib, "import_module", missing)
    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ConfigError, match=r"optim=prodigy: needs prodigyopt .*dit-precision-sweep\[lowprec\]"):
        optimizers.LibraryOptimizer(optimizers.OptimName.prodigy, [{"params": [w]}], lambda s: 1.0, {}, "cpu")


def test_the_tables_do_not_compare_lrs_that_mean_different_things(tmp_path):
    """Prodigy's lr multiplies its own step size: at the same lr value its run and AdamW's are no pair. The toggle
    row gives no lr steps, eval change or advice for them, and the frontier says what prodigy's lr means."""
    from sweep.report.recommend import toggle_advice
    from sweep.report.runs import runs_from_dirs
    from sweep.report.summary import summarize
    from sweep.report.text import render_text

    from .conftest import multirun_in_process

    multirun_in_process(
        tmp_path,
        *SMALL_MODEL,
        "optim=adamw,adamw_8bit,prodigy",
        "optim.lr=1e-3,1e-2",
        "steps=3",
        "report.html=false",
        "ledger.enabled=false",  # the tables read result.json; no Optuna study to write
    )
    s = summarize(runs_from_dirs(tmp_path))
    toggles = s.toggles.set_index(["a", "b"])
    for pair in [("adamw", "prodigy"), ("adamw_8bit", "prodigy")]:
        row = toggles.loc[pair]
        assert row.quality == "lrs not comparable" and row.isna()[["lr_steps", "eval_change"]].all()
    assert toggles.loc[("adamw", "adamw_8bit")].quality != "lrs not comparable"
    assert not [a for a in toggle_advice(s.toggles) if "prodigy" in (a.better, a.worse)]
    text = " ".join(render_text(s, width=10_000).split())
    assert "lr for optim=prodigy: multiplies Prodigy's own step-size estimate d" in text


def test_a_tie_goes_to_our_adamw_and_fp8_ranks_after_bf16_on_cuda():
    from sweep.report.target import cost

    assert cost("cuda", "bf16_amp", "flash", "adamw") < cost("cuda", "bf16_amp", "flash", "adamw_8bit")
    assert cost("cpu", "fp32", "math", "adamw") < cost("cpu", "fp32", "math", "prodigy")
    assert cost("cuda", "bf16_amp", "flash") < cost("cuda", "fp8_rowwise", "flash") < cost("cuda", "fp16_amp", "flash")
    assert cost("cpu", "fp16_amp", "math") < cost("cpu", "fp8_tensorwise", "math")  # emulated: ~3x bf16


def test_8bit_moments_dequantise_as_bitsandbytes_does():
    """The reference: bitsandbytes' own dequantize_blockwise, on a tensor whose size is not a multiple of the block."""
    F = pytest.importorskip("bitsandbytes.functional")
    w = torch.nn.Parameter(torch.zeros(5000))
    opt = optimizers.LibraryOptimizer(optimizers.OptimName.adamw_8bit, [{"params": [w]}], lambda s: 1e-3, {}, "cpu")
    for step in range(3):
        w.grad = torch.randn(5000, generator=torch.Generator().manual_seed(step)) * 10.0 ** torch.linspace(-6, 0, 5000)
        opt.at(step)
        opt.step()
    s = opt.state[w]
    got = optimizers.adamw_state_from_8bit(s, s["step"])
    for k, out in (("1", "exp_avg"), ("2", "exp_avg_sq")):
        ref = F.dequantize_blockwise(s[f"state{k}"], absmax=s[f"absmax{k}"], code=s[f"qmap{k}"], blocksize=256)
        torch.testing.assert_close(got[out], ref, rtol=0, atol=0)
    assert float(got["step"]) == 3 and got["exp_avg_sq"].min() >= 0


def test_an_8bit_checkpoint_resumes_into_our_adamw_with_its_moments_dequantised(tmp_path):
    """The diagnosis's "AdamW in fp32 state" row: from an AdamW8bit run's checkpoint our AdamW takes the same
    moments (and update count) in fp32, so its first step is the 8-bit run's step up to the 8-bit rounding."""
    common = ["optim.lr=1e-3", "steps=6", "ledger.enabled=false", "eval.enabled=false"]
    full = tmp_path / "full"
    execute(make_run(*SMALL_MODEL, "optim=adamw_8bit", *common, "checkpoint.every=3"), full, params={})
    ckpt = full / "checkpoints" / "step_000003"
    fresh = execute(
        make_run(
            *SMALL_MODEL, "optim=adamw", *common, f"checkpoint.resume_from={ckpt}", "checkpoint.resume_optimizer=false"
        ),
        tmp_path / "fresh",
        params={},
    )
    moved = execute(
        make_run(*SMALL_MODEL, "optim=adamw", *common, f"checkpoint.resume_from={ckpt}"), tmp_path / "moved", params={}
    )
    assert moved.status == fresh.status == "stable"
    eight, ours, afresh = (rows(d) for d in (full, tmp_path / "moved", tmp_path / "fresh"))
    assert ours[3][0] == eight[3][0]  # step 3's loss comes from the checkpointed weights: the same
    # step 4's loss follows the first update from the checkpoint: with the moments, close to the 8-bit run's;
    # fresh moments (a first Adam step, lr-sized in every weight) are further off
    gap = lambda r: abs(float(r[4][0]) - float(eight[4][0]))  # noqa: E731
    assert gap(ours) < gap(afresh)


def test_the_diagnosis_has_an_adamw_row_where_it_compares_like_with_like():
    from sweep.diagnose.counterfactual import adamw_row

    assert adamw_row(make_run("optim=adamw_8bit")).overrides == ["optim.name=adamw"]  # its moments dequantised
    assert "checkpoint.resume_optimizer=false" in adamw_row(make_run("optim=came")).overrides
    assert "multiplies" in adamw_row(make_run("optim=prodigy")).not_applicable
    assert adamw_row(make_run()).not_applicable == "the run already uses our AdamW"


def test_a_bad_optimizer_state_is_the_mechanism_with_its_known_fix():
    from pathlib import Path

    from sweep.diagnose.fix import candidates
    from sweep.diagnose.known import KNOWN
    from sweep.diagnose.mechanism import decide
    from sweep.diagnose.signals import RunRecord

    run = make_run("optim=adamw_8bit")
    health = {"nonfinite": ["3.absmax2"], "nonfinite_count": 1, "v_zero_m_nonzero": 0.0}
    result = {
        "status": "diverged",
        "verdict": "nonfinite_loss",
        "first_bad_step": 7,
        "cause": {"where": "forward", "module": None, "detail": "loss is nan"},
        "optimizer": {"name": "adamw_8bit", "library": "bitsandbytes 0.50.2", "health": health},
    }
    m = decide(RunRecord(Path("."), result, [], None, run))
    assert m.name == "optimizer_state" and "3.absmax2" in m.summary and "AdamW with fp32 state" in KNOWN[m.name]
    assert candidates(RunRecord(Path("."), result, [], None, run), m.name, m.evidence, None, [], None)[0][0] == (
        "optim.name=adamw"
    )
    healthy = {**result, "optimizer": {**result["optimizer"], "health": {"nonfinite_count": 0}}}
    assert decide(RunRecord(Path("."), healthy, [], None, run)).name != "optimizer_state"
