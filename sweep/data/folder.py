"""Training data from a folder: video files (decoded with PyAV) or latent tensors, checked as the data doctor does.

    python -m sweep data=video_folder data.path=clips/ data.frames=8 data.height=16 data.width=16
    python -m sweep data=latent_folder data.path=latents/ data.channels=4 data.frames=8

Every file under the folder (recursively, sorted by path) is one sample, read once when the run is
built with the data doctor's readers (sweep/data/readers.py): videos become (3, F, H, W) in [-1, 1]
the way a training loader maps uint8 pixels (the first F frames are used); a latent file holds one
tensor (its `latents` entry when it holds several) of shape (C, F, H, W), or (C, H, W) for images.
Pickle is never run: `.pt` loads with weights_only=True, `.npy` without allow_pickle.

A file that cannot be used (unreadable, truncated, empty, wrong shape, too few frames) stays in the
dataset with its problem; the batch that draws it is `bad_input` naming the file, whatever
`data.check` says, since no training script could use it either. Its values (NaN/Inf/out of range)
are found by the per-batch check; `data.drop_bad=true` leaves every such sample out instead.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

from sweep.data.readers import LATENT_EXTS, VIDEO_EXTS, ReadError, find_files, read_latents, read_video

log = logging.getLogger("sweep")


class FolderClips(Dataset):
    """Samples read from the files of a folder; sample i is the i-th file in path order."""

    def __init__(
        self, root: Path, kind: str, frames: int, channels: int, height: int, width: int, as_images: bool = False
    ) -> None:
        if kind not in ("video_folder", "latent_folder"):
            raise ValueError(f"unknown folder kind {kind!r}")
        self.root = Path(root)
        exts = VIDEO_EXTS if kind == "video_folder" else LATENT_EXTS
        found = find_files(self.root)
        if found.unlisted:  # its samples would be missing from the run without a word
            raise ValueError(
                f"data.path: {found.unlisted[0][1]}: the run would leave out the samples under it"
                f" (`python -m sweep.doctor {self.root}` checks every file)"
            )
        self.files = [p for p in found.files if p.suffix.lower() in exts]
        if not self.files:
            raise ValueError(f"data.path: no {'video' if kind == 'video_folder' else 'latent'} files under {self.root}")
        self.as_images = as_images
        self.shape = (channels, height, width) if as_images else (channels, frames, height, width)
        self.samples: list[Tensor] = []
        self.problems: list[str | None] = []
        for path in self.files:
            x, problem = self._read(path, kind)
            self.samples.append(x)
            self.problems.append(problem)
        bad = sum(p is not None for p in self.problems)
        log.info("data: %d samples from %s%s", len(self.files), self.root, f", {bad} unusable" if bad else "")

    def _read(self, path: Path, kind: str) -> tuple[Tensor, str | None]:
        """The sample (NaN-filled when unusable) and what makes it unusable."""
        placeholder = torch.full(self.shape, math.nan)
        try:
            if kind == "video_folder":
                x, cut = read_video(path)
                if cut:
                    return placeholder, f"truncated: {cut}"
                if self.as_images:
                    x = x[:, 0]
                elif x.shape[1] > self.shape[1]:
                    x = x[:, : self.shape[1]]  # the first F frames, as a clip sampler would take
            else:
                items = dict(read_latents(path))
                x = items.get("latents", next(iter(items.values())) if len(items) == 1 else None)
                if x is None:
                    return placeholder, f"holds {len(items)} tensors and none is called 'latents'"
        except ReadError as err:
            return placeholder, f"{err.kind}: {err.detail}"
        if tuple(x.shape) != self.shape:
            return (
                placeholder,
                f"shape {tuple(x.shape)}, the run expects {self.shape} (data.channels/frames/height/width)",
            )
        return x.float().contiguous(), None

    def label(self, i: int) -> str:
        """How a sample is named in a verdict: its index and file."""
        return f"{i} ({self.files[i].relative_to(self.root).as_posix()})"

    def problem(self, i: int) -> str | None:
        return self.problems[i]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> Tensor:
        return self.samples[i].clone()
