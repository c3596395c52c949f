"""Which settings a confirmation reruns: the grid's recommended setting, each combination's largest stable lr, and
where one of them fails, the next lower lr of its combination that was stable in the grid.

A setting is a combination of the swept axes (lr aside) at one lr: its grid runs are the cell's stable runs, one per
seed, and the confirmation reruns every one of them. The plan comes from the grid's own runs table and the report's
functions, so it names settings exactly as the frontier and the recommendation do.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from sweep.report.confirmation import LARGEST, RECOMMENDED, STEP_DOWN, Confirmation, confirm_records
from sweep.report.recommend import choice_by_combo, recommend, unrunnable_combos
from sweep.report.runs import PARAM, runs_from_dirs
from sweep.report.tables import LR, combo_axes, combo_labels, frontier_records
from sweep.report.target import resolve_target


@dataclass
class Setting:
    """One setting to confirm: a combination at an lr (None when the sweep has no lr axis) and its grid runs."""

    combination: str
    params: dict
    """The swept values that make it: the combination's axes and optim.lr."""
    lr: float | None
    why: list[str]
    runs: list[tuple[int, Path]]
    """(seed, grid run dir) of its stable grid runs, by seed."""
    step_down_from: float | None = None
    stable_lrs: list[float] = field(default_factory=list)
    """Its combination's lrs stable in every replicate of the grid (where a step down goes)."""

    @property
    def key(self) -> str:
        return f"{self.combination}@{self.lr!r}"

    @property
    def label(self) -> str:
        return f"{self.combination} lr {self.lr:.4g}" if self.lr is not None else self.combination

    @property
    def always(self) -> bool:
        """Confirmed whatever it costs: the recommended setting, and its steps down."""
        return RECOMMENDED in self.why

    def name(self) -> str:
        """Its folder under <sweep>/confirm/: readable, safe in a shell."""
        text = "-".join(f"{v}" for k, v in self.params.items() if k != LR) or "all"
        text += f"-lr{self.lr:g}" if self.lr is not None else ""
        return re.sub(r"[^A-Za-z0-9._=+-]+", "_", text)[:120]


def grid_runs(sweep_dir: Path) -> pd.DataFrame:
    """The sweep's own runs (its result.json files), superseded ones left out."""
    runs = runs_from_dirs(sweep_dir, starting_s=0)
    if "superseded_by" in runs and len(runs):
        runs = runs[runs.superseded_by.isna()].reset_index(drop=True)
    return runs


def plan(runs: pd.DataFrame, target: str | None = None) -> list[Setting]:
    """The recommended setting first (the report's recommendation for `target` (report.target) without a
    confirmation), then each combination's largest stable lr, in the frontier's order; one entry per setting, with
    every reason it was chosen."""
    if runs.empty or not (runs.status == "stable").any():
        return []
    recs = frontier_records(runs)
    axes = combo_axes(runs)
    labels = combo_labels(runs, axes)
    pick = recommended(runs, target=target)
    chosen: dict[str, Setting] = {pick.key: pick} if pick is not None else {}
    for rec in recs.to_dict("records"):
        if rec["max_stable_lr"] is None or pd.isna(rec["max_stable_lr"]):
            continue
        s = _setting(runs, labels, rec["combination"], {a: rec[a] for a in axes}, rec["max_stable_lr"], LARGEST)
        if s is not None:
            s.stable_lrs = rec["stable_lrs"]
            chosen.setdefault(s.key, s)
            chosen[s.key].why += [LARGEST] if LARGEST not in chosen[s.key].why else []
    return _runnable_first(runs, axes, list(chosen.values()), target)


def _runnable_first(runs: pd.DataFrame, axes: list[str], settings: list[Setting], target: str | None) -> list:
    """The settings the target can run first (report.target: fp32/flash does not run on CUDA), in their order:
    under a budget the others, which the recommendation leaves out anyway, are the ones left unconfirmed."""
    on, _ = resolve_target(runs, target)
    precision, attention = (choice_by_combo(runs, axes, a) for a in ("precision", "attention"))
    cannot = unrunnable_combos(on, [s.combination for s in settings], precision, attention)
    return sorted(settings, key=lambda s: s.combination in cannot)


def recommended(
    runs: pd.DataFrame, confirmation: Confirmation | None = None, target: str | None = None
) -> Setting | None:
    """The setting the report recommends for `target`, given what the confirmation so far says (none: the grid's
    own pick)."""
    grid = frontier_records(runs)
    pick = recommend(runs, confirm_records(grid, confirmation), target=target, confirmation=confirmation)
    if pick.combination is None:
        return None
    axes = combo_axes(runs)
    values = {a: pick.settings.get(a) for a in axes}
    s = _setting(runs, combo_labels(runs, axes), pick.combination, values, pick.settings.get(LR), RECOMMENDED)
    if s is not None and len(grid):
        s.stable_lrs = list(grid.set_index("combination").loc[pick.combination, "stable_lrs"])  # the grid's own
    return s


def step_down(failed: Setting, runs: pd.DataFrame) -> Setting | None:
    """The next lower lr of `failed`'s combination that was stable in every replicate of the grid, or None."""
    if failed.lr is None:
        return None
    lower = [lr for lr in failed.stable_lrs if lr < failed.lr]
    if not lower:
        return None
    values = {k: v for k, v in failed.params.items() if k != LR}
    s = _setting(runs, combo_labels(runs, combo_axes(runs)), failed.combination, values, max(lower), STEP_DOWN)
    if s is not None:
        s.stable_lrs, s.step_down_from = failed.stable_lrs, failed.lr
        if failed.always:  # the recommendation steps down through it: confirmed whatever it costs
            s.why.insert(0, RECOMMENDED)
    return s


def _setting(runs, labels, combination, values, lr, why) -> Setting | None:
    """The setting, with its stable grid runs by seed; None when it has none."""
    cell = runs[(labels == combination) & (runs.status == "stable")]
    if lr is not None and PARAM + LR in runs:
        cell = cell[[_same(x, lr) for x in pd.to_numeric(cell[PARAM + LR], errors="coerce")]]
    if cell.empty:
        return None
    members = sorted(
        ((int(s) if not pd.isna(s) else 0, Path(str(d))) for s, d in zip(cell.seed, cell.run_dir)),
        key=lambda sd: sd[0],
    )
    params = {a: _plain(v) for a, v in values.items()}
    if lr is not None:
        params[LR] = float(lr)
    return Setting(combination, params, float(lr) if lr is not None else None, [why], members)


def _same(a, b) -> bool:
    return a is not None and not pd.isna(a) and math.isclose(float(a), float(b), rel_tol=1e-9)


def _plain(v):
    return v.item() if hasattr(v, "item") else v
