"""data=image_folder: PNG/JPEG/WebP files read with Pillow, scaled to the run's size, checked by the doctor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.errors import ConfigCompositionException
from PIL import Image

from sweep.config import ConfigError
from sweep.data.readers import ReadError, read_image
from sweep.doctor import main
from sweep.run.execute import execute

from .conftest import make_run


def _stripes(height: int = 16, width: int = 8) -> np.ndarray:
    """(H, W, 3) uint8: the top quarter red, the bottom quarter blue, the middle half green."""
    a = np.zeros((height, width, 3), np.uint8)
    a[: height // 4, :, 0] = 255
    a[height // 4 : 3 * height // 4, :, 1] = 255
    a[3 * height // 4 :, :, 2] = 255
    return a


def _noise(seed: int, height: int = 12, width: int = 12) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    for i in range(4):
        Image.fromarray(_noise(i)).save(root / f"rgb{i}.png")
    Image.fromarray(_noise(4)).save(root / "photo.jpg", quality=95)
    Image.fromarray(_noise(5)).save(root / "photo.webp", lossless=True)
    Image.fromarray(_noise(6)[:, :, 0]).save(root / "gray.png")  # mode L
    Image.fromarray(np.dstack([_noise(7), np.full((12, 12, 1), 128, np.uint8)])).save(root / "alpha.png")  # RGBA
    Image.fromarray(_noise(8)).convert("P").save(root / "palette.png")
    return root


def test_images_are_rgb_in_minus_one_one_at_the_run_size(photos: Path) -> None:
    for name in ("rgb0.png", "photo.jpg", "photo.webp", "gray.png", "alpha.png", "palette.png"):
        image = read_image(photos / name, (8, 8))
        assert image.pixels.shape == (3, 8, 8) and image.pixels.dtype == torch.float32, name
        assert -1 <= image.pixels.min() < image.pixels.max() <= 1, name
        assert (image.height, image.width) == (12, 12)
    native = read_image(photos / "rgb0.png").pixels  # no size: as stored, mapped as a video frame is
    assert torch.equal(native, torch.from_numpy(_noise(0)).permute(2, 0, 1).float() / 127.5 - 1)
    gray = read_image(photos / "gray.png").pixels
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])
    assert read_image(photos / "gray.png").mode == "L" and read_image(photos / "palette.png").mode == "P"


def test_crop_keeps_the_centre_and_resize_stretches(tmp_path: Path) -> None:
    Image.fromarray(_stripes()).save(tmp_path / "tall.png")  # 16 high, 8 wide
    crop = read_image(tmp_path / "tall.png", (8, 8), "crop").pixels
    green = torch.tensor([-1.0, 1.0, -1.0]).view(3, 1, 1).expand(3, 8, 8)
    assert torch.equal(crop, green)  # the middle 8 rows, unscaled
    stretched = read_image(tmp_path / "tall.png", (8, 8), "resize").pixels
    assert stretched[0, 0].mean() > 0.9 and stretched[2, -1].mean() > 0.9  # red on top, blue at the bottom


def test_unusable_images_are_refused_with_their_kind(tmp_path: Path) -> None:
    Image.fromarray(np.arange(144, dtype=np.uint16).reshape(12, 12) * 400).save(tmp_path / "deep.png")  # I;16
    Image.fromarray(_noise(0, 64, 64)).save(tmp_path / "whole.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "whole.png").read_bytes()[:2000])
    (tmp_path / "text.jpg").write_text("not an image\n")
    kinds = {}
    for name in ("deep.png", "cut.png", "text.jpg"):
        with pytest.raises(ReadError) as err:
            read_image(tmp_path / name, (8, 8))
        kinds[name] = err.value.kind
    assert kinds == {"deep.png": "mode", "cut.png": "truncated", "text.jpg": "unreadable"}


def test_the_doctor_checks_images(photos: Path, tmp_path: Path, capsys) -> None:
    root = tmp_path / "mixed"
    root.mkdir()
    for name in ("rgb0.png", "rgb1.png", "gray.png"):
        (root / name).write_bytes((photos / name).read_bytes())
    Image.fromarray(_noise(9, 6, 20)).save(root / "small.png")  # 6 high: below the run's 8
    Image.fromarray(np.full((12, 12, 3), 40, np.uint8)).save(root / "blank.png")
    Image.fromarray(np.arange(144, dtype=np.uint16).reshape(12, 12) * 400).save(root / "deep.png")
    (root / "text.webp").write_text("not an image\n")
    out = tmp_path / "r.json"
    assert main([str(root), "--height", "8", "--width", "8", "--json", str(out)]) == 1
    report = json.loads(out.read_text())
    kinds = {s["path"]: [p["kind"] for p in s["problems"]] for s in report["samples"]}
    assert kinds == {
        "rgb0.png": [],
        "rgb1.png": [],
        "gray.png": [],
        "small.png": ["size"],
        "blank.png": ["constant"],
        "deep.png": ["mode"],
        "text.webp": ["unreadable"],
    }
    gray = next(s for s in report["samples"] if s["path"] == "gray.png")
    assert gray["shape"] == [3, 12, 12] and gray["mode"] == "L" and gray["source"] == "image"
    assert report["counts"]["mode"] == report["counts"]["size"] == 1
    assert list(report["eval_split"]["by_data"]) == ["image_folder"]
    assert "held out for the eval loss" in capsys.readouterr().out
    assert main([str(root / "rgb0.png"), "--channels", "4", "--json", str(out)]) == 1  # an image is RGB
    detail = json.loads(out.read_text())["samples"][0]["problems"][0]["detail"]
    assert detail == "shape (3, 12, 12), the run expects (4, F, H, W)"


def test_an_image_folder_trains_an_image_model_with_a_held_out_eval(photos: Path, tmp_path: Path) -> None:
    common = ["model=dit_tiny", "data=image_folder", f"data.path={photos}", "data.frames=1"]
    r = execute(make_run(*common, "steps=2", "data.resize=resize"), tmp_path / "run", params={})
    assert r.status == "stable" and r.eval_loss is not None and len(r.eval["files"]) >= 1
    assert all(Path(f).suffix in (".png", ".jpg", ".webp") for f in r.eval["files"])


def test_image_folder_config_errors_name_the_key(photos: Path) -> None:
    common = ["model=dit_tiny", "data=image_folder", f"data.path={photos}", "data.frames=1"]
    with pytest.raises(ConfigError, match="data.channels: data=image_folder reads images as RGB: must be 3, got 4"):
        make_run(*common, "data.channels=4")
    with pytest.raises(ConfigCompositionException, match="data.resize=squash"):  # the CLI: one line (test_config)
        make_run(*common, "data.resize=squash")
    with pytest.raises(ConfigError, match="data.frames: data=image_folder is one image per sample, for image models"):
        make_run("data=image_folder", f"data.path={photos}", "data.frames=4")
    with pytest.raises(ConfigError, match=r"data.frames: model.arch=dit trains on images: use data.frames=1 \(one"):
        make_run("model=dit_tiny", "data=latent_folder", f"data.path={photos}", "data.frames=4")


def test_the_latent_caching_example_feeds_a_latent_folder_run(photos: Path, tmp_path: Path, capsys) -> None:
    """examples/cache_latents.py with a tiny randomly initialised AutoencoderKL saved locally (nothing downloaded):
    its files pass the doctor at the shape and limit it prints, and train an image model."""
    from diffusers import AutoencoderKL

    from examples.cache_latents import main as cache

    torch.manual_seed(0)
    AutoencoderKL(
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=8,
        sample_size=16,
    ).save_pretrained(tmp_path / "vae")
    out = tmp_path / "latents"
    assert cache([str(photos), str(out), "--vae", str(tmp_path / "vae"), "--height", "16", "--width", "16"]) == 0
    printed = capsys.readouterr().out
    assert "wrote 9 latent files of shape (4, 8, 8)" in printed
    check = printed.split("check: python -m sweep.doctor ")[1].splitlines()[0].split()
    assert main([*check, "--json", str(tmp_path / "r.json")]) == 0  # clean at the printed shape and --limit
    train = printed.split("train: python -m sweep ")[1].splitlines()[0].split()
    assert "data.frames=1" in train and "data.channels=4" in train
    r = execute(make_run("model=dit_tiny", *train, "steps=2"), tmp_path / "run", params={})
    assert r.status == "stable" and r.eval_loss is not None
