"""Verdicts from a whole training curve, decided once at the end of a run: `slow_divergence` and `no_progress`.

The monitor (sweep/run/monitor.py) stops a run whose smoothed loss blows up 10x; a run can also fail to train
with no blow-up at all: it learns, then climbs back slowly, or it never gets anywhere while its weights thrash.
`judge` reads the run's own metrics rows (and how far its weights travelled, which the monitor measures at each
stall check and at the last step) and returns a `Trend`: the numbers, recorded in result.json `trend` for every
run that reached its last step, and the verdict, if any:

- slow_divergence: the smoothed loss ends at `trend_end_factor` x its own minimum or above, or after that minimum
  it rises steadily: a least-squares line through log(loss) of every step after it rises `trend_rise` x or more
  over those steps, with a t statistic of `trend_rise_t` or more. The smoothed loss is the median of the training
  losses of each window of steps that holds `trend_samples` samples (15 steps at batch 4), or a tenth of the run
  when that is more: a training loss at random timesteps swings tens of times from step to step (more at batch 1),
  and the smallest of many short medians sits far below the curve by chance alone. first_bad_step: the last step
  of the window whose median is the minimum (the rise began after it).
- no_progress: a run trained from scratch (no checkpoint, no init_from) whose final loss is still `trend_progress`
  x its initial loss or more, while its weights travelled `trend_weight_path` x their initial norm or more (the
  sum, over the stall windows, of how far they moved in each). With an eval loss, final and initial are the eval
  losses of the last and of the untrained weights (the same clips, timesteps and noise); without, the median of
  the last training losses and the first training loss, whose timesteps make it noisy under v-prediction and flow
  matching. A run whose weights moved little is at too low an lr, which is slow, not broken (the demo's lr 1e-4
  runs end at 0.93 of their initial loss, their weights 0.037 of their norm along); weights that travel far and
  get nowhere are high-lr thrashing. first_bad_step: the last step (only the whole run shows it).

The thresholds were chosen from measured healthy and failing runs (docs/verdicts.md, bench/trend.py). A pure
function of its inputs: sweep/run/execute.py `conclude` calls it once for lone and packed runs alike, after the
last step, so windows (monitor.sync_every > 1) cannot change it: the rows and the measured path are the same.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import asdict, dataclass, field

from sweep.config import MonitorConfig, Verdict

END_OF_RUN = (Verdict.slow_divergence, Verdict.no_progress)
"""The verdicts decided here, from the whole curve, once the run has ended."""
MIN_WINDOW = 3
SPAN = 10
"""A median covers at least 1/SPAN of the judged steps (and monitor.trend_samples): the smallest of more medians sits
further below the curve by chance alone (measured at batch 4: healthy 200-step runs end 2.0-4.3x their smallest
10-step median, 1.3-1.7x their smallest 20-step one; docs/verdicts.md)."""


@dataclass
class Weights:
    """How far a run's weights travelled, as the monitor measured it (sweep.run.monitor.DivergenceMonitor)."""

    norm0: float | None
    """||weights|| at the start."""
    norm: float | None
    """||weights|| at the end."""
    path: float
    """The sum over the stall windows (and the last, partial one) of ||weights - the window's start||."""


@dataclass
class Trend:
    """The numbers of one run's curve and the verdict they give (result.json `trend`)."""

    window: int
    """Steps per median (`window`): monitor.trend_samples training samples, or a tenth of the run when that is more."""
    steps: int
    """Steps with a finite loss that were judged."""
    batch_size: int = 4
    verdict: str | None = None
    """slow_divergence, no_progress, or null."""
    first_bad_step: int | None = None
    judged: bool = True
    """False when the run is too short to judge (fewer than 2 windows of finite losses): `reason` says so."""
    reason: str | None = None
    initial_loss: float | None = None
    """The first step's training loss (of the weights the run started from: result.json initial_loss)."""
    min_loss: float | None = None
    """The smallest median of `window` consecutive losses."""
    min_step: int | None = None
    """The last step of that window."""
    final_loss: float | None = None
    """The median of the last `window` losses."""
    end_over_min: float | None = None
    end_over_initial: float | None = None
    eval_initial: float | None = None
    """The untrained weights' eval loss, measured only where no_progress could apply (`needs_initial_eval`)."""
    eval_over_initial: float | None = None
    """The eval loss after the last step over eval_initial; null without both."""
    progress: float | None = None
    """What no_progress reads: eval_over_initial when there is one (the same clips, timesteps and noise at both ends),
    else end_over_initial."""
    rise: float | None = None
    """After min_step: the least-squares line through log(loss), as the factor it rises over those steps."""
    rise_t: float | None = None
    """That slope's t statistic (slope / its standard error); null with fewer than `window` steps after the min."""
    rise_steps: int = 0
    weight_path: float | None = None
    """How far the weights travelled over the run, in units of their initial norm."""
    weight_growth: float | None = None
    """||weights|| at the end over at the start."""
    logits: dict = field(default_factory=dict)
    """The largest attention logit (every monitor.logit_every steps): first, max, last (empty with fewer than two)."""
    grad_norm: dict = field(default_factory=dict)
    """Median gradient norm of the first window, of the minimum's window and of the last window."""
    eval_loss: dict = field(default_factory=dict)
    """The eval losses recorded during the run (eval.every): first, min, last (empty with fewer than two)."""
    thresholds: dict = field(default_factory=dict)
    detail: str = ""
    """One line: the verdict's evidence, or the numbers of a run that passed."""

    def to_dict(self) -> dict:
        return asdict(self)


def thresholds(cfg: MonitorConfig) -> dict:
    return {
        "samples": cfg.trend_samples,
        "end_factor": cfg.trend_end_factor,
        "rise": cfg.trend_rise,
        "rise_t": cfg.trend_rise_t,
        "progress": cfg.trend_progress,
        "weight_path": cfg.trend_weight_path,
    }


@dataclass
class Context:
    """What the rows do not say about a run: its batch size, how it started, its eval losses."""

    batch_size: int = 4
    fresh: bool = True
    """It trained from scratch (no checkpoint, no init_from): the only runs no_progress applies to."""
    eval_loss: float | None = None
    """Its eval loss after the last step (result.json eval_loss), if it has one."""
    eval_initial: float | None = None
    """The eval loss of its untrained weights (the same clips, timesteps and noise), when measured
    (`needs_initial_eval`)."""


def window(cfg: MonitorConfig, batch_size: int, steps: int) -> int:
    """Steps per median: monitor.trend_samples training samples, and at least a tenth of the run (and 3 steps)."""
    return max(MIN_WINDOW, math.ceil(cfg.trend_samples / batch_size), steps // SPAN)


def needs_initial_eval(weights: Weights, cfg: MonitorConfig, ctx: Context) -> bool:
    """Whether no_progress could apply, so the untrained weights' eval loss is worth measuring: a fresh run with an
    eval loss whose weights travelled trend_weight_path x their norm or more."""
    path = weights.path / weights.norm0 if weights.norm0 else None
    return ctx.fresh and ctx.eval_loss is not None and path is not None and path >= cfg.trend_weight_path


def judge(rows: list[dict], weights: Weights, cfg: MonitorConfig, ctx: Context | None = None) -> Trend:
    """The trend of a run that reached its last step: its numbers and its verdict (None: it trained).

    `rows` are its metrics rows (step, loss, grad_norm, attn_max_logit, eval_loss; a cell may be "" or NaN)."""
    ctx = ctx or Context()
    pts = [(int(r["step"]), x) for r in rows if (x := _num(r.get("loss"))) is not None and x > 0]
    w = window(cfg, ctx.batch_size, len(pts))
    t = Trend(window=w, steps=len(pts), batch_size=ctx.batch_size, thresholds=thresholds(cfg))
    t.logits = _first_max_last(rows, "attn_max_logit")
    t.eval_loss = _first_max_last(rows, "eval_loss", low=True)
    if weights.norm0:
        t.weight_path = weights.path / weights.norm0
        t.weight_growth = weights.norm / weights.norm0 if weights.norm is not None else None
    if len(pts) < 2 * w:
        t.judged, t.reason = False, f"{len(pts)} steps with a finite loss, fewer than 2 windows of {w}"
        t.detail = f"not judged: {t.reason}"
        return t
    steps, losses = [s for s, _ in pts], [x for _, x in pts]
    smoothed = _rolling_median(losses, w)
    low = min(range(len(smoothed)), key=smoothed.__getitem__)
    t.initial_loss, t.min_loss, t.min_step, t.final_loss = losses[0], smoothed[low], steps[low + w - 1], smoothed[-1]
    t.end_over_min, t.end_over_initial = t.final_loss / t.min_loss, t.final_loss / t.initial_loss
    ev, ev0 = _num(ctx.eval_loss), _num(ctx.eval_initial)
    t.eval_initial = ev0
    if ev is not None and ev0:
        t.eval_over_initial = ev / ev0
    t.progress = t.eval_over_initial if t.eval_over_initial is not None else t.end_over_initial
    after = [(s, math.log(x)) for s, x in pts if s > t.min_step]
    t.rise_steps = len(after)
    if len(after) >= w:
        slope, t.rise_t = _ols(after)
        t.rise = math.exp(slope * (after[-1][0] - t.min_step))
    grads = [(int(r["step"]), g) for r in rows if (g := _num(r.get("grad_norm"))) is not None]
    if len(grads) >= w:
        at = [g for s, g in grads if t.min_step - w < s <= t.min_step]
        t.grad_norm = {
            "first": statistics.median(g for _, g in grads[:w]),
            "at_min": statistics.median(at) if at else None,
            "last": statistics.median(g for _, g in grads[-w:]),
        }
    far = t.end_over_min >= cfg.trend_end_factor
    rising = t.rise_t is not None and t.rise_t >= cfg.trend_rise_t and t.rise >= cfg.trend_rise
    thrash = (
        ctx.fresh
        and t.progress >= cfg.trend_progress
        and t.weight_path is not None
        and t.weight_path >= cfg.trend_weight_path
    )
    if far or rising:
        t.verdict, t.first_bad_step = Verdict.slow_divergence, t.min_step
    elif thrash:
        t.verdict, t.first_bad_step = Verdict.no_progress, steps[-1]
    t.detail = _detail(t, far, rising)
    return t


def _detail(t: Trend, far: bool, rising: bool) -> str:
    """One line: what decided the verdict, then the evidence (logits, gradient norms, weights)."""
    th = t.thresholds
    w = t.window
    rise = (
        f"after it the loss rose {t.rise:.2g}x over {t.rise_steps} steps (t={t.rise_t:.1f})"
        if t.rise is not None
        else f"{t.rise_steps} steps after it (too few to fit a trend)"
    )
    base = (
        f"the smoothed loss (median of {w} steps) ended at {t.final_loss:.4g}, {t.end_over_min:.2f}x its minimum "
        f"{t.min_loss:.4g} at step {t.min_step}; {rise}"
    )
    if t.verdict == Verdict.slow_divergence:
        why = []
        if far:
            why.append(f"{t.end_over_min:.2f}x >= {th['end_factor']:g}x its minimum")
        if rising:
            why.append(f"a rise of {t.rise:.2g}x >= {th['rise']:g}x with t={t.rise_t:.1f} >= {th['rise_t']:g}")
        head = f"slow divergence ({'; '.join(why)}): {base}"
    elif t.verdict == Verdict.no_progress:
        head = (
            f"no progress: {_final(t)} (>= {th['progress']:g}) while the weights travelled {t.weight_path:.3g}x "
            f"their norm (>= {th['weight_path']:g}); {base}"
        )
    else:
        head = f"trained: {base}; {_final(t)}"
    extra = []
    if t.verdict != Verdict.no_progress and t.weight_path is not None:
        extra.append(f"weights travelled {t.weight_path:.3g}x their norm")
    if t.weight_growth is not None:
        extra.append(f"their norm x{t.weight_growth:.3g}")
    if t.logits:
        extra.append(
            f"attention logits {t.logits['first']:.3g} -> max {t.logits['max']:.3g}, last {t.logits['last']:.3g}"
        )
    g = t.grad_norm
    if g:
        at_min = f" -> {g['at_min']:.3g} at the minimum" if g.get("at_min") is not None else ""
        extra.append(f"grad norm (median of {w}) {g['first']:.3g}{at_min} -> {g['last']:.3g} at the end")
    if t.eval_loss:
        e = t.eval_loss
        extra.append(f"eval losses during the run {e['first']:.4g} -> min {e['min']:.4g}, last {e['last']:.4g}")
    return head + ("; " + "; ".join(extra) if extra else "")


def _final(t: Trend) -> str:
    """What `progress` compared: the eval losses at both ends when there are, else the training losses."""
    if t.eval_over_initial is not None:
        return (
            f"the eval loss after the last step {t.eval_over_initial * t.eval_initial:.4g} is {t.progress:.2f}x the "
            f"untrained weights' {t.eval_initial:.4g}"
        )
    return f"the smoothed final loss {t.final_loss:.4g} is {t.progress:.2f}x the initial loss {t.initial_loss:.4g}"


def _rolling_median(values: list[float], w: int) -> list[float]:
    """The median of each `w` consecutive values, from the w-th on: a sorted window kept by bisection, so a run of
    1e5 steps with windows of 1e4 takes well under a second."""
    window_, out = sorted(values[:w]), []
    for i in range(w, len(values) + 1):
        out.append(_middle(window_))
        if i < len(values):
            del window_[bisect.bisect_left(window_, values[i - w])]
            bisect.insort(window_, values[i])
    return out


def _middle(ordered: list[float]) -> float:
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _ols(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(slope, its t statistic) of the least-squares line through the points."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return 0.0, 0.0
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    resid = sum((y - my - slope * (x - mx)) ** 2 for x, y in points)
    se = math.sqrt(resid / (n - 2) / sxx) if n > 2 else math.inf
    return slope, (slope / se if se > 0 else math.copysign(math.inf, slope) if slope else 0.0)


def _first_max_last(rows: list[dict], column: str, low: bool = False) -> dict:
    """A column's first, largest (or smallest) and last value; {} with fewer than two (a trend needs two)."""
    values = [x for r in rows if (x := _num(r.get(column))) is not None]
    if len(values) < 2:
        return {}
    return {"first": values[0], ("min" if low else "max"): (min if low else max)(values), "last": values[-1]}


def _num(v) -> float | None:
    """A metrics cell as a finite float, else None (an empty cell, NaN, Inf)."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None
