"""Cache a folder's VAE latents for `data=latent_folder`: one .safetensors per image or clip, its `latents` entry.

    python -m examples.cache_latents photos/ latents/ --vae path/to/sd-vae --height 256 --width 256
    python -m sweep.doctor latents/ --channels 4 --frames 1 --height 32 --width 32 --limit 5
    python -m sweep model=dit_tiny data=latent_folder data.path=latents/ data.channels=4 data.frames=1 \
        data.height=32 data.width=32 data.range_limit=5

`--vae` is a diffusers `AutoencoderKL` saved in a local directory (config.json and its weights: a model's
`vae/` subfolder, or anything `AutoencoderKL.save_pretrained` wrote); nothing is downloaded. Images are read
as the runs read them (sweep/data/readers.py: upright, RGB, [-1, 1], scaled to --height x --width by
--resize); a clip's first --frames frames are encoded one by one (a 2-D VAE, as Latte and AnimateDiff do),
scaled to the size (stretched). The latent is the posterior's mean, shifted and scaled as diffusers'
pipelines do (`(z - shift_factor) * scaling_factor`), so the model sees what it would in training. Files are
written under OUT at the same relative paths: (C, h, w) per image, (C, F, h, w) per clip.

Scaled latents have about unit variance, not a [-1, 1] range: the run's data check (`data.range_limit`,
1.001 by default) would call most of them `bad_input`. The script prints the largest |value| it wrote and
the `data.range_limit` (and the doctor's --limit) that takes them.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from sweep.data.readers import RESIZE_MODES, ReadError, find_files, read_image, read_video, source_of

LIMITS = (1.001, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 50, 100)
"""The data.range_limit suggested: the first of these above the largest |value| written, with 10% to spare."""


def load_vae(path: Path, device: str):
    from diffusers import AutoencoderKL  # imported here: `--help` answers without it

    vae = AutoencoderKL.from_pretrained(str(path), local_files_only=True)
    return vae.to(device).eval()


def pixels(path: Path, height: int, width: int, resize: str, frames: int) -> torch.Tensor:
    """(N, 3, H, W) in [-1, 1]: one image, or the first `frames` frames of a clip."""
    if source_of(path) == "image":
        return read_image(path, (height, width), resize).pixels[None]
    clip, cut = read_video(path)
    if cut:
        raise ReadError("truncated", cut)
    if clip.shape[1] < frames:
        raise ReadError("empty", f"{clip.shape[1]} frames, fewer than --frames {frames}")
    x = clip[:, :frames].permute(1, 0, 2, 3)  # (F, 3, H0, W0)
    if tuple(x.shape[-2:]) != (height, width):
        x = F.interpolate(x, size=(height, width), mode="bicubic", antialias=True).clamp(-1, 1)
    return x


@torch.no_grad()
def encode(vae, x: torch.Tensor) -> torch.Tensor:
    """The scaled latents of (N, 3, H, W) pixels: (N, C, h, w)."""
    z = vae.encode(x.to(vae.device, vae.dtype)).latent_dist.mean
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return ((z - shift) * vae.config.scaling_factor).float().cpu()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m examples.cache_latents",
        description="Encode every image (.png .jpg .jpeg .webp) and clip under a folder with a local diffusers "
        "AutoencoderKL and write one .safetensors per file (its `latents` entry) for data=latent_folder.",
    )
    parser.add_argument("folder", type=Path, help="the images or clips (searched recursively)")
    parser.add_argument("out", type=Path, help="where the .safetensors files go (same relative paths)")
    parser.add_argument("--vae", type=Path, required=True, help="a local AutoencoderKL directory (config.json)")
    parser.add_argument("--height", type=int, required=True, help="pixel height the images are scaled to")
    parser.add_argument("--width", type=int, required=True, help="pixel width the images are scaled to")
    parser.add_argument(
        "--resize", choices=RESIZE_MODES, default="crop", help="crop (cover, cut the centre) or resize (stretch)"
    )
    parser.add_argument("--frames", type=int, default=8, help="frames taken from the start of each clip (default 8)")
    parser.add_argument("--device", default="cpu", help="where the VAE runs (cpu, cuda)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    files = [p for p in find_files(args.folder).files if source_of(p) != "latent"]
    if not files:
        print(f"cache_latents: no images or clips under {args.folder}", file=sys.stderr)
        return 1
    vae = load_vae(args.vae, args.device)
    written, largest, shape = 0, 0.0, None
    for path in files:
        try:
            x = pixels(path, args.height, args.width, args.resize, args.frames)
        except ReadError as err:
            print(f"  skipped {path}: {err.kind}: {err.detail}", file=sys.stderr)
            continue
        z = encode(vae, x)  # (N, C, h, w)
        latents = z[0] if source_of(path) == "image" else z.permute(1, 0, 2, 3)  # (C, h, w) or (C, F, h, w)
        dest = (args.out / path.relative_to(args.folder) if path != args.folder else args.out / path.name).with_suffix(
            ".safetensors"
        )
        dest.parent.mkdir(parents=True, exist_ok=True)
        save_file({"latents": latents.contiguous()}, str(dest))
        written, largest, shape = written + 1, max(largest, float(latents.abs().max())), tuple(latents.shape)
    if not written:
        print("cache_latents: no file could be read", file=sys.stderr)
        return 1
    limit = next((v for v in LIMITS if v >= largest * 1.1), math.ceil(largest * 1.1))
    c, *rest = shape
    frames, (h, w) = (1 if len(rest) == 2 else rest[0]), rest[-2:]
    print(f"wrote {written} latent files of shape {shape} under {args.out}; the largest |value| is {largest:.3g}")
    print(
        f"train: python -m sweep data=latent_folder data.path={args.out} data.channels={c} data.frames={frames} "
        f"data.height={h} data.width={w} data.range_limit={limit}"
    )
    print(
        f"check: python -m sweep.doctor {args.out} --channels {c} --frames {frames} --height {h} --width {w} "
        f"--limit {limit}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
