"""Training data from a folder: video files (decoded with PyAV), images (Pillow) or latent tensors, checked as the
data doctor checks them.

    python -m sweep data=video_folder data.path=clips/ data.frames=8 data.height=16 data.width=16
    python -m sweep data=latent_folder data.path=latents/ data.channels=4 data.frames=8
    python -m sweep model=dit_tiny data=image_folder data.path=photos/ data.height=32 data.width=32 data.resize=crop

Every file under the folder (recursively, sorted by path) is one sample, read once when the run is
built with the data doctor's readers (sweep/data/readers.py). `data.eval_files` of them (default 10%,
at least one) are held out for the eval loss and never train: `FolderSplit` chooses them by a hash of
each file's relative path (sweep/data/split.py), and `read_held_out` reads them for the eval set
(sweep/run/evaluate.py). The training set is the other files, sample i the i-th of them in path order.
Videos become (3, F, H, W) in [-1, 1] the way a training loader maps uint8 pixels (the first F frames
are used); images (3, H, W) the same way, scaled to the run's height x width by `data.resize` (crop:
cover and cut the centre; resize: stretch); a latent file holds one tensor (its `latents` entry when
it holds several) of shape (C, F, H, W), or (C, H, W) for one frame. Which shapes a run takes, and how
a (C, 1, H, W) file reaches an image model, is sweep/data/shape.py's one rule, the doctor's too.
Pickle is never run: `.pt` loads with weights_only=True, `.npy` without allow_pickle.

A file that cannot be used (unreadable, truncated, empty, wrong shape or mode, too few frames) stays in
the dataset with its problem; the batch that draws it is `bad_input` naming the file, whatever
`data.check` says, since no training script could use it either. Its values (NaN/Inf/out of range)
are found by the per-batch check; `data.drop_bad=true` leaves every such sample out instead. A held-out
file that cannot be used (unreadable, wrong shape, NaN/Inf/out of range) is left out of the eval set
and named (result.json `eval.unusable`, and a warning once per sweep: sweep/run/build.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

from sweep.data.checks import DataError, check_sample
from sweep.data.readers import (
    IMAGE_EXTS,
    LATENT_EXTS,
    VIDEO_EXTS,
    ReadError,
    find_files,
    read_image,
    read_latents,
    read_video,
)
from sweep.data.shape import Expected, conform, shape_problem
from sweep.data.split import split_files

log = logging.getLogger("sweep")


FOLDER_KINDS = {
    "video_folder": ("video", VIDEO_EXTS),
    "latent_folder": ("latent", LATENT_EXTS),
    "image_folder": ("image", IMAGE_EXTS),
}
"""Each folder data source: the kind of sample its files hold (sweep/data/shape.py) and their extensions."""


def list_files(root: Path, kind: str) -> list[Path]:
    """The `kind` files under root, sorted by path; a DataError naming data.path when the run cannot use it:
    a subfolder it may not list (its samples would be missing without a word), or no such files at all."""
    if kind not in FOLDER_KINDS:
        raise ValueError(f"unknown folder kind {kind!r}")
    source, exts = FOLDER_KINDS[kind]
    found = find_files(root)
    if found.unlisted:
        raise DataError(
            f"data.path: {found.unlisted[0][1]}: the run would leave out the samples under it"
            f" (`python -m sweep.doctor {root}` checks every file)"
        )
    files = [p for p in found.files if p.suffix.lower() in exts]
    if not files:
        shown = " ".join(sorted(exts))
        raise DataError(f"data.path: no {source} files ({shown}) under {root}")
    return files


def relative(root: Path, path: Path) -> str:
    """A file's name in a split, a verdict and result.json: its POSIX path relative to the folder."""
    return (path.relative_to(root) if path != root else Path(path.name)).as_posix()


@dataclass(frozen=True)
class FolderSplit:
    """The files of a folder that train and those held out for the eval loss (sweep/data/split.py)."""

    root: Path
    train: list[Path]
    held_out: list[Path]
    note: str | None = None
    """Why the held-out set is not what data.eval_files asked for (a folder too small), when it is not."""

    @classmethod
    def of(cls, root: Path, kind: str, eval_files: float) -> FolderSplit:
        files = list_files(Path(root), kind)
        by_name = {relative(Path(root), p): p for p in files}
        split = split_files(list(by_name), eval_files)
        return cls(Path(root), [by_name[n] for n in split.train], [by_name[n] for n in split.held_out], split.note)

    def names(self) -> list[str]:
        """The held-out files, relative to the folder, in path order."""
        return [relative(self.root, p) for p in self.held_out]


@dataclass
class HeldOutFiles:
    """The held-out files of a run and, when read, the usable ones' samples for the eval set."""

    files: list[str]
    """Every held-out file, relative to data.path, in path order: none of them trains."""
    note: str | None = None
    clips: Tensor | None = None
    """(n, C, F, H, W) or (n, C, H, W) float32: the usable files' samples, in path order; None when not read
    (eval off) or none is usable."""
    usable: list[str] = field(default_factory=list)
    unusable: dict[str, str] = field(default_factory=dict)
    """Held-out files left out of the eval set, and why (unreadable, wrong shape, NaN/Inf/out of range)."""


def read_held_out(
    split: FolderSplit,
    kind: str,
    frames: int,
    channels: int,
    height: int,
    width: int,
    as_images: bool,
    limit: float,
    resize: str = "crop",
) -> HeldOutFiles:
    """Read the held-out files for the eval set: the usable ones' samples, the others named with why.

    A file is unusable as the training loop would find it: unreadable or of the wrong shape (its
    FolderClips problem), or NaN/Inf/|x| > limit (the batch check's kinds; a constant sample is a
    legitimate, if odd, eval sample and stays). The run says which, once per sweep (sweep/run/build.py)."""
    out = HeldOutFiles(split.names(), split.note)
    if not split.held_out:
        return out
    clips = FolderClips(
        split.root, kind, frames, channels, height, width, as_images, files=split.held_out, resize=resize
    )
    kept = []
    for i in range(len(clips)):
        why = clips.problem(i)
        if why is None:
            found, _ = check_sample(clips.samples[i], limit)
            why = "; ".join(f"{p.kind}: {p.detail}" for p in found if p.kind in ("nan", "inf", "range")) or None
        if why is None:
            kept.append(i)
            out.usable.append(clips.name(i))
        else:
            out.unusable[clips.name(i)] = why
    if kept:
        out.clips = torch.stack([clips.samples[i] for i in kept])
    return out


class FolderClips(Dataset):
    """Samples read from the files of a folder; sample i is the i-th file in path order."""

    def __init__(
        self,
        root: Path,
        kind: str,
        frames: int,
        channels: int,
        height: int,
        width: int,
        as_images: bool = False,
        files: Sequence[Path] | None = None,
        resize: str = "crop",
    ) -> None:
        """`files`: which files of the folder (e.g. a FolderSplit's training files); None = all of `kind`.
        `resize`: how an image becomes height x width (image_folder; sweep/data/readers.py RESIZE_MODES)."""
        self.root = Path(root)
        self.files = list_files(self.root, kind) if files is None else list(files)
        self.source = FOLDER_KINDS[kind][0]
        self.as_images = as_images
        self.frames, self.resize = frames, resize
        self.expected = Expected(channels, frames, height, width)
        self.shape = (channels, height, width) if as_images else (channels, frames, height, width)
        self.samples: list[Tensor] = []
        self.problems: list[str | None] = []
        for path in self.files:
            x, problem = self._read(path)
            self.samples.append(x)
            self.problems.append(problem)
        bad = sum(p is not None for p in self.problems)
        if files is None:
            log.info("data: %d samples from %s%s", len(self.files), self.root, f", {bad} unusable" if bad else "")

    def _read(self, path: Path) -> tuple[Tensor, str | None]:
        """The sample (NaN-filled when unusable) and what makes it unusable."""
        placeholder = torch.full(self.shape, math.nan)
        try:
            if self.source == "video":
                x, cut = read_video(path)
                if cut:
                    return placeholder, f"truncated: {cut}"
            elif self.source == "image":
                x = read_image(path, (self.expected.height, self.expected.width), self.resize).pixels
            else:
                items = dict(read_latents(path))
                x = items.get("latents", next(iter(items.values())) if len(items) == 1 else None)
                if x is None:
                    return placeholder, f"holds {len(items)} tensors and none is called 'latents'"
        except ReadError as err:
            return placeholder, f"{err.kind}: {err.detail}"
        wrong = shape_problem(tuple(x.shape), self.expected, self.source)  # the doctor's rule (sweep/data/shape.py)
        if wrong is not None:
            return placeholder, wrong.detail
        return conform(x, self.frames, self.as_images).float().contiguous(), None

    def label(self, i: int) -> str:
        """How a sample is named in a verdict: its index and file."""
        return f"{i} ({self.name(i)})"

    def name(self, i: int) -> str:
        """Sample i's file, relative to the folder (POSIX)."""
        return relative(self.root, self.files[i])

    def problem(self, i: int) -> str | None:
        return self.problems[i]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> Tensor:
        return self.samples[i].clone()
