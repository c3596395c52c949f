"""Why a run diverged: one mechanism from a closed set, decided from what the run recorded, with its numbers.

The set (docs/design.md, "Diagnosis"); each is decided from evidence, never assumed from the verdict:

- bad_input: the batch at the bad step held NaN/Inf/out-of-range values (checked or found afterwards).
- corrupt_checkpoint: the weights were bad before any update (a checksum mismatch, or non-finite or implausibly
  large weights loaded from a checkpoint: the Hallo case).
- kernel: a fused or forced kernel the run used disagrees with its reference (sweep.parity, at the run's
  dtype and batch size: the OpenDiT modulate's row-index bug shows only at batch >= 2).
- activation_overflow: a forward activation reached the compute dtype's largest value (fp16: 65504).
- update_underflow: AdamW's updates were lost to the weights' dtype: eps rounds to 0 in fp16 so the first
  update is 0/0 (the Sana case), or updates fall below the weights' resolution (pure bf16 at a small lr).
- gradient_underflow: gradients flushed to exact zeros (fp16 without loss scaling).
- loss_scale_collapse: the loss scaler backed off to its floor with a finite forward (no overflow to blame).
- attention_logit_growth: the largest attention logit grew LOGIT_GROWTH x from its first record and the
  attention entropy fell below ENTROPY_COLLAPSE of its own before the first bad step (Dehghani et al.
  2023, Wortsman et al. 2023); qk-layernorm is the known fix.
- adam_second_moment_lag: AdamW's second moment under-estimated the squared gradients by LAGGED x or
  more when the loss spiked (Wortsman et al. 2023b; sweep.run.adam_lag); update clipping or a lower beta2.
- optimizer_state: the optimizer's own state went bad (result.json optimizer.health, sweep/run/optimizers.py):
  non-finite values in it (an 8-bit block's absmax gone inf dequantises the whole block to NaN), or 8-bit second
  moments that dequantise to 0 beside non-zero first moments (their update is m / eps); AdamW with fp32 state is
  the known fix.
- lr_too_high: nothing above explains it and the lr/10 counterfactual keeps the bad steps healthy; for the
  end-of-run verdicts (slow_divergence, no_progress) also named from the recorded signals when the weights
  travelled monitor.trend_weight_path x their initial norm or more (result.json trend): steps that large while the
  loss rose or went nowhere.
- nondeterministic: an identical replay did not reproduce the run.
- unexplained: none of the above; said as such, never guessed.

The last three need the counterfactual replay (sweep.diagnose.counterfactual): `decide` names one of the
first ten or `unexplained`, and `settle` revisits that with the table.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sweep.config import RunConfig, Verdict
from sweep.diagnose.signals import RunRecord, as_number, computes_in_fp32
from sweep.run.adam_lag import LAGGED

MECHANISMS = (
    "bad_input",
    "corrupt_checkpoint",
    "kernel",
    "activation_overflow",
    "update_underflow",
    "gradient_underflow",
    "loss_scale_collapse",
    "attention_logit_growth",
    "adam_second_moment_lag",
    "optimizer_state",
    "lr_too_high",
    "nondeterministic",
    "unexplained",
)

LOGIT_GROWTH = 10.0
"""attention_logit_growth: the largest logit before the first bad step over its first record. A healthy tiny
run's logit grows 2-4x while it learns (qk_norm_logit_growth with qk-norm: 1.7 -> at most 6.6)."""
ENTROPY_COLLAPSE = 0.25
"""attention_logit_growth: the lowest attention entropy before the first bad step, as a fraction of its first."""
OVERFLOW_HEADROOM = 0.5
"""activation_overflow: a module's max |activation| at this fraction of the dtype's max or above."""


@dataclass
class Mechanism:
    """A mechanism, what it rests on (numbers), and a sentence that says it."""

    name: str
    summary: str
    evidence: dict = field(default_factory=dict)


def decide(record: RunRecord) -> Mechanism:
    """The mechanism the recorded signals show (one of the first nine, or unexplained)."""
    r, run = record.result, record.run
    verdict, cause = r["verdict"], r.get("cause") or {}
    where, detail = cause.get("where"), cause.get("detail") or ""
    if verdict == Verdict.bad_input or where == "data":
        samples = detail.removeprefix("the batch held bad values: ")
        return Mechanism(
            "bad_input", f"the batch at step {record.first_bad} held bad samples: {samples}", {"cause": detail}
        )
    if verdict == Verdict.corrupt_checkpoint or where == "checkpoint":
        return Mechanism(
            "corrupt_checkpoint",
            f"the weights were bad before any update ({cause.get('module') or 'a tensor'}): {detail}",
            {"cause": detail, "loaded": r.get("loaded")},
        )
    found = kernel_mismatch(record) or optimizer_state(record)
    if found is not None:
        return found
    if verdict in (Verdict.slow_divergence, Verdict.no_progress):
        return trend_mechanism(record)
    overflow = activation_overflow(record, detail)
    if overflow is not None:
        return overflow
    if verdict == Verdict.stalled:
        return stalled(record, where, detail)
    if run.precision.param_dtype.value == "float16" and where == "optimizer" and "after the update" in detail:
        eps = run.optim.eps
        rounded = float(torch.tensor(eps, dtype=torch.float16))
        return Mechanism(
            "update_underflow",
            f"pure fp16 weights: AdamW's eps={eps:g} is {rounded:g} in fp16 and grad^2 underflows, so the update of "
            f"step {record.first_bad - 1} is 0/0 ({detail})",
            {"eps": eps, "eps_in_fp16": rounded, "param_dtype": "float16"},
        )
    if verdict == Verdict.scale_collapse:
        scales = [v for _, v in record.column("loss_scale")]
        return Mechanism(
            "loss_scale_collapse",
            f"the loss scaler backed off to {min(scales, default=math.nan):g} with a finite forward: {detail}",
            {"min_loss_scale": min(scales, default=None), "cause": detail},
        )
    growth = logit_growth(record)
    if growth is not None:
        return growth
    lag = second_moment_lag(detail)
    if lag is not None:
        return Mechanism(
            "adam_second_moment_lag",
            f"AdamW's second moment under-estimated the squared gradients {lag:.3g}x (>= {LAGGED:g}x) when the "
            f"loss spiked at step {record.first_bad}",
            {"lag_ratio": lag, "lagged_at": LAGGED},
        )
    return Mechanism("unexplained", "no recorded signal explains it", _context(record))


def of_run(result: dict, rows: list[dict], run: RunConfig) -> dict:
    """The mechanism of a run that just diverged, for its result.json (`mechanism`): name and summary, from the
    signals at hand; `python -m sweep.diagnose` tests it against counterfactual runs."""
    rows = [{k: as_number(v) for k, v in r.items()} for r in rows]
    m = decide(RunRecord(Path("."), result, rows, None, run))
    return {"name": m.name, "summary": m.summary}


def kernel_mismatch(record: RunRecord) -> Mechanism | None:
    """The run's modulate kernel and forced attention backend against their references (sweep.parity) at the
    run's compute dtype and batch size; a mismatch is the mechanism."""
    from sweep.parity import SHORT_NAMES, check, resolve

    run = record.run
    dtype = (run.precision.autocast_dtype or run.precision.param_dtype).value
    name = {config: short for short, config in SHORT_NAMES.items()}[dtype]
    batch = max(2, run.data.batch_size)
    candidates = []
    if run.modulate.impl.value != "eager":
        candidates.append(("modulate", run.modulate.impl.value))
    if run.attention.backend.value in ("flash", "eager"):
        candidates.append(("attention", run.attention.backend.value))
    for kind, spec in candidates:
        try:
            fwd, bwd = check(kind, resolve(kind, spec), name, batch)
        except (RuntimeError, ValueError):  # a backend this device cannot run in this dtype: nothing to compare
            continue
        if fwd > 1 or bwd > 1:
            return Mechanism(
                "kernel",
                f"{kind}={spec} disagrees with its reference in {name} at batch {batch}: forward error "
                f"{fwd:.3g}x and backward {bwd:.3g}x the tolerance (python -m sweep.parity --{kind} {spec})",
                {
                    "kind": kind,
                    "impl": spec,
                    "dtype": name,
                    "batch": batch,
                    "forward_err_over_tol": fwd,
                    "backward_err_over_tol": bwd,
                },
            )
    return None


def optimizer_state(record: RunRecord) -> Mechanism | None:
    """The optimizer's state at the bad step held non-finite values, or 8-bit second moments read as 0 where the
    first moments are not (health, sweep/run/optimizers.py): its updates, not the forward, went wrong."""
    o = record.result.get("optimizer") or {}
    h = o.get("health") or {}
    bad, zeroed = int(h.get("nonfinite_count") or 0), float(h.get("v_zero_m_nonzero") or 0.0)
    if not bad and not zeroed > 0:
        return None
    what = [f"{bad} state tensors non-finite ({', '.join(h.get('nonfinite', []))})"] if bad else []
    if zeroed > 0:
        what.append(f"{zeroed:.2%} of the 8-bit second moments read as 0 beside non-zero first moments")
    return Mechanism(
        "optimizer_state",
        f"the state of optim={o.get('name')} ({o.get('library')}) went bad by step {record.first_bad}: "
        + "; ".join(what),
        {"optimizer": o.get("name"), "health": h, "state_dtypes": o.get("state_dtypes")},
    )


def activation_overflow(record: RunRecord, detail: str) -> Mechanism | None:
    """A forward that went non-finite inside a module whose inputs were finite, in fp16 (only an overflow makes
    inf from finite fp16 values: QK^T, a sum of squares, an exp), or a module at the overflow edge of its
    dtype at the probed bad step (forensics' headroom)."""
    cause = record.result.get("cause") or {}
    edge = [h for h in record.result.get("headroom") or [] if h.get("headroom", 0) >= OVERFLOW_HEADROOM]
    in_fp16 = cause.get("where") == "forward" and "in float16" in detail
    if not edge and not in_fp16:
        return None
    logit = record.result.get("max_attn_logit")
    where = (
        f"{edge[0]['module']} reached {edge[0]['amax']:.3g} ({edge[0]['headroom']:.0%} of {edge[0]['dtype']}'s max)"
        if edge
        else f"{cause.get('module')} made inf/NaN from finite fp16 inputs"
    )
    return Mechanism(
        "activation_overflow",
        f"forward activations overflowed fp16 (max 65504): {where}"
        + (f"; the largest attention logit was {logit:.3g}" if logit else ""),
        {
            "module": cause.get("module"),
            "closest_to_overflow": edge[:5] or record.result.get("headroom"),
            "max_attn_logit": logit,
            "dtype_max": 65504.0,
            "cause": detail,
        },
    )


def stalled(record: RunRecord, where: str | None, detail: str) -> Mechanism:
    zero = record.column("zero_grad_fraction")
    same = record.column("unchanged_fraction")
    numbers = {"zero_grad_fraction": zero[-1][1] if zero else None, "unchanged_fraction": same[-1][1] if same else None}
    if where == "backward" or "underflowed" in detail:
        if computes_in_fp32(record.run):
            # no fp32 gradient underflows to exactly 0 (that takes |g| < 1e-45): the weights get none at all
            return Mechanism(
                "unexplained",
                f"the gradients are exactly 0 in fp32, which no underflow makes: the trained weights get no "
                f"gradient (frozen, or behind zero-initialised gates, as LoRA on weights that were never trained: "
                f"set model.init_from); {detail}",
                numbers,
            )
        return Mechanism("gradient_underflow", f"gradients flushed to exact zeros: {detail}", numbers)
    return Mechanism(
        "update_underflow",
        f"updates below the weights' resolution ({record.run.precision.param_dtype.value}): {detail}",
        numbers,
    )


def trend_mechanism(record: RunRecord) -> Mechanism:
    """An end-of-run verdict (sweep/run/trend.py): attention-logit growth when the logits grew over the whole run
    (the same rule as before a spike), else lr_too_high when the weights travelled monitor.trend_weight_path x their
    norm or more (the step size: the lr/10 row of `python -m sweep.diagnose` tests it), else unexplained."""
    growth = logit_growth(record, whole_run=True)
    if growth is not None:
        return growth
    trend = record.result.get("trend") or {}
    path, far = trend.get("weight_path"), record.run.monitor.trend_weight_path
    what = "rose after its minimum" if record.result["verdict"] == Verdict.slow_divergence else "went nowhere"
    if path is not None and path >= far:
        return Mechanism(
            "lr_too_high",
            f"the weights travelled {path:.3g}x their initial norm (>= {far:g}) while the loss {what}: steps too "
            f"large at lr {record.run.optim.lr:g}",
            {
                "weight_path": path,
                "weight_path_threshold": far,
                "lr": record.run.optim.lr,
                "trend": trend.get("detail"),
            },
        )
    return Mechanism("unexplained", f"no recorded signal explains it (the loss {what})", _context(record))


def logit_growth(record: RunRecord, whole_run: bool = False) -> Mechanism | None:
    """Logits grown LOGIT_GROWTH x and entropy collapsed before the first bad step (over the whole run for an
    end-of-run verdict, whose first bad step is where the rise began or the last step)."""
    before = None if whole_run else record.first_bad + 1
    logits = record.column("attn_max_logit", before=before)
    entropy = record.column("attn_min_entropy", before=before)
    if len(logits) < 2 or not entropy:
        return None
    first, peak = logits[0][1], max(v for _, v in logits)
    e0, low = entropy[0][1], min(v for _, v in entropy)
    growth = peak / first if first > 0 else math.inf
    if growth < LOGIT_GROWTH or not (e0 > 0 and low <= ENTROPY_COLLAPSE * e0):
        return None
    return Mechanism(
        "attention_logit_growth",
        f"the largest attention logit grew {growth:.0f}x ({first:.3g} at step {logits[0][0]} -> {peak:.3g}) and "
        f"the attention entropy fell to {low:.3g} from {e0:.3g} "
        + (_over_the_run(record) if whole_run else f"before the loss spiked at step {record.first_bad}"),
        {
            "logit_first": first,
            "logit_peak": peak,
            "growth": growth,
            "entropy_first": e0,
            "entropy_low": low,
            "thresholds": {"growth": LOGIT_GROWTH, "entropy_fraction": ENTROPY_COLLAPSE},
        },
    )


def _over_the_run(record: RunRecord) -> str:
    if record.result["verdict"] == Verdict.slow_divergence:
        return f"over the run, whose loss rose after its minimum at step {record.first_bad}"
    return "over the run, whose loss went nowhere"


_LAG = re.compile(
    r"second moment (?:lagged|kept up): the \d+ squared gradient norms before step \d+ average ([0-9.eE+-]+)x"
)


def second_moment_lag(detail: str) -> float | None:
    """The lag ratio a loss spike's cause states (sweep.run.adam_lag.lag_note), when it is LAGGED or more."""
    m = _LAG.search(detail)
    return float(m.group(1)) if m and float(m.group(1)) >= LAGGED else None


def _context(record: RunRecord) -> dict:
    r = record.result
    return {
        "verdict": r["verdict"],
        "cause": (r.get("cause") or {}).get("detail"),
        "max_attn_logit": r.get("max_attn_logit"),
        "max_grad_norm": r.get("max_grad_norm"),
    }
