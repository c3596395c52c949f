"""Training on a folder of real video files or latents: bad files are bad_input naming the file, drop_bad trains."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from sweep.config import ConfigError
from sweep.run.execute import execute

from .conftest import make_run
from .test_doctor import FRAMES, SIZE, _encode, _uint8_frames

VIDEO = [
    "data=video_folder",
    f"data.frames={FRAMES}",
    f"data.height={SIZE}",
    f"data.width={SIZE}",
    "data.batch_size=4",
    "steps=3",
    "progress=none",
]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("clips")
    for i in range(4):
        _encode(root / f"clip{i}.mp4", _uint8_frames(i))
    return root


def test_a_clean_video_folder_trains(clips, tmp_path):
    r = execute(make_run(*VIDEO, f"data.path={clips}", fast=False), tmp_path, params={})
    assert r.status == "stable" and r.steps_run == 3


def test_a_truncated_file_is_bad_input_naming_it_even_unchecked(clips, tmp_path):
    data = (clips / "clip0.mp4").read_bytes()
    bad = tmp_path / "bad"
    bad.mkdir()
    for i in range(1, 4):
        (bad / f"clip{i}.mp4").write_bytes((clips / f"clip{i}.mp4").read_bytes())
    (bad / "clip0.mp4").write_bytes(data[: len(data) // 2])
    r = execute(make_run(*VIDEO, f"data.path={bad}", "data.check=false", fast=False), tmp_path / "a", params={})
    assert (r.verdict, r.first_bad_step, r.cause["where"]) == ("bad_input", 0, "data")
    assert "(clip0.mp4): truncated" in r.cause["detail"]
    r = execute(make_run(*VIDEO, f"data.path={bad}", "data.drop_bad=true", fast=False), tmp_path / "b", params={})
    assert r.status == "stable"  # three good clips left; batches wrap around them


def test_latent_folder_names_the_nan_file(tmp_path):
    """Sample indices count the training files (z2 is held out by its path's hash), and the label names the file."""
    root = tmp_path / "latents"
    root.mkdir()
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        x = torch.rand(4, 2, 8, 8, generator=g) * 1.8 - 0.9
        if i == 3:
            x[0, 1, 3, 3] = float("nan")
        save_file({"latents": x}, str(root / f"z{i}.safetensors"))
    np.save(root / "z4.npy", (torch.rand(4, 2, 8, 8, generator=g) * 1.8 - 0.9).numpy())
    common = [
        "data=latent_folder",
        f"data.path={root}",
        "data.frames=2",
        "data.height=8",
        "data.width=8",
        "data.batch_size=5",
        "steps=2",
        "progress=none",
    ]
    r = execute(make_run(*common, fast=False), tmp_path / "run", params={})
    assert r.verdict == "bad_input" and "sample 2 (z3.safetensors): 1 NaN values" in r.cause["detail"]
    assert r.eval["files"] == ["z2.safetensors"]


def test_folder_config_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="data.path: data=video_folder reads a folder"):
        make_run("data=video_folder", fast=False)
    with pytest.raises(ConfigError, match="data.path: no such directory"):
        make_run("data=latent_folder", f"data.path={tmp_path / 'nope'}", fast=False)


def test_unreadable_files_and_subfolders_of_the_training_data_are_named(tmp_path, monkeypatch):
    """A chmod 000 file is a sample 'permission denied: PATH'; a chmod 000 subfolder stops the build, not skipped."""
    from sweep.data.folder import FolderClips

    from .test_doctor import deny

    root = tmp_path / "latents"
    (root / "locked").mkdir(parents=True)
    for name in ("z0.npy", "z1.npy", "locked/z2.npy"):
        np.save(root / name, np.zeros((4, 2, 8, 8), np.float32))
    try:
        deny(monkeypatch, root / "z1.npy")
        clips = FolderClips(root, "latent_folder", frames=2, channels=4, height=8, width=8)
        problems = {clips.files[i].name: clips.problem(i) for i in range(len(clips))}
        assert problems == {
            "z0.npy": None,
            "z1.npy": f"unreadable: permission denied: {root / 'z1.npy'}",
            "z2.npy": None,
        }
        monkeypatch.undo()
        deny(monkeypatch, root / "locked")
        with pytest.raises(ValueError, match=f"data.path: permission denied: {root / 'locked'}: the run would leave"):
            FolderClips(root, "latent_folder", frames=2, channels=4, height=8, width=8)
    finally:
        monkeypatch.undo()
        (root / "z1.npy").chmod(0o644)
        (root / "locked").chmod(0o755)


def test_folder_data_in_windows_is_one_sync_per_step_packed_and_alone(tmp_path):
    """Batches read from files reach a pack's window steps from the host (no device gather): with the lr changing
    every step, the metrics are byte for byte those of one sync per step, every window standing."""
    from sweep.run.packing import execute_pack

    root = tmp_path / "latents"
    root.mkdir()
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        save_file({"latents": torch.rand(4, 2, 8, 8, generator=g) * 1.8 - 0.9}, str(root / f"z{i}.safetensors"))
    common = ["data=latent_folder", f"data.path={root}", "data.frames=2", "data.height=8", "data.width=8"]
    common += ["data.batch_size=2", "steps=8", "progress=none", "threads=1", "ledger.enabled=false"]
    common += ["optim.schedule=cosine"]  # the lr the update reads from the clock changes every step
    got = {}
    for sync in (1, 4):
        runs = [make_run(*common, f"optim.lr={lr}", f"monitor.sync_every={sync}", fast=False) for lr in (1e-4, 1e-3)]
        dirs = [tmp_path / f"sync{sync}" / str(i) for i in range(2)]
        results = execute_pack(runs, dirs, [{}] * 2, ["0", "1"])
        got[sync] = [
            (r.status, r.verdict, r.first_bad_step, (d / "metrics.csv").read_bytes()) for r, d in zip(results, dirs)
        ]
        assert all(r.sync["windows"] == (0 if sync == 1 else 2) and r.sync["taken_back"] == 0 for r in results)
    assert got[4] == got[1] and {s for s, *_ in got[1]} == {"stable"}
    alone = {}  # and a lone run the same way (sweep.run.train.Lone.device_step with x0 from the host)
    for sync in (1, 4):
        r = execute(make_run(*common, f"monitor.sync_every={sync}", fast=False), tmp_path / f"alone{sync}", params={})
        alone[sync] = (r.status, (tmp_path / f"alone{sync}" / "metrics.csv").read_bytes(), r.sync["windows"])
    assert alone[4][:2] == alone[1][:2] and alone[4][2] == 2


@pytest.fixture(scope="module")
def single_frames(tmp_path_factory):
    """Latent folders of (4, 1, 8, 8) files (what a VAE script writes for images) and of (4, 2, 8, 8) files."""
    out = {}
    g = torch.Generator().manual_seed(1)
    for frames in (1, 2):
        root = tmp_path_factory.mktemp(f"frames{frames}")
        for i in range(4):
            save_file(
                {"latents": torch.rand(4, frames, 8, 8, generator=g) * 1.8 - 0.9}, str(root / f"z{i}.safetensors")
            )
        out[frames] = root
    return out


RUN_SHAPE = ["--channels", "4", "--frames", "1", "--height", "8", "--width", "8"]
IMAGE_RUN = [
    "model=dit_tiny",
    "data=latent_folder",
    "data.channels=4",
    "data.frames=1",
    "data.height=8",
    "data.width=8",
]


def test_the_doctor_and_the_loader_decide_shapes_by_one_rule(single_frames, tmp_path):
    """The trial: given the run's exact shape, the doctor called (4, 1, 8, 8) files clean and the loop refused every
    one ("the run expects (4, 8, 8)"). Now a (C, 1, H, W) file is an image sample for frames=1 (squeezed for an
    image model), and a file neither takes is refused by both with the same sentence."""
    import json

    from sweep.data.folder import FolderClips
    from sweep.doctor import main

    shape = dict(frames=1, channels=4, height=8, width=8)
    assert main([str(single_frames[1]), *RUN_SHAPE, "--json", str(tmp_path / "ones.json")]) == 0
    image = FolderClips(single_frames[1], "latent_folder", **shape, as_images=True)
    assert image.problems == [None] * 4 and image[0].shape == (4, 8, 8)
    video = FolderClips(single_frames[1], "latent_folder", **shape, as_images=False)
    assert video[0].shape == (4, 1, 8, 8) and torch.equal(video[0][:, 0], image[0])

    assert main([str(single_frames[2]), *RUN_SHAPE, "--json", str(tmp_path / "twos.json")]) == 1
    report = json.loads((tmp_path / "twos.json").read_text())
    doctor = {(p["kind"], p["detail"]) for s in report["samples"] for p in s["problems"]}
    loader = set(FolderClips(single_frames[2], "latent_folder", **shape, as_images=True).problems)
    sentence = "shape (4, 2, 8, 8), the run expects (4, 1, 8, 8) or (4, 8, 8)"
    assert doctor == {("frames", sentence)} and loader == {sentence}


def test_a_latent_folder_of_single_frames_trains_an_image_model(single_frames, tmp_path):
    r = execute(make_run(*IMAGE_RUN, f"data.path={single_frames[1]}", "steps=2"), tmp_path / "a", params={})
    assert r.status == "stable" and r.eval_loss is not None


def test_drop_bad_that_refuses_every_sample_says_why_counted(single_frames, tmp_path, caplog):
    """It said "every sample failed the data check" and no reason (the wrong-shape files, placeholders full of NaN,
    were counted as NaN); now the reasons, counted, in one line and no traceback."""
    run = make_run(*IMAGE_RUN, f"data.path={single_frames[2]}", "data.drop_bad=true", "steps=2")
    r = execute(run, tmp_path / "b", params={})
    assert r.status == "error"
    assert r.reason.startswith(
        "data.drop_bad: every sample failed the data check: "
        "3 x shape (4, 2, 8, 8), the run expects (4, 1, 8, 8) or (4, 8, 8) (e.g. sample 0 (z"
    ), r.reason
    assert "Traceback" not in caplog.text


def test_drop_bad_counts_its_reasons_and_says_them_once_per_sweep(tmp_path, caplog):
    """The same data line for each of a sweep's runs is said once in the sweep (sweep/run/once.py)."""
    from sweep.data.synthetic import Fault, SyntheticClips
    from sweep.run.build import drop_bad_samples
    from sweep.run.once import per_sweep

    clips = SyntheticClips(8, 2, 3, 8, 8, seed=0, faults=[Fault(1, "nan"), Fault(5, "nan"), Fault(6, "range")])
    caplog.set_level("DEBUG", logger="sweep")
    with per_sweep(tmp_path):
        for _ in range(3):
            kept = drop_bad_samples(clips, 1.001)
    said = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(kept) == 5 and len(said) == 1
    assert said[0].getMessage() == (
        "data.drop_bad: left out 3 of 8 samples: 2 x NaN values (e.g. sample 1); "
        "1 x values outside [-1.001, 1.001] (data.range_limit) (e.g. sample 6)"
    )
