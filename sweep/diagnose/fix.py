"""The fix: overrides that should make the run stable, tried from step 0 as a real run.

Candidates come, in order, from the mechanism's known fix (qk_norm, bf16, a lower lr, update clipping, the
samples left out; a smaller eps, then a 10x larger lr, for a stall that fp32 does not clear either; lr/100 for
an unexplained run whose lr/10 row only moved the bad steps later), from the
bisection's minimal fp32 set, and from the counterfactual rows that got past the bad steps. The first candidate
whose run is stable to the end is the confirmed fix. qk_norm is no candidate for a run that loads its weights
(checkpoint.resume_from, model.init_from): the file has no q/k norms, and the run would stop at the load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from sweep.config import Arch
from sweep.diagnose.counterfactual import Table
from sweep.diagnose.record import RunRecord
from sweep.diagnose.trials import from_start_last, run_trial, with_overrides

TRIES = 2
"""At most this many candidate fixes are run (each is a whole run)."""


def candidates(
    record: RunRecord, mechanism: str, evidence: dict, table: Table | None, bad: list[int], fp32_set: list[str] | None
) -> list[list[str]]:
    """Override sets to try, most specific first, none repeated."""
    run = record.run
    out: list[list[str]] = []
    lower_lr = [f"optim.lr={_round(run.optim.lr / 10)!r}"]
    if mechanism == "bad_input":
        if bad:
            out.append([f"data.skip_samples={sorted(set(run.data.skip_samples) | set(bad))}"])
        out.append(["data.drop_bad=true"])
    elif mechanism == "kernel":
        out.append(reference_kernel(evidence))
    elif mechanism == "attention_logit_growth":
        # q/k norms are new weights: a run that loads its weights (a resume, a fine-tune) cannot start with them
        loads_weights = run.checkpoint.resume_from or run.model.init_from
        if run.model.arch in (Arch.dit, Arch.video_dit) and not run.model.qk_norm and not loads_weights:
            out.append(["model.qk_norm=true"])
        out.append(lower_lr)
    elif mechanism == "adam_second_moment_lag":
        # beta2 0.95 first: on the beta2 scenario it kept 9 of 9 resumed runs stable, update_clip=1.0 only 5 of 9
        # (docs/experiments.md, "StableAdamW against the beta2 spike")
        out += [["optim.betas=[0.9,0.95]"], ["optim.update_clip=1.0"]]
    elif mechanism in ("activation_overflow", "loss_scale_collapse"):
        out.append(["precision=bf16_amp"])
        if fp32_set:
            out.append([f"precision.fp32_modules=[{','.join(fp32_set)}]"])
    elif mechanism in ("update_underflow", "gradient_underflow") and _fp32_kept_it(table):
        # not the precision alone: in fp32 too the gradients are far below AdamW's eps (tiny, or scaled down by a
        # loss weight), so each update shrinks by |g| / eps below even fp32's resolution. A smaller eps restores
        # AdamW's normalised step; then a larger lr. Either with the precision's own fix (fp32 master weights keep
        # eps=1e-12, which fp16 rounds to 0; a loss scale lifts fp16's gradients).
        base = _precision_fix(run, mechanism)
        out += [[*base, f"optim.eps={SMALL_EPS!r}"], [*base, f"optim.lr={_round(run.optim.lr * 10)!r}"]]
    elif mechanism == "update_underflow":
        out += [["precision=bf16_amp"], ["precision=fp32"]]
    elif mechanism == "gradient_underflow":
        out.append(["precision=fp16_amp"] if run.precision.name == "fp16_amp_noscale" else ["precision=bf16_amp"])
    elif mechanism == "lr_too_high":
        out.append(lower_lr)
    elif mechanism == "optimizer_state":
        out.append(["optim.name=adamw", "optim.eps=1e-08", "optim.betas=[0.9,0.999]"])
        if run.optim.name.value == "adamw_8bit":
            out.append([f"optim.min_8bit_size={2**31 - 1}"])  # every tensor's state in fp32, bitsandbytes' own code
    elif mechanism == "nondeterministic" and not run.deterministic:
        out.append(["deterministic=true"])
    elif mechanism == "unexplained" and lr_delayed_it(record, table):
        # lr/10 moved the bad steps later without clearing them: the step size is in it, and a run at lr/100
        # says whether it is all of it (diagnosis.py names it lr_too_high only if that run is stable)
        out.append([f"optim.lr={_round(run.optim.lr / 100)!r}"])
    o = run.optim
    if o.name.value == "prodigy" and o.warmup_steps and not o.safeguard_warmup and mechanism != "bad_input":
        # Prodigy's estimate of its step size overshoots during warmup (docs/scenarios.md, prodigy_safeguard_warmup)
        out.insert(0, ["optim.safeguard_warmup=true"])
    if mechanism in ("corrupt_checkpoint", "unexplained", "nondeterministic"):
        return [c for c in out if c]
    # what the counterfactuals showed to work, after the mechanism's own fix
    for row in table.rows if table else []:
        if row.cleared and row.overrides and row.name != "same config":
            out.append(row.overrides)
    seen, unique = set(), []
    for c in out:
        key = tuple(c)
        if key not in seen and c:
            seen.add(key)
            unique.append(c)
    return unique


def reference_kernel(evidence: dict) -> list[str]:
    """The override that puts the mismatching kernel of a `kernel` mechanism back to its reference."""
    return ["modulate=eager"] if evidence.get("kind") == "modulate" else ["attention=math"]


SMALL_EPS = 1e-12
"""AdamW's eps for a stall whose gradients are below the default 1e-8 (fp32 master weights hold it)."""


def _round(x: float) -> float:
    """x with 6 significant digits: 1e-06 * 10 is 1e-05 on the command line, not 9.999999999999999e-06."""
    return float(f"{x:.6g}")


def _precision_fix(run, mechanism: str) -> list[str]:
    """The precision change a low-precision stall needs besides its step size (none for fp32 weights)."""
    if mechanism == "gradient_underflow" and run.precision.name == "fp16_amp_noscale":
        return ["precision=fp16_amp"]
    return ["precision=bf16_amp"] if run.precision.param_dtype.value != "float32" else []


def lr_delayed_it(record: RunRecord, table: Table | None) -> bool:
    """Whether the table's lr/10 row diverged, but later than the run did (the step size matters, and lr/10 was
    not enough)."""
    row = next((r for r in table.rows if r.name == "lr/10"), None) if table else None
    out = row.outcome if row else None
    return bool(out and out.get("status") == "diverged" and (out.get("first_bad_step") or -1) > record.first_bad)


def _fp32_kept_it(table: Table | None) -> bool:
    """Whether the table's fp32 row ran and met the run's own verdict again (a stall in fp32 too)."""
    row = next((r for r in table.rows if r.name == "fp32"), None) if table else None
    return bool(row and row.outcome is not None and not row.cleared)


def confirm(record: RunRecord, tries: list[list[str]], scratch: Path, progress: Callable[[str], None] = print) -> dict:
    """Run the candidates from step 0, the run's whole length (at most FROM_START_HORIZON x the steps it took to
    fail: sweep/diagnose/trials.py), until one is stable."""
    tried, last = [], from_start_last(record)
    for i, overrides in enumerate(tries[:TRIES], 1):
        run = with_overrides(record.config, overrides)
        through = run.steps - 1 if last is None else last
        progress(f"fix {i}/{min(len(tries), TRIES)}: {' '.join(overrides)} from step {record.start} through {through}")
        outcome = run_trial(run, scratch / f"fix_{i}", last=last, quick=False)
        tried.append(
            {
                "overrides": overrides,
                "status": outcome.status,
                "outcome": outcome.short(),
                "run_dir": outcome.run_dir,
                "seconds": outcome.seconds,
            }
        )
        progress(f"fix {i}: {outcome.short()} ({outcome.seconds:.1f} s)")
        if outcome.healthy:
            return {
                "overrides": overrides,
                "confirmed": True,
                "run_dir": outcome.run_dir,
                "tried": tried,
                "through_step": through,
            }
    return {
        "overrides": tried[0]["overrides"] if tried else [],
        "confirmed": False,
        "run_dir": tried[0]["run_dir"] if tried else None,
        "tried": tried,
        "through_step": through if tried else None,
    }
