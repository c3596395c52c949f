"""`python -m sweep.report`: run directories and the Optuna study give the same runs and the same tables;
help, wrong paths, unknown studies and storage passwords are handled as the user sees them."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pandas as pd
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from sweep.report.__main__ import main
from sweep.report.runs import runs_from_dirs
from sweep.report.study import runs_from_study

from .conftest import read_result
from .test_report_tables import ATTENTIONS, PRECISIONS, diverged, make_grid, write_run

DISTRIBUTIONS = {
    "precision": CategoricalDistribution(PRECISIONS),
    "optim.lr": FloatDistribution(1e-5, 1.0, log=True),
    "attention": CategoricalDistribution(ATTENTIONS),
    "steps": IntDistribution(1, 100),
    "seed": IntDistribution(0, 10),
}


def record_study(url: str, name: str, sweep_dir: Path) -> optuna.Study:
    """Every finished run under sweep_dir as a trial, as the ledger contract (docs/design.md, "The ledger")
    records it: stable COMPLETE with the final loss; diverged COMPLETE with a penalty and an infeasible
    constraint, or PRUNED as a study written by another tool may have it (both kinds used here); error FAIL."""
    study = optuna.create_study(storage=url, study_name=name, direction="minimize")
    for i, path in enumerate(sorted(sweep_dir.glob("*/result.json"), key=lambda p: int(p.parent.name))):
        r = read_result(path.parent)
        cause = r["cause"] or {}
        attrs = {
            "status": r["status"],
            "verdict": r["verdict"],
            "first_bad_step": r["first_bad_step"],
            "cause_where": cause.get("where"),
            "cause_module": cause.get("module"),
            "final_loss": r["final_loss"],
            "steps_run": r["steps_run"],
            "run_dir": str(path.parent.resolve()),
            "initial_loss": r["initial_loss"],
            "min_loss": r["min_loss"],
            "seed": r["seed"],
            "steps_per_second": r["steps_per_second"],
            "device": r.get("device"),
        }
        state, value, system = {
            "stable": (TrialState.COMPLETE, r["final_loss"], {"constraints": [-1.0]}),
            "diverged": (TrialState.COMPLETE, 10.0, {"constraints": [1.0]}) if i % 2 else (TrialState.PRUNED, None, {}),
            "error": (TrialState.FAIL, None, {}),
        }[r["status"]]
        params = r["params"]
        study.add_trial(
            create_trial(
                state=state,
                value=value,
                params=params,
                user_attrs=attrs,
                system_attrs=system,
                distributions={k: DISTRIBUTIONS[k] for k in params},
            )
        )
    return study


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """The base grid with two seeds, one replicate changed, and its ledger."""
    root = make_grid(
        tmp_path_factory.mktemp("report") / "sweep",
        seeds=(0, 1),
        changes={("fp32", 1e-3, "flash", 1): diverged("loss_spike", 5, "loss")},
    )
    record_study(f"sqlite:///{root / 'ledger.db'}", str(root), root)
    return root


def test_study_and_run_directories_give_the_same_runs_table(sweep):
    from_dirs = runs_from_dirs(sweep)
    from_study, name = runs_from_study(f"sqlite:///{sweep / 'ledger.db'}")
    assert name == str(sweep) and len(from_dirs) == 36
    pd.testing.assert_frame_equal(from_dirs, from_study)


def test_report_prints_the_same_tables_from_either_source(sweep, capsys):
    assert main([str(sweep), "--no-html"]) == 0
    from_dirs = capsys.readouterr()
    assert main([str(sweep / "ledger.db"), "--no-html"]) == 0
    from_study = capsys.readouterr()
    assert from_dirs.out == from_study.out
    assert "36 runs: 17 stable, 19 diverged" in from_dirs.out and "1/2 div" in from_dirs.out
    assert "run directories" in from_dirs.err and "study" in from_study.err
    assert main([str(sweep), "--study", str(sweep), "--no-html"]) == 0  # a directory plus --study: its ledger
    assert capsys.readouterr().out == from_dirs.out


def test_report_writes_html_and_summary_files(sweep, tmp_path, capsys):
    out = tmp_path / "r" / "report.html"
    out.parent.mkdir()
    assert main([str(sweep / "ledger.db"), "--html", str(out), "--write"]) == 0
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and 'id="divergence-heatmap"' in page
    assert page.count('id="curves-') == 6  # one figure per precision/attention combination
    assert "<script src=" not in page  # self-contained: plotly.js inline, nothing fetched at view time
    assert (out.parent / "summary.md").exists() and (out.parent / "summary.parquet").exists()


def test_trial_states_without_attributes(tmp_path):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    study = optuna.create_study(storage=url, study_name="s")
    trial = study.ask()
    trial.suggest_float("optim.lr", 1e-4, 1e-2, log=True)
    study.add_trial(
        create_trial(
            state=TrialState.PRUNED,
            params={"optim.lr": 1e-3},
            distributions={"optim.lr": FloatDistribution(1e-5, 1.0, log=True)},
        )
    )
    stale = study.ask()  # a job that died unrecorded: the Optuna sweeper fails its trial as stale
    study._storage.set_trial_system_attr(stale._trial_id, "stale", True)
    study.tell(stale, state=TrialState.FAIL)
    runs, _ = runs_from_study(url)
    assert sorted(runs.status) == ["running", "skipped"]  # PRUNED without a status attribute: skipped


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for option in ("PATH_OR_STORAGE_URL", "--study", "--html", "--no-html", "--write", "--width", "SWEEP_LEDGER_URL"):
        assert option in text


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    return captured.err


def test_wrong_path_and_unknown_study_are_one_line(sweep, tmp_path, capsys):
    assert "no such sweep directory or ledger file" in one_line_error(capsys, [str(tmp_path / "nope")])
    err = one_line_error(capsys, [str(sweep / "0" / "result.json")])  # before: "no such ...", of a file that is there
    assert "result.json is a file, not a sweep directory or a ledger" in err
    assert "no such SQLite ledger" in one_line_error(capsys, [f"sqlite:///{tmp_path / 'nope.db'}"])
    assert not (tmp_path / "nope.db").exists()  # reading never creates an empty ledger
    err = one_line_error(capsys, [str(sweep / "ledger.db"), "--study", "nope"])
    assert "no study named 'nope'" in err and str(sweep) in err
    (tmp_path / "empty").mkdir()
    assert "no runs in" in one_line_error(capsys, [str(tmp_path / "empty")])


def test_several_studies_need_study(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'two.db'}"
    root = tmp_path / "a"
    write_run(root, 0, {"optim.lr": 1e-3}, {"status": "stable", "final_loss": 0.5})
    for name in ("first", "second"):
        study = optuna.create_study(storage=url, study_name=name)
        study.add_trial(
            create_trial(
                value=0.5,
                params={"optim.lr": 1e-3},
                distributions={"optim.lr": DISTRIBUTIONS["optim.lr"]},
                user_attrs={"status": "stable", "final_loss": 0.5, "run_dir": str(root / "0")},
            )
        )
    err = one_line_error(capsys, [str(tmp_path / "two.db")])
    assert "2 studies" in err and "--study" in err and "'first'" in err
    assert main([str(tmp_path / "two.db"), "--study", "second", "--no-html"]) == 0
    assert capsys.readouterr().out.startswith("1 runs: 1 stable")


def test_a_storage_password_is_never_printed(tmp_path, capsys, monkeypatch):
    # no server is reached: the driver is not installed, which is an error that names the URL
    err = one_line_error(capsys, ["postgresql://ann:hunter2@127.0.0.1:9/sweeps"])
    assert "hunter2" not in err and "ann:***@127.0.0.1" in err
    monkeypatch.setenv("SWEEP_LEDGER_URL", "mysql://ann:hunter2@127.0.0.1:9/sweeps")
    err = one_line_error(capsys, [])
    assert "hunter2" not in err and "ann:***@" in err


def test_html_escapes_every_config_string(tmp_path, capsys):
    root = tmp_path / "s"
    hostile = '<img src=x onerror="alert(1)">'
    write_run(root, 0, {"optim.lr": 1e-3, "attention": hostile}, {"status": "stable", "final_loss": 0.5})
    write_run(root, 1, {"optim.lr": 1e-3, "attention": "</script><b>x"}, diverged("loss_spike", 2, "forward"))
    assert main([str(root)]) == 0
    page = (root / "report.html").read_text()
    assert "<img src=x" not in page and "</script><b>" not in page
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in page


@pytest.mark.parametrize(
    "name,content,why",
    [
        ("list", "[1, 2]", "not a JSON object (a JSON array)"),
        ("cause", {"cause": "boom"}, "cause is not an object or null (a JSON string)"),
        ("params", {"params": [1, 2]}, "params is not an object or null (a JSON array)"),
        ("huge", {"steps_run": 10**30}, "steps_run is not a 64-bit integer or null (got an integer of 31 digits)"),
        ("loss", {"final_loss": "low"}, "final_loss is not a number or null"),
        ("status", {"status": ["stable"]}, "status is not a string"),
        ("module", {"cause": {"where": "forward", "module": ["a"]}}, "cause.module is not a string or null"),
        ("truncated", '{"status": "sta', "unreadable (JSONDecodeError"),
    ],
)
def test_a_malformed_result_json_is_skipped_and_named(tmp_path, capsys, name, content, why):
    """One damaged or foreign result.json: the report uses the other runs, names it and counts them."""
    root = tmp_path / "s"
    write_run(root, 0, {"optim.lr": 1e-3}, {"status": "stable", "final_loss": 0.5})
    write_run(root, 1, {"optim.lr": 1e-2}, diverged("loss_spike", 2, "forward"))
    bad = write_run(root, 2, {"optim.lr": 1e-1}, {"status": "stable"}) / "result.json"
    if isinstance(content, dict):
        content = json.dumps({**json.loads(bad.read_text()), **content})
    bad.write_text(content)
    assert main([str(root), "--no-html"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("2 runs: 1 stable, 1 diverged")  # not counted, not "running" either
    lines = err.strip().splitlines()
    assert lines[0].startswith(f"sweep.report: skipped {bad}: {why}"), lines
    assert lines[-1].startswith("sweep.report: 2 runs from ") and "(1 result.json skipped: " in lines[-1]
    assert "Traceback" not in err


def test_summary_md_escapes_strings_from_result_json(tmp_path, capsys):
    root = tmp_path / "s"
    write_run(
        root,
        0,
        {"optim.lr": 1e-3, "attention": "<script>alert(1)</script>"},
        {"status": "<script>alert(2)</script>", "final_loss": 0.5},
    )
    write_run(root, 1, {"optim.lr": 1e-2, "attention": "math"}, {"status": "stable", "final_loss": 0.5})
    assert main([str(root), "--write"]) == 0
    for path in (root / "summary.md", root / "report.html"):
        assert "<script>alert" not in path.read_text(), path


def test_a_storage_password_never_reaches_the_report_files(sweep, tmp_path, capsys, monkeypatch):
    import sweep.report.__main__ as cli

    runs = runs_from_dirs(sweep)
    monkeypatch.setattr(cli, "runs_from_study", lambda url, study: (runs, "my-sweep"))  # as if the server answered
    out = tmp_path / "out"
    out.mkdir()
    assert main(["postgresql://ann:hunter2@db.example/sweeps", "--html", str(out / "report.html"), "--write"]) == 0
    captured = capsys.readouterr()
    assert "hunter2" not in captured.out + captured.err and "ann:***@db.example" in captured.err
    page = (out / "report.html").read_text()
    assert "ann:***@db.example" in page
    for path in out.iterdir():
        assert "hunter2" not in path.read_bytes().decode("utf-8", "replace"), path.name


def test_a_killed_trial_is_interrupted_and_a_pruned_one_skipped(tmp_path):
    """RUNNING with no live lock on its job dir: interrupted (not running until stale); PRUNED: skipped at its step."""
    import os
    import time

    from sweep.run.results import hold_run_dir, release_run_dir

    sweep_dir = tmp_path / "sweep"
    url = f"sqlite:///{tmp_path / 'l.db'}"
    study = optuna.create_study(storage=url, study_name=str(sweep_dir))  # the default study name: the sweep dir
    for _ in range(3):
        study.ask({"optim.lr": FloatDistribution(1e-5, 1.0, log=True)})
    for n in (0, 1):  # 0 was killed; 1 is alive and holds its lock; 2 has no job dir yet
        overrides = sweep_dir / str(n) / ".hydra" / "overrides.yaml"
        overrides.parent.mkdir(parents=True)
        overrides.write_text("- optim.lr=0.001\n")
        os.utime(overrides, (time.time() - 60, time.time() - 60))
    pruned = study.ask({"optim.lr": FloatDistribution(1e-5, 1.0, log=True)})
    pruned.report(0.5, step=4)
    study.tell(pruned, state=TrialState.PRUNED)
    hold_run_dir(sweep_dir / "1")
    try:
        runs, _ = runs_from_study(url)
    finally:
        release_run_dir(sweep_dir / "1")
    named = {Path(d).name: s for d, s in zip(runs.run_dir, runs.status) if isinstance(d, str)}
    assert named == {"0": "interrupted", "1": "running"}
    assert sorted(runs.status[runs.run_dir.isna()]) == ["running", "skipped"]
    assert list(runs.pruned_at_step[runs.status == "skipped"]) == [4]


def test_report_write_puts_the_answer_on_the_study_from_either_source(tmp_path, capsys):
    """`--write` rewrites the summary, and the study's copy of the answer with it (its user attrs, which
    optuna-dashboard shows); a sweep without a ledger gets none made for it."""
    for source in ("dir", "storage"):
        root = make_grid(tmp_path / source / "sweep")
        url = f"sqlite:///{root / 'ledger.db'}"
        record_study(url, str(root), root)
        assert main([str(root if source == "dir" else root / "ledger.db"), "--write", "--no-html"]) == 0
        out = capsys.readouterr().out
        attrs = optuna.load_study(study_name=str(root), storage=url).user_attrs
        assert attrs["recommended"] == {"precision": "bf16_amp", "attention": "flash", "optim.lr": 0.01}, source
        assert " ".join(attrs["recommendation"].split()) in " ".join(out.split())
        assert len(attrs["recommended_trials"]) == 1 and attrs["marginal_trials"] == []
    bare = make_grid(tmp_path / "bare")
    assert main([str(bare), "--write", "--no-html"]) == 0
    assert not (bare / "ledger.db").exists() and "ledger" not in capsys.readouterr().err


def test_an_unreadable_overrides_yaml_is_named_and_splits_nothing(tmp_path, capsys):
    """issue 45: one started job whose .hydra/overrides.yaml could not be read became a run with no params, and the
    divergence map was split by every fixed key (steps, data.*: None against their value). It is left out of the
    runs table and named in one line; the other runs' tables are as without it."""
    from sweep.report.tables import swept_axes

    root = tmp_path / "s"
    write_run(root, 0, {"optim.lr": 1e-3, "steps": 8}, {"status": "stable", "final_loss": 0.5})
    write_run(root, 1, {"optim.lr": 1e-2, "steps": 8}, diverged("loss_spike", 2, "forward"))
    broken = write_run(root, 2, {"optim.lr": 1e-1, "steps": 8}, None) / ".hydra" / "overrides.yaml"
    broken.write_text("optim.lr: [unclosed\n")
    runs = runs_from_dirs(root, starting_s=0)
    assert len(runs) == 2 and swept_axes(runs) == ["optim.lr"], runs
    assert [line for line in runs.attrs["skipped"] if str(broken) in line and "\n" not in line], runs.attrs
    assert main([str(root), "--no-html"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("2 runs: 1 stable, 1 diverged") and "steps" not in out.split("Stability frontier")[0], out
    assert len([ln for ln in err.splitlines() if "overrides.yaml" in ln]) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("width", ["0", "-3", "wide"])
def test_a_width_of_no_columns_is_refused_by_the_parser(sweep, capsys, width):
    """--width 0 or -3 was textwrap's ValueError after the runs were read (a traceback, status 1)."""
    with pytest.raises(SystemExit) as e:
        main([str(sweep), "--no-html", "--width", width])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.splitlines()[-1].endswith(
        f"argument --width: must be a whole number of columns >= 1, got '{width}'"
    ), err
