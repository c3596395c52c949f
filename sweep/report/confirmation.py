"""The confirmation at a longer horizon (confirmation.json, written by sweep/confirm/) as the report reads it.

A sweep's frontier and recommendation rest on N-step runs; the confirmation reran the recommended setting and
each combination's largest stable lr (and, where one failed, the next lower stable lr) at `confirm.steps`, every
seed. Here that record changes three things, and only where it says something:
- the frontier records (`confirm_records`, applied once in registry.TableInputs.records): an lr that failed at the
  longer horizon is no longer stable; `max_stable_lr` is the largest grid-stable lr below every lr that failed,
  `min_diverging_lr` the smallest lr that diverged in the grid or failed at the horizon, and the eval loss, best
  lr and ties are taken over the lrs that are still stable (`by_lr`, the grid's own stability, is left as the
  grid measured it: the toggle table compares the axes at the grid's horizon);
- the frontier table gets a `held` column (`with_held`): what the confirmation says of `max_stable_lr`
  ("2/2 at 120 steps", "not checked", "-" with no confirmation of that combination), and the larger lr that
  failed, with its verdict, step and seed;
- the recommendation (`confirmed_candidates` and `pick_note`, called by recommend.recommend): where the grid's pick
  failed, it steps down to the next lr of that combination that held, and says why; its line says whether the
  setting it names held.
A missing confirmation.json changes nothing; a damaged one is one warning line (`read_confirmation`), and the
report goes on unconfirmed. The sweep's study holds a copy (user attr CONFIRMATION_ATTR, written with its answer:
sweep/search/answer.py), so a report from the ledger alone (a PostgreSQL URL) is confirmed as the directory's is.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from sweep.report.runs import DIAGNOSIS_FILE, read_diagnosis
from sweep.report.tables import FAILED, refresh_frontier

CONFIRMATION_FILE = "confirmation.json"
FORMAT = "dit-sweep-confirmation/1"
RECOMMENDED, LARGEST, STEP_DOWN = "recommended", "largest_stable_lr", "step_down"
"""Why a setting was confirmed (its `why` list)."""


@dataclass
class Confirmation:
    """confirmation.json, read: its settings by (combination, lr)."""

    path: Path
    settings: list[dict]
    left_out: list[dict] = field(default_factory=list)
    command: str | None = None
    complete: bool = True

    def of(self, combination: str, lr) -> dict | None:
        """The confirmed setting of this combination at this lr (lr None: a sweep with no lr axis), or None."""
        for s in self.settings:
            if s["combination"] == combination and same_lr_value(s.get("lr"), lr):
                return s
        return None

    def held(self, combination: str, lr) -> bool | None:
        s = self.of(combination, lr)
        return None if s is None else s.get("held")

    @property
    def recommended(self) -> dict | None:
        """The setting the grid recommended (confirmed whatever its cost)."""
        return next((s for s in self.settings if RECOMMENDED in s.get("why", [])), None)


def same_lr_value(a, b) -> bool:
    """Two lrs alike within rounding; no lr (None, or NaN: a sweep with no lr axis) only like no lr."""
    missing = [v is None or (isinstance(v, float) and math.isnan(v)) for v in (a, b)]
    if any(missing):
        return all(missing)
    return math.isclose(float(a), float(b), rel_tol=1e-9)


CONFIRMATION_ATTR = "confirmation"
"""The study's copy of it: {"sweep_dir": the sweep's directory, "record": confirmation.json's content}, or None."""


def read_confirmation(sweep_dir: Path) -> tuple[Confirmation | None, str | None]:
    """(the sweep's confirmation, None), (None, None) when it has none, or (None, one line saying why the file
    cannot be used) when confirmation.json is damaged."""
    path = Path(sweep_dir) / CONFIRMATION_FILE
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"{path}: unreadable ({type(e).__name__}); the frontier and the recommendation are unconfirmed"
    return confirmation_of(data, path, str(path))


def study_confirmation(attr, study: str) -> tuple[Confirmation | None, str | None]:
    """read_confirmation for the copy a study holds (its CONFIRMATION_ATTR user attr; None: it has none)."""
    if attr is None:
        return None, None
    if not isinstance(attr, dict) or not isinstance(attr.get("sweep_dir"), str):
        return (
            None,
            f"study {study}: its {CONFIRMATION_ATTR} attr is malformed; the frontier and the recommendation "
            "are unconfirmed",
        )
    return confirmation_of(attr.get("record"), Path(attr["sweep_dir"]) / CONFIRMATION_FILE, f"study {study}")


def confirmation_of(data, path: Path, where: str) -> tuple[Confirmation | None, str | None]:
    """A confirmation record's content read (`path`: the file it is or was; `where`: what the problem line names)."""
    problem = _shape_problem(data)
    if problem:
        return None, f"{where}: {problem}; the frontier and the recommendation are unconfirmed"
    _add_diagnoses(data["settings"], path.parent)
    return (
        Confirmation(
            path, data["settings"], data.get("left_out") or [], data.get("command"), bool(data.get("complete", True))
        ),
        None,
    )


def _add_diagnoses(settings: list[dict], sweep_dir: Path) -> None:
    """Each seed that failed gets `diagnosis` ({mechanism, fix, confirmed, through, file}) where its run dir holds a
    diagnosis.json (monitor.diagnose=auto after the confirmation, or `python -m sweep.diagnose` on the seed's run:
    sweep/diagnose/multirun.py); one that cannot be read is left out, as the grid's are (sweep/report/runs.py)."""
    for s in settings:
        for x in s.get("seeds") or []:
            if not isinstance(x, dict) or x.get("status") != "diverged" or not isinstance(x.get("record"), str):
                continue
            run_dir = (sweep_dir / x["record"]).parent
            d, _ = read_diagnosis(run_dir) if run_dir.is_dir() else (None, None)
            if d is not None and d.get("mechanism"):
                fix = d.get("fix") or {}
                x["diagnosis"] = {
                    "mechanism": d["mechanism"],
                    "fix": list(fix.get("overrides") or []),
                    "confirmed": fix.get("confirmed") is True,
                    "through": fix.get("through_step") if isinstance(fix.get("through_step"), int) else None,
                    "file": str(Path(x["record"]).parent / DIAGNOSIS_FILE),
                }


def _shape_problem(data) -> str | None:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return f"not a {FORMAT} record"
    if not isinstance(data.get("settings"), list) or not all(isinstance(s, dict) for s in data["settings"]):
        return "settings is not a list of objects"
    for s in data["settings"]:
        if not isinstance(s.get("combination"), str) or not isinstance(s.get("why", []), list):
            return "a setting has no combination"
        if s.get("held") not in (True, False, None) or not isinstance(s.get("seeds", []), list):
            return f"setting {s['combination']}: held or seeds malformed"
        if s.get("lr") is not None and not isinstance(s["lr"], (int, float)):
            return f"setting {s['combination']}: lr is not a number"
        if not isinstance(s.get("steps"), int):
            return f"setting {s['combination']}: steps is not an integer"
    return None


# --- the frontier ------------------------------------------------------------------------------


def failure(s: dict) -> str:
    """How a setting failed: "loss_spike@74 (seed 1)" (its first failing seed), "loss_spike@74 (seed 1:
    lr_too_high)" once that seed is diagnosed."""
    bad = _failed_seed(s)
    if bad is None:
        return "failed"
    why = f": {bad['diagnosis']['mechanism']}" if bad.get("diagnosis") else ""
    return f"{bad.get('verdict')}@{bad.get('first_bad_step')} (seed {bad.get('seed')}{why})"


def _failed_seed(s: dict) -> dict | None:
    return next((x for x in s.get("seeds", []) if x.get("status") == "diverged"), None)


def diagnosis_lines(conf: Confirmation | None) -> list[str]:
    """One sentence per failed setting whose failing seed was diagnosed: its mechanism and the fix the diagnosis
    ran from step 0 at the longer horizon, citing the seed's diagnosis.json."""
    lines = []
    for s in conf.settings if conf is not None else []:
        d = (_failed_seed(s) or {}).get("diagnosis") if s.get("held") is False else None
        if d is None:
            continue
        fix = " ".join(d["fix"]) or "-"
        through = f" through step {d['through']}" if d["through"] is not None else ""
        how = f"confirmed: stable from step 0{through}" if d["confirmed"] else "not confirmed"
        lines.append(
            f"Why {s['combination']} lr {_lr(s.get('lr'))} failed at {s['steps']} steps: {d['mechanism']}; fix {fix}"
            f" ({how}) [{d['file']}]"
        )
    return lines


def held_text(s: dict) -> str:
    """ "2/2 at 120 steps" for a setting that held; else how far it got."""
    seeds = s.get("seeds", [])
    if s.get("held") is True:
        return f"{len(seeds)}/{len(seeds)} at {s['steps']} steps"
    if s.get("held") is False:
        return f"failed: {failure(s)}"
    return "not finished" + (f": {s['note']}" if s.get("note") else "")


def confirm_records(recs: pd.DataFrame, conf: Confirmation | None) -> pd.DataFrame:
    """The frontier records (tables.frontier_records) with what the confirmation says (module docstring), plus
    a `held` column; unchanged (no `held`) without a confirmation."""
    if conf is None or recs.empty:
        return recs
    out = [_confirm_record(rec, conf) for rec in recs.to_dict("records")]
    confirmed = pd.DataFrame(out)
    confirmed.attrs.update(recs.attrs)
    return confirmed


def _confirm_record(rec: dict, conf: Confirmation) -> dict:
    """One combination's record with the lrs that failed at the longer horizon, and the stable lrs above the
    smallest of them, no longer `stable` in its `by_lr` (tables.refresh_frontier recomputes every column from it;
    a failure counts as diverging there), and its `held` text."""
    c = rec["combination"]
    failed = sorted(lr for lr in rec["stable_lrs"] if conf.held(c, lr) is False)
    by_lr, spreads = dict(rec["by_lr"]), dict(rec["spreads"])
    if failed:
        at = conf.of(c, failed[0])["steps"]
        for lr in (x for x in rec["stable_lrs"] if x >= failed[0]):
            by_lr[lr] = (
                f"{FAILED} at {conf.of(c, lr)['steps']} steps"
                if lr in failed
                else f"above lr {failed[0]:.4g}, which {FAILED} at {at} steps"
            )
            spreads.pop(lr, None)
    out = refresh_frontier(rec | {"by_lr": by_lr, "spreads": spreads})
    top = out["max_stable_lr"]
    checked = conf.of(c, top) if top is not None else None
    held = held_text(checked) if checked is not None else ("not checked" if failed else "-")
    if failed:
        above = conf.of(c, failed[0])
        at = f" at {above['steps']} steps" if checked is None or checked["steps"] != above["steps"] else ""
        held += f"; {failed[0]:.4g} failed{at}: {failure(above)}"
    return out | {"held": held}


def with_held(table: pd.DataFrame, recs: pd.DataFrame, conf: Confirmation | None) -> pd.DataFrame:
    """The frontier table with the confirmation's `held` column after `min_diverging_lr`, when there is one, and
    the sentences to print under it in `attrs["confirmation"]`."""
    if table.empty or "held" not in recs:
        return table
    table = table.copy()
    at = list(table.columns).index("min_diverging_lr") + 1 if "min_diverging_lr" in table else len(table.columns)
    table.insert(at, "held", recs.set_index("combination").loc[table.index, "held"].to_numpy())
    table.attrs["confirmation"] = frontier_lines(table, conf)
    return table


def frontier_lines(table: pd.DataFrame, conf: Confirmation | None) -> list[str]:
    """The sentences under the frontier: at which horizon `held` was checked, and what the budget left out."""
    if conf is None or "held" not in table:
        return []
    steps = sorted({s["steps"] for s in conf.settings})
    lines = [
        f"held: rerun at {'/'.join(map(str, steps)) or '-'} steps, every seed ({CONFIRMATION_FILE}); max_stable_lr is "
        "the largest lr stable in the grid below every lr that failed there"
        + ("" if conf.complete else "; the confirmation was stopped before it finished")
    ]
    if conf.left_out:
        names = ", ".join(f"{s['combination']} lr {_lr(s.get('lr'))}" for s in conf.left_out[:4])
        more = f" and {len(conf.left_out) - 4} more" if len(conf.left_out) > 4 else ""
        lines.append(f"Not confirmed (the budget left them out): {names}{more}: {conf.command}")
    return lines + diagnosis_lines(conf)


def _lr(lr) -> str:
    return "-" if lr is None else f"{lr:.4g}"


# --- the recommendation ------------------------------------------------------------------------


def confirmed_candidates(cands: pd.DataFrame, conf: Confirmation | None) -> tuple[pd.DataFrame, str]:
    """The recommendation's candidates (recommend._candidates, already without the lrs that failed: they are not
    in the confirmed records) and a sentence for its line. Where the grid's pick failed, only the next lr of its
    combination that held remains (the step down), or else the settings that held; with none, the sentence is the
    whole line."""
    if conf is None or cands.empty or conf.recommended is None or conf.recommended.get("held") is not False:
        return cands, ""
    pick = conf.recommended
    c, lr, steps = pick["combination"], pick.get("lr"), pick["steps"]
    held = cands[[conf.held(combo, x) is True for combo, x in zip(cands.combination, cands["optim.lr"])]]
    below = held[(held.combination == c) & (held["optim.lr"] < (lr if lr is not None else -np.inf))]
    said = f"the grid's pick, {c} at lr {_lr(lr)}, failed at {steps} steps: {failure(pick)}"
    if len(below):
        step = below.loc[[below["optim.lr"].idxmax()]]
        return step, f" The {said[4:]}; stepped down to the next lr of {c} that held."
    if held.empty:
        return held, f"No setting held at {steps} steps: nothing to recommend ({said}; see the frontier's held)."
    return held, f" The {said[4:]}, and no lower lr of {c} held: the best setting that held instead."


def pick_note(combination: str, lr, conf: Confirmation | None) -> str:
    """Whether the recommended setting held at the longer horizon, for the end of the recommendation's line."""
    if conf is None:
        return ""
    s = conf.of(combination, lr)
    where = conf.path.parent
    if s is None or s.get("held") is None:
        return f" Not confirmed at a longer horizon: python -m sweep.confirm {where}."
    return f" Held {held_text(s)} [{CONFIRMATION_FILE}]." if s["held"] else ""
