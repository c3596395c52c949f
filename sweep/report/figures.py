"""The plots of report.html that belong to a summary table (registered with it, sweep/report/registry.py):
the divergence map's heatmap and the ladder's log-log fit. Plotly is imported inside each function, so
that reading the registry costs no plotly import.

Every label that comes from a config or a result goes through `plot_text`: plotly renders a subset of
HTML in labels, and the escaped entities decode back to the text.
"""

from __future__ import annotations

import html

import numpy as np
import pandas as pd

from sweep.report.tables import sort_key

HEATMAP_ID = "divergence-heatmap"
STATUS_COLORS = [[0.0, "#2e9e44"], [0.5, "#f2c94c"], [1.0, "#d64541"]]
LINE_COLORS = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
]


def plot_text(text) -> str:
    """A string for a plotly label: plotly renders <b>, <a href>, ... tags, and decodes &lt; &gt; &amp;
    (but not &quot;), so escaping the three makes any string plain text."""
    return html.escape(str(text), quote=False)


def heatmap(cells: pd.DataFrame, divergence_map: pd.DataFrame):
    """The divergence map as a heatmap: colour = share of decided runs that diverged, text = cell label."""
    import plotly.graph_objects as go

    row_axis, col_axes = cells.attrs["row_axis"], cells.attrs["col_axes"]
    rows = sorted(cells.row_key.unique(), key=lambda k: sort_key(cells.loc[cells.row_key == k, "row"].iloc[0]))
    cols = list(
        dict.fromkeys(["/".join(map(str, c)) if isinstance(c, tuple) else str(c) for c in divergence_map.columns])
    )
    by_cell = {(r.row_key, r.combo): r for r in cells.itertuples()}
    z, text, hover = [], [], []
    for rk in rows:
        zr, tr, hr = [], [], []
        for c in cols:
            cell = by_cell.get((rk, c))
            zr.append(None if cell is None or pd.isna(cell.frac) else float(cell.frac))
            tr.append(plot_text(cell.label) if cell is not None else "")
            hr.append(
                "no run" if cell is None else f"{cell.diverged}/{cell.decided} decided runs diverged, {cell.runs} runs"
            )
        z.append(zr), text.append(tr), hover.append(hr)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[plot_text(c) for c in cols],
            y=[plot_text(k) for k in rows],
            text=text,
            customdata=hover,
            texttemplate="%{text}",
            zmin=0,
            zmax=1,
            colorscale=STATUS_COLORS,
            xgap=2,
            ygap=2,
            colorbar={"title": {"text": "diverged"}, "tickformat": ".0%"},
            hovertemplate="%{y} | %{x}<br>%{text}<br>%{customdata}<extra></extra>",
        )
    )
    fig.update_layout(
        height=150 + 40 * len(rows),
        margin={"l": 80, "r": 20, "t": 30, "b": 40},
        xaxis={
            "title": {"text": plot_text("/".join(col_axes) or ""), "standoff": 8},
            "type": "category",
            "automargin": True,
        },
        yaxis={"title": {"text": plot_text(row_axis or "")}, "type": "category", "autorange": "reversed"},
        plot_bgcolor="#dddddd",
        title={"text": "grey: no decided run (running, skipped, error or missing)", "font": {"size": 12}},
    )
    return fig


def ladder_figure(table: pd.DataFrame):
    """Largest stable lr against size, log-log: each size's bracket as an error bar around lr*, the fitted
    line extended to the target, and the prediction there with its interval; the best eval lr the same way (open
    markers, a dotted line), where the table has it (sweep/report/ladder.py `best_point`)."""
    import plotly.graph_objects as go

    axis = table.attrs["axis"].split(".")[-1]
    fig = go.Figure()
    for i, (combo, r) in enumerate(table.iterrows()):
        color = LINE_COLORS[i % len(LINE_COLORS)]
        kinds = [("", "points", "seed_points", "", "circle", "dash")]
        if "best_points" in table.attrs:
            kinds.append(("best_", "best_points", "best_seed_points", "best eval lr ", "circle-open", "dot"))
        for prefix, merged, seeds, what, symbol, dash in kinds:
            _ladder_traces(fig, go, table, combo, r, prefix, merged, seeds, what, symbol, dash, color, axis)
    fig.update_xaxes(type="log", title_text=axis)
    fig.update_yaxes(type="log", title_text="largest stable lr (best eval lr: open markers)", tickformat=".1e")
    fig.update_layout(
        title={"text": "Frontier across sizes", "font": {"size": 14}},
        height=480,
        margin={"l": 70, "r": 10, "t": 50, "b": 50},
        legend={"font": {"size": 10}},
    )
    return fig


def _ladder_traces(fig, go, table, combo, r, prefix, merged, seeds, what, symbol, dash, color, axis) -> None:
    """One fit's traces: its points with their error bars, its line to the target, its prediction there."""
    exponent, predicted = r.get(prefix + "exponent"), r.get("predicted_" + prefix + "lr")
    low, high = r.get(prefix + "low"), r.get(prefix + "high")
    pts = [p for p in table.attrs[merged].get(combo, []) if not pd.isna(p[3])]
    if pts:
        sizes, lo, hi, mid = (list(c) for c in zip(*pts))
        fig.add_trace(
            go.Scatter(
                x=sizes,
                y=mid,
                mode="markers",
                name=plot_text(f"{combo}: {what}measured"),
                marker={"color": color, "size": 8, "symbol": symbol},
                error_y=_error_bars(mid, lo, hi),
            )
        )
    if exponent is None or pd.isna(exponent) or not pts:
        return
    x_end = r.target if not pd.isna(predicted) else max(sizes)
    xs = np.geomspace(min(sizes), x_end, 30)
    # least squares passes through the centroid of the fitted points (log-log): each seed's point with replicates
    each = table.attrs.get(seeds, {}).get(combo, [])  # replicated as the fit decided (ladder._replicated)
    fitted = [p for p in each if not pd.isna(p[3])] if len(each) > len({p[0] for p in each}) else pts
    fx, fy = np.log([p[0] for p in fitted]), np.log([p[3] for p in fitted])
    ys_fit = np.exp(fy.mean() + exponent * (np.log(xs) - fx.mean()))
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=ys_fit,
            mode="lines",
            name=plot_text(f"{combo}: {what}fit, exponent {exponent:.2f}"),
            line={"color": color, "dash": dash},
        )
    )
    if not pd.isna(predicted):
        err = {} if pd.isna(low) else {"error_y": _error_bars([predicted], [low], [high])}
        fig.add_trace(
            go.Scatter(
                x=[r.target],
                y=[predicted],
                mode="markers",
                name=plot_text(f"{combo}: {what}predicted at {axis} {r.target:g}"),
                marker={"color": color, "size": 11, "symbol": "diamond-open" if not prefix else "star-open"},
                **err,
            )
        )


def _error_bars(centres: list, lows: list, highs: list) -> dict:
    """Plotly's asymmetric error bars spanning [low, high] around each centre."""
    return {
        "type": "data",
        "symmetric": False,
        "array": [h - c for h, c in zip(highs, centres)],
        "arrayminus": [c - lo for c, lo in zip(centres, lows)],
    }
