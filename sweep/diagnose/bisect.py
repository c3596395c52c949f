"""Which modules must compute in fp32 (or, in an fp8 run, in bf16): delta debugging over module groups, every trial
a real run to the end.

    python -m sweep.diagnose RUN_DIR --bisect

For a low-precision run that diverges while the same config in fp32 is stable. The groups are the model's
top-level parts (the embedders, the final layer) and each block's parts (attention, MLP, adaLN, norms);
ddmin (Zeller and Hildebrandt 2002) finds a set of groups that keeps the run stable when computed in fp32
(precision.fp32_modules) and from which no single group can be dropped; then each group of that set is
tried as its own children, the same way ("then finer"). The answer is that set, with its share of the
model's forward FLOPs (torch.utils.flop_counter at the run's batch), so the user sees what the fp32
islands cost. Trials are cached: a set is never run twice.

An fp8 run (precision.fp8) is bisected the same way one level down: the islands are modules whose linears keep
bf16 matmuls (precision.fp8_keep gains `name` and `name.*` for each), the high-precision check is the run with
bf16 matmuls everywhere (precision.fp8=null), and the answer is the smallest set of modules to keep out of fp8
(`Islands`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from sweep.diagnose.record import RunRecord
from sweep.diagnose.signals import computes_in_fp32
from sweep.diagnose.trials import from_start_last, run_trial, with_overrides
from sweep.run.build import build_parts, build_weights
from sweep.run.module_flops import module_flops
from sweep.run.precision import PrecisionPolicy

MAX_TRIALS = 40
"""A bisection stops after this many runs (it says so): ddmin on n groups needs O(n log n) at best."""


LISTS = (torch.nn.ModuleList, torch.nn.ModuleDict)


def parts(module: torch.nn.Module, name: str) -> list[str]:
    """The groups `module` (called `name`) splits into: each child, a ModuleList's (or Dict's) elements by their
    own children (a list has no forward of its own, so its hooks would never run)."""
    out = []
    for child_name, child in module.named_children():
        full = f"{name}.{child_name}" if name else child_name
        if isinstance(child, LISTS):
            for i, element in child.named_children():
                inner = [f"{full}.{i}.{k}" for k, _ in element.named_children()]
                out += inner or [f"{full}.{i}"]
        else:
            out.append(full)
    return out


def groups(model: torch.nn.Module) -> list[str]:
    """Module names to bisect over: the model's parts (embedders, final layer, each block's attention / MLP /
    adaLN / norms), looking through a wrapper with a single child (a diffusers transformer in our adapter)."""
    name, module = "", model
    while len(kids := list(module.named_children())) == 1 and not isinstance(kids[0][1], LISTS):
        name, module = (f"{name}.{kids[0][0]}" if name else kids[0][0]), kids[0][1]
    return parts(module, name)


def children(model: torch.nn.Module, name: str) -> list[str]:
    return parts(model.get_submodule(name), name)


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
    x0 = torch.stack([parts.dataset[i] for i in parts.order.indices(0)])
    noisy, t, _ = parts.objective.sample(x0, torch.Generator().manual_seed(0))
    flops = module_flops(parts.model.float(), (noisy.float(), t))
    total = flops.get("", 0)
    return {n: (flops.get(n, 0) / total if total else 0.0) for n in names}, total


def glob_list(key: str, globs: list[str]) -> str:
    """`key=['*t_embedder*','blocks.1.attn']`: each glob quoted, since a bare leading * is a YAML alias (and Hydra's
    grammar takes the quotes too, so the override also works on the command line)."""
    return f"{key}=[{','.join(repr(g) for g in globs)}]"


@dataclass(frozen=True)
class Islands:
    """What a bisection moves to higher precision, and how a set of modules says it as overrides."""

    high: str
    """What the modules move to: "fp32" (precision.fp32_modules) or "bf16" (out of fp8: precision.fp8_keep)."""
    everything: list[str]
    """The overrides of the whole run in that precision: precision=fp32, or precision.fp8=null."""
    keep: list[str]
    """fp8_keep's own globs, which every trial keeps."""

    @classmethod
    def of(cls, run) -> "Islands":
        if run.precision.fp8 is not None:
            return cls("bf16", ["precision.fp8=null"], list(run.precision.fp8_keep))
        return cls("fp32", ["precision=fp32"], [])

    def overrides(self, names: list[str]) -> list[str]:
        if self.high == "fp32":
            return [f"precision.fp32_modules=[{','.join(sorted(names))}]"]
        return [glob_list("precision.fp8_keep", self.keep + [g for n in sorted(names) for g in (n, f"{n}.*")])]


def bisect_fp32(record: RunRecord, scratch: Path, progress: Callable[[str], None] = print) -> dict:
    """The minimal fp32 set of a low-precision run (the minimal bf16 set of an fp8 run), or why there is none; each
    trial a run from step 0."""
    run = record.run
    islands = Islands.of(run)
    if computes_in_fp32(run) and islands.high == "fp32":
        return {"minimal": None, "summary": "not bisected: the run is fp32 already", "trials": []}
    trials: list[dict] = []
    cache: dict[tuple[str, ...], bool] = {}

    def stable(names: list[str], overrides: list[str] | None = None) -> bool:
        key = tuple(sorted(names)) if overrides is None else ("<" + " ".join(overrides) + ">",)
        if key in cache:
            return cache[key]
        if len(trials) >= MAX_TRIALS:
            raise TimeoutError
        o = overrides if overrides is not None else islands.overrides(names)
        last = from_start_last(record)  # from step 0: at most FROM_START_HORIZON x the steps the run took to fail
        outcome = run_trial(with_overrides(record.config, o), scratch / f"trial_{len(trials) + 1:02d}", last=last)
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
    # the module names only: the weights alone, none loaded, no data read and nothing said again
    model, _, _ = build_weights(run, cpu, PrecisionPolicy.from_config(run.precision, cpu), init_from=None, warn=False)
    top = groups(model)
    try:
        if not stable([], islands.everything):
            return {
                "minimal": None,
                "trials": trials,
                "summary": f"not bisected: the run diverges with {' '.join(islands.everything)} too, so no set of "
                f"{islands.high} modules can fix it",
            }
        if not stable(top):
            return {
                "minimal": None,
                "trials": trials,
                "groups": top,
                "summary": f"not bisected: with every module group in {islands.high} it still diverges (what stays "
                "in low precision is outside the modules: inputs, loss, optimizer state)",
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
        "high": islands.high,
        "fix": islands.overrides(minimal),
        "summary": f"{len(minimal)} module(s) in {islands.high} keep the run stable: {', '.join(minimal)} "
        f"({share:.1%} of the forward FLOPs; {len(trials)} runs)",
    }
