"""Reading the samples of a dataset folder (the data doctor, the loader), safely, and saying why one cannot be read.

Videos are decoded with PyAV to RGB and mapped to [-1, 1] the way a training loader would
(``uint8 / 127.5 - 1``), as one (C, F, H, W) float32 tensor per file. Images (PNG, JPEG, WebP) are
decoded with Pillow, turned upright by their EXIF orientation, converted to RGB and mapped the same
way, as one (3, H, W) tensor, scaled to the run's size when one is given (``read_image``). Latent tensors come from
``.safetensors``, ``.pt``/``.pth`` (``torch.load(weights_only=True)``: a file that pickles
anything but tensors and plain containers is refused, never run), ``.npy`` and ``.npz``
(``allow_pickle=False``). A file that cannot be read raises ``ReadError`` with the problem kind
(``unreadable``, ``truncated`` or ``empty``; ``mode`` for an image that is not 8-bit) and one line saying why.

Truncation: an MP4/MOV file is a list of boxes each declaring its size, so a cut file is found
exactly by walking the top-level boxes (a box that runs past the end, or no ``moov`` index box);
a Matroska/WebM file by its Segment element declaring more bytes than the file has; for any
container, decoding that stops with an error after some frames, or fewer frames
than the stream declares, means truncated.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

VIDEO_EXTS = frozenset(
    {".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi", ".mpg", ".mpeg", ".wmv", ".flv", ".ts", ".3gp", ".gif", ".ogv"}
)
LATENT_EXTS = frozenset({".safetensors", ".pt", ".pth", ".npy", ".npz"})
IMAGE_EXTS = frozenset({".png", ".jpg", ".jpeg", ".webp"})
SAMPLE_EXTS = VIDEO_EXTS | LATENT_EXTS | IMAGE_EXTS


class ReadError(Exception):
    """A file that yields no sample: kind 'unreadable', 'truncated', 'empty' or 'mode' (an image that is not 8-bit)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind, self.detail = kind, detail


class FoundFiles(NamedTuple):
    """The sample files under a folder, and the folders under it that could not be listed (with why)."""

    files: list[Path]
    unlisted: list[tuple[Path, str]]


def find_files(root: Path) -> FoundFiles:
    """Every video, image or latent file under root (recursively, sorted), or root itself if it is such a file.

    A folder that cannot be listed (no permission) is not skipped silently, as Path.rglob would: it
    is returned in `unlisted`, for the caller to report.
    """
    if root.is_file():
        return FoundFiles([root] if root.suffix.lower() in SAMPLE_EXTS else [], [])
    unlisted: list[tuple[Path, str]] = []

    def note(err: OSError) -> None:
        where = Path(err.filename) if err.filename else root
        why = denied(where) if isinstance(err, PermissionError) else f"cannot list {where}: {_first_line(err)}"
        unlisted.append((where, why))

    files = [
        Path(folder) / name
        for folder, _, names in os.walk(root, onerror=note)
        for name in names
        if Path(name).suffix.lower() in SAMPLE_EXTS
    ]
    return FoundFiles(sorted(p for p in files if p.is_file()), sorted(unlisted))


def denied(path: Path) -> str:
    return f"permission denied: {path}"


def check_readable(path: Path) -> None:
    """Raise ReadError 'permission denied: PATH' for a file this process may not read.

    Said up front because the libraries say it badly: safetensors reports "No such file or
    directory" for a file it may not open.
    """
    try:
        with open(path, "rb"):
            pass
    except PermissionError:
        raise ReadError("unreadable", denied(path)) from None


def is_video(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_EXTS


def is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTS


def source_of(path: Path) -> str:
    """The kind of sample a file holds: "video", "image" or "latent" (sweep/data/shape.py's sources)."""
    return "video" if is_video(path) else "image" if is_image(path) else "latent"


def _first_line(err: BaseException) -> str:
    """'ErrorType: first line of the message' (FFmpeg's own message, without the file name)."""
    text = (getattr(err, "strerror", None) or str(err)).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


# ---- videos -------------------------------------------------------------------------------------


def iso_bmff_truncation(path: Path) -> str | None:
    """Why an MP4/MOV-family file is cut short, from its top-level boxes; None if complete or not that format."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8 or head[4:8] != b"ftyp":
            return None
        offset, types = 0, []
        while offset < size:
            f.seek(offset)
            header = f.read(16)
            if len(header) < 8:
                return f"file ends inside a box header at byte {offset} of {size}"
            n, box = int.from_bytes(header[:4], "big"), header[4:8].decode("latin-1")
            if n == 1:  # 64-bit size follows the type
                if len(header) < 16:
                    return f"file ends inside the '{box}' box header at byte {offset}"
                n = int.from_bytes(header[8:16], "big")
            elif n == 0:  # the box runs to the end of the file
                n = size - offset
            if n < 8:
                return f"corrupt '{box}' box size {n} at byte {offset}"
            if offset + n > size:
                left = size - offset
                return f"'{box}' box at byte {offset} needs {n} bytes, only {left} are left (file cut at {size} bytes)"
            types.append(box)
            offset += n
    if "moov" not in types:
        return "no 'moov' index box (cut short, or a recording that was never finished)"
    return None


def _ebml_vint(data: bytes, pos: int, keep_marker: bool) -> tuple[int | None, int]:
    """One EBML variable-length integer at pos: (value, next pos); value None when unknown (all ones) or cut."""
    if pos >= len(data) or data[pos] == 0:
        return None, len(data) + 1
    length = 8 - data[pos].bit_length() + 1
    if pos + length > len(data):
        return None, len(data) + 1
    value = int.from_bytes(data[pos : pos + length], "big")
    if not keep_marker:
        value &= (1 << (7 * length)) - 1
        if value == (1 << (7 * length)) - 1:
            return None, pos + length  # "unknown size": a live stream, nothing to compare
    return value, pos + length


def matroska_truncation(path: Path) -> str | None:
    """Why a Matroska/WebM file is cut short (its Segment declares more bytes than the file has), else None."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4096)
    if head[:4] != b"\x1a\x45\xdf\xa3":
        return None
    pos = 0
    while pos < len(head):
        element, pos = _ebml_vint(head, pos, keep_marker=True)
        length, pos = _ebml_vint(head, pos, keep_marker=False)
        if element is None or length is None:
            return None
        if element == 0x18538067:  # Segment: everything after the EBML header
            if pos + length > size:
                return f"the Segment declares {pos + length} bytes but the file has {size} (cut short)"
            return None
        pos += length
    return None


def read_video(path: Path) -> tuple[Tensor, str | None]:
    """The clip as (3, F, H, W) float32 in [-1, 1], and why it is truncated (None when whole)."""
    import av  # optional dependency: only video folders need it

    check_readable(path)
    try:
        container = av.open(str(path))
    except (av.error.FFmpegError, OSError, ValueError, UnicodeDecodeError) as err:
        cut = iso_bmff_truncation(path) or matroska_truncation(path)
        if cut:
            raise ReadError("truncated", cut) from None
        raise ReadError("unreadable", f"not a readable video ({_first_line(err)})") from None
    frames: list[np.ndarray] = []
    error: BaseException | None = None
    with container:
        if not container.streams.video:
            raise ReadError("unreadable", "the container has no video stream")
        stream = container.streams.video[0]
        declared = stream.frames  # 0 when the container does not say
        try:
            for frame in container.decode(stream):
                frames.append(frame.to_ndarray(format="rgb24"))
        except (av.error.FFmpegError, ValueError) as err:
            error = err
    cut = iso_bmff_truncation(path) or matroska_truncation(path)
    if not frames:
        if error is not None or cut:
            raise ReadError("truncated" if cut else "unreadable", cut or f"no frame decodes ({_first_line(error)})")
        raise ReadError("empty", "the video stream has no frames")
    if error is not None:
        cut = f"decoding stopped after {len(frames)} frames ({_first_line(error)})"
    elif declared and len(frames) < declared:
        cut = f"only {len(frames)} of the {declared} frames the stream declares decode"
    if len({f.shape for f in frames}) > 1:
        raise ReadError("unreadable", f"frame size changes within the clip: {sorted({f.shape[:2] for f in frames})}")
    pixels = torch.from_numpy(np.stack(frames))  # (F, H, W, 3) uint8
    clip = pixels.permute(3, 0, 1, 2).float() / 127.5 - 1.0  # (3, F, H, W), as a training loader maps it
    return clip, cut


# ---- images -------------------------------------------------------------------------------------

IMAGE_MODES = frozenset({"1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr"})
"""Pillow modes of at most 8 bits per channel, converted to RGB as read (an alpha channel is dropped, as
``Image.convert("RGB")`` drops it). Any other mode (16-bit ``I;16``, 32-bit ``I``, float ``F``, ``LAB``,
``HSV``) is refused as ``mode``: its values have no one mapping to [0, 255], so the run would guess."""

RESIZE_MODES = ("crop", "resize")
"""How an image becomes the run's height x width (``data.resize``): ``crop`` scales it so it covers the size,
keeping its aspect ratio, and cuts out the centre (``PIL.ImageOps.fit``); ``resize`` scales it to the size
(the aspect ratio changes). Both resample with Pillow's bicubic filter."""


class ImageInfo(NamedTuple):
    """An image as read: (3, H, W) float32 in [-1, 1], its mode and its upright size before any scaling."""

    pixels: Tensor
    mode: str
    height: int
    width: int


def read_image(path: Path, size: tuple[int, int] | None = None, resize: str = "crop") -> ImageInfo:
    """The image as RGB (3, H, W) float32 in [-1, 1] (``uint8 / 127.5 - 1``, as a video frame), scaled to
    size = (height, width) by `resize` (RESIZE_MODES) when given; ReadError when it cannot be used."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    check_readable(path)
    try:
        with Image.open(path) as opened:
            opened.load()  # decode now: a cut file fails here, not later
            mode = opened.mode
            if mode not in IMAGE_MODES:
                raise ReadError(
                    "mode",
                    f"mode {mode}: not an 8-bit image; the run reads 8-bit RGB, grayscale, palette or RGBA images "
                    "(converted to RGB): save it as 8-bit",
                )
            image = ImageOps.exif_transpose(opened).convert("RGB")  # upright, as viewers show it
    except ReadError:
        raise
    except UnidentifiedImageError as err:
        raise ReadError("unreadable", f"not a readable image ({_first_line(err)})") from None
    except Exception as err:  # noqa: BLE001 - any decoder error on a corrupt file is a finding, not a crash
        kind = "truncated" if "truncated" in str(err).lower() else "unreadable"
        raise ReadError(kind, f"cannot decode ({_first_line(err)})") from None
    height, width = image.height, image.width
    if size is not None and (height, width) != tuple(size):
        h, w = size
        bicubic = Image.Resampling.BICUBIC
        if resize == "crop":
            image = ImageOps.fit(image, (w, h), method=bicubic, centering=(0.5, 0.5))
        elif resize == "resize":
            image = image.resize((w, h), bicubic)
        else:
            raise ValueError(f"resize must be one of {', '.join(RESIZE_MODES)}, got {resize!r}")
    pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy())  # (H, W, 3)
    return ImageInfo(pixels.permute(2, 0, 1).float() / 127.5 - 1.0, mode, height, width)


# ---- latents ------------------------------------------------------------------------------------


def _tensors_in(obj: object, prefix: str = "") -> list[tuple[str, Tensor]]:
    """(key, tensor) for every tensor in a loaded object, nested dicts/lists flattened with dotted keys."""
    if isinstance(obj, Tensor):
        return [(prefix, obj)]
    if isinstance(obj, np.ndarray):
        return [(prefix, _from_numpy(obj))]
    items: list = []
    if isinstance(obj, dict):
        items = [(str(k), v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(obj)]
    out: list[tuple[str, Tensor]] = []
    for key, value in items:
        out += _tensors_in(value, f"{prefix}.{key}" if prefix else key)
    return out


def _from_numpy(arr: np.ndarray) -> Tensor:
    try:
        return torch.from_numpy(np.ascontiguousarray(arr))
    except TypeError:
        raise ReadError("unreadable", f"array of dtype {arr.dtype} is not numeric") from None


def read_latents(path: Path) -> list[tuple[str, Tensor]]:
    """Every tensor in a latent file as (key, tensor); key '' for a bare tensor/array."""
    ext = path.suffix.lower()
    check_readable(path)
    try:
        if ext == ".safetensors":
            from safetensors.torch import load_file

            items = list(load_file(str(path)).items())
        elif ext in (".pt", ".pth"):
            # weights_only: the unpickler accepts tensors and plain containers and nothing else,
            # so a file carrying code is refused before any of it runs.
            items = _tensors_in(torch.load(path, map_location="cpu", weights_only=True))
        elif ext == ".npy":
            items = [("", _from_numpy(np.load(path, allow_pickle=False)))]
        elif ext == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                items = [(k, _from_numpy(archive[k])) for k in archive.files]
        else:
            raise ReadError("unreadable", f"unknown latent file type {ext!r}")
    except ReadError:
        raise
    except pickle.UnpicklingError as err:
        # torch's message is a page of advice; the line that matters names the refused global.
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        what = f"pickles {found.group(1)}, " if found else "the pickle holds something "
        raise ReadError(
            "unreadable",
            f"refused: {what}not tensors or plain containers (loaded with weights_only=True; nothing in it was run)",
        ) from None
    except ValueError as err:
        if "allow_pickle" in str(err):
            detail = "refused: an object array needs pickle (loaded with allow_pickle=False)"
            raise ReadError("unreadable", detail) from None
        raise ReadError("unreadable", f"cannot load ({_first_line(err)})") from None
    except Exception as err:  # noqa: BLE001 - any library error on a corrupt file is a finding, not a crash
        raise ReadError("unreadable", f"cannot load ({_first_line(err)})") from None
    if not items:
        raise ReadError("empty", "the file holds no tensors")
    return items
