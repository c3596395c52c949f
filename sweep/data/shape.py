"""The one shape rule: which sample shapes a run on (channels, frames, height, width) takes, and how.

The loader (sweep/data/folder.py `FolderClips`) and the data doctor (sweep/doctor.py) both decide a
sample's shape here, so a file the doctor calls clean for the run's shape is one the run trains on, and
a file the run refuses the doctor refuses with the same sentence:

- a sample is (C, F, H, W) or (C, H, W); a (C, H, W) sample is one frame (F = 1);
- frames=1 (an image model, or a video model trained on single frames): (C, 1, H, W) and (C, H, W) are the
  same sample, given to the model as it takes them: (C, H, W) to an image model (the frame axis
  squeezed), (C, 1, H, W) to a video model;
- a video file may have more frames than the run's F: its first F are used, as a clip sampler takes them;
  a latent file has exactly F;
- an image file (data=image_folder) is scaled to H x W as it is read (data.resize), so only its channels
  (3: RGB) and its single frame are checked here; an image smaller than H x W is the doctor's `size` finding.

A sample of the wrong shape is `frames` when only its frame count is off, else `shape`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor

from sweep.data.checks import SampleProblem

DIMS = ("channels", "frames", "height", "width")
"""The (C, F, H, W) layout's dims, in order."""


@dataclass(frozen=True)
class Expected:
    """The sample shape a run takes (None: any, for the doctor without --channels/--frames/--height/--width)."""

    channels: int | None = None
    frames: int | None = None
    height: int | None = None
    width: int | None = None

    def values(self) -> tuple[int | None, ...]:
        return tuple(getattr(self, d) for d in DIMS)

    def describe(self, source: str = "latent") -> str:
        """'(4, 1, 8, 8) or (4, 8, 8)'; unknown dims by their letter: '(C, 8, H, W)'."""
        c, f, h, w = (str(v) if v is not None else letter for v, letter in zip(self.values(), "CFHW"))
        if source == "video":
            return f"({c}, {f}, {h}, {w}) (the first {f} frames of a video)"
        if self.frames == 1:
            return f"({c}, 1, {h}, {w}) or ({c}, {h}, {w})"
        return f"({c}, {f}, {h}, {w})"


def as_cfhw(shape: tuple[int, ...]) -> tuple[int, int, int, int] | None:
    """The (C, F, H, W) of a sample shape (a (C, H, W) one has F = 1), or None for any other rank."""
    if len(shape) == 4:
        return (shape[0], shape[1], shape[2], shape[3])
    if len(shape) == 3:
        return (shape[0], 1, shape[1], shape[2])
    return None


def shape_problem(shape: tuple[int, ...], expected: Expected, source: str = "latent") -> SampleProblem | None:
    """Why a sample of `shape` from a `source` file ("video", "latent" or "image") does not fit `expected`,
    or None when the run takes it (module docstring)."""
    shape = tuple(int(n) for n in shape)
    if source == "image":  # scaled to the run's height x width when read
        expected = replace(expected, height=None, width=None)
    dims = as_cfhw(shape)
    if dims is None:
        return SampleProblem("shape", f"shape {shape}: a sample is (C, F, H, W) or (C, H, W)")
    wrong = [
        name
        for name, have, want in zip(DIMS, dims, expected.values())
        if want is not None and (have < want if name == "frames" and source == "video" else have != want)
    ]
    if not wrong:
        return None
    kind = "frames" if wrong == ["frames"] else "shape"
    return SampleProblem(kind, f"shape {shape}, the run expects {expected.describe(source)}")


def conform(x: Tensor, frames: int, as_images: bool) -> Tensor:
    """A sample that passed shape_problem, as the model takes it: (C, H, W) for an image model, else the
    first `frames` frames as (C, F, H, W)."""
    if x.dim() == 3:
        x = x.unsqueeze(1)  # one frame
    x = x[:, :frames]
    return x[:, 0] if as_images else x
