"""Which modules must compute in fp32: delta debugging over module groups, every trial a real run to the end.

    python -m sweep.diagnose RUN_DIR --bisect

For a low-precision run that diverges while the same config in fp32 is stable. The groups are the model's
top-level parts (the embedders, the final layer) and each block's parts (attention, MLP, adaLN, norms);
ddmin (Zeller and Hildebrandt 2002) finds a set of groups that keeps the run stable when computed in fp32
(precision.fp32_modules) and from which no single group can be dropped; then each group of that set is
tried as its own children, the same way ("then finer"). The answer is that set, with its share of the
model's forward FLOPs (torch.utils.flop_counter at the run's batch), so the user sees what the fp32
islands cost. Trials are cached: a set is never run twice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from sweep.diagnose.record import RunRecord
from sweep.diagnose.trials import run_trial, with_overrides
from sweep.run.build import build_parts
from sweep.run.precision import PrecisionPolicy

MAX_TRIALS = 40
"""A bisection stops after this many runs (it says so): ddmin on n groups needs O(n log n) at best."""


def groups(model: torch.nn.Module) -> list[str]:
    """Module names to bisect over: each top-level child, except a ModuleList, which gives each element's children."""
    out = []
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList):
            for i, block in enumerate(child):
                subs = [f"{name}.{i}.{n}" for n, _ in block.named_children()]
                out += subs or [f"{name}.{i}"]
        else:
            out.append(name)
    return out


def children(model: torch.nn.Module, name: str) -> list[str]:
    module = model.get_submodule(name)
    return [f"{name}.{n}" for n, _ in module.named_children()]


def ddmin(items: list[str], stable: Callable[[list[str]], bool]) -> list[str]:
    """A 1-minimal subset of `items` for which `stable` holds (it must hold for `items`)."""
    c, n = list(items), 2
    while len(c) >= 2:
        chunks = [c[i * len(c) // n : (i + 1) * len(c) // n] for i in range(n)]
        chunks = [k for k in chunks if k]
        for chunk in chunks:
            if stable(chunk):
                c, n = chunk, 2
                break
        else:
            for chunk in chunks:
                rest = [x for x in c if x not in chunk]
                if rest and stable(rest):
                    c, n = rest, max(n - 1, 2)
                    break
            else:
                if n >= len(c):
                    break
                n = min(len(c), 2 * n)
    if len(c) == 1 and stable([]):  # nothing needed at all (only when the caller's empty set is stable)
        return []
    return c


def flop_shares(record: RunRecord, names: list[str]) -> tuple[dict[str, float], int]:
    """Each named module's share of one forward's FLOPs at the run's batch (fp32, on the CPU), and the total."""
    run = record.run
    cpu = torch.device("cpu")
    parts = build_parts(run, cpu, PrecisionPolicy.from_config(run.precision, cpu))
    model = parts.model.float()
    x0 = torch.stack([parts.dataset[i] for i in parts.order.indices(0)])
    noisy, t, _ = parts.objective.sample(x0, torch.Generator().manual_seed(0))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(noisy.float(), t)
    counts = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    total = counts.get("Global", 0)
    root = type(model).__name__
    shares = {n: (counts.get(f"{root}.{n}", 0) / total if total else 0.0) for n in names}
    return shares, total


def bisect_fp32(record: RunRecord, scratch: Path, progress: Callable[[str], None] = print) -> dict:
    """The minimal fp32 set of a low-precision run, or why there is none; each trial a run from step 0."""
    run = record.run
    if run.precision.param_dtype.value == "float32" and run.precision.autocast_dtype is None:
        return {"minimal": None, "summary": "not bisected: the run is fp32 already", "trials": []}
    trials: list[dict] = []
    cache: dict[tuple[str, ...], bool] = {}

    def stable(names: list[str], overrides: list[str] | None = None) -> bool:
        key = tuple(sorted(names)) if overrides is None else ("<" + " ".join(overrides) + ">",)
        if key in cache:
            return cache[key]
        if len(trials) >= MAX_TRIALS:
            raise TimeoutError
        o = overrides if overrides is not None else [f"precision.fp32_modules=[{','.join(sorted(names))}]"]
        outcome = run_trial(with_overrides(record.config, o), scratch / f"trial_{len(trials) + 1:02d}")
        cache[key] = outcome.healthy
        trials.append(
            {
                "fp32_modules": sorted(names) if overrides is None else None,
                "overrides": o,
                "outcome": outcome.short(),
                "seconds": outcome.seconds,
            }
        )
        progress(f"bisect trial {len(trials)}: {' '.join(o)}: {outcome.short()} ({outcome.seconds:.1f} s)")
        return outcome.healthy

    cpu = torch.device("cpu")
    model = build_parts(run, cpu, PrecisionPolicy.from_config(run.precision, cpu)).model
    top = groups(model)
    try:
        if not stable([], ["precision=fp32"]):
            return {
                "minimal": None,
                "trials": trials,
                "summary": "not bisected: the run diverges in fp32 too, so no set of fp32 modules can fix it",
            }
        if not stable(top):
            return {
                "minimal": None,
                "trials": trials,
                "groups": top,
                "summary": "not bisected: with every module group in fp32 it still diverges (what stays in low "
                "precision is outside the modules: inputs, loss, optimizer state)",
            }
        cache[()] = False  # the run itself
        coarse = ddmin(top, stable)
        fine = []
        for name in coarse:  # then finer: the group's children, the rest of the set kept in fp32
            kids = children(model, name)
            others = [n for n in coarse if n != name]
            if len(kids) > 1 and stable(others + kids):
                fine += ddmin(kids, lambda sub, others=others: stable(others + sub))
            else:
                fine.append(name)
        minimal = sorted(fine)
        if fine != coarse and not stable(minimal):
            minimal = sorted(coarse)
    except TimeoutError:
        return {
            "minimal": None,
            "trials": trials,
            "groups": top,
            "summary": f"stopped after {MAX_TRIALS} trials without a minimal set",
        }
    shares, total = flop_shares(record, minimal)
    share = sum(shares.values())
    return {
        "minimal": minimal,
        "groups": top,
        "flop_share": share,
        "flop_shares": shares,
        "forward_flops": total,
        "trials": trials,
        "summary": f"{len(minimal)} module(s) in fp32 keep the run stable: {', '.join(minimal)} "
        f"({share:.1%} of the forward FLOPs; {len(trials)} runs)",
    }
