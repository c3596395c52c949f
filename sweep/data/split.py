"""Which files of a data folder are held out for the eval loss: a pure function of their relative paths.

`data.eval_files` says how many: a fraction f (0 < f < 1), a count k (a whole number >= 1), or 0 for
none. Which ones is decided by a stable hash of each file's path relative to `data.path`, never by
its place in the listing, so adding files to a folder does not reshuffle the split:

- every file gets u = the first 8 bytes of sha256(POSIX relative path), read as a number in [0, 1);
- a fraction f holds out the files with u < f. Adding files changes no existing file's side. When no
  file falls below f (a small folder), the one with the smallest u is held out, so there is an eval set
  (adding a file below f later returns that one to training);
- a count k holds out the k files of smallest u. Adding a file displaces at most one: the new file
  enters the k smallest only by pushing out their largest;
- never everything: at least one file trains. When the rule above would hold out every file, the file
  of largest u trains (a folder of one file holds out nothing), and `note` says so.

The training run (sweep/data/folder.py, sweep/run/build.py), the eval set (sweep/run/evaluate.py) and the
data doctor (sweep/doctor.py) all call `split_files`, so the doctor reports the split a run will use.
Pure Python (no torch): sweep/config/validate.py checks `data.eval_files` with `eval_files_problem`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

_HASH_BYTES = 8


def file_hash(relative: str) -> float:
    """u in [0, 1): the first 8 bytes of sha256 of the POSIX relative path (UTF-8), over 2**64."""
    digest = hashlib.sha256(relative.encode("utf-8")).digest()
    return int.from_bytes(digest[:_HASH_BYTES], "big") / 2.0 ** (8 * _HASH_BYTES)


def eval_files_problem(value: object) -> str | None:
    """Why `value` is not a valid data.eval_files (None when it is): a fraction in (0, 1), a whole
    count >= 1, or 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a number: a fraction in (0, 1) or a count of files >= 1 (0 holds none out), got {value!r}"
    if not math.isfinite(value) or value < 0:
        return f"must be a fraction in (0, 1) or a count of files >= 1 (0 holds none out), got {value}"
    if value >= 1 and value != int(value):
        return f"a count of files must be a whole number (a fraction must be below 1), got {value}"
    return None


def describe(eval_files: float) -> str:
    """The value as a user writes it: 0.1, 3 (a count), 0."""
    return str(int(eval_files)) if eval_files == int(eval_files) else f"{eval_files:g}"


def how_many(eval_files: float) -> str:
    """What a fraction means, for the lines that report a split ("" for a count or 0): the files whose hash falls
    below it, so the count varies around the fraction (15 of 96 files at 0.1 in a user's folder: a binomial
    draw, the price of a split that adding files never reshuffles)."""
    if eval_files == int(eval_files):
        return ""
    return f"; the files whose path hash falls below {describe(eval_files)}: about {eval_files:.0%}, a count is exact"


@dataclass(frozen=True)
class FileSplit:
    """The files that train and those held out (each in the order given), and why the held-out set is
    not what `eval_files` asked for, when it is not."""

    train: tuple[str, ...]
    held_out: tuple[str, ...]
    note: str | None = None


def split_files(relative_paths: Sequence[str], eval_files: float) -> FileSplit:
    """Split files (POSIX paths relative to data.path, distinct) into training and held-out files.

    Pure: the result depends on the paths and eval_files only, and each file's side on its own hash
    (fraction) or its hash's rank (count); see the module docstring for the rules."""
    problem = eval_files_problem(eval_files)
    if problem is not None:
        raise ValueError(f"data.eval_files: {problem}")
    paths = list(relative_paths)
    if eval_files == 0 or not paths:
        return FileSplit(tuple(paths), ())
    u = {p: file_hash(p) for p in paths}
    by_hash = sorted(paths, key=lambda p: (u[p], p))
    note = None
    if eval_files < 1:
        held = {p for p in paths if u[p] < eval_files}
        if not held:
            held = {by_hash[0]}
            note = f"no file's hash falls below {describe(eval_files)}: the one with the smallest hash is held out"
    else:
        held = set(by_hash[: int(eval_files)])
    if len(held) == len(paths):  # at least one file trains
        held.discard(by_hash[-1])
        note = (
            f"one file ({by_hash[-1]}): it trains, nothing is held out"
            if len(paths) == 1
            else f"data.eval_files={describe(eval_files)} would hold out all {len(paths)} files: {by_hash[-1]} trains"
        )
    return FileSplit(tuple(p for p in paths if p not in held), tuple(p for p in paths if p in held), note)
