"""The evaluation loss: a held-out set never trained on, measured without disturbing training, recorded everywhere."""

from __future__ import annotations

import math

import optuna
import pandas as pd
import pytest
import torch

from sweep.config import ConfigError
from sweep.data import synthetic
from sweep.run.build import build_parts, reset_process_state, resolve_device
from sweep.run.evaluate import build_eval_set, eval_settings, make_evaluator
from sweep.run.execute import conclude, execute, new_result
from sweep.run.monitor import Cause, Divergence
from sweep.run.packing import execute_pack
from sweep.run.precision import PrecisionPolicy
from sweep.run.results import METRIC_COLUMNS, MetricsLog
from sweep.search.ledger import record_run, storage_url

from .conftest import SMALL_MODEL, make_run, read_result


def built(run):
    device = resolve_device(run.device)
    policy = PrecisionPolicy.from_config(run.precision, device)
    reset_process_state(run, policy)
    return build_parts(run, device, policy)


def metrics(run_dir):
    return pd.read_csv(run_dir / "metrics.csv", dtype=str, keep_default_na=False)


def test_eval_clips_are_never_drawn_for_training_and_differ_from_every_training_clip():
    run = make_run(*SMALL_MODEL, "data.num_samples=12", "data.batch_size=5", "eval.samples=8", "steps=40")
    synthetic._render_all.cache_clear()
    before = synthetic.SyntheticClips(12, 4, 3, 8, 8, seed=0)._cache().clone()
    parts = built(run)
    evaluator = make_evaluator(run, parts)
    assert set(evaluator.data.indices).isdisjoint(range(12)) and len(evaluator.data) == 8
    drawn = {i for step in range(run.steps) for i in parts.order.indices(step)}
    assert drawn == set(range(12))  # every training clip, and only those, over 40 steps
    assert drawn.isdisjoint(evaluator.data.indices)
    # By content: no held-out clip equals a training clip, and making them left the training clips' bits alone.
    held = synthetic.held_out_clips(0, 12, 8, 3, 4, 8, 8, as_images=False)
    training = torch.stack([parts.dataset[i] for i in range(12)])
    assert torch.equal(training, before)
    assert not any(torch.equal(h, c) for h in held for c in training)
    assert min(float((h - c).abs().max()) for h in held for c in training) > 0.1
    # A second eval seed is another, disjoint held-out set.
    other = make_run("data.num_samples=12", "eval.samples=8", "eval.seed=1")
    assert set(build_eval_set(other, parts.objective, parts.device, False).indices).isdisjoint(evaluator.data.indices)


@pytest.mark.parametrize("precision", ["fp32", "bf16_amp"])
def test_evaluating_the_same_weights_twice_gives_the_same_bits(precision):
    run = make_run(f"precision={precision}", "eval.samples=6", "eval.batch_size=4")
    parts = built(run)
    evaluator = make_evaluator(run, parts)
    first, second = evaluator(parts.model, 0), evaluator(parts.model, 1)
    assert first == second and math.isfinite(first)
    assert parts.model.training  # training mode restored
    again = make_evaluator(run, built(run))(built(run).model, 0)  # a fresh build: the same set, the same weights
    assert again == first


@pytest.mark.parametrize("precision", ["fp32", "bf16_amp"])
def test_the_training_curve_is_bit_identical_with_eval_on_and_off(tmp_path, precision):
    common = [f"precision={precision}", "steps=6", "threads=1", "optim.lr=1e-3", "monitor.logit_every=2"]
    on = execute(make_run(*SMALL_MODEL, *common, "eval.every=1", "eval.samples=4"), tmp_path / "on", {})
    off = execute(make_run(*SMALL_MODEL, *common, "eval.enabled=false"), tmp_path / "off", {})
    a, b = metrics(tmp_path / "on"), metrics(tmp_path / "off")
    assert list(a.columns) == list(METRIC_COLUMNS)
    training = [c for c in METRIC_COLUMNS if c != "eval_loss"]
    assert a[training].equals(b[training])  # every training number, to the last printed digit
    assert (a.eval_loss != "").all() and (b.eval_loss == "").all()
    assert on.status == off.status == "stable" and off.eval_loss is None
    assert on.eval_loss == float(a.eval_loss.iloc[-1])
    assert off.eval["enabled"] is False and off.eval["reason"] == "eval.enabled=false"


def test_eval_loss_reaches_result_json_metrics_csv_and_the_ledger(tmp_path):
    run = make_run(*SMALL_MODEL, "steps=5", "threads=1", "eval.every=2", "eval.samples=4")
    result = execute(run, tmp_path / "r", {"optim.lr": 1e-4})
    stored = read_result(tmp_path / "r")  # strict JSON (no NaN)
    m = metrics(tmp_path / "r")
    assert list(m.step[m.eval_loss != ""]) == ["1", "3", "4"]  # every 2 steps, and after the last one
    assert stored["eval_loss"] == result.eval_loss == float(m.eval_loss.iloc[-1])
    assert stored["eval"] == {
        "enabled": True,
        "every": 2,
        "samples": 4,
        "seed": 0,
        "batch_size": 16,
        "clips": "synthetic data.seed=0 indices [32, 36)",
        "reason": None,
    }
    record_run(run.ledger, tmp_path, tmp_path / "r", stored)
    (summary,) = optuna.get_all_study_summaries(storage_url(run.ledger, tmp_path))
    (trial,) = optuna.load_study(study_name=summary.study_name, storage=storage_url(run.ledger, tmp_path)).trials
    assert trial.user_attrs["eval_loss"] == stored["eval_loss"] == trial.value  # a stable run's value: its eval loss
    assert trial.value != stored["final_loss"]


def test_a_stable_value_stays_below_the_penalty_whatever_its_eval_loss(tmp_path):
    from sweep.search.ledger import penalty, stable_value, trial_outcome

    stable = {"status": "stable", "final_loss": 0.5, "initial_loss": 1.0, "eval_loss": 30.0}
    assert stable_value(stable, 10.0) < penalty(stable, 10.0) == 10.0
    assert stable_value({**stable, "eval_loss": 0.25}) == 0.25
    assert stable_value({**stable, "eval_loss": None}) == 0.5  # no eval: the final training loss, as before
    assert trial_outcome({**stable, "status": "diverged"}, 10.0)[1] == 10.0


def test_a_diverged_runs_eval_loss_is_the_last_one_before_its_first_bad_step(tmp_path):
    run = make_run(
        "steps=12", "threads=1", "optim.lr=3e-2", "eval.every=1", "eval.samples=4", "monitor.forensics=false"
    )
    result = execute(run, tmp_path / "d", {})
    assert result.status == "diverged" and result.first_bad_step > 0, result.headline()
    m = pd.read_csv(tmp_path / "d" / "metrics.csv")
    evals = m.dropna(subset=["eval_loss"])
    assert evals.step.max() < result.steps_run  # never after the step that met the verdict
    before = evals[evals.step < result.first_bad_step]
    assert result.eval_loss == before.eval_loss.iloc[-1]  # the weights before the first bad step's update


def test_a_loss_spike_that_began_before_its_tripping_step_takes_the_eval_from_before_it_began():
    # A spike's first_bad_step is where the excursion began, possibly steps before the test tripped; evaluations
    # made in between measured weights already on the way up and must not count.
    run = make_run("monitor.forensics=false")
    parts = built(run)
    ev = make_evaluator(run, parts)
    ev.losses = {1: 0.5, 3: 0.4, 5: 0.9, 7: 3.0}
    log = MetricsLog()
    for step in range(8):
        log.log(step=step, loss=1.0, grad_norm=1.0, attn_max_logit="", attn_min_entropy="")
    result = new_result(run, {})
    conclude(result, run, parts, Divergence("loss_spike", 5, Cause("optimizer", None, "x")), log, 1.0, evaluator=ev)
    assert result.status == "diverged" and result.eval_loss == 0.4
    assert ev.before(4) == 0.4 and ev.before(1) is None and ev.before(None) == 3.0
    stable = new_result(run, {})
    conclude(stable, run, parts, None, log, 1.0, evaluator=ev)
    assert stable.eval_loss == 3.0  # a stable run: its last evaluation, the one after its last step


def test_packed_runs_get_the_eval_loss_they_get_alone(tmp_path):
    lrs = [1e-4, 1e-3, 3e-1]
    runs = [
        make_run(*SMALL_MODEL, f"optim.lr={lr}", f"seed={i}", "steps=6", "threads=1", "eval.every=2", "eval.samples=4")
        for i, lr in enumerate(lrs)
    ]
    runs.append(
        make_run(*SMALL_MODEL, "optim.lr=1e-4", "seed=7", "steps=6", "threads=1", "eval.every=2", "data.num_samples=24")
    )
    alone = [execute(r, tmp_path / f"alone{i}", {}) for i, r in enumerate(runs)]
    packed = execute_pack(runs, [tmp_path / f"packed{i}" for i in range(len(runs))], [{}] * len(runs), [""] * 4)
    assert all(p.packed == 4 for p in packed)
    assert [(p.status, p.first_bad_step) for p in packed] == [(a.status, a.first_bad_step) for a in alone]
    assert [p.eval for p in packed] == [a.eval for a in alone]
    for i, (a, p) in enumerate(zip(alone, packed)):
        if a.eval_loss is None:
            assert p.eval_loss is None
            continue
        assert p.eval_loss == pytest.approx(
            a.eval_loss, rel=1e-4
        )  # packed training rounds differently (docs/packing.md)
        ca, cp = (pd.read_csv(tmp_path / f"{k}{i}" / "metrics.csv").eval_loss for k in ("alone", "packed"))
        assert list(ca.notna()) == list(cp.notna())
        torch.testing.assert_close(
            torch.tensor(cp.dropna().values), torch.tensor(ca.dropna().values), rtol=1e-4, atol=0
        )
    assert any(a.status == "stable" for a in alone)


def test_folder_data_holding_no_file_out_has_no_eval_loss_and_says_why(tmp_path):
    # Folder data's held-out eval loss: tests/test_folder_eval.py.
    run = make_run("data=latent_folder", f"data.path={tmp_path}", "data.eval_files=0")
    settings = eval_settings(run)
    assert settings["enabled"] is False and "data.eval_files=0: every file of data.path trains" in settings["reason"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("eval.samples=0", "eval.samples: must be > 0"),
        ("eval.every=-1", "eval.every: must be >= 0"),
        ("eval.batch_size=0", "eval.batch_size: must be > 0"),
        ("eval.seed=-2", "eval.seed: must be in [0"),
    ],
)
def test_bad_eval_settings_are_one_line_config_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        make_run(override)
