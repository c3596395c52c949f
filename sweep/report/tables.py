"""The summary tables of a sweep, computed from the runs table (`runs.py`).

Axes are discovered from the params: any param that takes more than one value is an axis, except
`seed`, whose values are replicates of one cell. `optim.lr` is the row axis of the divergence map and
the axis of the frontier; every other axis forms the *combinations*. Only `stable` and `diverged` runs
decide anything; `skipped`, `error` and `running` runs are shown but never counted as either.

1. divergence_map   rows lr, columns combinations; cell `stable`, `spike@4`, `pruned@19`, or `k/n div` with seeds
2. frontier         per combination: largest stable lr (not marginal: marginal.py), smallest diverging lr,
                    loss at the former, the marginal lrs skipped
3. lr_sensitivity   per combination (Wortsman et al. 2023): mean over the lr grid of
                    min(final loss, initial loss) - best, diverged runs counted at the initial loss
4. toggle_effects   per axis and pair of values: runs equal in everything else, diverged with each
                    value, and the change in largest stable lr in lr-grid steps
Each is registered, with its title and what the renderers need, in registry.py; the tables of what went wrong
(root_causes, diagnoses, errors) are in causes.py.
"""

from __future__ import annotations

from itertools import combinations

import numpy as np
import pandas as pd

from sweep.config import Verdict
from sweep.config.enums import OPTIM_LR_MEANING, lr_meaning
from sweep.report.learned import frontier_lines as learned_lines
from sweep.report.marginal import is_marginal
from sweep.report.noise import Spread, effect_label, paired_change, quality_column, within_noise
from sweep.report.runs import DECIDED, PARAM, param_columns
from sweep.report.speed import like_with_like_speed

LR = "optim.lr"
SEED = "seed"
PRECISION = "precision"
OPTIM = "optim"
SHORT = {
    Verdict.nonfinite_loss: "nan-loss",
    Verdict.nonfinite_grad: "nan-grad",
    Verdict.loss_spike: "spike",
    Verdict.scale_collapse: "scale-min",
    Verdict.stalled: "stalled",
    Verdict.bad_input: "bad-input",
    Verdict.corrupt_checkpoint: "bad-ckpt",
    Verdict.slow_divergence: "slow-div",
    Verdict.no_progress: "no-progress",
}
"""Each verdict's name in a divergence-map cell, in the order the root-causes table lists them. A Verdict equals and
hashes as its word, so the plain strings the runs table holds look it up."""
WHERE = ["data", "forward", "loss", "backward", "optimizer", "scaler", "checkpoint"]
PENDING_MARK = "*"
"""Appended to a cell some of whose runs have no result yet."""


# --- axes and combinations ---------------------------------------------------------------------


def swept_axes(runs: pd.DataFrame) -> list[str]:
    """Params that take more than one value in this sweep, in the order the sweep named them."""
    return [c[len(PARAM) :] for c in param_columns(runs) if c != PARAM + SEED and runs[c].map(_key).nunique() > 1]


def combo_axes(runs: pd.DataFrame) -> list[str]:
    """The axes that make a combination: every swept axis but lr."""
    return [a for a in swept_axes(runs) if a != LR]


def combo_labels(runs: pd.DataFrame, axes: list[str]) -> pd.Series:
    """Each run's combination of `axes` values as "v1/v2/..." ("all" when there is no such axis)."""
    if not axes:
        return pd.Series("all", index=runs.index, dtype=object)
    columns = [runs[PARAM + a].map(_key).tolist() for a in axes]
    return pd.Series(["/".join(values) for values in zip(*columns)], index=runs.index, dtype=object)


def sort_key(v):
    """Numbers before strings, numbers by value: 1e-4 < 3e-4 < 1e-3 whatever their spelling."""
    if isinstance(v, (bool, np.bool_)) or v is None:
        return (1, str(v))
    try:
        return (0, float(v))
    except (TypeError, ValueError):
        return (1, str(v))


def _key(v) -> str:
    return "None" if v is None or (isinstance(v, float) and v != v) else str(v)


def _lr(runs: pd.DataFrame) -> pd.Series:
    if PARAM + LR not in runs:
        return pd.Series(np.nan, index=runs.index)
    return pd.to_numeric(runs[PARAM + LR], errors="coerce")


def seed_labels(runs: pd.DataFrame) -> pd.Series:
    """Each run's seed, as a label (the swept `seed` param, else result.json's)."""
    seed = runs[PARAM + SEED] if PARAM + SEED in runs else runs["seed"]
    return seed.map(_key)


def _decided(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs.status.isin(DECIDED)]


def _records(runs: pd.DataFrame, **keys: pd.Series) -> list[dict]:
    """The runs as dicts (plus the given per-run keys): per-group logic in plain Python stays fast."""
    return runs.assign(**keys).to_dict("records")


def _grouped(records: list[dict], key: str) -> dict:
    groups: dict = {}
    for r in records:
        groups.setdefault(r[key], []).append(r)
    return groups


# --- 1. divergence map -------------------------------------------------------------------------


def divergence_cells(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (row value, combination) cell: its label and counts (the heatmap plots `frac`)."""
    axes = swept_axes(runs)
    row_axis = LR if LR in axes else (axes[0] if axes else None)
    col_axes = [a for a in axes if a != row_axis]
    rows = runs[PARAM + row_axis] if row_axis else pd.Series("run", index=runs.index)
    records = _records(
        runs,
        _row=rows,
        _cell=rows.map(_key) + "|" + combo_labels(runs, col_axes),
        _marginal=marginal_column(runs),
    )
    out = []
    for group in _grouped(records, "_cell").values():
        decided = [r for r in group if r["status"] in DECIDED]
        diverged = [r for r in decided if r["status"] == "diverged"]
        first = group[0]
        out.append(
            {
                "row": first["_row"],
                "row_key": _key(first["_row"]),
                "combo": first["_cell"].split("|", 1)[1],
                **{a: first[PARAM + a] for a in col_axes},
                "label": cell_label(group),
                "runs": len(group),
                "decided": len(decided),
                "diverged": len(diverged),
                "marginal": sum(bool(r["_marginal"]) for r in decided),
                "frac": len(diverged) / len(decided) if decided else np.nan,
                "verdict": _mode([r["verdict"] for r in diverged]),
                "first_bad_step": min(
                    (r["first_bad_step"] for r in diverged if not pd.isna(r["first_bad_step"])), default=None
                ),
            }
        )
    cells = pd.DataFrame(
        out,
        columns=[
            "row",
            "row_key",
            "combo",
            *col_axes,
            "label",
            "runs",
            "decided",
            "diverged",
            "frac",
            "verdict",
            "first_bad_step",
            "marginal",
        ],
    )
    cells["first_bad_step"] = cells.first_bad_step.astype("Int64")
    cells.attrs.update(row_axis=row_axis, col_axes=col_axes)
    return cells


def cell_label(group: list[dict]) -> str:
    """`stable`, `marginal` or `kind@step` for one run; `k/n div` over the decided replicates of a cell, or
    `m k/n` when none diverged and k were marginal (sweep/report/marginal.py).

    A cell with no decided run shows its status (`running`, `skipped`, `ERROR: <short reason>`), or
    `pruned@19` when the sweeper's pruner stopped it after step 19; a `*` marks a replicated cell some of
    whose runs are still running.
    """
    decided = [r for r in group if r["status"] in DECIDED]
    if not decided:
        status = _mode([r["status"] for r in group])
        pruned = [r["pruned_at_step"] for r in group if not pd.isna(r.get("pruned_at_step"))]
        if status == "skipped" and pruned:
            return f"pruned@{min(pruned)}"
        if status == "error":
            reason = _mode([r.get("reason") for r in group if r["status"] == "error"])
            return "ERROR" + (f": {short_reason(reason)}" if reason else "")
        return status
    marginal = sum(bool(r.get("_marginal")) for r in decided)
    if len(group) > 1:
        pending = PENDING_MARK if any(r["status"] == "running" for r in group) else ""
        diverged = sum(r["status"] == "diverged" for r in decided)
        if marginal and not diverged:
            return f"m {marginal}/{len(decided)}{pending}"
        return f"{diverged}/{len(decided)} div{pending}"
    r = decided[0]
    if r["status"] == "stable":
        return "marginal" if marginal else "stable"
    step = r["first_bad_step"]
    return SHORT.get(r["verdict"], str(r["verdict"])) + ("" if pd.isna(step) else f"@{step}")


SHORT_REASON = 30
"""At most this many characters of an error's reason in a map cell (`ERROR: ` aside), so the map stays readable."""


def short_reason(reason: str) -> str:
    """The exception type and the first words of an error's reason, cut at a word within SHORT_REASON
    characters: "RuntimeError: CUDA out of memory. Tried to allocate 2 GiB" -> "RuntimeError: CUDA out of...".
    """
    text = " ".join(first_line(reason).split())
    if len(text) <= SHORT_REASON:
        return text
    cut = text[: SHORT_REASON - 3]
    head = cut.rsplit(" ", 1)[0] if " " in cut else cut
    return head.rstrip(" :,;.") + "..."


def divergence_map(runs: pd.DataFrame, cells: pd.DataFrame | None = None) -> tuple[pd.DataFrame, str]:
    """(table, column legend): rows lr sorted, columns the combinations, one header line per axis."""
    cells = divergence_cells(runs) if cells is None else cells
    row_axis, col_axes = cells.attrs["row_axis"], cells.attrs["col_axes"]
    row_values = dict(zip(cells.row_key, cells.row))
    rows = sorted(row_values, key=lambda k: sort_key(row_values[k]))
    # combination label -> its axis values, for sorting and the column header
    combos = {c: tuple(vals) for c, *vals in cells[["combo", *col_axes]].itertuples(index=False)}
    order = sorted(combos, key=lambda c: [sort_key(v) for v in combos[c]])
    labels = dict(zip(zip(cells.row_key, cells.combo), cells.label))
    data = [[labels.get((rk, c), "-") for c in order] for rk in rows]
    index = pd.Index([row_values[k] for k in rows], name=row_axis or "")
    if len(col_axes) > 1:
        columns = pd.MultiIndex.from_tuples([tuple(_key(v) for v in combos[c]) for c in order], names=col_axes)
    else:
        columns = pd.Index(order, name=col_axes[0] if col_axes else None)
    return pd.DataFrame(data, index=index, columns=columns), map_legend(cells)


def map_legend(cells: pd.DataFrame) -> str:
    """The axes of the divergence map's columns, "precision/attention"."""
    return "/".join(cells.attrs["col_axes"]) or "(no other swept axis)"


def _mode(values: list):
    values = [v for v in values if v is not None]
    return max(sorted(set(values), key=str), key=values.count) if values else None


# --- 2. stability frontier ---------------------------------------------------------------------


def frontier_records(runs: pd.DataFrame) -> pd.DataFrame:
    """Per combination: its axis values, stability per lr, the frontier columns and the quality per lr.

    `by_lr` is the per-(combination, lr) view: lr -> `stable` (every decided replicate stable), `diverged` (any
    diverged) or `marginal` (stable, but a run of it marginal: sweep/report/marginal.py). Quality is the eval loss
    (sweep/report/noise.py: the final loss when no run has one), as a Spread `spreads[lr]` over the replicates of
    each lr stable in every replicate, marginal ones included; `best_lr` is the one with the lowest mean. Every
    other column follows from `by_lr` and `spreads` (`refresh_frontier`), so a later step that learns more about
    an lr (a confirmation at a longer horizon) can change `by_lr` and refresh the record.
    """
    if PARAM + LR not in runs:
        return pd.DataFrame()
    axes = combo_axes(runs)
    quality = quality_column(runs)
    out = []
    records = _records(runs, _combo=combo_labels(runs, axes), _lr=_lr(runs), _marginal=marginal_column(runs))
    stable = runs[runs.status == "stable"]
    speed, _ = like_with_like_speed(stable, combo_labels(stable, axes))  # the recommendation's, of one packing
    for group in _grouped(records, "_combo").values():
        by_lr = lr_stability(group)
        spreads = _spreads(group, by_lr, quality)
        for r in group:
            if r["_marginal"] and by_lr.get(float(r["_lr"])) == "stable":
                by_lr[float(r["_lr"])] = "marginal"
        rec = {
            "combination": group[0]["_combo"],
            **{a: group[0][PARAM + a] for a in axes},
            "by_lr": by_lr,
            "spreads": spreads,
            "steps_per_s": float(speed.get(group[0]["_combo"], np.nan)),
            "runs": len(group),
        }
        out.append(refresh_frontier(rec))
    out.sort(key=lambda rec: [sort_key(rec[a]) for a in axes])
    recs = pd.DataFrame(out)
    recs.attrs.update(axes=axes, quality=quality)
    return recs


FAILED = "failed"
"""How a `by_lr` status starts for an lr stable in the grid that failed at a longer horizon ("failed at 120 steps",
sweep/report/confirmation.py): it counts as diverging."""


def refresh_frontier(rec: dict) -> dict:
    """`rec` with the columns that follow from its `by_lr` and `spreads` (re)computed (frontier_records):
    `grid`, `stable_lrs` and `max_stable_lr` (lrs `stable` in `by_lr`: neither diverged nor marginal),
    `marginal_lrs`, `min_diverging_lr` (diverged, or failed at a longer horizon), the quality at the largest
    stable lr, `best_lr` and `best_ties`."""
    by_lr, spreads = rec["by_lr"], rec["spreads"]
    stable = sorted(lr for lr, s in by_lr.items() if s == "stable")
    diverged = [lr for lr, s in by_lr.items() if s == "diverged" or s.startswith(FAILED)]
    best = stable[-1] if stable else None
    measured = {lr: sp for lr, sp in spreads.items() if sp.n}
    best_lr = min(measured, key=lambda lr: (measured[lr].mean, -lr)) if measured else None
    top = spreads.get(best)
    rec.update(
        grid=sorted(by_lr),
        stable_lrs=stable,
        max_stable_lr=best,
        marginal_lrs=sorted(lr for lr, s in by_lr.items() if s == "marginal"),
        min_diverging_lr=min(diverged) if diverged else None,
        eval_at_max_stable=top.mean if top else np.nan,
        eval_spread=top.sd if top else np.nan,
        replicates=top.n if top else 0,
        best_lr=best_lr,
        eval_at_best=measured[best_lr].mean if best_lr is not None else np.nan,
        best_ties=sorted(
            lr for lr in measured if by_lr.get(lr) == "stable" and within_noise(measured[lr], measured[best_lr])
        )
        if measured
        else [],
    )
    return rec


def _spreads(group: list[dict], by_lr: dict[float, str], quality: str) -> dict[float, Spread]:
    """lr -> the quality Spread over the stable runs of each lr stable in every replicate."""
    ok = [r for r in group if r["status"] == "stable"]
    return {lr: Spread.of(r[quality] for r in ok if r["_lr"] == lr) for lr in sorted(by_lr) if by_lr[lr] == "stable"}


def marginal_column(runs: pd.DataFrame) -> pd.Series:
    """The runs table's `marginal` column where it has one (summary.py adds it), else `marginal_runs`."""
    return runs["marginal"].fillna(False).astype(bool) if "marginal" in runs else marginal_runs(runs)


def marginal_runs(runs: pd.DataFrame) -> pd.Series:
    """Per run: whether it is marginal (sweep/report/marginal.py): stable, above its combination's best lr, and
    its quality more than marginal.FACTOR[quality] x that lr's mean (and beyond its replicates' noise)."""
    out = pd.Series(False, index=runs.index, dtype=bool)
    if PARAM + LR not in runs or runs.empty:
        return out
    quality = quality_column(runs)
    records = _records(runs, _combo=combo_labels(runs, combo_axes(runs)), _lr=_lr(runs), _i=runs.index)
    for group in _grouped(records, "_combo").values():
        spreads = {lr: sp for lr, sp in _spreads(group, lr_stability(group), quality).items() if sp.n}
        if not spreads:
            continue
        best_lr = min(spreads, key=lambda lr: (spreads[lr].mean, -lr))
        for r in group:
            if is_marginal(r["status"], r["_lr"], r[quality], best_lr, spreads[best_lr], quality):
                out[r["_i"]] = True
    return out


def lr_stability(group: list[dict]) -> dict[float, str]:
    """lr -> `stable` (every decided replicate stable) or `diverged` (any diverged); undecided lrs left out."""
    out: dict[float, str] = {}
    for r in group:
        if r["status"] in DECIDED and not pd.isna(r["_lr"]):
            lr = float(r["_lr"])
            out[lr] = "diverged" if r["status"] == "diverged" or out.get(lr) == "diverged" else "stable"
    return out


FRONTIER_COLUMNS = (
    "max_stable_lr marginal_lrs min_diverging_lr eval_at_max_stable eval_spread replicates best_lr eval_at_best "
    "steps_per_s runs"
).split()


def frontier(runs: pd.DataFrame, recs: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per combination: max_stable_lr (stable in every replicate and not marginal), marginal_lrs (the stable lrs
    it skipped as marginal, "0.01, 0.03"), min_diverging_lr, the eval loss at max_stable_lr (mean, spread = sd
    over its stable replicates, replicates), best_lr (the stable lr of the lowest mean eval loss) and its eval
    loss, steps_per_s, runs."""
    recs = frontier_records(runs) if recs is None else recs
    if recs.empty:
        return pd.DataFrame()
    table = recs.set_index("combination")[FRONTIER_COLUMNS]
    table.index.name = "/".join(recs.attrs["axes"]) or "combination"
    table = table.astype({c: float for c in table.columns if c not in ("runs", "replicates", "marginal_lrs")})
    table["marginal_lrs"] = [", ".join(f"{lr:.4g}" for lr in lrs) or None for lrs in table.marginal_lrs]
    table.attrs["learned"] = learned_lines(table, runs, combo_labels(runs, recs.attrs["axes"]), recs.attrs["quality"])
    return table


def _mean(values) -> float:
    values = [v for v in values if v is not None and not pd.isna(v)]
    return float(np.mean(values)) if values else np.nan


# --- 3. lr sensitivity -------------------------------------------------------------------------


def lr_sensitivity(runs: pd.DataFrame) -> pd.DataFrame:
    """Per combination: Wortsman et al.'s lr sensitivity over its lr grid (lower is more robust).

    Each decided run scores min(quality, initial loss), quality being the eval loss (noise.py); a diverged
    run scores its initial loss (the combination's mean initial loss if the run has none). Replicates at
    one lr are averaged; best_loss is the best lr's score (l*), lr_sensitivity the mean over the grid of
    score - l*. `spread` is the sd of the same number computed per seed (NaN with one seed), and `vs_best`
    says whether the combination is the most robust, tied with it within noise, or worse. With no stable run at all
    the sensitivity is undefined (NaN), not 0.
    """
    decided = _decided(runs)
    if PARAM + LR not in runs or decided.empty:
        return pd.DataFrame()
    axes = combo_axes(runs)
    quality = quality_column(runs)
    out = []
    records = _records(decided, _combo=combo_labels(decided, axes), _lr=_lr(decided), _seed=seed_labels(decided))
    for group in _grouped(records, "_combo").values():
        fallback = _mean(r["initial_loss"] for r in group)
        per_seed: dict[str, dict[float, float]] = {}
        for r in group:
            initial = fallback if pd.isna(r["initial_loss"]) else r["initial_loss"]
            score = initial if r["status"] == "diverged" else np.fmin(r[quality], initial)
            if not pd.isna(score) and not pd.isna(r["_lr"]):
                per_seed.setdefault(r["_seed"], {})[float(r["_lr"])] = float(score)
        any_stable = any(r["status"] == "stable" for r in group) and per_seed
        scores = pd.DataFrame(per_seed.values()).mean() if per_seed else pd.Series(dtype=float)  # lr -> mean score
        per_seed_sens = Spread.of(_sensitivity(s) for s in per_seed.values())
        sens = (  # Wortsman's number on the seed-mean scores; the noise from the seeds' own numbers
            Spread(_sensitivity(scores.to_dict()), per_seed_sens.sd, per_seed_sens.n)
            if any_stable
            else Spread(np.nan, np.nan, 0)
        )
        out.append(
            {
                "combination": group[0]["_combo"],
                "_sort": [sort_key(group[0][PARAM + a]) for a in axes],
                "_spread": sens,
                "lr_sensitivity": sens.mean,
                "spread": sens.sd,
                "best_loss": float(scores.min()) if any_stable else np.nan,
                "best_lr": float(scores.idxmin()) if any_stable else np.nan,
                "lrs": len(scores),
                "diverged_runs": sum(r["status"] == "diverged" for r in group),
                "runs": len(group),
            }
        )
    out.sort(key=lambda r: r["_sort"])
    ranked = [r for r in out if r["_spread"].n]
    top = min(ranked, key=lambda r: r["_spread"].mean)["_spread"] if ranked else None
    for r in out:
        r["vs_best"] = _versus(r["_spread"], top)
    table = pd.DataFrame(out).drop(columns=["_sort", "_spread"]).set_index("combination")
    table.index.name = "/".join(axes) or "combination"
    table.attrs["quality"] = quality
    return table


def _sensitivity(scores: dict[float, float]) -> float:
    best = min(scores.values())
    return float(np.mean([v - best for v in scores.values()]))


def _versus(sp: Spread, top: Spread | None) -> str:
    """`best`, `tie` (within noise of the best), `worse`, or `worse?` (noise not measured)."""
    if top is None or not sp.n:
        return ""
    if sp is top:
        return "best"
    tie = within_noise(sp, top)
    return {True: "tie", False: "worse", None: "worse?"}[tie]


# --- 4. effect of each toggle ------------------------------------------------------------------


def toggle_effects(runs: pd.DataFrame, recs: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per axis (lr aside) and pair of its values a < b, over runs equal in everything else:

    pairs          matched run pairs (same other axes, same lr, same seed), both decided
    diverged_a/_b  how many of those diverged with a / with b
    combos         matched combinations (same other axes) compared on the lrs decided on both sides
    lr_steps       mean change of the largest stable lr from a to b, in steps of the sweep's sorted lrs
                   (+1: b stays stable one lr higher; no stable lr counts as one step below those lrs)
    eval_change    over the matched pairs stable on both sides: mean relative change of the eval loss
                   from a to b (-0.10: b's is 10% lower), and `eval_noise` two standard errors of it
    quality        `tie` when |eval_change| is within eval_noise (or under 0.1%), else which value is
                   better; `unmeasured (1 pair)` when one pair cannot tell (sweep/report/noise.py)
    Two optimizers whose lr means different things (OPTIM_LR_MEANING: Prodigy's multiplier, Adafactor's cap)
    get no lr_steps, eval_change or quality ("lrs not comparable"): their runs at one lr value are not a pair.
    """
    axes = swept_axes(runs)
    decided = _decided(runs)
    recs = frontier_records(runs) if recs is None else recs
    grid = sorted(_lr(decided).dropna().unique()) if PARAM + LR in runs else []
    quality = quality_column(runs)
    out = []
    for axis in [a for a in axes if a != LR]:
        others = [a for a in axes if a != axis]
        # per value of the axis: {everything else (other axes, seed) -> (diverged?, quality when stable)}
        keys = combo_labels(decided, others) + "|" + seed_labels(decided)
        outcome: dict[str, dict[str, tuple[bool, float]]] = {}
        for value, key, status, q in zip(decided[PARAM + axis].map(_key), keys, decided.status, decided[quality]):
            outcome.setdefault(value, {}).setdefault(key, (status == "diverged", np.nan if status != "stable" else q))
        frontiers = _frontiers_by_value(recs, axis) if len(recs) else {}
        values = sorted({_key(v): v for v in decided[PARAM + axis]}.items(), key=lambda kv: sort_key(kv[1]))
        for (ka, a), (kb, b) in combinations(values, 2):
            both = outcome[ka].keys() & outcome[kb].keys()
            pairs = [(outcome[ka][k][1], outcome[kb][k][1]) for k in sorted(both)]
            change, noise, n = paired_change([(qa, qb) for qa, qb in pairs if not (pd.isna(qa) or pd.isna(qb))])
            row = {
                "axis": axis,
                "a": a,
                "b": b,
                "pairs": len(both),
                "diverged_a": sum(outcome[ka][k][0] for k in both),
                "diverged_b": sum(outcome[kb][k][0] for k in both),
                **_lr_steps(frontiers.get(ka, {}), frontiers.get(kb, {}), grid, same_lr(axis, a, b)),
                "eval_change": change,
                "eval_noise": noise,
                "quality": effect_label(change, noise, a, b),
            }
            if not same_lr(axis, a, b):  # pairs at the same lr value of unlike lrs compare nothing
                row.update(eval_change=np.nan, eval_noise=np.nan, quality="lrs not comparable")
            if row["pairs"] or row["combos"]:
                out.append(row)
    columns = ["axis", "a", "b", "pairs", "diverged_a", "diverged_b", "combos", "lr_steps"]
    table = pd.DataFrame(out, columns=[*columns, "eval_change", "eval_noise", "quality"])
    table.attrs["quality"] = quality
    return table


def _frontiers_by_value(recs: pd.DataFrame, axis: str) -> dict[str, dict[str, dict]]:
    """value of `axis` -> {the other combination axes' values -> stability per lr}."""
    others = [a for a in recs.attrs["axes"] if a != axis]
    out: dict[str, dict[str, dict]] = {}
    for rec in recs.to_dict("records"):
        out.setdefault(_key(rec[axis]), {})["/".join(_key(rec[a]) for a in others)] = rec["by_lr"]
    return out


def same_lr(axis: str, a, b) -> bool:
    """Whether optim.lr means the same for both values: not for two optimizers of which one reads lr as something
    other than its step size (Prodigy's multiplier of d, Adafactor's cap on the relative step)."""
    return axis != OPTIM or lr_meaning(a) == lr_meaning(b)


def lr_notes(runs: pd.DataFrame) -> str:
    """'; lr for optim=prodigy: multiplies ...' for the swept optimizers whose lr is not their step size."""
    if PARAM + OPTIM not in runs:
        return ""
    names = sorted({str(v) for v in runs[PARAM + OPTIM].dropna()} & set(OPTIM_LR_MEANING))
    return "".join(f"; lr for optim={n}: {OPTIM_LR_MEANING[n]}, not comparable with AdamW's" for n in names)


def _lr_steps(side_a: dict, side_b: dict, grid: list[float], comparable: bool = True) -> dict:
    """Matched combinations compared on the lrs decided on both sides, so that a partial sweep's
    missing or running cell does not look like a lost lr step; on each side's own lrs when they share
    none. A step is one place in the sorted list of every lr the sweep decided. Not `comparable` (the lr means
    another thing on each side): no lr steps."""
    if not comparable:
        return {"combos": len(side_a.keys() & side_b.keys()), "lr_steps": np.nan}
    steps = []
    for k in side_a.keys() & side_b.keys():
        a, b = side_a[k], side_b[k]
        common = sorted(a.keys() & b.keys())
        if common:
            steps.append(_max_stable_step(b, common, grid) - _max_stable_step(a, common, grid))
        elif a and b:  # an Optuna or frontier search tries different lrs per combination
            steps.append(_max_stable_step(b, sorted(b), grid) - _max_stable_step(a, sorted(a), grid))
    return {"combos": len(steps), "lr_steps": float(np.mean(steps)) if steps else np.nan}


def _max_stable_step(by_lr: dict, lrs: list[float], grid: list[float]) -> int:
    """Grid index of the largest stable lr among `lrs`; one below the lowest of them if none is stable."""
    stable = [lr for lr in lrs if by_lr[lr] == "stable"]
    return grid.index(max(stable)) if stable else grid.index(min(lrs)) - 1


# --- 5. root causes ----------------------------------------------------------------------------


REASON_CHARS = 160
"""At most this many characters of a reason in the errors table (its result.json holds it whole)."""


def first_line(reason) -> str:
    """An error's first line, cut at REASON_CHARS characters."""
    if reason is None or pd.isna(reason):
        return ""
    line = (str(reason).strip().splitlines() or [""])[0]
    return line if len(line) <= REASON_CHARS else line[: REASON_CHARS - 3] + "..."
