"""report.html: written at the end of every multirun (`report.html=false` turns it off) and by the report's CLI.

    python -m sweep.report outputs/sweeps/<date>/<time>                     # writes report.html there
    python -m sweep.report outputs/sweeps/<date>/<time> --self-contained    # one file, plotly.js inline

plotly.js (4.8 MB) is written once beside the page, as plotly-<plotly.js version>.min.js, and loaded with a
relative <script src>: never a CDN, nothing fetched at view time. A page moved away from it says so in one
visible line; `--self-contained` inlines it instead (one file to mail). Each curve is cut to at most
MAX_POINTS points (`downsample`: the minimum and maximum of each of MAX_POINTS / 2 buckets, the first and last
point and the diverged run's first bad step) and its numbers rounded to 4 significant digits, so a
100-run sweep of 1000-step runs makes a page under 2 MB (docs/design.md, "Files of a sweep directory").

It holds the recommendation, every summary table of the registry (registry.py) with its plot (the
divergence map's heatmap: share of decided runs that diverged, the cell text the map's label; the
ladder's fit; figures.py), and per combination the loss, eval-loss, grad-norm and loss-scale curves of
its runs, a diverged run marked with an x at its first bad step, and with replicate seeds a band of
mean ± sd around each lr's eval losses.

Every string that comes from a config or a result is escaped: `html.escape` for the page, and the
same for plotly labels, which plotly renders as a subset of HTML (entities decode back to the text).
"""

from __future__ import annotations

import functools
import html
import json
import os
from pathlib import Path

import numpy as np
import pandas as pd

from sweep.report.figures import LINE_COLORS, plot_text
from sweep.report.registry import Summary, shown
from sweep.report.runs import PARAM, load_metrics
from sweep.report.tables import LR, combo_axes, combo_labels, sort_key

PLOT_CONFIG = {"displaylogo": False, "responsive": True}
STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.8em; } h3 { font-size: 1em; }
p.note { color: #555; font-size: 0.9em; margin-top: 0; }
ul.note { color: #555; font-size: 0.9em; }
table.tbl { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
table.tbl th, table.tbl td { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
table.tbl th { background: #f3f3f3; }
.recommendation { background: #eef6ee; border-left: 4px solid #3a3; padding: 0.6em 1em; }
.curves { display: grid; grid-template-columns: repeat(auto-fill, minmax(540px, 1fr)); gap: 1em; }
.warn { background: #fdecea; border-left: 4px solid #d64541; padding: 0.6em 1em; }
code { background: #f3f3f3; padding: 0 3px; }
"""


REPORT_FILE = "report.html"
MAX_POINTS = 200
"""The most points a curve keeps: 100 buckets' minimum and maximum. A curve panel is 450 to 1100 pixels wide, so
a bucket is 5 to 11 pixels, where min and max draw the same band as every point did; at about 13 bytes a point
(x and a 4-digit y as JSON), 100 runs of 3 curves each take about 0.8 MB (0.75 MB measured: docs/design.md)."""
DIGITS = 4
"""Significant digits of a plotted number: a 400-pixel axis cannot show a fifth (the tables keep every digit)."""


def write_report(path: Path, s: Summary, title: str, source: str, self_contained: bool = False) -> list[Path]:
    """Write report.html for a summary, and plotly.js beside it unless `self_contained`; `source` says where the
    runs came from (already masked). The files written (a plotly.js already there is not rewritten)."""
    path = Path(path)
    path.write_text(render_html(s, title, source, None if self_contained else plotly_js_name()), encoding="utf-8")
    return [path, *([] if self_contained else write_plotly_js(path.parent))]


def write_sweep_report(sweep_dir: Path, s: Summary) -> tuple[list[Path], str | None]:
    """At the end of a multirun: report.html in the sweep dir, titled as `python -m sweep.report DIR` titles it.
    (the files written, None) or ([], why not) for one warning line; never raises for a file system error."""
    try:
        return write_report(
            sweep_dir / REPORT_FILE, s, dir_title(sweep_dir), f"run directories under {sweep_dir}"
        ), None
    except OSError as e:
        return [], f"could not write {REPORT_FILE} ({e.filename or sweep_dir}: {e.strerror or type(e).__name__})"


def dir_title(sweep_dir: Path) -> str:
    return f"Sweep report: {Path(sweep_dir).resolve().name}"


def plotly_js_name() -> str:
    from plotly.offline import get_plotlyjs_version

    return f"plotly-{get_plotlyjs_version()}.min.js"


def write_plotly_js(directory: Path) -> list[Path]:
    """plotly.js into `directory` once: skipped when a file of its name and size is there; written under a
    temporary name and renamed, so a page never loads half of it. ([the file] when written, else [])."""
    from plotly.offline import get_plotlyjs

    js = get_plotlyjs().encode("utf-8")
    path = Path(directory) / plotly_js_name()
    if path.is_file() and path.stat().st_size == len(js):
        return []
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(js)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return [path]


def render_html(s: Summary, title: str, source: str, script: str | None = None) -> str:
    """The page; plotly.js inline, or with `script` loaded from that relative path (plotly_js_name)."""
    body = [
        *([] if script is None else [missing_script_line(script)]),
        f"<h1>{esc(title)}</h1>",
        f"<p>{esc(s.counts_line())}; from {esc(source)}.</p>",
        "<h2>Recommendation</h2>",
        f'<p class="recommendation">{esc(s.recommendation.line)}</p>',
        *([f'<p class="recommendation">{esc(s.confirmed_fixes())}</p>'] if s.confirmed_fixes() else []),
    ]
    tables = [(spec, table) for spec, table in shown(s) if spec.in_html]
    for spec, table in tables:
        body += [f"<h2>{esc(spec.title)}</h2>", f'<p class="note">{esc(spec.explain(s))}</p>']
        if spec.plot and spec.plot.above:
            body.append(plot_div(spec.plot.make(s), spec.plot.div_id))
        body.append(table_html(table, index=spec.index))
        body += notes_html(spec.lines(table) if spec.lines else [])
    body += [plot_div(spec.plot.make(s), spec.plot.div_id) for spec, _ in tables if spec.plot and not spec.plot.above]
    body += [
        "<h2>Curves per combination</h2>",
        '<p class="note">training loss, held-out eval loss, gradient norm and loss scale per step (log '
        "scale); one line per run; x = a diverged run's first bad step; the shaded band around an lr's eval "
        "losses is their mean ± sd over its replicate seeds (the noise the tables compare against).</p>",
        '<div class="curves">',
    ]
    body += [plot_div(fig, f"curves-{i}") for i, fig in enumerate(curve_figures(s.runs))]
    body += [
        "</div>",
        "<h2>Runs</h2>",
        "<details><summary>every run of the sweep</summary>",
        table_html(runs_for_display(s.runs), index=False),
        "</details>",
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)}</title><style>{STYLE}</style>"
        f"{plotly_script(script)}</head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def notes_html(lines: list[str]) -> list[str]:
    """A table's sentences under it (the frontier's confirmation, the ladder's fits and warnings), as the terminal
    and summary.md give them."""
    return ['<ul class="note">' + "".join(f"<li>{esc(line)}</li>" for line in lines) + "</ul>"] if lines else []


def plotly_script(script: str | None) -> str:
    if script is not None:
        return f'<script type="text/javascript" src="{esc(script)}"></script>'
    from plotly.offline import get_plotlyjs

    return f'<script type="text/javascript">{get_plotlyjs()}</script>'


def missing_script_line(script: str) -> str:
    """The line a page moved away from its plotly.js shows (hidden once plotly has loaded)."""
    return (
        f'<p id="plotly-missing" class="warn">The plots need {esc(script)} beside this file: copy it here, or '
        "rerun <code>python -m sweep.report SWEEP_DIR --self-contained</code> for one file with plotly inside.</p>"
        '<script>if (window.Plotly) document.getElementById("plotly-missing").hidden = true;</script>'
    )


def esc(text) -> str:
    return html.escape(str(text), quote=True)


def table_html(table: pd.DataFrame, index: bool = True) -> str:
    """A summary table as HTML; every cell and header escaped."""
    return table.to_html(
        index=index, escape=True, na_rep="-", classes="tbl", border=0, float_format=lambda x: f"{x:.4g}"
    )


def plot_div(fig, div_id: str) -> str:
    """A figure's <div>: a plotly Figure, or a figure dict already in plotly's own form (`curve_figures`: built from
    plotly's validated layouts, so validating it again would change nothing and cost most of the page's time)."""
    import plotly.io as pio

    return pio.to_html(
        fig,
        include_plotlyjs=False,
        full_html=False,
        div_id=div_id,
        config=PLOT_CONFIG,
        validate=not isinstance(fig, dict),
    )


def curve_figures(runs: pd.DataFrame) -> list[dict]:
    """One figure per combination: loss, grad norm and (when any run has one) loss scale per step. Figure dicts
    ({"data": traces, "layout": ...}) as plotly's Figure.to_dict gives them: the layout comes from plotly's own
    make_subplots (once per set of panels, `_panels`), each trace is the dict plotly's validation would give
    (tests/test_report_html.py checks both round-trip through go.Figure unchanged). Built through go.Scatter and
    add_trace, the validation was ~80% of a report's time (0.6 s of a 48-run sweep's page, 2.3 s of a 100-run one)."""
    axes = combo_axes(runs)
    df = runs.assign(_combo=combo_labels(runs, axes))
    df_lr = pd.to_numeric(df[PARAM + LR], errors="coerce") if PARAM + LR in df else pd.Series(np.nan, df.index)
    lrs = sorted(df_lr.dropna().unique())
    several_seeds = df.seed.nunique() > 1
    figs = []
    order = sorted(
        df._combo.unique(),
        key=lambda c: [sort_key(v) for v in df.loc[df._combo == c, [PARAM + a for a in axes]].iloc[0]],
    )
    for combo in order:
        group = df[df._combo == combo]
        curves = [(r, load_metrics(r.run_dir)) for r in group.itertuples()]
        curves = [(r, m) for r, m in curves if m is not None and len(m)]
        if not curves:
            continue
        has_scale = any("loss_scale" in m and m.loss_scale.notna().any() for _, m in curves)
        has_eval = any(_eval_points(m) is not None for _, m in curves)
        names = ["loss"] + (["eval loss"] if has_eval else []) + ["grad norm"] + (["loss scale"] if has_scale else [])
        columns = [CURVE_COLUMNS[n] for n in names]
        data = []
        for r, m in curves:
            lr = df_lr.at[r.Index]
            color = LINE_COLORS[lrs.index(lr) % len(LINE_COLORS)] if lr in lrs else "#444"
            name = (f"lr={lr:g}" if not pd.isna(lr) else "run") + (f" seed={r.seed}" if several_seeds else "")
            if r.status != "stable":
                name += f" ({r.status})"
            group_id = f"{r.Index}"
            bad_step = int(r.first_bad_step) if r.status == "diverged" and not pd.isna(r.first_bad_step) else None
            for row, col in enumerate(columns, start=1):
                if col not in m:
                    continue
                points = _eval_points(m) if col == "eval_loss" else m
                if points is None:
                    continue
                x, y = curve(points.step, points[col], keep=bad_step)
                line = {"color": color, "dash": "solid" if r.status == "stable" else "dot", "width": 1.5}
                # markers too on short runs: a run that died at step 1 has a single finite point
                mode = "lines+markers" if len(points) <= 30 else "lines"
                data.append(
                    _scatter(
                        row,
                        legendgroup=group_id,
                        line=line,
                        marker={"size": 4},
                        mode=mode,
                        name=plot_text(name),
                        showlegend=row == 1,
                        x=x,
                        y=y,
                    )
                )
            if bad_step is not None:
                step, y = _bad_point(m, bad_step)
                marker = {"color": color, "size": 11, "symbol": "x"}
                hover = plot_text(f"{r.verdict} at step {r.first_bad_step}")
                data.append(
                    _scatter(
                        1,
                        hoverinfo="text",
                        hovertext=hover,
                        legendgroup=group_id,
                        marker=marker,
                        mode="markers",
                        showlegend=False,
                        x=[step],
                        y=rounded([np.nan if y is None else y]),
                    )
                )
        if has_eval:
            for lr, band in _eval_bands(curves, df_lr, lrs):
                data += _band(band, LINE_COLORS[lrs.index(lr) % len(LINE_COLORS)], f"lr={lr:g}", row=2)
        layout = _panels(tuple(names))
        layout["title"]["text"] = plot_text(combo)
        figs.append({"data": data, "layout": layout})
    return figs


def _scatter(row: int, **props) -> dict:
    """A scatter trace on panel `row` (1 at the top), as plotly's to_dict writes it: `props` in its order
    (alphabetical), then the type and the panel's axes, so the page's JSON is the one the validated figures gave,
    byte for byte."""
    axis = "" if row == 1 else str(row)
    return {**dict(sorted(props.items())), "type": "scatter", "xaxis": "x" + axis, "yaxis": "y" + axis}


@functools.lru_cache(maxsize=8)
def _panels_json(names: tuple[str, ...]) -> str:
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=len(names), cols=1, shared_xaxes=True, vertical_spacing=0.06, subplot_titles=names)
    fig.update_yaxes(type="log", tickformat=".3~g")  # 1 2 5 10 20, not 1 2 5 10 2
    if "loss scale" in names:
        fig.update_yaxes(tickformat="~s", row=len(names), col=1)  # 32k 64k
    fig.update_xaxes(title_text="step", row=len(names), col=1)
    fig.update_layout(
        title={"text": "", "font": {"size": 14}},  # each figure's own text goes in (`curve_figures`)
        height=160 + 170 * len(names),
        margin={"l": 60, "r": 10, "t": 60, "b": 40},
        legend={"font": {"size": 10}},
    )
    return json.dumps(fig.to_dict()["layout"])


def _panels(names: tuple[str, ...]) -> dict:
    """A curves figure's layout: one log-scale panel per name, stacked, sharing the step axis, with plotly's default
    template and an empty title text (a copy each time: the caller writes its title in)."""
    return json.loads(_panels_json(names))


CURVE_COLUMNS = {"loss": "loss", "eval loss": "eval_loss", "grad norm": "grad_norm", "loss scale": "loss_scale"}


def _eval_points(m: pd.DataFrame) -> pd.DataFrame | None:
    """The steps of a run's metrics that hold an eval loss (None when none does)."""
    if "eval_loss" not in m:
        return None
    points = m[pd.to_numeric(m.eval_loss, errors="coerce").notna()]
    return points if len(points) else None


def _eval_bands(curves: list, df_lr: pd.Series, lrs: list) -> list[tuple[float, pd.DataFrame]]:
    """Per lr with two or more runs holding eval losses (replicates): mean and sd per eval step."""
    out = []
    for lr in lrs:
        points = [_eval_points(m) for r, m in curves if df_lr.at[r.Index] == lr]
        points = [p.assign(eval_loss=pd.to_numeric(p.eval_loss)) for p in points if p is not None]
        if len(points) < 2:
            continue
        stats = pd.concat(points).groupby("step").eval_loss.agg(["mean", "std", "count"])
        out.append((lr, stats[stats["count"] > 1].reset_index()))
    return out


def _band(band: pd.DataFrame, color: str, name: str, row: int) -> list[dict]:
    """The noise band of one lr's replicates: mean ± sd of their eval losses, translucent over the runs' lines (its
    upper edge, then the lower one filled up to it)."""
    rgb = tuple(int(color[i : i + 2], 16) for i in (1, 3, 5))
    upper = (band["mean"] + band["std"]).to_numpy(dtype=float)
    lower = (band["mean"] - band["std"]).clip(lower=1e-12).to_numpy(dtype=float)
    idx = np.union1d(downsample(upper), downsample(lower))  # one x for both edges: the fill between them
    x, upper, lower = band.step.to_numpy()[idx].tolist(), rounded(upper[idx]), rounded(lower[idx])
    common = {"hoverinfo": "skip", "legendgroup": f"band-{name}", "line": {"width": 0}, "mode": "lines"}
    return [
        _scatter(row, **common, showlegend=False, x=x, y=upper),
        _scatter(
            row,
            fill="tonexty",
            fillcolor=f"rgba({rgb[0]},{rgb[1]},{rgb[2]},0.18)",
            **common,
            name=plot_text(f"{name} mean ± sd"),
            x=x,
            y=lower,
        ),
    ]


def curve(steps: pd.Series, values: pd.Series, keep: int | None = None, n: int = MAX_POINTS) -> tuple[list, list]:
    """A curve as plotted: at most about `n` points (`downsample`; `keep` a step that must stay), each number
    rounded to DIGITS significant digits, a non-finite one None (a gap)."""
    x, y = np.asarray(steps), pd.to_numeric(values, errors="coerce").to_numpy(dtype=float)
    idx = downsample(y, n, np.flatnonzero(x == keep) if keep is not None else ())
    return x[idx].tolist(), rounded(y[idx])


def downsample(y: np.ndarray, n: int = MAX_POINTS, keep=()) -> np.ndarray:
    """The indices of y to plot: all of them when there are at most n, else, over n // 2 equal buckets, each
    bucket's minimum and maximum (so a one-step spike keeps its height: min-max decimation), the first
    non-finite point of each gap, the first and last point, and `keep`. Sorted."""
    if len(y) <= n:
        return np.arange(len(y))
    buckets = max(1, n // 2)
    bucket = np.arange(len(y)) * buckets // len(y)
    starts = np.searchsorted(bucket, np.arange(buckets))
    finite = np.isfinite(y)
    low, high = np.where(finite, y, np.inf), np.where(finite, y, -np.inf)
    mins = np.lexsort((low, bucket))[starts]  # sorted by bucket, then value: each bucket's first is its least
    maxs = np.lexsort((-high, bucket))[starts]
    gaps = np.flatnonzero(~finite & np.r_[True, finite[:-1]])
    keep = np.asarray(keep, dtype=int)
    return np.unique(np.concatenate([[0, len(y) - 1], mins, maxs, gaps, keep]).astype(int))


def rounded(values: np.ndarray) -> list:
    """Numbers for a plot: DIGITS significant digits (the JSON holds 0.1235, not 0.12345678901234568), None for
    a non-finite one (a gap in the line)."""
    return [float(f"{v:.{DIGITS}g}") if np.isfinite(v) else None for v in values]


def _bad_point(m: pd.DataFrame, step: int) -> tuple[int, float | None]:
    """Where to draw the x: the loss at the first bad step, or the last finite loss before it."""
    loss = pd.to_numeric(m.loss, errors="coerce")
    before = m[(m.step <= step) & np.isfinite(loss)]
    if before.empty:
        return step, None
    at = before[before.step == step]
    return step, float((at if len(at) else before.iloc[[-1]]).loss.iloc[0])


def runs_for_display(runs: pd.DataFrame) -> pd.DataFrame:
    cols = (
        ["status", "verdict", "first_bad_step", "cause_where", "cause_module", "final_loss", "steps_per_second", "seed"]
        + [c for c in runs.columns if c.startswith(PARAM)]
        + ["run_dir"]
    )
    return runs[cols].rename(columns=lambda c: c[len(PARAM) :] if c.startswith(PARAM) else c)
