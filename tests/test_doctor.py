"""The data doctor on real files: mp4 clips encoded with PyAV, and latent files in every format."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from sweep.data.checks import check_sample
from sweep.data.synthetic import SyntheticClips
from sweep.doctor import main

av = pytest.importorskip("av")

FRAMES, SIZE = 6, 16
CLIPS = SyntheticClips(num_samples=4, frames=FRAMES, channels=3, height=SIZE, width=SIZE, seed=0)


def _encode(path: Path, frames: np.ndarray) -> None:
    """Write (F, H, W, 3) uint8 frames as a video, container from the suffix (libx264 if PyAV has it, else mpeg4)."""
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=8)
        stream.width, stream.height, stream.pix_fmt = SIZE, SIZE, "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "10", "preset": "ultrafast"}
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def _uint8_frames(i: int, frames: int = FRAMES) -> np.ndarray:
    clip = CLIPS.clip(i)[:, :frames]  # (C, F, H, W) in [-0.9, 0.9]
    return ((clip + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 3, 0).numpy()


class _Exploit:
    """Unpickling this would create the marker file: a .pt that runs code when loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("videos")
    (root / "sub").mkdir()
    for i in range(3):
        _encode(root / f"good{i}.mp4", _uint8_frames(i))
    _encode(root / "sub" / "good3.mp4", _uint8_frames(3))  # recursion into subfolders
    _encode(root / "good4.mkv", _uint8_frames(0))
    for name in ("good0.mp4", "good4.mkv"):  # MP4 boxes and the Matroska Segment say how long the file is
        data = (root / name).read_bytes()
        (root / "sub" / f"cut{Path(name).suffix}").write_bytes(data[: len(data) // 2])
    (root / "notavideo.webm").write_bytes(b"this is a text file, not a video\n" * 20)
    _encode(root / "black.mp4", np.zeros((FRAMES, SIZE, SIZE, 3), np.uint8))
    _encode(root / "short.mp4", _uint8_frames(1, frames=FRAMES - 2))
    (root / "notes.txt").write_text("ignored: not a sample")
    return root


@pytest.fixture(scope="module")
def latents(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("latents")
    marker = root.parent / f"{root.name}_PWNED"
    good = [CLIPS.clip(i)[:, :4].contiguous() for i in range(4)]  # (3, 4, 16, 16) in [-1, 1]
    save_file({"latents": good[0]}, str(root / "a.safetensors"))
    torch.save(good[1], root / "b.pt")
    np.save(root / "c.npy", good[2].numpy())
    (root / "nested").mkdir()
    torch.save({"latents": good[3]}, root / "nested" / "d.pt")
    bad = good[0].clone()
    bad[0, 1, 2, 3] = float("nan")
    torch.save(bad, root / "nan.pt")
    bad = good[1].clone()
    bad[1, 2, 3, 4] = float("inf")
    save_file({"latents": bad}, str(root / "inf.safetensors"))
    np.save(root / "pixels.npy", ((good[2] + 1) * 127.5).numpy())
    np.save(root / "wrongshape.npy", good[3][:, :, :, :8].contiguous().numpy())
    torch.save(_Exploit(marker), root / "evil.pt")
    return root, marker


def _report(path: Path) -> dict:
    return json.loads(path.read_text())


def _kinds(report: dict) -> dict[str, list[str]]:
    return {s["path"]: [p["kind"] for p in s["problems"]] for s in report["samples"]}


def test_video_folder(videos: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.json"
    assert main([str(videos), "--json", str(out)]) == 1
    kinds = _kinds(_report(out))
    assert kinds == {
        "good0.mp4": [],
        "good1.mp4": [],
        "good2.mp4": [],
        "sub/good3.mp4": [],
        "good4.mkv": [],
        "sub/cut.mp4": ["truncated"],
        "sub/cut.mkv": ["truncated"],
        "notavideo.webm": ["unreadable"],
        "black.mp4": ["constant"],
        "short.mp4": ["frames"],
    }
    report = _report(out)
    assert report["majority_shapes"]["video"] == [3, FRAMES, SIZE, SIZE]
    good = next(s for s in report["samples"] if s["path"] == "good0.mp4")
    assert good["shape"] == [3, FRAMES, SIZE, SIZE] and -1 <= good["min"] < good["max"] <= 1
    text = capsys.readouterr().out
    assert "10 samples in 10 files" in text and "5 bad" in text
    assert "sub/cut.mp4" in text and "all black" in text and "good0.mp4" not in text


def test_expected_dims_option(videos: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main([str(videos / "sub" / "good3.mp4"), "--frames", str(FRAMES), "--json", str(out)]) == 0
    assert main([str(videos / "sub" / "good3.mp4"), "--height", "32", "--json", str(out)]) == 1
    assert _kinds(_report(out)) == {"good3.mp4": ["shape"]}


def test_latent_folder(latents: tuple[Path, Path], capsys) -> None:
    root, marker = latents
    assert main([str(root)]) == 1
    assert not marker.exists(), "the pickled object was executed"
    report = _report(root / "doctor_report.json")  # the default place
    assert _kinds(report) == {
        "a.safetensors": [],
        "b.pt": [],
        "c.npy": [],
        "nested/d.pt": [],
        "nan.pt": ["nan"],
        "inf.safetensors": ["inf"],
        "pixels.npy": ["range"],
        "wrongshape.npy": ["shape"],
        "evil.pt": ["unreadable"],
    }
    assert report["counts"]["nan"] == report["counts"]["unreadable"] == 1 and report["n_bad"] == 5
    evil = next(s for s in report["samples"] if s["path"] == "evil.pt")
    assert "weights_only" in evil["problems"][0]["detail"]
    pixels = next(s for s in report["samples"] if s["path"] == "pixels.npy")
    assert "[0, 255]" in pixels["problems"][0]["detail"] and pixels["max"] > 200
    assert next(s for s in report["samples"] if s["path"] == "nan.pt")["min"] == "nan"  # strict JSON: no NaN literal
    out = capsys.readouterr().out
    assert "evil.pt" in out
    assert out.count("give --limit and data.range_limit the largest value they reach") == 1  # a range problem: how


def test_clean_folder_exits_zero(latents: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    root, _ = latents
    clean = tmp_path / "clean"
    clean.mkdir()
    for name in ("a.safetensors", "b.pt", "c.npy"):
        (clean / name).write_bytes((root / name).read_bytes())
    assert main([str(clean)]) == 0
    out = capsys.readouterr().out
    assert "all clean" in out and "--limit" not in out
    assert _report(clean / "doctor_report.json")["n_bad"] == 0


def test_missing_path_is_a_usage_error(tmp_path: Path, capsys) -> None:
    assert main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file or directory" in err and "Traceback" not in err


def test_help_documents_every_option(capsys) -> None:
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for option in (
        "--json",
        "--limit",
        "--constant-tol",
        "--eval-files",
        "--channels",
        "--frames",
        "--height",
        "--width",
    ):
        assert option in text


def test_check_sample_matches_check_batch() -> None:
    x = CLIPS.clip(0)
    assert check_sample(x)[0] == []
    x[0, 0, 0, 0] = float("nan")
    x[0, 0, 0, 1] = 5.0
    assert [p.kind for p in check_sample(x)[0]] == ["nan"]  # most severe first, like check_batch
    assert [p.kind for p in check_sample(torch.zeros(2, 3))[0]] == ["constant"]
    assert [p.kind for p in check_sample(torch.empty(0))[0]] == ["empty"]


def test_the_report_replaces_a_planted_symlink_and_never_writes_through_it(latents, tmp_path, capsys) -> None:
    """DIR/doctor_report.json -> a file elsewhere: the link is replaced by the report; its target is untouched."""
    root, _ = latents
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.safetensors").write_bytes((root / "a.safetensors").read_bytes())
    victim = tmp_path / "victim.conf"
    victim.write_text("precious\n")
    (data / "doctor_report.json").symlink_to(victim)
    assert main([str(data)]) == 0
    assert victim.read_text() == "precious\n"
    report = data / "doctor_report.json"
    assert not report.is_symlink() and _report(report)["n_samples"] == 1
    assert sorted(p.name for p in data.iterdir()) == ["a.safetensors", "doctor_report.json"]  # no temp file left


def deny(monkeypatch, *paths: Path) -> None:
    """chmod 000 `paths`; as root (whom modes do not stop) also make opening and listing them fail as they would."""
    import builtins
    import os

    for p in paths:
        p.chmod(0)
    if os.geteuid() != 0:
        return
    denied = {str(p) for p in paths}

    def refuse(path):
        if str(path) in denied:
            raise PermissionError(13, "Permission denied", str(path))

    real_open, real_scandir = builtins.open, os.scandir
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: (refuse(f), real_open(f, *a, **k))[1])
    monkeypatch.setattr(os, "scandir", lambda p=".": (refuse(p), real_scandir(p))[1])


def test_unreadable_files_and_folders_are_named_as_permission_denied(latents, tmp_path, monkeypatch, capsys) -> None:
    """A chmod 000 file is 'permission denied', not 'No such file'; a chmod 000 subfolder is a problem, not skipped."""
    root, _ = latents
    data = tmp_path / "data"
    (data / "locked").mkdir(parents=True)
    for name in ("a.safetensors", "b.pt", "c.npy"):
        (data / name).write_bytes((root / name).read_bytes())
    (data / "locked" / "d.npy").write_bytes((root / "c.npy").read_bytes())
    try:
        deny(monkeypatch, data / "a.safetensors", data / "locked")
        assert main([str(data), "--json", str(tmp_path / "report.json")]) == 1
    finally:
        monkeypatch.undo()
        (data / "a.safetensors").chmod(0o644)
        (data / "locked").chmod(0o755)
    out = capsys.readouterr().out
    assert "all clean" not in out
    kinds = _kinds(_report(tmp_path / "report.json"))
    assert kinds == {"a.safetensors": ["unreadable"], "locked": ["unreadable"], "b.pt": [], "c.npy": []}
    assert f"permission denied: {data / 'a.safetensors'}" in out and f"permission denied: {data / 'locked'}" in out
    assert "No such file" not in out


def test_the_doctor_reports_the_held_out_files_a_run_uses(latents: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    from sweep.data.folder import FolderSplit

    root, _ = latents
    out = tmp_path / "r.json"
    assert main([str(root), "--json", str(out), "--eval-files", "3"]) == 1  # the bad files still fail it
    report = _report(out)
    split = report["eval_split"]["by_data"]["latent_folder"]
    assert report["eval_split"]["eval_files"] == 3 and list(report["eval_split"]["by_data"]) == ["latent_folder"]
    assert (split["files"], split["train"], len(split["held_out"])) == (9, 6, 3)
    assert split["held_out"] == FolderSplit.of(root, "latent_folder", 3).names()  # the run's own split
    bad = {s["path"] for s in report["samples"] if not s["ok"]}
    assert split["held_out_bad"] == [n for n in split["held_out"] if n in bad]
    text = capsys.readouterr().out
    assert "3 of 9 latent files held out for the eval loss, 6 train\n" in text  # a count is exact: nothing to add
    assert all(name in text.split("held out:")[1] for name in split["held_out"])
    assert main([str(root), "--json", str(out)]) == 1  # the default: the run's data.eval_files
    assert _report(out)["eval_split"]["eval_files"] == 0.1
    # a fraction: the files whose hash falls below it, so the line says the count only comes near it
    assert "train; the files whose path hash falls below 0.1: about 10%, a count is exact" in capsys.readouterr().out
    assert (
        _report(out)["eval_split"]["by_data"]["latent_folder"]["held_out"]
        == FolderSplit.of(root, "latent_folder", 0.1).names()
    )
    capsys.readouterr()
    assert main([str(root), "--eval-files", "1.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("doctor: --eval-files: a count of files must be a whole number")
