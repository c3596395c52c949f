"""The data doctor: find the samples of a dataset folder that would break or poison a training run.

    python -m sweep.doctor data/clips                      # a folder of videos (mp4, webm, mkv, ...)
    python -m sweep.doctor data/latents --json report.json # a folder of .safetensors / .pt / .npy / .npz
    python -m sweep.doctor data/photos --height 32 --width 32  # a folder of .png / .jpg / .webp images
    python -m sweep.doctor data/clips --frames 16 --height 256 --width 256
    python -m sweep.doctor data/latents --eval-files 8      # which 8 files a run holds out for its eval loss

Subfolders are scanned too. Per sample it reports, by kind:
- ``unreadable`` / ``truncated`` / ``empty``: the file cannot be decoded or loaded ("permission
  denied: PATH" when it may not be read), is cut short, or holds nothing (a ``.pt`` that pickles
  anything but tensors is refused, never run); a subfolder that cannot be listed is an
  ``unreadable`` entry of its own (source ``folder``): its samples are unknown, so never "all clean";
- ``nan`` / ``inf`` / ``range``: what the training loop's ``bad_input`` check
  (``sweep.data.checks.check_batch``) would reject, through the shared ``check_sample``; videos and
  images are mapped to [-1, 1] as a loader would (``uint8 / 127.5 - 1``), so ``range`` is mostly about
  latents, e.g. [0, 255] data where [-1, 1] was expected;
- ``shape`` / ``frames``: a shape the run would refuse, decided for the run's shape
  (``--channels/--frames/--height/--width``, all four for the verdict the run will give) by the loader's own
  rule (sweep/data/shape.py: a (C, 1, H, W) file is an image for frames=1, a video may be longer than
  --frames), with the loader's sentence; and, for the dims not given, a shape unlike most samples of the folder;
- ``mode``: an image that is not 8-bit (16-bit, float): the loader refuses it too;
- ``size``: an image smaller than --height x --width, which the run scales up (blurred);
- ``constant``: every value the same (an all-black clip, a zero latent, a blank image).

It also reports the split a training run on PATH would use (sweep/data/split.py): which files are held
out of training for the eval loss under ``data.eval_files`` (``--eval-files``, default the run's, 0.1),
per data kind (``data=video_folder`` reads the videos, ``data=image_folder`` the images, ``data=latent_folder``
the latents). The split
hashes each file's path relative to PATH, so run the doctor on the folder that will be ``data.path``.

It prints counts per kind and one line per bad sample, writes every sample's result as JSON
(``--json``; default ``PATH/doctor_report.json``, or the current directory when PATH is not
writable), and exits 0 when everything is clean, 1 when anything is bad, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from sweep.config import DataConfig, Progress
from sweep.data.checks import CONSTANT_TOL, PROBLEM_KINDS, RANGE_LIMIT, SampleProblem, check_sample
from sweep.data.folder import FOLDER_KINDS, relative
from sweep.data.readers import ReadError, find_files, read_image, read_latents, read_video, source_of
from sweep.data.shape import DIMS, Expected, as_cfhw, shape_problem
from sweep.data.split import describe, eval_files_problem, how_many, split_files
from sweep.run.progress import resolve_mode

REPORT_NAME = "doctor_report.json"


@dataclass
class SampleResult:
    """The doctor's findings on one sample: a video file, or one tensor of a latent file."""

    path: str  # relative to the scanned root, with forward slashes
    key: str = ""  # the tensor's name inside a multi-tensor latent file, else ""
    source: str = "latent"  # "video" | "image" | "latent" | "folder" (one that cannot be listed)
    shape: list[int] | None = None
    dtype: str | None = None
    min: float | None = None
    max: float | None = None
    problems: list[SampleProblem] = field(default_factory=list)
    group: str = ""  # samples compared with each other for the majority shape
    mode: str | None = None  # an image's Pillow mode as stored (RGB, L, P, ...)
    sample: bool = True  # what a run trains on: a file's one tensor or its `latents` entry (not its other entries)

    @property
    def name(self) -> str:
        return f"{self.path}[{self.key}]" if self.key else self.path

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "key": self.key,
            "source": self.source,
            "shape": self.shape,
            "dtype": self.dtype,
            "min": _json_float(self.min),
            "max": _json_float(self.max),
            "ok": self.ok,
            "problems": [p.to_dict() for p in self.problems],
            "mode": self.mode,
        }


def _json_float(v: float | None) -> float | str | None:
    """NaN/Inf as strings: strict JSON has no literal for them."""
    if v is None or v == v and abs(v) != float("inf"):
        return v
    return str(v)


def examine_file(path: Path, root: Path, limit: float, constant_tol: float) -> list[SampleResult]:
    """Read one file and check each of its samples' values (shapes are compared later, across samples)."""
    rel = relative(root, path)
    source = source_of(path)
    mode = None
    try:
        if source == "video":
            clip, cut = read_video(path)
            items, notes = [("", clip)], [cut]
        elif source == "image":  # at its own size: the run scales it (a `size` finding when it must scale up)
            image = read_image(path)
            items, notes, mode = [("", image.pixels)], [None], image.mode
        else:
            items = read_latents(path)
            notes = [None] * len(items)
    except ReadError as err:
        return [SampleResult(rel, source=source, problems=[SampleProblem(err.kind, err.detail)])]
    except Exception as err:  # noqa: BLE001 - a library crashing on a corrupt file is a finding
        problem = SampleProblem("unreadable", f"{type(err).__name__}: {err}")
        return [SampleResult(rel, source=source, problems=[problem])]

    results = []
    for (key, x), cut in zip(items, notes):
        problems = [SampleProblem("truncated", cut)] if cut else []
        found, stats = check_sample(x, limit, constant_tol)
        results.append(
            SampleResult(
                rel,
                key=key if len(items) > 1 else "",
                source=source,
                shape=list(x.shape),
                dtype=str(x.dtype).removeprefix("torch."),
                min=stats.min if stats else None,
                max=stats.max if stats else None,
                problems=problems + found,
                group=source if source != "latent" else (key if len(items) > 1 else "latent"),
                mode=mode,
                sample=len(items) == 1 or key == "latents",  # the tensor the loader reads (sweep/data/folder.py)
            )
        )
    return results


def unlisted_result(folder: Path, root: Path, why: str) -> SampleResult:
    """A folder whose files cannot be listed, as an unreadable entry of the report."""
    rel = folder.relative_to(root).as_posix() if folder != root else folder.name
    return SampleResult(rel, source="folder", problems=[SampleProblem("unreadable", why)])


def check_shapes(results: list[SampleResult], expected: dict[str, int]) -> dict[str, list[int] | None]:
    """Add shape/frames/size problems: the run's shape rule for the dims given (sweep/data/shape.py, the loader's
    own, with its sentence), and each group's majority shape for the dims not given; returns the majorities."""
    want = Expected(**expected)
    majorities: dict[str, list[int] | None] = {}
    # A truncated clip's short frame count is a consequence, already reported: leave it out.
    comparable = [r for r in results if r.shape is not None and not any(p.kind == "truncated" for p in r.problems)]
    for r in comparable:
        if not r.sample:
            continue
        problem = shape_problem(tuple(r.shape), want, r.source)
        if problem is not None:
            r.problems.append(problem)
        small = r.source == "image" and _smaller(r.shape[1:], want)
        if small:
            r.problems.append(SampleProblem("size", small))
    free = [i for i, d in enumerate(DIMS) if d not in expected]  # the dims the majority decides
    for group in sorted({r.group for r in comparable if r.source != "image"}):  # images are scaled to the run's size
        members = [r for r in comparable if r.group == group]
        normal = {id(r): as_cfhw(tuple(r.shape)) or tuple(r.shape) for r in members}
        counts = Counter(normal[id(r)] for r in members).most_common(2)
        unique = len(counts) == 1 or counts[0][1] > counts[1][1]
        majority = counts[0][0] if unique else None  # a tie names no majority
        majorities[group] = next(r.shape for r in members if normal[id(r)] == majority) if majority else None
        for r in members:
            if majority is None or any(p.kind in ("shape", "frames") for p in r.problems):
                continue
            mine = normal[id(r)]
            if len(mine) != len(majority):
                off = ["rank"]
            else:
                off = [DIMS[i] for i in free if mine[i] != majority[i]]
            if off == ["frames"]:
                r.problems.append(SampleProblem("frames", f"{mine[1]} frames, most samples have {majority[1]}"))
            elif off:
                shown = tuple(majorities[group])
                r.problems.append(SampleProblem("shape", f"shape {tuple(r.shape)}, most samples are {shown}"))
    return majorities


def _smaller(size: list[int], want: Expected) -> str | None:
    """Why an image of size (height, width) is scaled up to the run's size, or None when it is not."""
    h, w = size
    if (want.height is None or h >= want.height) and (want.width is None or w >= want.width):
        return None
    run = f"{want.height or 'any'} x {want.width or 'any'}"
    return f"{h} x {w} pixels, smaller than the run's {run} (height x width): scaled up, so blurred"


def eval_split(root: Path, files: list[Path], results: list[SampleResult], eval_files: float) -> dict:
    """The held-out files a run on `root` would use, per data kind present: {"eval_files", "by_data": {data:
    {"files", "train", "held_out" (relative paths), "held_out_bad" (those the doctor found bad), "note"}}}."""
    bad = {r.path for r in results if not r.ok}
    by_data = {}
    for data, (source, _) in FOLDER_KINDS.items():
        names = [relative(root, f) for f in files if source_of(f) == source]
        if not names:
            continue
        split = split_files(names, eval_files)
        by_data[data] = {
            "files": len(names),
            "train": len(split.train),
            "held_out": list(split.held_out),
            "held_out_bad": [n for n in split.held_out if n in bad],
            "note": split.note,
        }
    return {"eval_files": int(eval_files) if eval_files == int(eval_files) else eval_files, "by_data": by_data}


def format_split(split: dict, shown: int = 10) -> str:
    """The split's lines of the printed summary: counts per data kind, then the held-out files."""
    lines = []
    for data, s in split["by_data"].items():
        what = FOLDER_KINDS[data][0]
        lines.append(
            f"eval split (data={data} data.eval_files={describe(split['eval_files'])}): {len(s['held_out'])} of"
            f" {s['files']} {what} files held out for the eval loss, {s['train']} train{how_many(split['eval_files'])}"
        )
        names = [n + (" (bad)" if n in s["held_out_bad"] else "") for n in s["held_out"]]
        if names:
            more = f", +{len(names) - shown} more" if len(names) > shown else ""
            lines.append(f"  held out: {', '.join(names[:shown])}{more}")
        if s["note"]:
            lines.append(f"  note: {s['note']}")
    return "\n".join(lines)


def _report_path(root: Path, json_arg: str | None) -> list[Path]:
    """Where to write the JSON report, in order of preference."""
    if json_arg:
        return [Path(json_arg)]
    folder = root if root.is_dir() else root.parent
    return ([folder / REPORT_NAME] if os.access(folder, os.W_OK) else []) + [Path.cwd() / REPORT_NAME]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_report(report: dict, candidates: list[Path]) -> Path | None:
    """Write the report to the first candidate that accepts it.

    Written to a fresh temporary file beside it, then renamed over the name: a symlink planted there
    (the scanned folder may belong to someone else) is replaced, never written through, and a reader
    never sees half a report.
    """
    text = json.dumps(report, indent=2) + "\n"
    for path in candidates:
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # O_EXCL
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600; give it a plain file's mode
            os.replace(tmp, path)
            return path
        except OSError:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            continue
    return None


def format_summary(root: Path, results: list[SampleResult], n_files: int) -> str:
    """Counts per problem kind, then one line per bad sample."""
    bad = [r for r in results if not r.ok]
    lines = [
        f"doctor: {len(results)} samples in {n_files} files under {root}: "
        + (f"{len(bad)} bad" if bad else "all clean")
    ]
    if not bad:
        return "\n".join(lines)
    counts = Counter(p.kind for r in bad for p in {p.kind: p for p in r.problems}.values())
    width = max(len(k) for k in counts)
    lines += ["", f"{'problem':<{max(width, 7)}}  samples"]
    lines += [f"{k:<{max(width, 7)}}  {counts[k]:>7}" for k in PROBLEM_KINDS if counts[k]]
    name_w = min(max(len(r.name) for r in bad), 60)
    kind_w = max(len(",".join(dict.fromkeys(p.kind for p in r.problems))) for r in bad)
    lines += ["", "bad samples:"]
    for r in bad:
        kinds = ",".join(dict.fromkeys(p.kind for p in r.problems))
        lines.append(f"  {r.name:<{name_w}}  {kinds:<{kind_w}}  {'; '.join(p.detail for p in r.problems)}")
    if counts["range"]:
        lines += ["", RANGE_HINT]
    return "\n".join(lines)


RANGE_HINT = (
    "range: values past --limit, the run's data.range_limit (data is expected in [-1, 1]); latents scaled by a "
    "VAE's scaling_factor have about unit variance: give --limit and data.range_limit the largest value they "
    "reach (docs/data.md)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sweep.doctor",
        description="Scan a folder of videos, images or latent tensors (recursively) for samples that would break "
        "or poison training: unreadable/truncated/empty files, NaN/Inf, values outside [-limit, limit], "
        "wrong shapes or frame counts (the run's own rule), images that are not 8-bit or smaller than the run's "
        "size, constant clips. Exit status: 0 clean, 1 problems found, 2 usage error.",
    )
    parser.add_argument(
        "path",
        help="dataset folder (or one file): videos (.mp4 .webm .mkv .avi .mov ...) decoded "
        "with PyAV and images (.png .jpg .jpeg .webp) with Pillow, mapped to [-1, 1]; latents "
        "(.safetensors .pt .pth .npy .npz)",
    )
    parser.add_argument(
        "--json",
        metavar="FILE",
        help=f"where to write the per-sample JSON report "
        f"(default: PATH/{REPORT_NAME}, or ./{REPORT_NAME} when PATH is not writable)",
    )
    parser.add_argument(
        "--limit",
        type=float,
        default=RANGE_LIMIT,
        help="values with |x| above this are out of range (default %(default)s, the training "
        "loop's data.range_limit; VAE latents not scaled to [-1, 1] need a larger one)",
    )
    parser.add_argument(
        "--constant-tol",
        type=float,
        default=CONSTANT_TOL,
        help="a sample whose max - min is at most this is constant (default %(default)s)",
    )
    parser.add_argument(
        "--eval-files",
        type=float,
        default=DataConfig().eval_files,
        metavar="N",
        help="report the files a run holds out for its eval loss under data.eval_files=N: a fraction in (0, 1), "
        "a count >= 1, or 0 for none (default %(default)s, the run's default)",
    )
    for dim in DIMS:
        parser.add_argument(
            f"--{dim}",
            type=int,
            metavar="N",
            help=f"the run's data.{dim}: samples are checked by the loader's own shape rule, in the (C, F, H, W) / "
            "(C, H, W) layout (a (C, 1, H, W) file is an image for --frames 1; give all four for the run's verdict; "
            "default: compare with the majority of the folder)",
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a bad option (2, argparse printed why)
        return int(exit_.code or 0)
    root = Path(args.path)
    if not root.exists():
        print(f"doctor: no such file or directory: {args.path}", file=sys.stderr)
        return 2
    if not args.limit > 0 or args.constant_tol < 0:
        print("doctor: --limit must be > 0 and --constant-tol >= 0", file=sys.stderr)
        return 2
    problem = eval_files_problem(args.eval_files)
    if problem is not None:
        print(f"doctor: --eval-files: {problem}", file=sys.stderr)
        return 2
    expected = {d: getattr(args, d) for d in DIMS if getattr(args, d) is not None}
    if any(v < 1 for v in expected.values()):
        print("doctor: --channels/--frames/--height/--width must be >= 1", file=sys.stderr)
        return 2

    files, unlisted = find_files(root)
    if not files and not unlisted:
        print(f"doctor: no video, image or latent files under {root}", file=sys.stderr)
        return 1
    bar = resolve_mode(Progress.auto) is Progress.bar  # a bar for a person at a terminal only
    # A folder that cannot be listed hides its samples: a problem of its own, never "all clean".
    results = [unlisted_result(folder, root, why) for folder, why in unlisted]
    for path in tqdm(files, desc="doctor", unit="file", disable=not bar, leave=False, file=sys.stderr):
        results += examine_file(path, root, args.limit, args.constant_tol)
    majorities = check_shapes(results, expected)

    split = eval_split(root, files, results, args.eval_files)
    print(format_summary(root, results, len(files)))
    if split["by_data"]:
        print("\n" + format_split(split))
    bad = [r for r in results if not r.ok]
    report = {
        "path": str(root.resolve()),
        "limit": args.limit,
        "constant_tol": args.constant_tol,
        "expected": expected,
        "majority_shapes": majorities,
        "n_files": len(files),
        "n_samples": len(results),
        "n_bad": len(bad),
        "counts": {k: sum(any(p.kind == k for p in r.problems) for r in bad) for k in PROBLEM_KINDS},
        "samples": [r.to_dict() for r in results],
        "eval_split": split,
    }
    written = write_report(report, _report_path(root, args.json))
    if written is None:
        print("doctor: could not write the JSON report anywhere", file=sys.stderr)
    else:
        print(f"report: {written}")
    return 1 if bad else 0


if __name__ == "__main__":
    from sweep.exit import exit_after

    exit_after(main)
