"""One diagnosis, end to end: mechanism, counterfactual table, agreement, bisection, fix; diagnosis.json."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable

from sweep.config import Verdict
from sweep.diagnose.counterfactual import PAST, ROWS, Row, Table, reproduced, run_table
from sweep.diagnose.fix import candidates, confirm, lr_delayed_it, reference_kernel
from sweep.diagnose.known import KNOWN
from sweep.diagnose.mechanism import Mechanism, decide
from sweep.diagnose.record import DiagnoseError, RunRecord, load, sweep_dir_of, write_mechanism
from sweep.run.results import recorded_mechanism, unwritable

log = logging.getLogger("sweep")

DIAGNOSIS_FILE = "diagnosis.json"
SCRATCH = "diagnosis"
"""The folder in the run dir that holds the diagnosis's own runs (replay, counterfactuals, bisection, fix)."""

CONFIRMING = {
    "bad_input": ("without extreme samples",),
    "kernel": ("reference kernels",),
    "activation_overflow": ("fp32",),
    "update_underflow": ("fp32",),
    "gradient_underflow": ("fp32",),
    "loss_scale_collapse": ("fp32",),
    "attention_logit_growth": ("lr/10", "update clipping"),
    "adam_second_moment_lag": ("update clipping", "lr/10"),
    "lr_too_high": ("lr/10",),
}
"""Rows of the counterfactual table that get past the bad steps when the mechanism is right (Row.cleared)."""


def settle(record: RunRecord, mechanism: Mechanism, table: Table) -> tuple[Mechanism, bool, str]:
    """The mechanism in the light of the table: (mechanism, whether the table agrees, a sentence why)."""
    if not reproduced(record, table):
        same = table.row("same config").outcome or {}
        got = (
            f"{same.get('verdict')}@{same.get('first_bad_step')}"
            if same.get("status") == "diverged"
            else same.get("status")
        )
        m = Mechanism(
            "nondeterministic",
            f"an identical replay did not reproduce the run ({record.result['verdict']}@{record.first_bad}): "
            f"{table.prefix.get('detail')}; the same config again gave {got}",
            {"prefix": table.prefix, "same_config": same, "was": mechanism.name},
        )
        return m, True, "the same config did not reproduce the run"
    if mechanism.name == "unexplained" and table.row("lr/10").cleared:
        mechanism = Mechanism(
            "lr_too_high",
            f"no specific signal, and lr/10 from step {table.from_step} gets past the bad steps",
            mechanism.evidence,
        )
    healthy = [r.name for r in table.rows if r.cleared and r.name != "same config"]
    if mechanism.name == "corrupt_checkpoint":
        agrees = not healthy
        why = (
            "no change at the bad steps helps: the weights were bad before them"
            if agrees
            else (f"but {', '.join(healthy)} got past the bad steps")
        )
        return mechanism, agrees, why
    want = CONFIRMING.get(mechanism.name, ())
    hits = [n for n in want if n in healthy]
    if hits:
        return mechanism, True, f"{' and '.join(hits)} got past the bad steps, as {mechanism.name} predicts"
    if mechanism.name == "unexplained":
        return (
            mechanism,
            True,
            "no single change got past the bad steps"
            if not healthy
            else (f"{', '.join(healthy)} got past the bad steps, which no recorded signal explains"),
        )
    ran = [n for n in want if table.row(n).outcome is not None]
    eps = mechanism.name in ("update_underflow", "gradient_underflow") and "fp32" in ran
    return (
        mechanism,
        False,
        (
            f"the table does not confirm {mechanism.name}: "
            + (f"{', '.join(ran)} did not get past the bad steps" if ran else f"{', '.join(want)} could not run")
            + (f"; {', '.join(healthy)} did" if healthy else "")
            + ("; in fp32 too the updates are lost, below AdamW's eps whatever the precision" if eps else "")
        ),
    )


def step_size_proven(
    record: RunRecord, mechanism: Mechanism, table: Table, fix: dict | None
) -> tuple[Mechanism, bool, str] | None:
    """An unexplained run whose lr/10 row only moved the bad steps later, and whose fix run at a lower lr alone
    trained stable from step 0: the step size, shown by real runs (lr_too_high). None otherwise."""
    if mechanism.name != "unexplained" or not (fix and fix["confirmed"]) or not lr_delayed_it(record, table):
        return None
    if [o.split("=")[0] for o in fix["overrides"]] != ["optim.lr"]:
        return None
    later = table.row("lr/10").outcome["first_bad_step"]
    lr = fix["overrides"][0].split("=")[1]
    m = Mechanism(
        "lr_too_high",
        f"no specific signal; lr/10 from step {table.from_step} only moved the bad steps ({record.first_bad} -> "
        f"{later}), and lr {lr} trained stable from step 0",
        mechanism.evidence | {"lr/10 first bad step": later, "stable lr": float(lr)},
    )
    return m, True, f"lr/10 delayed the bad steps to {later} and lr {lr} is stable from step 0: the step size"


def kernel_proven(
    record: RunRecord, mechanism: Mechanism, agrees: bool, fix: dict | None
) -> tuple[Mechanism, bool, str] | None:
    """A `kernel` run whose reference-kernels row did not get past the bad steps, but whose reference kernel
    alone trained stable from step 0: the two runs differ in the kernel only, so the kernel made it, and its
    error was in the weights before the bad steps (OpenDiT's modulate: a backward that moves the adaLN weights
    where its forward cannot see, for hundreds of steps). None otherwise."""
    if mechanism.name != "kernel" or agrees or not (fix and fix["confirmed"]):
        return None
    if fix["overrides"] != reference_kernel(mechanism.evidence):
        return None
    change = " ".join(fix["overrides"])
    m = Mechanism(
        mechanism.name,
        f"{mechanism.summary}; with {change} alone the run trained stable from step 0",
        mechanism.evidence | {"stable from step 0 with": change},
    )
    return (
        m,
        True,
        f"the reference kernels from the last healthy state did not get past the bad steps, but {change} alone "
        f"trained stable from step 0 where the run diverged at {record.first_bad}: the kernel's error had built up "
        "in the weights before the bad steps",
    )


def diagnose(
    run_dir: Path,
    bisect: bool = False,
    past: int = PAST,
    fix: bool = True,
    progress: Callable[[str], None] = print,
    out: Path | None = None,
) -> dict:
    """Diagnose the diverged run in `run_dir` and write diagnosis.json there (or into `out`, with the diagnosis's
    own runs, `diagnosis/`); returns what it holds. A directory it cannot write is one line (DiagnoseError) before
    anything runs: before, a read-only run dir let every trial fail to write its record, then a traceback."""
    start = time.perf_counter()
    record = load(run_dir)
    out = Path(run_dir) if out is None else Path(out)
    problem = unwritable(out)
    if problem is not None:
        given = "" if out == Path(run_dir) else " (--out)"
        raise DiagnoseError(
            f"{out}{given} is not writable ({problem}): a diagnosis writes {DIAGNOSIS_FILE} and its runs ({SCRATCH}/) "
            "there; give --out DIR, a directory you can write"
        )
    if out.resolve() != Path(run_dir).resolve() and (out / "result.json").is_file():
        # the report reads a run dir's diagnosis.json as that run's own (sweep/report/runs.py read_diagnosis)
        raise DiagnoseError(
            f"{out} (--out) is another run's directory (it holds result.json): its {DIAGNOSIS_FILE} would be read as"
            " that run's diagnosis; give --out DIR, a directory of no run"
        )
    scratch = out / SCRATCH
    mechanism = decide(record)
    progress(f"mechanism from the recorded signals: {mechanism.name}")
    if record.result["verdict"] == Verdict.corrupt_checkpoint:  # refused at the load: nothing trained, nothing to run
        table, agrees, why = refused_at_load(record)
        bisect = fix = False
        bad: list[int] = []
    else:
        table, bad = run_table(record, scratch, past, progress)
        mechanism, agrees, why = settle(record, mechanism, table)
    bisection = None
    if bisect:
        from sweep.diagnose.bisect import bisect_fp32

        bisection = bisect_fp32(record, scratch / "bisect", progress)
    fp32_set = (bisection or {}).get("minimal") if (bisection or {}).get("high", "fp32") == "fp32" else None
    tries = candidates(record, mechanism.name, mechanism.evidence, table, bad, fp32_set)
    if (bisection or {}).get("high") == "bf16" and bisection.get("minimal"):  # an fp8 run: modules out of fp8
        tries.insert(0, bisection["fix"])
    confirmed = confirm(record, tries, scratch, progress) if fix and tries else None
    if (settled := step_size_proven(record, mechanism, table, confirmed)) is not None:
        mechanism, agrees, why = settled
    if (settled := kernel_proven(record, mechanism, agrees, confirmed)) is not None:
        mechanism, agrees, why = settled
    written = {
        "format": "dit-sweep-diagnosis/1",
        "run_dir": str(run_dir),
        "verdict": record.result["verdict"],
        "first_bad_step": record.first_bad,
        "mechanism": mechanism.name,
        "summary": mechanism.summary,
        "evidence": mechanism.evidence,
        "agrees": agrees,
        "agreement": why,
        "counterfactuals": table.to_dict(),
        "bisection": bisection,
        "fix": confirmed
        or {
            "overrides": tries[0] if tries else [],
            "confirmed": False,
            "run_dir": None,
            "tried": [],
            "note": "not run (--no-fix)" if tries else "no change to propose",
        },
        "known_fix": KNOWN.get(mechanism.name) or (REFETCH if table.prefix.get("refused") else None),
        "seconds": time.perf_counter() - start,
        "run_seconds": record.result.get("seconds"),
    }
    (out / DIAGNOSIS_FILE).write_text(json.dumps(written, indent=2, default=str) + "\n")
    write_back(record, mechanism)
    return written


REFETCH = "a good copy of the file (fetch or save it again), or a resume from an earlier checkpoint"
"""The known fix of a run refused at the load of its weights (verdict corrupt_checkpoint)."""


def refused_at_load(record: RunRecord) -> tuple[Table, bool, str]:
    """The diagnosis of a run refused when its weights were loaded (verdict `corrupt_checkpoint`: a checksum
    mismatch, non-finite weights, a truncated or foreign file): (its table, agreement, why). The run stopped
    before its first step, so there is nothing to replay, and every row would load the same file and be refused
    again: no row runs, and no fix does (before, the replay loaded the file and the diagnosis died of the
    CorruptCheckpoint exception, a traceback, also in the sweep's own monitor.diagnose=auto)."""
    step = record.first_bad
    what = f"the run was refused at the load of its weights, before step {step}"  # the mechanism says why
    rows = [Row(name, [], not_applicable="every row loads the same file") for name in ROWS]
    prefix = {"steps": 0, "identical": True, "refused": True, "detail": f"nothing to replay: {what}"}
    why = f"{what}: no change at the bad steps can help; the file must be replaced"
    return Table(step, step, step, rows, prefix), True, why


def write_back(record: RunRecord, mechanism: Mechanism) -> None:
    """The diagnosed mechanism into the run's result.json (the recorded one kept beside it) and its sweep's study
    (sweep/search/answer.py `record_diagnosed`), so that every place that names the run's mechanism says the
    same. diagnosis.json is written: a failure here is a warning line, never the diagnosis's."""
    from sweep.search.answer import record_diagnosed

    recorded = recorded_mechanism(record.result)
    try:
        write_mechanism(record, mechanism.name, mechanism.summary)
    except OSError as e:
        log.warning("%s: result.json keeps its recorded mechanism (%s): %s", record.run_dir, recorded, e)
    problem = record_diagnosed(
        record.run.ledger, sweep_dir_of(record.run_dir), record.run_dir, mechanism.name, recorded
    )
    if problem:
        log.warning("%s", problem)


def _through(fix: dict) -> str:
    """through step N: where a fix run from step 0 stopped short of the run's end (FROM_START_HORIZON)."""
    return f" through step {fix['through_step']}" if fix.get("through_step") is not None else ""


def _from(step: int) -> str:
    """Where the counterfactual rows start: a run that went bad at its first step has no state "after step -1"."""
    return "from the initial weights" if step <= 0 else f"from the state after step {step - 1}"


def render(d: dict) -> str:
    """The terminal view of a diagnosis."""
    lines = [
        f"{d['run_dir']}: {d['verdict']}@{d['first_bad_step']}",
        f"mechanism: {d['mechanism']} - {d['summary']}",
        f"counterfactuals ({_from(d['counterfactuals']['from_step'])}, "
        f"through step {d['counterfactuals']['through_step']}; replay: {d['counterfactuals']['prefix'].get('detail')})",
    ]
    width = max(len(r["name"]) for r in d["counterfactuals"]["rows"])
    for r in d["counterfactuals"]["rows"]:
        if r["outcome"] is None:
            result = f"n/a ({r['not_applicable']})"
        else:
            o = r["outcome"]
            result = (
                "healthy"
                if o["status"] == "stable"
                else (f"{o['verdict']}@{o['first_bad_step']}" if o["status"] == "diverged" else f"{o['status']}")
            )
        lines.append(f"  {r['name']:<{width}}  {result:<32} {' '.join(r['overrides'])}")
    lines.append(f"agreement: {'yes' if d['agrees'] else 'NO'} - {d['agreement']}")
    b = d.get("bisection")
    if b:
        lines.append(f"bisection: {b.get('summary')}")
    f = d["fix"]
    if f.get("tried"):
        lines.append(
            f"fix: {' '.join(f['overrides'])} - "
            + (f"CONFIRMED stable from step 0{_through(f)}" if f["confirmed"] else "not confirmed")
            + f" ({'; '.join(t['outcome'] + ' with ' + ' '.join(t['overrides']) for t in f['tried'])})"
        )
    else:
        lines.append(f"fix: {f.get('note', 'none')}" + (f"; known fix: {d['known_fix']}" if d.get("known_fix") else ""))
    lines.append(f"took {d['seconds']:.1f} s (the run took {d['run_seconds'] or 0:.1f} s)")
    return "\n".join(lines)
