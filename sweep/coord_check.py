"""Coordinate check: does each layer's activation size stay put as the model widens? (SP beside µP)

    python -m sweep.coord_check                                  # widths 32,64,128,256; sp and mup
    python -m sweep.coord_check --add-512 --steps 4 --lr 1e-2    # also width 512
    python -m sweep.coord_check --widths 64,128,256 --base-width 64 --html /tmp/coord.html

microsoft/mup's coord check (Yang et al. 2022, Tensor Programs V, Fig. 5): train the same model at
several widths for a few steps from fixed seeds and look at the size of every layer's output. Under the
standard parametrization (SP) the sizes grow with the width once the weights have moved (an Adam step
changes every weight by ~lr whatever its fan_in, so a hidden layer's output moves by ~lr x width); under
µP (models/mup.py) they stay flat, which is what lets a lr found at a small width carry to a wide one.

What it measures: the native model (`--arch`, the tiny size with `--depth` blocks, head dim 32 kept as
`model.width` does) at each width, trained for `--steps` steps of DeviceAdamW at a constant `--lr`
(µP: its per-layer lr_scale), on one fixed batch of synthetic clips in [-1, 1] with rectified-flow noise
(x_t = (1 - s) x0 + s noise, the model predicts noise - x0; s, noise and batch fixed by `--seed`, the
same at every width). Forward hooks on the patch embedder, the timestep embedder, every block and the
final layer record the RMS of each output in the forward of every step (step 0 = at init: the final
layer is zero there, adaLN-Zero).

Output: per parametrization a table, rows layer x step, columns widths; then per layer the slope of
log RMS against log width at the last step (0 = flat; SP's hidden layers go toward +1); and an HTML page
(plotly, `--html`, default coord_check.html) with RMS against width, log-log, per layer and step. A bad
argument (one width, a width that is not a multiple of the head dim, ...) is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import html
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_WIDTHS = (32, 64, 128, 256)
PARAMS = ("sp", "mup")


class UsageError(ValueError):
    """A bad argument: printed as one line, exit status 2."""


@dataclass
class Setup:
    """What one coord check trains: the model family, the data and the optimizer."""

    arch: str = "video_dit"
    depth: int = 2
    widths: tuple[int, ...] = DEFAULT_WIDTHS
    base_width: int | None = None
    """µP's base width; None = the smallest width."""
    steps: int = 4
    lr: float = 1e-2
    seed: int = 0
    batch: int = 4
    frames: int = 2
    size: int = 8
    """Height and width of the clips (patch size 2)."""
    params: tuple[str, ...] = PARAMS

    def check(self) -> None:
        """UsageError naming what is wrong."""
        from models.registry import ARCHS, sized

        if self.arch not in ARCHS:
            raise UsageError(f"--arch: choose one of {', '.join(ARCHS)}, got {self.arch!r}")
        if len(set(self.widths)) < 2:
            raise UsageError(f"--widths: a slope needs at least two different widths, got {list(self.widths)}")
        for w in self.widths:
            try:
                sized("tiny", width=w)
            except ValueError as e:
                raise UsageError(f"--widths: width {w} {e}") from None
        if self.depth <= 0 or (self.arch == "video_dit" and self.depth % 2):
            raise UsageError(f"--depth: must be > 0 (and even for video_dit), got {self.depth}")
        if self.base_width is not None and not 0 < self.base_width <= min(self.widths):
            raise UsageError(f"--base-width: must be in (0, smallest width {min(self.widths)}], got {self.base_width}")
        if self.steps < 1:
            raise UsageError(f"--steps: must be >= 1, got {self.steps}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UsageError(f"--lr: must be a finite number > 0, got {self.lr}")
        from sweep.config.validate import MAX_SEED  # a run's own bound (seed=...)

        if not 0 <= self.seed <= MAX_SEED:  # before: -1 was taken, 2**64 a traceback
            raise UsageError(f"--seed: must be in [0, {MAX_SEED}] (2**32 - 1), got {self.seed}")
        if self.size <= 0 or self.size % 2 or self.batch <= 0 or self.frames <= 0:
            raise UsageError("--size must be even and > 0; --batch and --frames > 0")
        bad = [p for p in self.params if p not in PARAMS]
        if bad or not self.params:
            raise UsageError(f"--params: choose from {', '.join(PARAMS)}, got {','.join(self.params)}")
        self._check_size()

    def _check_size(self) -> None:
        """The widest model under the runs' own parameter limit (sweep/run/sizes.py): `--depth 100000` or a width
        of 65536 built for minutes, then ran out of memory."""
        from sweep.run.sizes import PARAMS_LIMIT, native_params

        video = self.arch == "video_dit"
        width = max(self.widths)
        n = native_params(self.arch, "tiny", width, self.depth, 2, False, 3, self.frames if video else 1, self.size)
        if n is not None and n > PARAMS_LIMIT:
            raise UsageError(
                f"--widths/--depth: width {width} at depth {self.depth} would have ~{n / 1e6:,.0f}M parameters,"
                f" over the {PARAMS_LIMIT / 1e6:,.0f}M limit of a run"
            )


def watched_modules(model) -> dict:
    """The layers whose outputs the check measures, in forward order: name -> module."""
    mods = {"x_embedder": model.x_embedder, "t_embedder": model.t_embedder}
    mods.update({f"blocks.{i}": b for i, b in enumerate(model.blocks)})
    mods["final_layer"] = model.final_layer
    return mods


def measure(setup: Setup, param: str, width: int) -> dict[tuple[str, int], float]:
    """{(layer, step): RMS of the layer's output in that step's forward} for one width."""
    import torch

    from models import build_model
    from models.mup import param_groups
    from sweep.run.adamw import DeviceAdamW

    s = setup
    base = s.base_width or min(s.widths)
    torch.manual_seed(s.seed)
    video = s.arch == "video_dit"
    model = build_model(
        s.arch,
        "tiny",
        input_size=s.size,
        in_channels=3,
        num_frames=s.frames if video else None,
        width=width,
        depth=s.depth,
        param=param,
        base_width=base if param == "mup" else None,
    )
    groups = param_groups(model, s.lr, 0.0) or [{"params": list(model.parameters()), "lr": s.lr, "lr_scale": 1.0}]
    opt = DeviceAdamW(groups, lambda step: s.lr, s.steps, (0.9, 0.999), 1e-8, 0.0, torch.device("cpu"))
    g = torch.Generator().manual_seed(s.seed + 1)  # the same batch, noise and timesteps at every width
    shape = (s.batch, 3, s.frames, s.size, s.size) if video else (s.batch, 3, s.size, s.size)
    x0 = torch.rand(shape, generator=g) * 2 - 1
    noise = torch.randn(shape, generator=g)
    sigma = torch.rand(s.batch, generator=g)
    expand = sigma.view(-1, *[1] * (len(shape) - 1))
    xt, target, t = (1 - expand) * x0 + expand * noise, noise - x0, sigma * 1000

    out: dict[tuple[str, int], float] = {}
    step = 0

    def hook(name):
        def record(module, inputs, output):
            out[(name, step)] = output.detach().float().pow(2).mean().sqrt().item()

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in watched_modules(model).items()]
    try:
        for step in range(s.steps):
            opt.at(step)
            loss = (model(xt, t) - target).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        for h in handles:
            h.remove()
    return out


def run(setup: Setup) -> dict[str, dict[int, dict[tuple[str, int], float]]]:
    """{param: {width: {(layer, step): rms}}} over the setup's parametrizations and widths."""
    setup.check()
    return {p: {w: measure(setup, p, w) for w in setup.widths} for p in setup.params}


def slopes(by_width: dict[int, dict[tuple[str, int], float]], step: int) -> dict[str, float]:
    """Per layer, the least-squares slope of log RMS against log width at `step` (NaN where an RMS is 0)."""
    widths = sorted(by_width)
    layers = list(dict.fromkeys(layer for layer, _ in by_width[widths[0]]))
    result = {}
    for layer in layers:
        rms = np.array([by_width[w][(layer, step)] for w in widths])
        if (rms <= 0).any() or not np.isfinite(rms).all():
            result[layer] = math.nan
            continue
        result[layer] = float(np.polyfit(np.log(widths), np.log(rms), 1)[0])
    return result


def spread(by_width: dict[int, dict[tuple[str, int], float]], layer: str, step: int) -> float:
    """max / min of a layer's RMS over the widths at `step`."""
    rms = [by_width[w][(layer, step)] for w in by_width]
    return max(rms) / min(rms) if min(rms) > 0 else math.inf


def render_text(results, setup: Setup) -> str:
    lines = []
    for param, by_width in results.items():
        widths = sorted(by_width)
        lines.append(f"== {param}: RMS of each layer's output (rows layer x step, columns width) ==")
        head = f"{'layer':<14}{'step':>5}" + "".join(f"{w:>11}" for w in widths)
        lines.append(head)
        keys = list(by_width[widths[0]])
        for layer, step in sorted(keys, key=lambda k: (list(dict.fromkeys(x for x, _ in keys)).index(k[0]), k[1])):
            lines.append(f"{layer:<14}{step:>5}" + "".join(f"{by_width[w][(layer, step)]:>11.4g}" for w in widths))
        last = setup.steps - 1
        lines.append(f"-- {param}: slope of log RMS vs log width at step {last} (0 = flat), and max/min over widths --")
        for layer, b in slopes(by_width, last).items():
            lines.append(f"{layer:<14}{b:>+8.3f}   max/min {spread(by_width, layer, last):.3g}")
        lines.append("")
    return "\n".join(lines)


def write_html(results, setup: Setup, path: Path, command: str) -> Path:
    """One log-log plot per parametrization and step: RMS against width, a line per layer."""
    import plotly.graph_objects as go
    import plotly.io as pio
    from plotly.offline import get_plotlyjs
    from plotly.subplots import make_subplots

    from sweep.report.html import LINE_COLORS, PLOT_CONFIG

    params = list(results)
    steps = list(range(setup.steps))
    fig = make_subplots(
        rows=len(params),
        cols=len(steps),
        subplot_titles=[f"{p}, step {s}" for p in params for s in steps],
        shared_yaxes=True,
    )
    for r, param in enumerate(params, 1):
        by_width = results[param]
        widths = sorted(by_width)
        layers = list(dict.fromkeys(layer for layer, _ in by_width[widths[0]]))
        for c, step in enumerate(steps, 1):
            for i, layer in enumerate(layers):
                fig.add_trace(
                    go.Scatter(
                        x=widths,
                        y=[by_width[w][(layer, step)] or None for w in widths],  # log axes cannot show 0
                        mode="lines+markers",
                        name=layer,
                        legendgroup=layer,
                        showlegend=r == 1 and c == 1,
                        line={"color": LINE_COLORS[i % len(LINE_COLORS)]},
                    ),
                    row=r,
                    col=c,
                )
    fig.update_xaxes(type="log", title_text="width")
    fig.update_yaxes(type="log")
    fig.update_layout(height=320 * len(params), margin={"l": 60, "r": 20, "t": 50, "b": 40})
    body = pio.to_html(fig, include_plotlyjs=False, full_html=False, config=PLOT_CONFIG)
    page = (
        '<!DOCTYPE html><html><head><meta charset="utf-8"><title>coord check</title>'
        f'<script type="text/javascript">{get_plotlyjs()}</script></head><body>'
        "<h1>Coordinate check: activation RMS against width</h1>"
        f"<p><code>{html.escape(command)}</code></p>"
        "<p>Flat lines: the layer's activations keep their size as the model widens (what µP is for).</p>"
        f"{body}<pre>{html.escape(render_text(results, setup))}</pre></body></html>"
    )
    path = Path(path)
    path.write_text(page, encoding="utf-8")
    return path


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage too)
        raise UsageError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m sweep.coord_check",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--widths", default=",".join(map(str, DEFAULT_WIDTHS)), help="comma-separated (default %(default)s)")
    p.add_argument("--add-512", action="store_true", help="also width 512 (about 10x the time of 256)")
    p.add_argument("--base-width", type=int, default=None, help="µP's base width (default: the smallest width)")
    p.add_argument("--arch", default="video_dit", help="dit or video_dit (default %(default)s)")
    p.add_argument("--depth", type=int, default=2, help="blocks (default %(default)s)")
    p.add_argument("--steps", type=int, default=4, help="AdamW steps (default %(default)s)")
    p.add_argument("--lr", type=float, default=1e-2, help="constant lr (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="weights, batch and noise (default %(default)s)")
    p.add_argument("--params", default="sp,mup", help="parametrizations (default %(default)s)")
    p.add_argument("--html", default="coord_check.html", help="the plot page (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")
    return p


def setup_from(args: argparse.Namespace) -> Setup:
    try:
        widths = tuple(int(w) for w in args.widths.split(",") if w.strip())
    except ValueError:
        raise UsageError(f"--widths: comma-separated integers, got {args.widths!r}") from None
    if args.add_512 and 512 not in widths:
        widths += (512,)
    return Setup(
        arch=args.arch,
        depth=args.depth,
        widths=widths,
        base_width=args.base_width,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        params=tuple(p.strip() for p in args.params.split(",") if p.strip()),
    )


def check_run_args(threads: int, html_path: Path) -> None:
    """UsageError for --threads outside [0, MAX_THREADS] (100000 segfaulted torch, rc 139) or an --html page that
    cannot be written (a folder, or in one that does not exist): found before the runs, not after them."""
    from sweep.config.validate import MAX_THREADS

    if not 0 <= threads <= MAX_THREADS:
        raise UsageError(f"--threads: must be in [0, {MAX_THREADS}] (0: 1 thread), got {threads}")
    if html_path.is_dir():
        raise UsageError(f"--html: {html_path} is a folder; name the page's file")
    if not html_path.absolute().parent.is_dir():
        raise UsageError(f"--html: no folder {html_path.absolute().parent} to write the page in")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parser().parse_args(argv)
        setup = setup_from(args)
        setup.check()
        check_run_args(args.threads, Path(args.html))
    except UsageError as e:
        print(f"coord_check: {e}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(max(1, args.threads))
    results = run(setup)
    print(render_text(results, setup))
    path = write_html(results, setup, Path(args.html), "python -m sweep.coord_check " + " ".join(argv))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from sweep.exit import exit_after

    exit_after(main)
