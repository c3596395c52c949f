"""Checkpoints: bit-identical resume, verified loads, and corrupt files refused before any step."""

from __future__ import annotations

import csv
import json
import os
import pickle
import tempfile

import pytest
import torch
from safetensors.torch import save_file

from models import build_model
from sweep.run import checkpoint
from sweep.run.execute import execute

from .conftest import SMALL_MODEL, make_run


def losses(run_dir):
    with open(run_dir / "metrics.csv") as f:
        return {int(r["step"]): (r["loss"], r["grad_norm"], r["loss_scale"]) for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 12-step fp16_amp run (loss scaler live) that checkpoints every 6 steps."""
    out = tmp_path_factory.mktemp("full")
    r = execute(
        make_run(*SMALL_MODEL, "precision=fp16_amp", "steps=12", "checkpoint.every=6", "optim.lr=1e-3"), out, params={}
    )
    assert r.status == "stable"
    return out


def test_resume_gives_the_same_losses_bit_for_bit(trained, tmp_path):
    ckpt = trained / "checkpoints" / "step_000006"
    assert json.loads((ckpt / "manifest.json").read_text())["step"] == 6
    r = execute(
        make_run(*SMALL_MODEL, "precision=fp16_amp", "steps=12", "optim.lr=1e-3", f"checkpoint.resume_from={ckpt}"),
        tmp_path,
        params={},
    )
    assert (r.status, r.start_step, r.steps_run, r.loaded) == ("stable", 6, 6, str(ckpt))
    full, resumed = losses(trained), losses(tmp_path)
    assert sorted(resumed) == list(range(6, 12))
    assert resumed == {s: full[s] for s in range(6, 12)}  # loss, grad norm and loss scale, as strings


def test_resume_without_the_optimizer_state_starts_adamw_afresh(trained, tmp_path):
    from sweep.run.build import build_parts, resolve_device
    from sweep.run.precision import PrecisionPolicy

    ckpt = trained / "checkpoints" / "step_000006"
    run = make_run(
        *SMALL_MODEL,
        "precision=fp16_amp",
        "steps=12",
        "optim.lr=1e-3",
        f"checkpoint.resume_from={ckpt}",
        "checkpoint.resume_optimizer=false",
    )
    # on the device the checkpoint was written on (device=auto): its RNG states resume there only
    parts = build_parts(run, resolve_device(run.device), PrecisionPolicy.from_config(run.precision))
    assert parts.start_step == 6 and not parts.optimizer.state  # weights resumed, moments and step count not
    r = execute(run, tmp_path, params={})
    assert (r.status, r.start_step, r.steps_run) == ("stable", 6, 6)
    full, fresh = losses(trained), losses(tmp_path)
    assert fresh[6] == full[6]  # the same weights, batch, noise and loss scale...
    assert fresh[7][0] != full[7][0]  # ...but a different first update: bias correction from step 1


def test_keep_prunes_old_checkpoints(tmp_path):
    execute(make_run(*SMALL_MODEL, "steps=6", "checkpoint.every=2", "checkpoint.keep=1"), tmp_path, params={})
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000006"]


@pytest.mark.parametrize("kind", ["bitflip", "nan"])
def test_a_corrupted_checkpoint_is_refused_before_any_step(trained, tmp_path, kind):
    ckpt = trained / "checkpoints" / "step_000006"
    r = execute(
        make_run(
            *SMALL_MODEL,
            "precision=fp16_amp",
            "steps=12",
            f"checkpoint.resume_from={ckpt}",
            f"checkpoint.inject={kind}",
            "checkpoint.inject_tensor=blocks.1.attn.qkv.weight",
        ),
        tmp_path,
        params={},
    )
    assert (r.status, r.verdict, r.first_bad_step, r.steps_run) == ("diverged", "corrupt_checkpoint", 6, 0)
    assert r.cause["where"] == "checkpoint" and r.cause["module"] == "blocks.1.attn.qkv.weight"
    assert r.cause["detail"].startswith("model.safetensors: SHA-256 mismatch in tensor blocks.1.attn.qkv.weight")
    assert not (tmp_path / "metrics.csv").exists()


def test_unverified_nan_checkpoint_collapses_the_loss_scale_and_is_traced_to_the_weights(trained, tmp_path):
    """The Hallo case: load a corrupted file without checking; NaN predictions; the scaler halves to its floor."""
    ckpt = trained / "checkpoints" / "step_000006"
    r = execute(
        make_run(
            *SMALL_MODEL,
            "precision=fp16_amp",
            "steps=60",
            f"checkpoint.resume_from={ckpt}",
            "checkpoint.inject=nan",
            "checkpoint.verify=false",
            "checkpoint.inject_tensor=blocks.1.attn.qkv.weight",
        ),
        tmp_path,
        params={},
    )
    assert (r.status, r.verdict) == ("diverged", "scale_collapse")
    assert (r.cause["where"], r.cause["module"]) == ("checkpoint", "blocks.1.attn.qkv"), r.cause
    scales = [float(row[2]) for _, row in sorted(losses(tmp_path).items())]
    assert scales[0] == 65536 and scales[-1] == 1.0 and scales == sorted(scales, reverse=True)


@pytest.mark.parametrize("links", [True, False], ids=["linked", "no_links"])
def test_an_injected_copy_links_the_state_it_leaves_alone_and_never_writes_the_source(
    trained, tmp_path, monkeypatch, links
):
    """inject_fault copies the weights file it corrupts and hard-links the optimizer's and trainer's state (~3/4 of
    a checkpoint; a run and each trial of its diagnosis make a copy), or copies them where no link can be made:
    either way the source stays as it was, byte for byte."""
    if not links:

        def cross_device(src, dst):
            raise OSError(18, "Invalid cross-device link")

        monkeypatch.setattr(os, "link", cross_device)
    ckpt = trained / "checkpoints" / "step_000006"
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    path, name = checkpoint.inject_fault(ckpt, tmp_path / "copy", "nan", "blocks.1.attn.qkv.weight")
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    copied = {p.name: p for p in path.iterdir()}
    assert set(copied) == set(before) and name == "blocks.1.attn.qkv.weight"
    model = checkpoint.MODEL_FILE
    assert not os.path.samefile(copied[model], ckpt / model) and copied[model].read_bytes() != before[model]
    for n, p in copied.items():
        if n != model:
            assert p.read_bytes() == before[n] and os.path.samefile(p, ckpt / n) == links, n


def test_a_build_with_no_run_directory_loads_the_corrupted_copy_and_keeps_none(trained, tmp_path, monkeypatch):
    """A diagnosis reads a checkpoint.inject run's data through build_parts with no run directory: the corrupted
    copy it loads is removed after the build (it was left in the temp folder, a checkpoint's size each time)."""
    from sweep.run.build import build_parts, resolve_device
    from sweep.run.precision import PrecisionPolicy

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    ckpt = trained / "checkpoints" / "step_000006"
    run = make_run(
        *SMALL_MODEL,
        "precision=fp16_amp",
        "steps=12",
        f"checkpoint.resume_from={ckpt}",
        "checkpoint.inject=nan",
        "checkpoint.verify=false",
        "checkpoint.inject_tensor=blocks.1.attn.qkv.weight",
    )
    parts = build_parts(run, resolve_device(run.device), PrecisionPolicy.from_config(run.precision))
    assert parts.start_step == 6
    assert not torch.isfinite(dict(parts.model.named_parameters())["blocks.1.attn.qkv.weight"]).all()  # the copy
    assert list(temp.iterdir()) == []


@pytest.mark.parametrize("precision", ["fp32", "fp16_amp"])
def test_an_unverified_bitflip_is_traced_to_the_file_by_its_size(trained, tmp_path, precision):
    """A flipped exponent bit is finite (0.02 -> ~7e36): no NaN scan sees it, and the forward overflows. Its size,
    before any update, names the file, not the forward (fp32) or an fp16 overflow (fp16_amp)."""
    ckpt = trained / "checkpoints" / "step_000006"
    r = execute(
        make_run(
            *SMALL_MODEL,
            f"precision={precision}",
            "steps=30",
            f"checkpoint.resume_from={ckpt}",
            "checkpoint.inject=bitflip",
            "checkpoint.verify=false",
            "checkpoint.inject_tensor=t_embedder.mlp.0.bias",
        ),
        tmp_path,
        params={},
    )
    assert r.status == "diverged"
    assert (r.cause["where"], r.cause["module"]) == ("checkpoint", "t_embedder.mlp.0"), r.cause
    assert "before any update, beyond any trained weight" in r.cause["detail"]
    assert r.mechanism["name"] == "corrupt_checkpoint"


def test_init_from_loads_weights_and_scans_a_bare_file(tmp_path):
    model = build_model("video_dit", "tiny", input_size=8, in_channels=3, num_frames=4)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, tmp_path / "pretrained.safetensors")
    r = execute(
        make_run("steps=2", f"model.init_from={tmp_path / 'pretrained.safetensors'}"), tmp_path / "a", params={}
    )
    assert r.status == "stable" and r.loaded.endswith("pretrained.safetensors")
    state["blocks.2.mlp.fc1.weight"][0, 0] = float("inf")
    save_file(state, tmp_path / "bad.safetensors")  # no manifest: only the scan can catch it, and does
    r = execute(make_run("steps=2", f"model.init_from={tmp_path / 'bad.safetensors'}"), tmp_path / "b", params={})
    assert (r.verdict, r.first_bad_step, r.cause["module"]) == ("corrupt_checkpoint", 0, "blocks.2.mlp.fc1.weight")
    state["blocks.2.mlp.fc1.weight"][0, 0] = 7e36  # a flipped exponent bit: finite, so only its size shows it
    save_file(state, tmp_path / "flipped.safetensors")
    r = execute(make_run("steps=2", f"model.init_from={tmp_path / 'flipped.safetensors'}"), tmp_path / "c", params={})
    assert (r.verdict, r.first_bad_step, r.cause["module"]) == ("corrupt_checkpoint", 0, "blocks.2.mlp.fc1.weight")
    assert "holds 7e+36, beyond any trained weight" in r.cause["detail"]


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_pickle_is_never_executed(tmp_path):
    class Evil:
        def __reduce__(self):
            return (exec, ("open('pwned', 'w').write('x')",))

    path = tmp_path / "weights.pt"
    path.write_bytes(pickle.dumps({"w": Evil()}))
    r = execute(make_run("steps=2", f"model.init_from={path}"), tmp_path / "run", params={})
    assert (r.verdict, r.cause["where"]) == ("corrupt_checkpoint", "checkpoint")
    assert "weights only" in r.cause["detail"] and not (tmp_path / "pwned").exists()


def test_missing_manifest_and_truncation_are_named(trained, tmp_path):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained / "checkpoints" / "step_000006", ckpt)
    with open(ckpt / "optimizer.safetensors", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(checkpoint.CorruptCheckpoint, match="optimizer.safetensors: .*truncated"):
        checkpoint.resume(_parts(), ckpt)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(checkpoint.CorruptCheckpoint, match="no manifest.json"):
        checkpoint.load_weights(ckpt)


@pytest.mark.parametrize(
    "name,content", [("w.safetensors", b""), ("w.safetensors", b"just some text, not safetensors\n"), ("w.pt", b"")]
)
def test_an_empty_or_foreign_safetensors_file_is_a_corrupt_checkpoint(tmp_path, name, content):
    path = tmp_path / name  # an empty .pt: torch's EOFError has no message (was an IndexError, a run error)
    path.write_bytes(content)
    r = execute(make_run("steps=2", f"model.init_from={path}"), tmp_path / "run", params={})
    assert (r.status, r.verdict, r.first_bad_step, r.cause["where"]) == (
        "diverged",
        "corrupt_checkpoint",
        0,
        "checkpoint",
    )
    assert f"empty or corrupt weights file {path}" in r.cause["detail"], r.cause


@pytest.mark.parametrize("drop", ["bytes", "sha256"])
def test_a_manifest_entry_without_size_or_sum_is_a_corrupt_checkpoint(trained, tmp_path, drop):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained / "checkpoints" / "step_000006", ckpt)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["files"]["model.safetensors"][drop]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    r = execute(
        make_run(*SMALL_MODEL, "precision=fp16_amp", "steps=8", f"checkpoint.resume_from={ckpt}"),
        tmp_path / "run",
        params={},
    )
    assert (r.verdict, r.cause["where"]) == ("corrupt_checkpoint", "checkpoint"), r.reason
    assert r.cause["detail"] == f"model.safetensors: its manifest.json entry has no '{drop}'" + (
        " (the file size) to verify against" if drop == "bytes" else " to verify against"
    )


def _parts():
    """The parts `trained`'s checkpoints resume into."""
    from sweep.run.build import build_parts, resolve_device
    from sweep.run.precision import PrecisionPolicy

    run = make_run(*SMALL_MODEL, "precision=fp16_amp")  # the model `trained` checkpointed
    return build_parts(run, resolve_device("cpu"), PrecisionPolicy.from_config(run.precision))


def test_config_errors_are_one_line():
    from sweep.config import ConfigError

    with pytest.raises(ConfigError, match="checkpoint.inject: corrupts the file being loaded"):
        make_run("checkpoint.inject=nan")
    with pytest.raises(ConfigError, match="checkpoint.inject: must be null, bitflip or nan"):
        make_run("checkpoint.inject=zap", "model.init_from=x")


def test_an_unscaled_checkpoint_does_not_set_the_loss_scale_of_a_scaled_run(tmp_path, caplog):
    """fp32 saves the disabled scaler's state (scale 1.0); resumed under fp16_amp the scale starts at init_scale."""
    from sweep.run.build import build_parts, resolve_device
    from sweep.run.precision import PrecisionPolicy

    r = execute(
        make_run(*SMALL_MODEL, "precision=fp32", "steps=1", "checkpoint.every=1", "eval.enabled=false"),
        tmp_path / "fp32",
        params={},
    )
    assert r.status == "stable"
    ckpt = tmp_path / "fp32" / "checkpoints" / "step_000001"
    run = make_run(*SMALL_MODEL, "precision=fp16_amp", "steps=4", f"checkpoint.resume_from={ckpt}")
    with caplog.at_level("WARNING", logger="sweep"):
        parts = build_parts(run, resolve_device(run.device), PrecisionPolicy.from_config(run.precision))
    assert parts.start_step == 1
    assert parts.scaler.scale == run.precision.scaler.init_scale
    assert "without loss scaling" in caplog.text and str(run.precision.scaler.init_scale) in caplog.text


def _as_if_saved_on_cuda(source, dest, marker: bool):
    """A copy of a checkpoint whose RNG states look like a CUDA run's (a Philox state is 16 bytes: seed and
    offset), with trainer.json's device marker or (marker=False) without it, as checkpoints saved before it;
    the manifest is rewritten to match, so only the device can refuse it."""
    import shutil

    import torch
    from safetensors.torch import load_file

    shutil.copytree(source, dest)
    trainer = load_file(dest / checkpoint.TRAINER_FILE)
    philox = torch.arange(16, dtype=torch.uint8)
    trainer.update({"rng.noise": philox, "rng.cuda.0": philox.clone()})
    save_file(trainer, dest / checkpoint.TRAINER_FILE)
    numbers = json.loads((dest / checkpoint.TRAINER_JSON).read_text())
    numbers.pop("device", None)
    if marker:
        numbers["device"] = "cuda"
    (dest / checkpoint.TRAINER_JSON).write_text(json.dumps(numbers))
    manifest = json.loads((dest / checkpoint.MANIFEST).read_text())
    for name in (checkpoint.TRAINER_FILE, checkpoint.TRAINER_JSON):
        entry = manifest["files"][name]
        entry.update(sha256=checkpoint.sha256_file(dest / name), bytes=(dest / name).stat().st_size)
        if "tensors" in entry:
            entry["tensors"] = checkpoint.tensor_digests(dest / name)
    (dest / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    return dest


@pytest.mark.parametrize("marker", [True, False], ids=["marked", "older"])
def test_a_cuda_checkpoint_resumed_on_the_cpu_is_refused_in_one_line(trained, tmp_path, marker):
    """Not torch's "Expected a CPUGeneratorImplState of size 5056 but found the input RNG state size to be 16":
    a line naming both devices and what to do, before any step; an older checkpoint's device is told by the
    size of its noise state."""
    ckpt = _as_if_saved_on_cuda(trained / "checkpoints" / "step_000006", tmp_path / "ckpt", marker)
    run = make_run(
        *SMALL_MODEL, "device=cpu", "precision=fp16_amp", "steps=12", "optim.lr=1e-3", f"checkpoint.resume_from={ckpt}"
    )
    r = execute(run, tmp_path / "run", params={})
    assert (r.status, r.steps_run) == ("error", 0), r.reason
    assert r.reason == (
        f"ValueError: checkpoint.resume_from: {ckpt} was saved by a run on cuda and this run is on cpu: its RNG"
        " states (diffusion noise, cuda) continue only on cuda, so the resumed losses would not be the"
        " uninterrupted run's. Resume it with device=cuda, or start from its weights alone with"
        f" model.init_from={ckpt} (fresh optimizer, scaler and RNG)"
    )
    assert "\n" not in r.reason and not (tmp_path / "run" / "metrics.csv").exists()


def test_a_checkpoint_names_the_device_type_that_wrote_it(trained):
    """Older checkpoints without the marker still resume on their device: the noise state's size tells it."""
    import torch
    from safetensors.torch import load_file

    ckpt = trained / "checkpoints" / "step_000006"
    numbers = json.loads((ckpt / checkpoint.TRAINER_JSON).read_text())
    trainer = load_file(ckpt / checkpoint.TRAINER_FILE)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the fixture ran with device=auto
    assert numbers["device"] == device
    del numbers["device"]
    assert checkpoint.saved_device(trainer, numbers) == device


@pytest.mark.cuda
def test_a_cuda_checkpoint_resumes_bit_for_bit_on_cuda_and_is_refused_on_the_cpu(tmp_path):
    common = ["precision=fp16_amp", "steps=8", "optim.lr=1e-3"]
    full = tmp_path / "full"
    assert (
        execute(make_run(*SMALL_MODEL, "device=cuda", *common, "checkpoint.every=4"), full, params={}).status
        == "stable"
    )
    ckpt = full / "checkpoints" / "step_000004"
    assert json.loads((ckpt / checkpoint.TRAINER_JSON).read_text())["device"] == "cuda"
    r = execute(
        make_run(*SMALL_MODEL, "device=cuda", *common, f"checkpoint.resume_from={ckpt}"), tmp_path / "cuda", params={}
    )
    assert (r.status, r.start_step) == ("stable", 4), r.reason
    assert losses(tmp_path / "cuda") == {s: v for s, v in losses(full).items() if s >= 4}
    r = execute(
        make_run(*SMALL_MODEL, "device=cpu", *common, f"checkpoint.resume_from={ckpt}"), tmp_path / "cpu", params={}
    )
    assert r.status == "error" and f"{ckpt} was saved by a run on cuda and this run is on cpu" in r.reason


@pytest.mark.parametrize("where", ["run", "checkpoints"])
def test_resume_from_a_run_dir_or_its_checkpoints_folder_is_a_config_error_naming_the_steps(trained, where):
    """issue 45: resume_from=<run dir> or <run dir>/checkpoints (not a step directory) became a
    `corrupt_checkpoint` divergence; it is a config error that names the step directories found there."""
    from sweep.config import ConfigError, check_inputs

    path = trained if where == "run" else trained / "checkpoints"
    with pytest.raises(ConfigError) as err:
        check_inputs(make_run("precision=fp16_amp", f"checkpoint.resume_from={path}"))
    line = str(err.value)
    assert line.startswith("checkpoint.resume_from: ") and "not a checkpoint" in line, line
    assert "checkpoints/step_000006" in line and "checkpoints/step_000012" in line and "\n" not in line, line


def test_resume_from_a_step_dir_is_left_to_the_verifier(trained, tmp_path):
    """What is inside a step directory (or a copied checkpoint) is the verifier's business: not a config error."""
    from sweep.config import check_inputs

    empty = tmp_path / "checkpoints" / "step_000003"
    empty.mkdir(parents=True)
    check_inputs(make_run(f"checkpoint.resume_from={empty}"))
    copied = tmp_path / "mine"
    copied.mkdir()
    (copied / "model.safetensors").write_bytes(b"")
    check_inputs(make_run(f"checkpoint.resume_from={copied}"))


def test_init_from_a_run_dir_is_a_config_error_too(trained):
    from sweep.config import ConfigError, check_inputs

    with pytest.raises(ConfigError, match=r"^model.init_from: .* not a checkpoint but holds step directories"):
        check_inputs(make_run(f"model.init_from={trained}"))


def test_the_config_check_knows_every_file_a_checkpoint_holds():
    from sweep.config.inputs import CHECKPOINT_FILES

    names = (checkpoint.MANIFEST, checkpoint.MODEL_FILE, checkpoint.OPTIM_FILE, checkpoint.TRAINER_FILE)
    assert set(CHECKPOINT_FILES) == {*names, checkpoint.TRAINER_JSON}
