"""confirm.mode=auto: at the end of a multirun (after its diagnosis), rerun its answer at a longer horizon.

The settings (sweep/confirm/plan.py): the recommended one, and each combination's largest stable lr, every seed,
to `confirm.steps` (null: `confirm.factor` x the grid's steps). The recommended setting is confirmed whatever it
costs; the others while their estimated cost fits `confirm.budget` x the sweep's run time (its runs' result.json
`seconds` added up; 0 confirms the recommended setting alone); the rest are named, with the command that confirms
them. Where a setting fails, the next lower stable lr of its combination is confirmed (within the budget; always for
the recommended setting's), so the frontier says which lr held and the recommendation steps down to it.

Everything lands in <sweep>/confirmation.json (sweep/confirm/record.py), written after every seed; a resume (the
same multirun command, or `python -m sweep.confirm`) reruns none of the settings it already holds for the same grid
runs and horizon. A first Ctrl-C or SIGTERM stops the run in progress after its step and ends the confirmation:
what was confirmed is recorded, and the sweep's summary is still printed and written.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Callable

from sweep.config import ConfigError, RunConfig
from sweep.config.recorded import load_recorded
from sweep.confirm import state
from sweep.confirm.plan import Setting, grid_runs, plan, recommended, step_down
from sweep.confirm.record import previous_settings, relative, write_record
from sweep.confirm.trial import CONTINUED, FROM_ZERO, PACKED, SeedRun, packs_pay, run_seeds, seed_runs
from sweep.report.confirmation import CONFIRMATION_FILE, Confirmation
from sweep.run.interrupt import StopRequest, stopping_on_signals
from sweep.run.results import RESULT_FILE
from sweep.run.sizes import STEPS_LIMIT

log = logging.getLogger("sweep")

CONFIRM_DIR = "confirm"
"""<sweep>/confirm/<setting>/seed_<s>/: the confirmation's runs (trial.json, metrics.csv)."""


class ConfirmError(ConfigError):
    """Input a confirmation cannot take: one line for the user, exit status 2."""


def confirm_sweep(
    sweep_dir: Path,
    steps: int | None = None,
    factor: float | None = None,
    budget: float | None = None,
    progress: Callable[[str], None] = print,
    packed: bool | None = None,
    target: str | None = None,
) -> dict | None:
    """Confirm the sweep's answer at the longer horizon; returns what confirmation.json holds (None: nothing to
    confirm). `steps`, `factor`, `budget`: confirm.* (None: each grid run's own recorded confirm.*). `packed`:
    train each setting's seeds as one pack from step 0 (None: where that pays, on a GPU). `target`: the device the
    recommendation is for (report.target; None: the report's default), so the setting confirmed first is the one
    the summary recommends."""
    sweep_dir = Path(sweep_dir)
    runs = grid_runs(sweep_dir)
    settings = plan(runs, target)
    if not settings:
        progress("Nothing to confirm at a longer horizon: no setting was stable in every replicate")
        return None
    results = _results(sweep_dir)
    _, first = load_recorded(settings[0].runs[0][1])  # the sweep's confirm.* where not given
    budget = first.confirm.budget if budget is None else budget
    sweep_seconds = sum(r.get("seconds") or 0.0 for r in results.values())
    limit = budget * sweep_seconds
    horizon = _horizon(steps, factor)
    within = f"within {limit:.0f} s" if budget else "the recommended setting only"
    progress(
        f"Confirming {len(settings)} setting(s) at {horizon(first)} steps (recommended + largest stable lr "
        f"of each combination; {within}: confirm.budget={budget:g} x the sweep's run time; confirm.mode=off skips this)"
    )
    before = previous_settings(sweep_dir)
    record = {
        "steps": steps,
        "factor": factor if factor is not None else first.confirm.factor,
        "budget": budget,
        "limit_s": round(limit, 3),
        "sweep_seconds": round(sweep_seconds, 3),
        "seconds": 0.0,
        "runs": 0,
        "steps_trained": 0,
        "complete": False,
        "interrupted": None,
        "settings": [],
        "left_out": [],
        "command": None,
    }
    queue, planned, spent, started = list(settings), {s.key for s in settings}, 0.0, time.perf_counter()
    repicked: set[str] = set()
    with stopping_on_signals(when="after the current step; the sweep's summary is still written") as request:
        i = 0
        while request.signum is None:
            if i == len(queue):  # what the recommendation names now, given what held and failed, is confirmed too
                again = recommended(runs, Confirmation(sweep_dir / CONFIRMATION_FILE, record["settings"]), target)
                if again is None or again.key in repicked or any(_is(e, again) for e in record["settings"]):
                    break
                record["left_out"] = [x for x in record["left_out"] if not _is(x, again)]
                queue.append(again)
                planned.add(again.key)
                repicked.add(again.key)
            setting = queue[i]
            i += 1
            try:
                seeds = seed_runs(setting.runs, sweep_dir / CONFIRM_DIR / setting.name(), horizon)
            except ConfirmError:
                raise
            except (ConfigError, OSError) as e:  # a grid run whose config no longer composes: said, not fatal
                progress(f"{setting.label}: not confirmed: its grid run cannot be rerun ({e})")
                record["left_out"].append(_left_out(setting, 0.0) | {"note": f"cannot be rerun: {e}"})
                continue
            pack = packs_pay(seeds) if packed is None else packed and len(seeds) > 1
            prev = _reusable(before.get((setting.combination, setting.lr, seeds[0].run.steps)), seeds, sweep_dir)
            estimate = _estimate(seeds, results, pack)
            if prev is None and not setting.always and (budget == 0 or spent + estimate > limit):
                record["left_out"].append(_left_out(setting, estimate))
                continue
            entry = _entry(setting, seeds, sweep_dir)
            record["settings"].append(entry)
            if prev is not None and prev.get("held") is not None:
                entry.update(held=prev["held"], seeds=prev["seeds"], seconds=prev.get("seconds", 0.0))
                said = f"{setting.label}: {_said(entry)} (recorded before)"
            else:
                spent += _confirm(setting, seeds, prev, entry, request, pack, record, sweep_dir, progress)
                said = f"  {_said(entry)}"
            said += _why_hint(entry, sweep_dir)
            lower = step_down(setting, runs) if entry["held"] is False else None
            if lower is not None:
                if lower.key not in planned:
                    queue.insert(i, lower)
                    planned.add(lower.key)
                said += f"; stepping down to lr {lower.lr:.4g}"
            elif entry["held"] is False:
                said += f"; no lower lr of {setting.combination} was stable in the grid"
            progress(said)
        record.update(complete=request.signum is None, interrupted=request.name or None)
    if record["left_out"]:
        need = (spent + sum(x["estimate_s"] for x in record["left_out"])) / max(sweep_seconds, 1e-9)
        record["command"] = f"python -m sweep.confirm {sweep_dir} --budget {math.ceil(need * 10) / 10:g}"
    elif request.signum is not None:
        record["command"] = f"python -m sweep.confirm {sweep_dir}"
    record["seconds"] = round(sum(s.get("seconds") or 0.0 for s in record["settings"]), 3)
    write_record(sweep_dir, record)
    _finish_line(record, time.perf_counter() - started, progress, request)
    return record


def _is(entry: dict, setting: Setting) -> bool:
    """Whether a recorded (or left out) setting is `setting`."""
    return entry["combination"] == setting.combination and entry.get("lr") == setting.lr


def _results(sweep_dir: Path) -> dict[str, dict]:
    """The sweep's result.json files by run dir (resolved)."""
    out = {}
    for path in sorted(Path(sweep_dir).glob(f"*/{RESULT_FILE}")):
        try:
            out[str(path.parent.resolve())] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return out


def _horizon(steps: int | None, factor: float | None) -> Callable[[RunConfig], int]:
    """A grid run's config -> its confirmation's steps; ConfirmError when that is not beyond its own steps."""

    def of(run: RunConfig) -> int:
        s = steps if steps is not None else run.confirm.steps
        f = factor if factor is not None else run.confirm.factor
        key = "confirm.steps" if s is not None else "confirm.factor"
        s = s if s is not None else round(f * run.steps)
        if s <= run.steps:
            raise ConfirmError(f"confirm.steps: must be > the sweep's steps ({run.steps}), got {s}")
        if s > STEPS_LIMIT:  # before: every setting "not confirmed", and an empty confirmation.json over the last one
            got = f"{s:,}" if s < 10**12 else f"{s:.3g}"
            how = "" if key == "confirm.steps" else f"{f:g} x steps={run.steps} gives a horizon of "
            raise ConfirmError(
                f"{key}: {how}{got} steps, over the {STEPS_LIMIT:,} steps a run may have (each keeps a metrics row "
                "per step in memory); give a shorter one"
            )
        return int(s)

    return of


def _estimate(seeds: list[SeedRun], results: dict[str, dict], pack: bool) -> float:
    """Seconds the seeds should take: each grid run's own seconds, scaled to the steps still to train (all of them
    from step 0, the rest when its final state was kept); a pack of K costs about the dearest of its runs."""
    each = []
    for r in seeds:
        grid = results.get(str(r.grid_run.resolve()), {}).get("seconds") or 0.0
        todo = r.run.steps - (r.grid_steps if state.has(r.grid_run) and not pack else 0)
        each.append(grid * todo / max(r.grid_steps, 1))
    return max(each, default=0.0) if pack else sum(each)


def _reusable(prev: dict | None, seeds: list[SeedRun], sweep_dir: Path) -> dict | None:
    """An earlier record of this setting at this horizon, when it was confirmed from the same grid runs."""
    if prev is None:
        return None
    same = {x.get("seed"): x.get("grid_run") for x in prev.get("seeds", [])}
    ours = {r.seed: relative(r.grid_run, sweep_dir) for r in seeds}
    return prev if all(same.get(k) == v for k, v in ours.items()) else None


def _entry(setting: Setting, seeds: list[SeedRun], sweep_dir: Path) -> dict:
    return {
        "combination": setting.combination,
        "params": setting.params,
        "lr": setting.lr,
        "why": list(setting.why),
        "step_down_from": setting.step_down_from,
        "steps": seeds[0].run.steps,
        "grid_steps": seeds[0].grid_steps,
        "held": None,
        "note": None,
        "seconds": 0.0,
        "seeds": [_not_run(r, sweep_dir, "not run yet") for r in seeds],
    }


def _not_run(r: SeedRun, sweep_dir: Path, note: str) -> dict:
    return {"seed": r.seed, "status": None, "note": note, "grid_run": relative(r.grid_run, sweep_dir)}


def _confirm(setting, seeds, prev, entry, request: StopRequest, pack: bool, record, sweep_dir, progress) -> float:
    """Run the setting's seeds not yet decided (an earlier, stopped confirmation's decided seeds stand); fill `entry`
    and write confirmation.json after every seed. Returns the seconds spent."""
    decided = {x["seed"]: x for x in (prev or {}).get("seeds", []) if _decided(x, entry["steps"])}
    todo = [r for r in seeds if r.seed not in decided]
    how = _how(seeds, pack)
    progress(f"confirming {setting.label} ({', '.join(setting.why).replace('_', ' ')}; {len(seeds)} seed(s), {how})")
    by_seed = {r.seed: i for i, r in enumerate(seeds)}
    for seed, x in decided.items():
        entry["seeds"][by_seed[seed]] = x
    start = time.perf_counter()

    def done(r: SeedRun, outcome: dict) -> None:
        outcome.update(grid_run=relative(outcome["grid_run"], sweep_dir), record=relative(outcome["record"], sweep_dir))
        entry["seeds"][by_seed[r.seed]] = outcome
        record["runs"] += 1
        record["steps_trained"] += max((outcome["steps_run"] or 0) - outcome["start_step"], 0)
        _settle(entry, time.perf_counter() - start)
        write_record(sweep_dir, record)

    if not any(x["status"] == "diverged" for x in decided.values()):
        run_seeds(todo, request, pack, done)
    _settle(entry, time.perf_counter() - start)
    write_record(sweep_dir, record)
    return time.perf_counter() - start


def _decided(x: dict, steps: int) -> bool:
    return x.get("status") == "diverged" or (x.get("status") == "stable" and x.get("steps_run") == steps)


def _how(seeds: list[SeedRun], pack: bool) -> str:
    if pack:
        return PACKED
    kept = [r for r in seeds if state.has(r.grid_run)]
    return f"{CONTINUED} from step {kept[0].grid_steps}" if len(kept) == len(seeds) else FROM_ZERO


def _settle(entry: dict, seconds: float) -> None:
    """`held` from the seeds so far: False once one failed, True when every one stayed stable to the end."""
    seeds = entry["seeds"]
    failed = next((x for x in seeds if x.get("status") == "diverged"), None)
    entry["seconds"] = round(seconds, 3)
    if failed is not None:
        entry["held"] = False
        for x in seeds:
            if x.get("status") is None:
                x["note"] = f"not run: seed {failed['seed']} failed first"
    elif all(_decided(x, entry["steps"]) for x in seeds):
        entry["held"] = True
    else:
        entry["held"] = None
        other = next((x for x in seeds if x.get("status") not in (None, "stable", "diverged")), None)
        entry["note"] = f"seed {other['seed']}: {other['status']} ({other.get('reason')})" if other else "not finished"


def _said(entry: dict) -> str:
    from sweep.report.confirmation import failure

    n = len(entry["seeds"])
    if entry["held"] is True:
        return f"held {n}/{n}"
    if entry["held"] is False:
        return f"failed: {failure(entry)}"
    return entry.get("note") or "not finished"


def _why_hint(entry: dict, sweep_dir: Path) -> str:
    """' (why: python -m sweep.diagnose RUN)' for a setting that failed: its diverged seed's run, which keeps its
    config (sweep/confirm/trial.py) and is diagnosed as a grid run is."""
    bad = next((x for x in entry["seeds"] if x.get("status") == "diverged" and x.get("record")), None)
    return f" (why: python -m sweep.diagnose {(sweep_dir / bad['record']).parent})" if bad else ""


def _left_out(setting: Setting, estimate: float) -> dict:
    return {
        "combination": setting.combination,
        "params": setting.params,
        "lr": setting.lr,
        "why": list(setting.why),
        "estimate_s": round(estimate, 3),
    }


def _finish_line(record: dict, elapsed: float, progress, request: StopRequest) -> None:
    done = [s for s in record["settings"] if s["held"] is not None]
    held = sum(s["held"] is True for s in done)
    progress(
        f"Confirmation: {held} of {len(done)} setting(s) held; {record['runs']} run(s), {record['steps_trained']} "
        f"steps trained in {elapsed:.0f} s (confirmation.json)"
    )
    if record["left_out"]:
        progress(f"{len(record['left_out'])} setting(s) left out by the budget: {record['command']}")
    if request.signum is not None:
        progress(f"{request.name}: the confirmation stopped; {record['command']} finishes it (or the same multirun)")
