"""Folder data's held-out eval loss: a split stable by path hash, files that never train, a fixed eval loss."""

from __future__ import annotations

import math
import random

import pytest
import torch
from safetensors.torch import save_file

from sweep.config import ConfigError
from sweep.data.folder import FolderSplit
from sweep.data.split import file_hash, split_files
from sweep.run.execute import execute
from sweep.run.packing import execute_pack

from .conftest import make_run, read_result, sweep_forked
from .test_eval_loss import built, metrics

SHAPE = (4, 2, 8, 8)
LATENT = ["data=latent_folder", "data.frames=2", "data.height=8", "data.width=8", "data.batch_size=4"]
LATENT += ["steps=4", "threads=1", "progress=none", "ledger.enabled=false", "eval.samples=6"]


def write_latents(root, names, seed=0):
    """One (4, 2, 8, 8) latent in [-0.9, 0.9] per name, smooth enough to learn something in a few steps."""
    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for name in names:
        x = torch.nn.functional.interpolate(torch.rand(4, 2, 4, 4, generator=g), size=(8, 8), mode="bilinear")
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        save_file({"latents": (x * 1.8 - 0.9).contiguous()}, str(root / name))
    return root


# ---- the split ------------------------------------------------------------------------------------


def names(n, start=0, folder="clips"):
    return [f"{folder}/{i:05d}.safetensors" for i in range(start, start + n)]


def test_a_fraction_moves_no_existing_file_when_files_are_added():
    before = split_files(names(400), 0.1)
    after = split_files(names(400) + names(600, 400) + names(50, folder="more"), 0.1)
    assert before.note is None and 0.05 < len(before.held_out) / 400 < 0.15  # ~10%
    assert set(after.held_out) & set(names(400)) == set(before.held_out)  # no old file changed side
    assert all(file_hash(n) < 0.1 for n in after.held_out) and all(file_hash(n) >= 0.1 for n in after.train)
    shuffled = names(400)
    random.Random(0).shuffle(shuffled)
    assert set(split_files(shuffled, 0.1).held_out) == set(before.held_out)  # the listing order does not matter


def test_a_count_is_displaced_by_at_most_one_file_per_file_added():
    files = names(20)
    held = set(split_files(files, 8).held_out)
    for name in names(60, 20):
        files.append(name)
        now = set(split_files(files, 8).held_out)
        assert len(now) == 8 and now <= held | {name} and len(held - now) <= 1
        held = now


def test_the_split_holds_one_file_out_at_least_and_never_every_file():
    small = split_files(["a.pt", "b.pt", "c.pt"], 0.001)  # no hash below 0.001: the smallest is held out
    assert len(small.held_out) == 1 and "smallest hash" in small.note
    assert small.held_out[0] == min(["a.pt", "b.pt", "c.pt"], key=file_hash)
    assert len(split_files(["a.pt", "b.pt", "c.pt"], 5).held_out) == 2  # a count past the folder: one trains
    assert split_files(["a.pt", "b.pt"], 0.9999).train == (max(["a.pt", "b.pt"], key=file_hash),)
    one = split_files(["a.pt"], 0.1)
    assert one.train == ("a.pt",) and one.held_out == () and "nothing is held out" in one.note
    assert split_files(["a.pt", "b.pt"], 0) == split_files(["a.pt", "b.pt"], 0.0)
    assert split_files(["a.pt", "b.pt"], 0).held_out == ()


@pytest.mark.parametrize("value", ["-1", "1.5", "-0.25", "2.5"])
def test_bad_eval_files_values_fail_at_composition_naming_the_key(value, tmp_path):
    with pytest.raises(ConfigError, match=r"^data\.eval_files: ") as err:
        make_run("data=latent_folder", f"data.path={tmp_path}", f"data.eval_files={value}")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"^data\.eval_files: "):  # malformed whatever the source
        make_run(f"data.eval_files={value}")


def test_a_bad_eval_files_value_is_one_line_at_the_command_line(tmp_path):
    proc = sweep_forked("data.eval_files=1.5", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("sweep: config error: data.eval_files"), lines[0]


# ---- runs -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def latents(tmp_path_factory):
    return write_latents(tmp_path_factory.mktemp("latents"), [f"z{i:02d}.safetensors" for i in range(12)])


def test_held_out_files_never_appear_in_a_training_batch(latents):
    run = make_run(*LATENT, f"data.path={latents}", "data.eval_files=3", "data.skip_samples=[0]", fast=False)
    parts = built(run)
    split = FolderSplit.of(latents, "latent_folder", 3)
    assert parts.held_out.files == split.names() and len(split.held_out) == 3
    assert parts.dataset.files == split.train
    drawn = {parts.dataset.files[i] for step in range(300) for i in parts.order.indices(step)}
    assert drawn == set(split.train[1:])  # every training file but the skipped one, over 300 steps
    assert drawn.isdisjoint(split.held_out)


def test_a_latent_folder_run_has_a_fixed_finite_eval_loss_named_by_its_files(latents, tmp_path):
    common = [*LATENT, f"data.path={latents}", "optim.lr=1e-3"]
    first = execute(make_run(*common, fast=False), tmp_path / "a", {})
    again = execute(make_run(*common, fast=False), tmp_path / "b", {})
    every = execute(make_run(*common, "eval.every=1", fast=False), tmp_path / "c", {})
    off = execute(make_run(*common, "eval.enabled=false", fast=False), tmp_path / "d", {})
    assert first.status == "stable" and math.isfinite(first.eval_loss)
    assert first.eval_loss == again.eval_loss == every.eval_loss  # the same bits, evaluated once or every step
    assert first.eval_loss != first.final_loss
    training = [c for c in metrics(tmp_path / "a").columns if c != "eval_loss"]
    for other in ("b", "c", "d"):  # the training curve does not see the eval
        assert metrics(tmp_path / "a")[training].equals(metrics(tmp_path / other)[training])
    held = FolderSplit.of(latents, "latent_folder", 0.1).names()
    stored = read_result(tmp_path / "a")["eval"]
    assert stored["files"] == held and stored["unusable"] == {} and stored["pairs"] == 6
    assert stored["enabled"] is True and stored["reason"] is None and "clips" not in stored
    assert off.eval_loss is None and off.eval["files"] == held and off.eval["reason"] == "eval.enabled=false"
    none = execute(make_run(*common, "data.eval_files=0", fast=False), tmp_path / "e", {})
    assert none.eval_loss is None and none.eval["files"] == [] and "data.eval_files=0" in none.eval["reason"]


def test_unusable_held_out_files_are_named_and_left_out(tmp_path):
    files = [f"z{i:02d}.safetensors" for i in range(10)]
    root = write_latents(tmp_path / "latents", files)
    nan, short, clean = FolderSplit.of(root, "latent_folder", 3).names()
    x = torch.zeros(SHAPE).uniform_(-0.5, 0.5)
    x[0, 0, 0, 0] = math.nan
    save_file({"latents": x}, str(root / nan))
    save_file({"latents": torch.zeros(4, 1, 8, 8)}, str(root / short))
    run = make_run(*LATENT, f"data.path={root}", "data.eval_files=3", fast=False)
    result = execute(run, tmp_path / "r", {})
    assert result.status == "stable" and math.isfinite(result.eval_loss)  # from the one usable file
    stored = read_result(tmp_path / "r")["eval"]
    assert stored["files"] == [nan, short, clean] and list(stored["unusable"]) == [nan, short]
    assert "nan: 1 NaN values" in stored["unusable"][nan] and "shape (4, 1, 8, 8)" in stored["unusable"][short]
    save_file({"latents": x}, str(root / clean))  # none usable: no eval loss, and why
    result = execute(run, tmp_path / "none", {})
    assert result.status == "stable" and result.eval_loss is None
    assert result.eval["enabled"] is False and "none of the 3 held-out files is usable" in result.eval["reason"]


def test_a_video_folder_run_has_a_fixed_finite_eval_loss(tmp_path):
    pytest.importorskip("av")
    from .test_doctor import FRAMES, SIZE, _encode, _uint8_frames

    root = tmp_path / "clips"
    root.mkdir()
    for i in range(5):
        _encode(root / f"clip{i}.mp4", _uint8_frames(i % 4))
    common = ["data=video_folder", f"data.path={root}", f"data.frames={FRAMES}", f"data.height={SIZE}"]
    common += [f"data.width={SIZE}", "steps=2", "threads=1", "progress=none", "ledger.enabled=false", "eval.samples=4"]
    a = execute(make_run(*common, fast=False), tmp_path / "a", {})
    b = execute(make_run(*common, "eval.every=1", fast=False), tmp_path / "b", {})
    assert a.status == b.status == "stable" and math.isfinite(a.eval_loss) and a.eval_loss == b.eval_loss
    assert a.eval["files"] == FolderSplit.of(root, "video_folder", 0.1).names() and len(a.eval["files"]) == 1


def test_packed_folder_runs_evaluate_as_they_do_alone(latents, tmp_path):
    runs = [
        make_run(*LATENT, f"data.path={latents}", f"optim.lr={lr}", f"seed={i}", fast=False)
        for i, lr in enumerate((1e-4, 1e-3))
    ]
    alone = [execute(r, tmp_path / f"alone{i}", {}) for i, r in enumerate(runs)]
    packed = execute_pack(runs, [tmp_path / f"packed{i}" for i in range(2)], [{}] * 2, ["0", "1"])
    assert all(p.packed == 2 for p in packed)
    assert [p.eval for p in packed] == [a.eval for a in alone]
    for a, p in zip(alone, packed):
        assert p.eval_loss == pytest.approx(a.eval_loss, rel=1e-4)  # packed training rounds differently


def test_synthetic_runs_ignore_eval_files(tmp_path):
    common = ["steps=3", "threads=1", "eval.samples=4", "ledger.enabled=false"]
    a = execute(make_run(*common), tmp_path / "a", {})
    b = execute(make_run(*common, "data.eval_files=0.5"), tmp_path / "b", {})
    assert (tmp_path / "a" / "metrics.csv").read_bytes() == (tmp_path / "b" / "metrics.csv").read_bytes()
    assert a.eval == b.eval and a.eval_loss == b.eval_loss and "files" not in a.eval
