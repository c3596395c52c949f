"""Records of every era read back as the runs they were. `optim.name` was in the schema (always adamw), left it
(issue #32: nothing read it) and came back with the optimizer axis (issue #46): a run recorded in any of the
three eras replays, diagnoses and reruns in its own directory as the same AdamW run. `without_retired` keeps
dropping what the schema does not know (a user's `+tag`). `precision.name` stays: the diagnosis reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from sweep.callbacks import check_run_dir
from sweep.config import RETIRED_KEYS, ConfigError, without_retired

from .conftest import hydra_cfg, make_run


def recorded(run_dir: Path, *overrides: str, name: bool = True) -> None:
    """<run dir>/.hydra/config.yaml as Hydra saved it; `name=False`: as it was saved while optim.name was out of
    the schema (issue #32 to #46)."""
    saved = OmegaConf.to_container(hydra_cfg(*overrides, f"hydra.run.dir={run_dir}"), resolve=False)
    del saved["hydra"]
    if not name:
        del saved["optim"]["name"]
    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(saved), run_dir / ".hydra" / "config.yaml")
    (run_dir / "result.json").write_text('{"status": "stable"}')  # a run that ran (one refused at composition has none)


def recorded_before(run_dir: Path, *overrides: str) -> None:
    recorded(run_dir, *overrides)


def test_optim_name_is_in_the_schema_again_and_precision_name_stays():
    assert RETIRED_KEYS == ()
    assert hydra_cfg().optim.name == "adamw"
    assert make_run("optim=prodigy").optim.name.value == "prodigy"
    with pytest.raises(Exception, match="sgd"):  # not an optimizer we have: refused while composing
        hydra_cfg("optim.name=sgd")
    # read by sweep/diagnose/fix.py (gradient_underflow's fix) and counterfactual.py (the fp32 row)
    assert make_run("precision=fp16_amp_noscale").precision.name == "fp16_amp_noscale"


def test_without_retired_keeps_the_schema_keys_and_leaves_its_input_alone():
    old = OmegaConf.create({"optim": {"name": "adamw", "lr": 0.01}, "precision": {"name": "fp16_amp"}, "tag": "x"})
    new = without_retired(old)
    assert OmegaConf.to_container(new) == {"optim": {"name": "adamw", "lr": 0.01}, "precision": {"name": "fp16_amp"}}
    assert old.tag == "x"
    assert OmegaConf.to_container(without_retired(new)) == OmegaConf.to_container(new)  # nothing to drop


@pytest.mark.parametrize("name", [True, False], ids=["with-optim.name", "recorded-without-it"])
def test_a_recorded_run_replays_and_diagnoses_as_the_same_run(tmp_path, name):
    from sweep.diagnose.record import load
    from sweep.replay import load_run

    run_dir = tmp_path / "run"
    recorded(run_dir, "steps=3", "optim.lr=0.03", name=name)
    want = make_run("steps=3", "optim.lr=0.03")
    assert load_run(run_dir) == want

    result = {"status": "diverged", "verdict": "loss_spike", "first_bad_step": 2, "cause": None, "params": {}}
    (run_dir / "result.json").write_text(json.dumps({**result, "steps_run": 3}))
    (run_dir / "metrics.csv").write_text("step,loss\n0,1.0\n1,1.1\n2,50.0\n")
    record = load(run_dir)
    assert record.run == want


@pytest.mark.parametrize("name", [True, False], ids=["with-optim.name", "recorded-without-it"])
def test_a_recorded_run_reruns_in_its_own_run_dir(tmp_path, name):
    run_dir = tmp_path / "run"
    recorded(run_dir, "steps=2", "optim.lr=0.001", name=name)
    check_run_dir(hydra_cfg("steps=2", "optim.lr=0.001", f"hydra.run.dir={run_dir}"))  # the same run: no error
    with pytest.raises(ConfigError, match="optim.lr=0.001 there, 0.03 here"):  # another config is still refused
        check_run_dir(hydra_cfg("steps=2", "optim.lr=0.03", f"hydra.run.dir={run_dir}"))
    with pytest.raises(ConfigError, match="optim"):  # another optimizer is another run
        check_run_dir(hydra_cfg("steps=2", "optim=adamw_8bit", "optim.lr=0.001", f"hydra.run.dir={run_dir}"))


def test_replay_and_diagnosis_read_a_recorded_config_the_same_way_hydra_references_resolved(tmp_path):
    """A scenario's run records `${hydra:sweep.dir}/pretrained/...` (its init weights): outside Hydra nothing
    resolves it. Replay used to read the config without resolving it, so only the diagnosis could load such a
    run; both now read it through sweep.config.recorded.load_recorded."""
    from sweep.config.recorded import UnresolvedReference, load_recorded
    from sweep.diagnose.record import DiagnoseError, load
    from sweep.replay import load_run

    run_dir = tmp_path / "sweep" / "0"
    recorded_before(run_dir, "steps=3")
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    saved.model.init_from = "${hydra:sweep.dir}/pretrained/weights.safetensors"
    OmegaConf.save(saved, run_dir / ".hydra" / "config.yaml")
    weights = str((tmp_path / "sweep").resolve() / "pretrained" / "weights.safetensors")
    assert load_run(run_dir).model.init_from == weights  # no hydra.yaml: a job dir sits in its sweep dir
    assert load_recorded(run_dir)[1] == load_run(run_dir)

    saved.model.init_from = "${hydra:job.name}/w.safetensors"  # a key the run's hydra.yaml does not hold
    OmegaConf.save(saved, run_dir / ".hydra" / "config.yaml")
    with pytest.raises(UnresolvedReference, match=r"refers to \$\{hydra:job.name\}"):
        load_run(run_dir)
    result = {"status": "diverged", "verdict": "loss_spike", "first_bad_step": 2, "cause": None, "params": {}}
    (run_dir / "result.json").write_text(json.dumps({**result, "steps_run": 3}))
    (run_dir / "metrics.csv").write_text("step,loss\n0,1.0\n1,1.1\n2,50.0\n")
    with pytest.raises(DiagnoseError, match=r"refers to \$\{hydra:job.name\}"):
        load(run_dir)


def test_a_checkpoint_resumes_only_into_the_same_parametrization_and_older_ones_read_as_sp(tmp_path):
    """µP (model.param=mup) changes the init, the attention scale and every layer's lr: weights and AdamW state
    saved under SP do not mean the same under µP. A run recorded before model.param existed was SP."""
    from sweep.config import resume_mismatches

    checkpoint = tmp_path / "checkpoints" / "step_000006"
    checkpoint.mkdir(parents=True)
    (tmp_path / ".hydra").mkdir()
    saved = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(make_run("model.width=64"))))
    OmegaConf.save(saved, tmp_path / ".hydra" / "config.yaml")
    assert resume_mismatches(make_run("model.width=64"), checkpoint) == []
    mup = make_run("model.width=64", "model.param=mup", "model.base_width=32")
    assert [k for k, *_ in resume_mismatches(mup, checkpoint)] == ["model.param", "model.base_width"]
    del saved.model["param"], saved.model["base_width"]  # saved before the keys existed
    OmegaConf.save(saved, tmp_path / ".hydra" / "config.yaml")
    assert resume_mismatches(make_run("model.width=64"), checkpoint) == []
    assert [k for k, *_ in resume_mismatches(mup, checkpoint)] == ["model.param", "model.base_width"]


def test_a_run_with_a_tag_of_its_own_loads_as_the_run_it_was(tmp_path):
    """`+tag='...'` adds a top-level key the schema does not have; the run ignores it, and the recorded config must
    load as that run (before: a sweep with it had its confirmation and diagnoses end in a traceback, "Key 'tag'
    not in 'RunConfig'")."""
    from sweep.config.recorded import load_recorded

    run_dir = tmp_path / "run"
    saved = OmegaConf.to_container(hydra_cfg("steps=3", "+tag=a-tag", f"hydra.run.dir={run_dir}"), resolve=False)
    del saved["hydra"]
    assert saved["tag"] == "a-tag"
    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(saved), run_dir / ".hydra" / "config.yaml")
    config, run = load_recorded(run_dir)
    assert run == make_run("steps=3") and "tag" not in config
