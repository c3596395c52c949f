"""The one-line recommendation at the end of the summary, each claim backed by the table row it comes from.

- Precision: the fastest one (mean steps/s over its stable runs) that has a stable lr somewhere.
- Combination: within it, the one with the highest largest-stable-lr (ties: the one that follows more of
  the toggle advice, then the lower final loss), from the frontier table.
- lr: with margin, the next stable lr of its grid below that largest stable lr (the frontier); the
  largest stable lr itself only when the grid has nothing below it, and the line says so.
- Toggles: from the toggle table, every axis value that diverged less without losing lr (or gained lr
  without diverging more) than the value it was paired with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from sweep.report.runs import PARAM
from sweep.report.tables import LR, PRECISION, combo_axes, combo_labels, frontier_records, toggle_effects


@dataclass
class Advice:
    """Prefer `axis=better` over `axis=worse`, as the toggle table's row `row` shows."""

    axis: str
    better: object
    worse: object
    row: str
    evidence: str

    def text(self) -> str:
        return f"prefer {self.axis}={self.better} over {self.worse} ({self.evidence}) [toggles: {self.row}]"


@dataclass
class Recommendation:
    line: str
    precision: object = None
    combination: str | None = None
    settings: dict = field(default_factory=dict)
    """The recommended overrides, e.g. {"precision": "bf16_amp", "attention": "flash", "optim.lr": 0.001}."""
    margin: bool = False
    advice: list[Advice] = field(default_factory=list)


def toggle_advice(toggles: pd.DataFrame) -> list[Advice]:
    """Axis values to prefer, one per toggle-table row with a clear direction (precision aside)."""
    out = []
    for r in toggles.itertuples(index=False):
        if r.axis in (PRECISION, LR):
            continue
        steps = 0.0 if pd.isna(r.lr_steps) else r.lr_steps
        b_better = (r.diverged_b < r.diverged_a and steps >= 0) or (r.diverged_b <= r.diverged_a and steps > 0)
        a_better = (r.diverged_a < r.diverged_b and steps <= 0) or (r.diverged_a <= r.diverged_b and steps < 0)
        if not (a_better or b_better):
            continue
        better, worse = (r.b, r.a) if b_better else (r.a, r.b)
        d_better, d_worse = (r.diverged_b, r.diverged_a) if b_better else (r.diverged_a, r.diverged_b)
        evidence = f"diverged {d_better} vs {d_worse} of {r.pairs} paired runs"
        if not pd.isna(r.lr_steps) and r.combos:
            evidence += f", largest stable lr {steps if b_better else -steps:+.1f} grid steps"
        out.append(Advice(r.axis, better, worse, f"{r.axis} {r.a} vs {r.b}", evidence))
    return out


def recommend(
    runs: pd.DataFrame, recs: pd.DataFrame | None = None, toggles: pd.DataFrame | None = None
) -> Recommendation:
    """What to use: the fastest stable precision at the highest stable lr with margin, and the toggles.

    `recs` (tables.frontier_records) and `toggles` (tables.toggle_effects) are computed when not given.
    """
    stable = runs[runs.status == "stable"]
    if stable.empty:
        return Recommendation(
            "No stable run in this sweep, so nothing to recommend: try lower optim.lr "
            "or a precision with fp32 master weights."
        )
    recs = frontier_records(runs) if recs is None else recs
    advice = toggle_advice(toggle_effects(runs, recs) if toggles is None else toggles)
    axes = combo_axes(runs)
    precision_of = _precision_by_combo(runs, axes)
    if recs.empty:  # no lr in the params: recommend a combination without an lr
        recs = pd.DataFrame(
            {
                "combination": combo_labels(stable, axes),
                "max_stable_lr": np.nan,
                "loss_at_max_stable": stable.final_loss,
                "stable_lrs": [[]] * len(stable),
            }
        )
        for a in axes:
            recs[a] = stable[PARAM + a]
        recs = recs.drop_duplicates("combination")
    else:
        recs = recs[recs.max_stable_lr.notna()]
        if recs.empty:
            return Recommendation(
                "No lr was stable in every replicate of any combination: nothing to recommend; see the divergence map."
            )
    recs = recs.assign(_precision=[precision_of.get(c) for c in recs.combination])
    speed = stable.groupby(
        stable[PARAM + PRECISION].map(str) if PARAM + PRECISION in stable else pd.Series("", index=stable.index)
    ).steps_per_second.mean()
    recs = recs.assign(_speed=recs._precision.map(lambda p: speed.get(str(p) if p is not None else "", np.nan)))
    fastest = recs.sort_values("_speed", ascending=False, na_position="last")._precision.iloc[0]
    cands = recs[recs._precision.map(str) == str(fastest)].copy()
    cands["_follows"] = [
        sum(_key(c[a.axis]) == _key(a.better) for a in advice if a.axis in c) for _, c in cands.iterrows()
    ]
    best = cands.sort_values(
        ["max_stable_lr", "_follows", "loss_at_max_stable", "combination"],
        ascending=[False, False, True, True],
        na_position="last",
    ).iloc[0]
    return _line(best, axes, fastest, speed, advice)


def _line(best: pd.Series, axes: list[str], precision, speed: pd.Series, advice: list[Advice]) -> Recommendation:
    settings = {} if precision is None or PRECISION in axes else {PRECISION: precision}
    settings.update({a: _py(best[a]) for a in axes})
    max_lr = best.max_stable_lr
    below = [lr for lr in best.stable_lrs if lr < max_lr] if not pd.isna(max_lr) else []
    parts = []
    if not pd.isna(max_lr):
        settings[LR] = float(max(below) if below else max_lr)
        source = f"[frontier: {best.combination}]"
        parts.append(
            f"one grid step below its largest stable lr {max_lr:.4g} {source}"
            if below
            else f"its largest stable lr {max_lr:.4g}, with no margin: no lr below it was stable, sweep lower "
            f"ones {source}"
        )
    rate = speed.get(str(precision) if precision is not None else "", np.nan)
    parts.append(
        f"fastest stable precision, {rate:.3g} steps/s"
        if not pd.isna(rate)
        else "a stable precision; no run recorded its speed"
    )
    if pd.isna(max_lr):
        parts[-1] += f" [frontier: {best.combination}]"
    line = "Use " + " ".join(f"{k}={_fmt(v)}" for k, v in settings.items()) + " (" + "; ".join(parts) + ")."
    if advice:
        line += " Toggles: " + "; ".join(a.text() for a in advice) + "."
    return Recommendation(line, precision, best.combination, settings, bool(below), advice)


def _precision_by_combo(runs: pd.DataFrame, axes: list[str]) -> dict:
    if PARAM + PRECISION not in runs:
        return {}
    labels = combo_labels(runs, axes)
    return runs[PARAM + PRECISION].groupby(labels).first().to_dict()


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _key(v) -> str:
    return str(v)


def _py(v):
    """A plain Python value (a bool column of a DataFrame hands out numpy bools)."""
    return v.item() if isinstance(v, np.generic) else v
