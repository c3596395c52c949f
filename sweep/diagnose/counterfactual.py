"""Counterfactual replay: the run exactly to its last healthy step, then its bad steps with one change at a time.

    python -m sweep.diagnose RUN_DIR          # runs these, then the fix (sweep/diagnose/__main__.py)

Runs are bit-reproducible, so the replay to the last healthy step reaches the state the run had there
(its losses are compared with metrics.csv, bit for bit), and a checkpoint of that state (weights,
AdamW, loss scaler, monitor, RNG: sweep/run/checkpoint.py) is the start of every row. The last healthy
step is where the trouble began, not the step that tripped the verdict: a step's loss comes from the
weights the step before it made, so a change must reach the updates that led there (`healthy_until`):

- a loss spike: the step where the smoothed loss was at its lowest before the spike (the climb starts after);
- a scale collapse: the first of the overflowing (skipped) steps in a row that ended in the collapse;
- a stall: the start of the stall window (its updates were the ones lost);
- an end-of-run verdict (slow_divergence, no_progress: sweep/run/trend.py): the run's start, since only the whole
  curve decides it: every row trains the whole run again, and is healthy when no verdict, the end-of-run check
  included, comes by its last step;
- anything else (a NaN): the step before the first bad one (its update made the weights the bad step used).

The rows:

- same config: the bad steps again, unchanged (reproducible or not);
- fp32: precision=fp32 for those steps;
- reference kernels: attention=math, modulate=eager;
- without extreme samples: the rows' batches without their bad samples (non-finite, out of range,
  constant: the data doctor's check; a second bad sample a few steps on counts too) or outliers (largest
  |x| OUTLIER x the dataset's median), through data.skip_samples; not applicable when no sample stands
  out (leaving out an ordinary sample only perturbs a chaotic trajectory, which can move a spike past the
  table's last step);
- lr/10: the lr schedule divided by 10 from the last healthy step on;
- update clipping: StableAdamW's update clipping (optim.update_clip=1), for our AdamW;
- AdamW in fp32 state: our AdamW from the last healthy state (`adamw_row`): an 8-bit AdamW's moments dequantised;
- bf16 matmuls, underflowing layers in bf16: an fp8 run without fp8, and with the layers whose fp8 operands
  underflowed kept in bf16 (`fp8_rows`, fp8 runs only);
- bf16 storage (only for a run whose frozen base is stored in fp8, finetune.base_dtype=fp8_*): the base stored in
  bf16 instead, **from the run's start** (model.init_from's weights): the state at the last healthy step holds the
  base's fp8 bytes, whose error no later change of storage undoes. Not applicable when the run itself resumed a
  checkpoint (there is no unquantised copy of its base to start from).

Each row runs from the last healthy step through the step that tripped the verdict and `past` steps more:
healthy when no verdict comes by then.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from sweep.config import BaseDtype, OptimName, RunConfig, Verdict
from sweep.config.enums import lr_meaning
from sweep.data.checks import check_sample
from sweep.diagnose.bisect import glob_list
from sweep.diagnose.record import RunRecord, read_metrics
from sweep.diagnose.signals import computes_in_fp32
from sweep.diagnose.trials import Outcome, run_trial, with_overrides
from sweep.run.build import build_parts
from sweep.run.precision import PrecisionPolicy
from sweep.run.trend import END_OF_RUN

PAST = 10
"""Steps run past the one that tripped the verdict: a change that only delays the failure shows as such."""

OUTLIER = 4.0
"""A clean sample is extreme when its largest |x| is this many times the dataset's median one."""

ROWS = (
    "same config",
    "fp32",
    "reference kernels",
    "without extreme samples",
    "lr/10",
    "update clipping",
    "AdamW in fp32 state",
)
"""The rows every run's table has (a row that does not apply says why)."""
FP8_ROWS = ("bf16 matmuls", "underflowing layers in bf16")
"""The rows an fp8 run adds (precision.fp8, `fp8_rows`)."""
FP8_BASE_ROW = "bf16 storage"
"""The row a run with an fp8-stored base adds (after ROWS, which every run has)."""


@dataclass
class Row:
    name: str
    overrides: list[str]
    outcome: dict | None = None
    """Outcome as a dict (None when the row does not apply)."""
    not_applicable: str | None = None
    cleared: bool | None = None
    """The row got past the run's bad steps: no verdict through them, and none of the run's kind after them
    (a spike only moved later is not cleared; a stall found later is another problem, and is shown)."""

    @property
    def healthy(self) -> bool | None:
        return None if self.outcome is None else self.outcome["status"] == "stable"


@dataclass
class Table:
    """The counterfactual table of one run."""

    from_step: int
    """The state after the last healthy step's update: every row starts here."""
    through_step: int
    last_bad: int
    """The step that tripped the run's verdict: a row clears the bad steps when it gets past it (Row.cleared)."""
    rows: list[Row] = field(default_factory=list)
    prefix: dict = field(default_factory=dict)
    """How the replay to from_step compared with the run's metrics.csv."""

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    def to_dict(self) -> dict:
        return {
            "from_step": self.from_step,
            "through_step": self.through_step,
            "prefix": self.prefix,
            "rows": [asdict(r) | {"healthy": r.healthy} for r in self.rows],
            "last_bad_step": self.last_bad,
        }


def plan(record: RunRecord, extreme: list[int]) -> list[Row]:
    """The rows for this run; a row whose change is already the run's config says so instead of running."""
    run = record.run
    rows = [Row("same config", [])]
    if computes_in_fp32(run):
        rows.append(Row("fp32", [], not_applicable=f"the run is already fp32 ({run.precision.name})"))
    else:
        rows.append(Row("fp32", ["precision=fp32"]))
    kernels = []
    if run.attention.backend.value != "math":
        kernels.append("attention=math")
    if run.modulate.impl.value != "eager":
        kernels.append("modulate=eager")
    rows.append(
        Row("reference kernels", kernels)
        if kernels
        else Row("reference kernels", [], not_applicable="the run already uses math attention and eager modulate")
    )
    rows.append(
        Row("without extreme samples", [f"data.skip_samples={sorted(set(run.data.skip_samples) | set(extreme))}"])
        if extreme
        else Row(
            "without extreme samples",
            [],
            not_applicable=f"no sample of the bad steps stands out (bad values, or {OUTLIER:g}x the median |x|)",
        )
    )
    lr = [f"optim.lr={_tenth(run.optim.lr)!r}"]  # 0.055, not 0.05500000000000001
    if run.optim.lora_lr is not None:
        lr.append(f"optim.lora_lr={_tenth(run.optim.lora_lr)!r}")
    rows.append(Row("lr/10", lr))
    if getattr(run.optim, "update_clip", None) is None:
        rows.append(Row("update clipping", [], not_applicable="this version has no optim.update_clip"))
    elif run.optim.update_clip and run.optim.update_clip <= 1:
        rows.append(
            Row("update clipping", [], not_applicable=f"already on (optim.update_clip={run.optim.update_clip})")
        )
    elif run.optim.name is OptimName.adamw:
        rows.append(Row("update clipping", ["optim.update_clip=1.0"]))
    else:
        rows.append(Row("update clipping", [], not_applicable="StableAdamW's clipping is our AdamW's"))
    rows.append(adamw_row(run))
    rows += fp8_rows(record)
    if run.finetune.base_dtype not in (None, BaseDtype.bf16):
        rows.append(storage_row(run))
    return rows


UNDERFLOW_LIMIT = 5.0
"""An fp8 layer's operand underflow (%) above which its row keeps the layer in bf16: TE AutoswitchGemm's (its MSE
limit flags the inputs of healthy runs too: docs/fp8.md)."""


def fp8_rows(record: RunRecord) -> list[Row]:
    """An fp8 run's rows: bf16 matmuls everywhere (precision.fp8=null), and its layers whose underflow passed
    UNDERFLOW_LIMIT (result.json fp8.layers, sweep/run/fp8_evidence.py) kept in bf16 (precision.fp8_keep)."""
    run = record.run
    if run.precision.fp8 is None:
        return []
    layers = (record.result.get("fp8") or {}).get("layers") or {}
    under = sorted(
        n for n, ops in layers.items() if any((s or {}).get("underflow_pct", 0) > UNDERFLOW_LIMIT for s in ops.values())
    )
    keep = [*run.precision.fp8_keep, *under]
    return [
        Row("bf16 matmuls", ["precision.fp8=null"]),
        Row("underflowing layers in bf16", [glob_list("precision.fp8_keep", keep)])
        if under
        else Row(
            "underflowing layers in bf16", [], not_applicable=f"no fp8 operand underflowed over {UNDERFLOW_LIMIT:g}%"
        ),
    ]


def adamw_row(run: RunConfig) -> Row:
    """Our AdamW from the last healthy state: an 8-bit AdamW's moments dequantised to fp32 (sweep/run/checkpoint.py
    load_optimizer), so the row changes only where its state is held; CAME (whose lr is a step size too) with fresh
    moments. Prodigy's and Adafactor's lr mean something else: no like-for-like AdamW from their state."""
    name = run.optim.name
    if name is OptimName.adamw:
        return Row("AdamW in fp32 state", [], not_applicable="the run already uses our AdamW")
    if name is OptimName.adamw_8bit:
        return Row("AdamW in fp32 state", ["optim.name=adamw"])
    if name is OptimName.came:
        fresh = ["optim.name=adamw", "optim.eps=1e-08", "optim.betas=[0.9,0.999]", "checkpoint.resume_optimizer=false"]
        return Row("AdamW in fp32 state", fresh)
    return Row(
        "AdamW in fp32 state",
        [],
        not_applicable=f"optim={name.value}'s lr {lr_meaning(name.value)}: no like-for-like AdamW from its state",
    )


def storage_row(run: RunConfig) -> Row:
    """bf16 storage of the frozen base, from the run's start (the later overrides win over the replay's resume)."""
    if run.checkpoint.resume_from:
        return Row(
            FP8_BASE_ROW,
            [],
            not_applicable="the run resumed a checkpoint of its fp8 base: no unquantised copy of it to start from",
        )
    return Row(FP8_BASE_ROW, ["finetune.base_dtype=bf16", "checkpoint.resume_from=null"])


def _tenth(x: float) -> float:
    """x / 10 with 6 significant digits, as a command line writes it."""
    return float(f"{x / 10:.6g}")


def extreme_samples(run: RunConfig, steps: range) -> tuple[list[int], list[int]]:
    """(the bad steps' extreme samples, every bad sample of the dataset): bad ones (non-finite, out of range,
    constant: the data doctor's check) and outliers (largest |x| >= OUTLIER x the dataset's median)."""
    parts = build_parts(run, torch.device("cpu"), PrecisionPolicy.from_config(run.precision, torch.device("cpu")))
    dataset, order, limit = parts.dataset, parts.order, run.data.range_limit
    amax = [_amax(dataset[i]) for i in range(len(dataset))]
    bad_everywhere = [i for i in range(len(dataset)) if check_sample(dataset[i], limit)[0]]
    median = sorted(amax)[len(amax) // 2]
    extreme = set(bad_everywhere) | {i for i, a in enumerate(amax) if a >= OUTLIER * median}
    drawn = {i for step in steps for i in order.indices(step)}
    return sorted(drawn & extreme), bad_everywhere


def _amax(x: torch.Tensor) -> float:
    x = x.float()
    return math.inf if not bool(torch.isfinite(x).all()) else float(x.abs().max())


def healthy_until(record: RunRecord) -> int:
    """The first step the counterfactual rows run (the state after the step before it is the last healthy one)."""
    run, first, start = record.run, record.first_bad, record.start
    verdict = record.result["verdict"]
    before = [r for r in record.rows if r["step"] < first]
    if verdict == Verdict.loss_spike and before:
        ema, low, at = None, math.inf, start
        for r in before:
            if math.isfinite(r["loss"]):
                ema = r["loss"] if ema is None else run.monitor.ema_beta * ema + (1 - run.monitor.ema_beta) * r["loss"]
                if ema <= low:
                    low, at = ema, int(r["step"])
        return max(start, at)
    if verdict == Verdict.scale_collapse:
        at = first
        for r in reversed(before):
            if r.get("skipped") != 1:
                break
            at = int(r["step"])
        return max(start, at)
    if verdict == Verdict.stalled:
        return max(start, first + 1 - run.monitor.stall_window)
    if verdict in END_OF_RUN:
        return start
    return max(start, first - 1)


def replay_prefix(record: RunRecord, first: int, scratch: Path) -> tuple[Path | None, dict]:
    """Replay the run to step `first` and checkpoint the state there: (the checkpoint, or None when `first` is
    the run's first step; how the replayed losses compare with metrics.csv)."""
    start = record.start
    if first <= start:
        return None, {"steps": 0, "identical": True, "detail": "the rows start at the run's first step: no replay"}
    run = with_overrides(record.config, [f"checkpoint.every={first}", "checkpoint.keep=0"])
    outcome = run_trial(run, scratch, last=first - 1)
    want = {int(r["step"]): r["loss"] for r in record.rows if r["step"] < first}
    got = {int(r["step"]): r["loss"] for r in read_metrics(scratch / "metrics.csv")}
    differ = [s for s in sorted(want) if not _same(want[s], got.get(s, math.nan))]
    prefix = {
        "steps": len(want),
        "identical": not differ and outcome.healthy,
        "seconds": outcome.seconds,
        "detail": (
            f"steps {start}-{first - 1} replayed, every loss bit for bit the run's"
            if not differ and outcome.healthy
            else f"the replay differs from the run: {outcome.short() if not outcome.healthy else ''}"
            f"{f' first at step {differ[0]} ({want[differ[0]]!r} vs {got.get(differ[0])!r})' if differ else ''}"
        ),
    }
    pack = int(record.result.get("packed") or 0)
    if pack > 1:  # a pack's vmapped batch reduces in another order: its run is replayed alone, never bit for bit
        worst = max((_relative(want[s], got.get(s, math.nan)) for s in want), default=0.0)
        prefix["matches"] = outcome.healthy and worst <= PACKED_RTOL
        prefix["detail"] = (
            f"a run of a pack of {pack}, replayed alone (a pack is not bit for bit a lone run: docs/packing.md): "
            f"steps {start}-{first - 1}, losses within a relative {worst:.1e} of the pack's"
            + ("" if prefix["matches"] else f", beyond {PACKED_RTOL:g}")
            + ("" if outcome.healthy else f"; the replay {outcome.short()}")
        )
    checkpoint = scratch / "checkpoints" / f"step_{first:06d}"
    return (checkpoint if checkpoint.is_dir() else None), prefix


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


PACKED_RTOL = 1e-2
"""How close a packed run's losses and its lone replay's must be for the replay to count as the same run: the
tolerance packing keeps in low precision inside the stable region (docs/packing.md; fp32 keeps 1e-4)."""


def _relative(a: float, b: float) -> float:
    if _same(a, b):
        return 0.0
    return abs(a - b) / max(abs(a), abs(b)) if math.isfinite(a) and math.isfinite(b) else math.inf


def run_table(
    record: RunRecord, scratch: Path, past: int = PAST, progress: Callable[[str], None] = print
) -> tuple[Table, list[int]]:
    """Replay, then every applicable row; returns the table and every bad sample of the dataset."""
    first, last = healthy_until(record), record.last_step
    through = min(last + past, record.run.steps - 1)
    if first > record.start:
        progress(f"replaying steps {record.start}-{first - 1} to the last healthy state")
    checkpoint, prefix = replay_prefix(record, first, scratch / "replay")
    extreme, bad_everywhere = extreme_samples(record.run, range(first, through + 1))  # every step the rows run
    table = Table(first, through, last, plan(record, extreme), prefix)
    resume = (
        [f"checkpoint.resume_from={checkpoint}", "checkpoint.inject=null", "checkpoint.resume_optimizer=true"]
        if checkpoint is not None
        else []
    )
    todo = [r for r in table.rows if r.not_applicable is None]
    # An end-of-run verdict compares eval losses (sweep/run/trend.py): its rows evaluate as the run did.
    whole = record.result["verdict"] in END_OF_RUN
    for i, row in enumerate(todo, 1):
        run = with_overrides(record.config, resume + row.overrides)
        outcome = run_trial(run, scratch / _slug(row.name), last=through, quick=not whole)
        row.outcome = asdict(outcome)
        row.cleared = outcome.healthy or (
            outcome.status == "diverged"
            and outcome.verdict != record.result["verdict"]
            and (outcome.first_bad_step or 0) > last
        )
        progress(f"[{i}/{len(todo)}] {row.name}: {outcome.short()} ({outcome.seconds:.1f} s)")
    return table, bad_everywhere


def _slug(name: str) -> str:
    return "cf_" + "".join(c if c.isalnum() else "_" for c in name).strip("_")


def reproduced(record: RunRecord, table: Table) -> bool:
    """Whether the same config again gave the run's verdict at its first bad step, after a bit-identical replay
    (a packed run's: its verdict, after a replay within PACKED_RTOL; alone its chaos may move the step)."""
    row = table.row("same config")
    o = row.outcome or {}
    same = o.get("status") == "diverged" and o.get("verdict") == record.result["verdict"]
    if table.prefix.get("matches"):
        return same
    return same and o.get("first_bad_step") == record.first_bad and table.prefix.get("identical", False)


__all__ = ["ROWS", "PAST", "Table", "Row", "run_table", "reproduced", "Outcome"]
