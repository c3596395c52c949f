"""The confirmation at a longer horizon (sweep/confirm/, sweep/report/confirmation.py).

The tiny grid below is the issue's case in small: fp32 at lr 1.5e-2 is stable in both seeds at 15 steps and spikes
at step 31-32 (found by searching lrs 3e-3..2e-2 on a 2-core AMD EPYC with AVX-512-BF16, 2026-11-27), while lr 1e-2
holds to 60 steps. So the confirmation (4x: 60 steps, with room on either side of the spike for another CPU's
kernels) finds the frontier's largest stable lr failing, steps down to 1e-2, and the frontier and the
recommendation say so.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from sweep.config import ConfigError
from sweep.report.confirmation import CONFIRMATION_FILE, read_confirmation
from sweep.report.runs import runs_from_dirs
from sweep.report.summary import summarize
from sweep.run.results import TRIAL_FILE

from .conftest import FAST, SMALL_MODEL, make_run, multirun_in_process, run_cli
from .test_report_tables import make_grid

pytestmark = pytest.mark.xdist_group("confirm")  # one worker runs the module's sweep once

GRID = [
    "device=cpu",  # the spike at step 31-32 is this CPU's (a late first bad step is chaotic across kernels)
    "steps=15",
    "replicates=2",
    "optim.lr=1e-2,1.5e-2",
    "ledger.enabled=false",
    "confirm.mode=auto",
    "confirm.budget=10",
    "monitor.diagnose=auto",  # the grid has no failure; the confirmation's is diagnosed
]


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    """The grid, confirmed at its end; what it printed is in <sweep>/printed.txt."""
    out = tmp_path_factory.mktemp("confirm") / "s"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        multirun_in_process(out, *GRID)
    (out.parent / "printed.txt").write_text(printed.getvalue())
    return out


def printed(sweep_dir: Path) -> str:
    return (sweep_dir.parent / "printed.txt").read_text()


def record(sweep_dir: Path) -> dict:
    return json.loads((sweep_dir / CONFIRMATION_FILE).read_text())


def by_lr(sweep_dir: Path) -> dict[float, dict]:
    return {s["lr"]: s for s in record(sweep_dir)["settings"]}


def test_a_continued_run_is_the_run_from_step_zero(tmp_path):
    """N steps, the state kept, then continued to 4N with the N rows as history: every step's loss and gradient
    norm, and the result's numbers, are those of the 4N-step run from step 0 (fp16 AMP: its loss scale too).
    Fails if the continuation misses a piece of state or the history is not the whole curve."""
    from sweep.confirm.state import KeepFinalState, take
    from sweep.confirm.trial import read_rows
    from sweep.run.checkpoint import write
    from sweep.run.execute import execute

    for precision in ("fp16_amp",):  # 3 steps, then to 12: across the data order's epoch (8 batches of 4)
        short = make_run(*SMALL_MODEL, "steps=3", "threads=1", f"precision={precision}", "optim.lr=3e-3", "device=cpu")
        long = make_run(*SMALL_MODEL, "steps=12", "threads=1", f"precision={precision}", "optim.lr=3e-3", "device=cpu")
        execute(short, tmp_path / precision / "grid", {}, hooks=[KeepFinalState(tmp_path / precision / "grid", 3)])
        kept = take(tmp_path / precision / "grid")
        assert kept is not None and kept.steps == 3
        state = write(tmp_path / precision / "state", kept.state)
        resumed = make_run(
            *SMALL_MODEL, "steps=12", "threads=1", f"precision={precision}", "optim.lr=3e-3", "device=cpu",
            f"checkpoint.resume_from={state}",
        )  # fmt: skip
        a = execute(
            resumed,
            tmp_path / precision / "cont",
            {},
            record=TRIAL_FILE,
            history=read_rows(tmp_path / precision / "grid"),
        )
        b = execute(long, tmp_path / precision / "full", {})
        rows_a, rows_b = read_rows(tmp_path / precision / "cont"), read_rows(tmp_path / precision / "full")
        assert [(r["step"], r["loss"], r["grad_norm"], r["loss_scale"]) for r in rows_a] == [
            (r["step"], r["loss"], r["grad_norm"], r["loss_scale"]) for r in rows_b
        ]
        for key in ("status", "final_loss", "eval_loss", "initial_loss", "min_loss", "steps_run"):
            assert getattr(a, key) == getattr(b, key), key
        assert a.start_step == 3 and b.start_step == 0
        # how far the weights travelled, as the trend check reads it: the grid run's last-step tail is not state
        assert a.trend["weight_path"] == b.trend["weight_path"] and a.trend["weight_growth"] == b.trend["weight_growth"]
        assert not (tmp_path / precision / "cont" / "result.json").exists()


def test_the_largest_stable_lr_failed_and_the_confirmation_stepped_down(sweep_dir):
    """confirmation.json: 1.5e-2 (the largest stable lr) failed with a spike past step 15, its other seed not run;
    1e-2 (recommended) held in both seeds to 60 steps, continued from the grid runs' step 15."""
    r = record(sweep_dir)
    assert r["format"] == "dit-sweep-confirmation/1" and r["factor"] == 4.0 and r["budget"] == 10.0
    assert r["complete"] is True and r["left_out"] == [] and r["command"] is None and r["seconds"] > 0
    settings = by_lr(sweep_dir)
    failed, held = settings[0.015], settings[0.01]
    assert failed["why"] == ["largest_stable_lr"] and failed["held"] is False
    assert failed["params"] == {"optim.lr": 0.015} and failed["steps"] == 60 and failed["grid_steps"] == 15
    spike = next(x for x in failed["seeds"] if x["status"] == "diverged")
    assert spike["verdict"] == "loss_spike" and 15 <= spike["first_bad_step"] < 60
    assert spike["steps_run"] == spike["first_bad_step"] + 1 and spike["how"] == "continued"
    assert [x["status"] for x in failed["seeds"]] in (["diverged", None], ["stable", "diverged"])
    assert "recommended" in held["why"] and held["held"] is True
    for x in held["seeds"]:
        assert (x["status"], x["steps_run"], x["start_step"], x["how"]) == ("stable", 60, 15, "continued")
        assert x["eval_loss"] > 0 and x["final_loss"] > 0
        trial = json.loads((sweep_dir / x["record"]).read_text())
        assert x["record"].startswith("confirm/") and trial["status"] == "stable" and trial["params"]["steps"] == 60
        assert trial["eval_loss"] == x["eval_loss"] and (sweep_dir / x["grid_run"] / "result.json").is_file()
    said = printed(sweep_dir)
    assert "Confirming 2 setting(s) at 60 steps (recommended + largest stable lr of each combination; within" in said
    why = f"(why: python -m sweep.diagnose {sweep_dir / 'confirm' / 'all-lr0.015' / ('seed_' + str(spike['seed']))})"
    failed = f"failed: loss_spike@{spike['first_bad_step']} (seed {spike['seed']})"
    assert f"{failed} {why}; stepping down to lr 0.01" in said
    assert "held 2/2" in said and "continued from step 15" in said


def test_the_frontier_and_the_recommendation_name_what_held(sweep_dir):
    """The frontier's largest stable lr is the one that held, the failure is named in `held`, the smallest
    diverging lr is the one that failed at 60 steps; the recommendation's setting held. The summary printed at the
    end of the multirun and summary.md say the same."""
    conf, problem = read_confirmation(sweep_dir)
    assert problem is None
    s = summarize(runs_from_dirs(sweep_dir), confirmation=conf)
    row = s.frontier.loc["all"]
    spike = next(x for x in by_lr(sweep_dir)[0.015]["seeds"] if x["status"] == "diverged")
    mechanism = json.loads(((sweep_dir / spike["record"]).parent / "diagnosis.json").read_text())["mechanism"]
    failure = f"loss_spike@{spike['first_bad_step']} (seed {spike['seed']}: {mechanism})"
    assert (row.max_stable_lr, row.min_diverging_lr) == (0.01, 0.015)
    assert row.held == f"2/2 at 60 steps; 0.015 failed: {failure}"
    assert s.recommendation.settings == {"optim.lr": 0.01}
    assert "Held 2/2 at 60 steps [confirmation.json]. Target: cuda" in s.recommendation.line
    assert "lr 0.01: no margin, the next grid lr 0.015 failed at 60 steps" in s.recommendation.line
    unconfirmed = summarize(runs_from_dirs(sweep_dir))
    assert unconfirmed.frontier.loc["all"].max_stable_lr == 0.015 and "held" not in unconfirmed.frontier
    md = (sweep_dir / "summary.md").read_text()
    assert f"2/2 at 60 steps; 0.015 failed: {failure}" in md and "Held 2/2 at 60 steps" in md
    assert "held" in printed(sweep_dir).split("Stability frontier")[1].split("LR sensitivity")[0]


def test_the_confirmation_runs_are_not_runs_of_the_sweep(sweep_dir):
    """trial.json, never result.json, under confirm/: `find -name result.json` counts the grid's 4 runs, and so
    does the runs table; no confirmation run is a job directory (.hydra/overrides.yaml: it keeps only the config it
    is, for sweep.diagnose) or holds a kept state. (The diagnosis of the seed that failed keeps its own runs in its
    diagnosis/, trial.json too.)"""
    assert len(list(sweep_dir.rglob("result.json"))) == 4 == len(runs_from_dirs(sweep_dir))
    trials = [t for t in (sweep_dir / "confirm").rglob(TRIAL_FILE) if "diagnosis" not in t.relative_to(sweep_dir).parts]
    assert len(trials) >= 3 and not list((sweep_dir / "confirm").rglob("overrides.yaml"))
    assert all((t.parent / ".hydra" / "config.yaml").is_file() for t in trials)
    assert not list((sweep_dir / "confirm").rglob("state"))
    assert (sweep_dir / "confirm" / "all-lr0.01" / "seed_0" / "metrics.csv").is_file()


def test_a_damaged_confirmation_is_one_warning_line(sweep_dir, capsys):
    from sweep.report.__main__ import main

    path = sweep_dir / CONFIRMATION_FILE
    kept = path.read_text()
    try:
        for damage in ("{not json", json.dumps({"format": "dit-sweep-confirmation/1", "settings": [{"held": 3}]})):
            path.write_text(damage)
            conf, problem = read_confirmation(sweep_dir)
            assert conf is None and problem.startswith(str(path)) and "\n" not in problem
            assert main([str(sweep_dir), "--no-html"]) == 0
            out, err = capsys.readouterr()
            assert err.count(CONFIRMATION_FILE) == 1 and "Traceback" not in err and "held" not in out
    finally:
        path.write_text(kept)
    assert main([str(sweep_dir), "--no-html", "--table", "frontier"]) == 0
    assert "2/2 at 60 steps" in capsys.readouterr().out


def test_a_resume_redoes_no_confirmation(sweep_dir):
    """The same multirun again: no run, no confirmation run; confirmation.json holds the same outcomes."""
    before = record(sweep_dir)
    stamps = {p: p.stat().st_mtime_ns for p in (sweep_dir / "confirm").rglob(TRIAL_FILE)}
    again = io.StringIO()
    with contextlib.redirect_stdout(again):
        multirun_in_process(sweep_dir, *GRID)
    after = record(sweep_dir)
    assert after["runs"] == 0 and "recorded before" in again.getvalue()
    assert {p: p.stat().st_mtime_ns for p in (sweep_dir / "confirm").rglob(TRIAL_FILE)} == stamps
    assert [(s["lr"], s["held"], s["seeds"]) for s in after["settings"]] == [
        (s["lr"], s["held"], s["seeds"]) for s in before["settings"]
    ]


def test_on_a_gpu_the_seeds_pack_from_step_zero(tmp_path):
    """The packed path (what a CUDA device chooses; forced here on the CPU): the seeds train as one pack from step
    0, each with its own trial.json, and by hand (`confirm_sweep`, no kept states) nothing is continued."""
    from sweep.confirm.multirun import confirm_sweep

    multirun_in_process(
        tmp_path, *SMALL_MODEL, "steps=3", "replicates=2", "optim.lr=1e-3", "ledger.enabled=false", "device=cpu"
    )
    r = confirm_sweep(tmp_path, steps=6, budget=0, progress=lambda _: None, packed=True)
    (setting,) = r["settings"]
    assert setting["held"] is True and [x["how"] for x in setting["seeds"]] == ["packed from step 0"] * 2
    for x in setting["seeds"]:
        trial = json.loads((tmp_path / x["record"]).read_text())
        assert (trial["packed"], trial["start_step"], trial["steps_run"], x["steps_run"]) == (2, 0, 6, 6)
    r = confirm_sweep(tmp_path, steps=9, budget=0, progress=lambda _: None)
    assert [x["how"] for x in r["settings"][0]["seeds"]] == ["from step 0"] * 2


def test_confirm_mode_off_does_nothing(tmp_path):
    multirun_in_process(tmp_path, "steps=2", "optim.lr=1e-3", "ledger.enabled=false", "confirm.mode=off")
    assert (tmp_path / "summary.md").is_file() and "held" not in (tmp_path / "summary.md").read_text()
    assert not (tmp_path / CONFIRMATION_FILE).exists() and not (tmp_path / "confirm").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("confirm.factor=1", "confirm.factor: must be > 1"),
        ("confirm.steps=3", "confirm.steps: must be > steps=5"),
        ("confirm.budget=-1", "confirm.budget: must be >= 0"),
        ("confirm.budget=nan", "confirm.budget: must be a finite number"),
        ("confirm.steps=7158279", "confirm.steps: 7,158,279 is over the 7,158,278 steps a run may have"),
    ],
)
def test_bad_confirm_values_fail_at_composition_in_one_line(override, message):
    with pytest.raises(ConfigError, match=f"^{message}") as e:
        make_run("steps=5", override)
    assert "\n" not in str(e.value)


def test_the_command_helps_and_refuses_a_bad_directory_in_one_line(tmp_path, capsys):
    """`python -m sweep.confirm --help` as typed; the refusals by its main in this process (one start-up, not 4)."""
    from sweep.confirm.__main__ import main

    proc = run_cli("-m", "sweep.confirm", "--help")
    assert proc.returncode == 0 and "python -m sweep.confirm SWEEP_DIR --steps 200" in proc.stdout
    for where in (tmp_path / "nope", tmp_path):
        code, err = main([str(where)]), capsys.readouterr().err
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("sweep.confirm: "), err
    code, err = main([str(tmp_path), "--budget", "-1"]), capsys.readouterr().err
    assert code == 2 and "--budget must be a finite number >= 0" in err


def test_a_horizon_no_run_may_have_is_one_line_and_keeps_the_last_confirmation(sweep_dir, tmp_path, capsys):
    """--steps over the steps a run may have (a typed zero too many): before, every setting was "not confirmed",
    and a confirmation.json of 0 settings replaced the one the report reads, with exit status 0. A factor that gets
    there (confirm.factor=1e300 at a multirun's end) names the factor and prints no 300-digit number."""
    import shutil

    from sweep.confirm.__main__ import main
    from sweep.confirm.multirun import ConfirmError, _horizon

    copy = tmp_path / "s"
    shutil.copytree(sweep_dir, copy)
    before = (copy / CONFIRMATION_FILE).read_bytes()
    code, err = main([str(copy), "--steps", "1000000000"]), capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [
        "sweep.confirm: confirm.steps: 1,000,000,000 steps, over the 7,158,278 steps a run may have (each keeps a "
        "metrics row per step in memory); give a shorter one"
    ], err
    assert (copy / CONFIRMATION_FILE).read_bytes() == before
    with pytest.raises(
        ConfirmError, match=r"^confirm.factor: 1e\+300 x steps=5 gives a horizon of 5e\+300 steps, over"
    ):
        _horizon(None, 1e300)(make_run("steps=5"))


def test_the_command_rewrites_the_answer_where_the_sweeps_end_wrote_it(sweep_dir, tmp_path, capsys, monkeypatch):
    """`python -m sweep.confirm` after the sweep's end: summary.md, its tables and report.html say what it confirmed,
    as the terminal does (before, they kept the unconfirmed answer until `sweep.report --write`); and it, like
    `sweep.report`, recommends for the sweep's own report.target (before, the report's default: cuda). A seed that
    failed and has no diagnosis is diagnosed, as the sweep's end does (its monitor.diagnose=auto): here by a
    stand-in for sweep.diagnose's `diagnose` (the real one ran in the module's sweep), which names the run it got."""
    import shutil

    import yaml

    import sweep.diagnose.multirun as multirun

    def stand_in(run_dir, progress=print):
        d = {"mechanism": "stand_in", "verdict": "loss_spike", "fix": {"overrides": ["a=1"], "confirmed": False}}
        (Path(run_dir) / "diagnosis.json").write_text(json.dumps(d))
        return d | {"diagnosed": str(run_dir)}

    monkeypatch.setattr(multirun, "diagnose", stand_in)

    from sweep.confirm.__main__ import main as confirm
    from sweep.report.__main__ import main as report

    copy = tmp_path / "s"
    shutil.copytree(sweep_dir, copy)
    saved = yaml.safe_load((copy / "multirun.yaml").read_text())
    saved["report"]["target"] = "cpu"
    (copy / "multirun.yaml").write_text(yaml.safe_dump(saved))
    (copy / CONFIRMATION_FILE).rename(tmp_path / CONFIRMATION_FILE)
    failed = next(x for x in by_lr(sweep_dir)[0.015]["seeds"] if x["status"] == "diverged")["record"]
    ((copy / failed).parent / "diagnosis.json").unlink()
    assert report([str(copy), "--write"]) == 0  # the files as the sweep's end wrote them, unconfirmed
    capsys.readouterr()
    assert "Held" not in (copy / "summary.md").read_text() and "Held" not in (copy / "report.html").read_text()
    (tmp_path / CONFIRMATION_FILE).rename(copy / CONFIRMATION_FILE)
    assert confirm([str(copy)]) == 0
    out = capsys.readouterr().out
    assert "recorded before" in out and "\nRecommendation\nUse optim.lr=0.01 " in out
    assert f"diagnosing {Path(failed).parent} (loss_spike@" in out
    out = " ".join(out.split())  # wrapped at 100 columns
    assert f"Rewritten in {copy}: summary.md, summary.csv" in out and "report.html" in out
    assert "Held 2/2 at 60 steps [confirmation.json]. Target: cpu (as asked)." in out
    md, page, frontier = ((copy / name).read_text() for name in ("summary.md", "report.html", "summary_frontier.csv"))
    for text in (md, page):
        assert "Held 2/2 at 60 steps" in text and "Target: cpu (as asked)." in text
    assert "2/2 at 60 steps; 0.015 failed" in frontier and "stand_in" in frontier
    assert f"Why all lr 0.015 failed at 60 steps: stand_in; fix a=1 (not confirmed) \\[{Path(failed).parent}/" in md
    assert report([str(copy), "--no-html"]) == 0
    assert "Target: cpu (as asked)." in " ".join(capsys.readouterr().out.split())


def test_a_setting_that_failed_at_the_longer_horizon_is_diagnosed_like_a_grid_run(sweep_dir, tmp_path, capsys):
    """monitor.diagnose=auto diagnoses the seed that spiked at step 31-32 after the confirmation (before: grid failures
    only, and this seed was "not a run directory" to `python -m sweep.diagnose`). A confirmation run keeps the config
    it is (.hydra/config.yaml: the grid run's at 60 steps); it was continued from the grid run's step 15, and its
    config from step 0 replays it bit for bit. Its mechanism and confirmed fix are in the frontier's `held`, the
    lines under it and summary.md; `python -m sweep.diagnose` on such a seed rewrites the sweep's files too."""
    import shutil

    import yaml

    from sweep.diagnose.__main__ import rewrite_sweep

    spike = next(x for x in by_lr(sweep_dir)[0.015]["seeds"] if x["status"] == "diverged")
    seed_dir = (sweep_dir / spike["record"]).parent
    assert yaml.safe_load((seed_dir / ".hydra" / "config.yaml").read_text())["steps"] == 60
    assert spike["how"] == "continued" and spike["start_step"] == 15
    d = json.loads((seed_dir / "diagnosis.json").read_text())
    assert d["verdict"] == "loss_spike" and d["first_bad_step"] == spike["first_bad_step"]
    assert d["counterfactuals"]["prefix"]["identical"] is True  # the replay from step 0: every loss bit for bit
    said = printed(sweep_dir)
    assert "Diagnosing 1 distinct failure(s) of the confirmation at 60 steps: the first" in said
    assert f"diagnosing {spike['record'].rsplit('/', 1)[0]} (loss_spike@{spike['first_bad_step']}, 1 run(s)" in said
    fix = " ".join(d["fix"]["overrides"])
    why = (
        f"Why all lr 0.015 failed at 60 steps: {d['mechanism']}; fix {fix} ("
        + (
            f"confirmed: stable from step 0 through step {d['fix']['through_step']})"
            if d["fix"]["confirmed"]
            else "not confirmed)"
        )
        + f" [{spike['record'].rsplit('/', 1)[0]}/diagnosis.json]"
    )
    md, page = (sweep_dir / "summary.md").read_text(), (sweep_dir / "report.html").read_text()
    assert f"Why all lr 0.015 failed at 60 steps: {d['mechanism']}" in page
    for text in (md.replace("\\", ""), said):
        assert f"0.015 failed: loss_spike@{spike['first_bad_step']} (seed {spike['seed']}: {d['mechanism']})" in text
        assert " ".join(why.split()) in " ".join(text.split()), text
    copy = tmp_path / "s"
    shutil.copytree(sweep_dir, copy)
    (copy / "summary.md").write_text("stale")
    capsys.readouterr()
    rewrite_sweep((copy / spike["record"]).parent)
    assert f"Rewritten in {copy.resolve()}: summary.md" in capsys.readouterr().out
    assert " ".join(why.split()) in " ".join((copy / "summary.md").read_text().replace("\\", "").split())


def test_a_report_from_the_ledger_alone_is_confirmed_as_the_directorys(tmp_path, capsys):
    """The study holds a copy of confirmation.json (its `confirmation` attr), so a report from the ledger alone (a
    server URL; here the ledger file copied away from the sweep) gives the directory's frontier and recommendation
    (before: unconfirmed, without `held`, and another recommendation line)."""
    import shutil

    from sweep.report.__main__ import main as report

    sweep_dir, away = tmp_path / "s", tmp_path / "elsewhere"
    with contextlib.redirect_stdout(io.StringIO()):
        multirun_in_process(sweep_dir, "steps=3", "optim.lr=1e-3,3e-3", "confirm.mode=auto", "confirm.budget=0")
    assert record(sweep_dir)["settings"][0]["held"] is True
    away.mkdir()
    shutil.copy(sweep_dir / "ledger.db", away / "ledger.db")
    assert report([str(sweep_dir), "--no-html"]) == 0
    from_dir = capsys.readouterr().out
    assert report([f"sqlite:///{away / 'ledger.db'}", "--no-html"]) == 0
    from_ledger = capsys.readouterr().out
    assert "Held 1/1 at 12 steps" in " ".join(from_dir.split())
    assert from_ledger.split("\nStability frontier")[1] == from_dir.split("\nStability frontier")[1]


def test_ctrl_c_during_the_confirmation_keeps_the_runs_and_the_summary(tmp_path):
    """A SIGINT while the confirmation trains: the run in progress stops after its step, confirmation.json says
    the confirmation stopped, and the summary is still printed and written (the sweep's runs are all there)."""
    sweep_dir = tmp_path / "s"
    proc = run_cli(
        "-m", "sweep", "-m", *FAST, "confirm.mode=auto", "confirm.steps=3000", "steps=4", "optim.lr=1e-3",
        "ledger.enabled=false", "threads=1", "logger.flush_s=0", f"hydra.sweep.dir={sweep_dir}",
        background=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    out, trial = [], sweep_dir / "confirm" / "all-lr0.001" / "seed_0"
    for line in proc.stdout:
        out.append(line)
        if line.startswith("confirming "):
            break
    deadline = time.monotonic() + 120
    while not (trial / "metrics.csv").is_file() and time.monotonic() < deadline:  # its first step is written
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGINT)
    out += proc.stdout.readlines()
    assert proc.wait(timeout=300) == 0, "".join(out)
    said = "".join(out)
    assert "SIGINT: the confirmation stopped" in said and "Recommendation" in said, said
    r = record(sweep_dir)
    assert r["complete"] is False and r["interrupted"] == "SIGINT"
    (seed,) = r["settings"][0]["seeds"]
    assert seed["status"] == "interrupted" and r["settings"][0]["held"] is None
    assert (sweep_dir / "summary.md").is_file() and (sweep_dir / "0" / "result.json").is_file()


# --- the report on a synthetic sweep (tests/test_report_tables.py's grid, two seeds) -----------------------------


def confirm_synthetic(root: Path, settings: list[dict]):
    """A confirmation.json of `settings` (combination, lr, why, held, failure seed or None) for the synthetic grid."""
    from sweep.confirm.record import write_record

    entries = []
    for combination, lr, why, held in settings:
        seeds = [{"seed": s, "status": "stable", "steps_run": 32} for s in (0, 1)]
        if held is False:
            seeds[1] = {"seed": 1, "status": "diverged", "verdict": "loss_spike", "first_bad_step": 31}
        entries.append({"combination": combination, "lr": lr, "why": why, "held": held, "steps": 32, "seeds": seeds})
    write_record(root, {"settings": entries, "left_out": [], "command": None, "complete": True})
    conf, problem = read_confirmation(root)
    assert problem is None
    return conf


def test_the_recommendation_steps_down_where_its_setting_failed_and_says_why(tmp_path):
    """The grid's pick (bf16_amp/flash at 1e-2, the lowest loss and the fastest) failed at 32 steps; 1e-3 of its
    combination held: the recommendation steps down to it and names the failure, the frontier moves."""
    root = make_grid(tmp_path / "sweep", seeds=(0, 1))
    runs = runs_from_dirs(root)
    assert summarize(runs).recommendation.settings["optim.lr"] == 0.01
    conf = confirm_synthetic(
        root,
        [
            ("bf16_amp/flash", 0.01, ["recommended", "largest_stable_lr"], False),
            ("bf16_amp/flash", 0.001, ["step_down"], True),
        ],
    )
    s = summarize(runs, confirmation=conf)
    assert s.recommendation.settings == {"precision": "bf16_amp", "attention": "flash", "optim.lr": 0.001}
    assert (
        "The grid's pick, bf16_amp/flash at lr 0.01, failed at 32 steps: loss_spike@31 (seed 1); stepped down to the "
        "next lr of bf16_amp/flash that held. Held 2/2 at 32 steps [confirmation.json]." in s.recommendation.line
    )
    row = s.frontier.loc["bf16_amp/flash"]
    assert (row.max_stable_lr, row.min_diverging_lr, row.best_lr) == (0.001, 0.01, 0.001)
    assert row.held == "2/2 at 32 steps; 0.01 failed: loss_spike@31 (seed 1)"
    assert s.frontier.loc["fp32/flash"].held == "-" and s.frontier.loc["fp32/flash"].max_stable_lr == 0.001


def test_with_no_lower_lr_that_held_the_recommendation_takes_the_best_that_held_or_none(tmp_path):
    root = make_grid(tmp_path / "sweep", seeds=(0, 1))
    runs = runs_from_dirs(root)
    pick = ("bf16_amp/flash", 0.01, ["recommended", "largest_stable_lr"], False)
    conf = confirm_synthetic(root, [pick, ("fp32/math", 0.001, ["largest_stable_lr"], True)])
    s = summarize(runs, confirmation=conf)
    assert s.recommendation.settings == {"precision": "fp32", "attention": "math", "optim.lr": 0.001}
    assert "and no lower lr of bf16_amp/flash held: the best setting that held instead" in s.recommendation.line
    assert s.frontier.loc["bf16_amp/flash"].held == "not checked; 0.01 failed at 32 steps: loss_spike@31 (seed 1)"
    conf = confirm_synthetic(root, [pick])
    line = summarize(runs, confirmation=conf).recommendation.line
    assert line.startswith("No setting held at 32 steps: nothing to recommend (the grid's pick, bf16_amp/flash at")
    assert "failed at 32 steps: loss_spike@31 (seed 1)" in line


def test_the_plan_puts_what_the_target_cannot_run_last(tmp_path):
    """Under a budget the settings cut are the last ones: fp32/flash, which CUDA cannot run and the recommendation
    for cuda leaves out, comes after every setting CUDA can run; for the CPU, in the frontier's order."""
    from sweep.confirm.plan import plan

    runs = runs_from_dirs(make_grid(tmp_path / "sweep", seeds=(0, 1)))
    on_cuda = [s.combination for s in plan(runs, target="cuda")]
    assert on_cuda[-1] == "fp32/flash" and on_cuda.count("fp32/flash") == 1, on_cuda
    on_cpu = [s.combination for s in plan(runs, target="cpu")]
    assert on_cpu != on_cuda and sorted(on_cpu) == sorted(on_cuda)
