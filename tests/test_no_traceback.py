"""Issue 45, red-team finding 8: inputs that ended in a traceback, each now one clear line or a correct result.

Each test says what it was before; each fails without its fix (checked when it was written)."""

from __future__ import annotations

import json

import pytest

from sweep.config import ConfigError, check_inputs
from sweep.diagnose.counterfactual import ROWS

from .conftest import make_run


def test_a_resume_with_steps_at_or_below_the_checkpoints_step_is_a_config_error(tmp_path):
    """Before: every such run ended `error` with a traceback (`ValueError: checkpoint.resume_from is at step 2,
    steps=2: nothing left to run`), raised after the model, the data and the checkpoint were built."""
    ckpt = tmp_path / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(json.dumps({"format": "dit-sweep-checkpoint/1", "step": 2, "files": {}}))
    for steps in (1, 2):
        with pytest.raises(
            ConfigError, match=r"^steps: steps=%d, but checkpoint.resume_from .* saved at step 2" % steps
        ):
            check_inputs(make_run(f"checkpoint.resume_from={ckpt}", f"steps={steps}"))
    check_inputs(make_run(f"checkpoint.resume_from={ckpt}", "steps=3"))  # one step left: fine


def flipped_checkpoint(tmp_path):
    """A 2-step run's checkpoint at step 2 with one byte of its weights flipped (a checksum mismatch)."""
    from sweep.run.execute import execute

    execute(make_run("steps=2", "checkpoint.every=2", "ledger.enabled=false"), tmp_path / "base", {})
    ckpt = tmp_path / "base" / "checkpoints" / "step_000002"
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    return ckpt


def test_a_run_refused_at_the_load_of_its_checkpoint_is_diagnosed_without_a_run(tmp_path, capsys):
    """Before: `python -m sweep.diagnose` on a `corrupt_checkpoint` run replayed it, loaded the same file and died
    of CorruptCheckpoint (a traceback), and so did the sweep's own monitor.diagnose=auto. Now: its mechanism,
    a table whose rows say why none runs, and the known fix; no run is made."""
    from sweep.diagnose.__main__ import main

    from .conftest import multirun_in_process

    ckpt = flipped_checkpoint(tmp_path)
    overrides = ["steps=4", f"checkpoint.resume_from={ckpt}", "optim.lr=1e-3,2e-3", "ledger.enabled=false"]
    multirun_in_process(tmp_path / "s", *overrides, "monitor.diagnose=auto")
    first, second = sorted((tmp_path / "s").glob("*/result.json"))
    assert json.loads(first.read_text())["verdict"] == "corrupt_checkpoint"
    d = json.loads((first.parent / "diagnosis.json").read_text())  # the sweep's own diagnosis
    assert d["mechanism"] == "corrupt_checkpoint" and d["agrees"] and "good copy of the file" in d["known_fix"]
    rows = d["counterfactuals"]["rows"]
    assert len(rows) == len(ROWS) and all(r["outcome"] is None and r["not_applicable"] for r in rows)
    assert not (first.parent / "diagnosis").exists()  # no replay, no row, no fix ran
    capsys.readouterr()
    assert main([str(second.parent)]) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and "nothing to replay" in out.out
    assert json.loads((second.parent / "diagnosis.json").read_text())["mechanism"] == "corrupt_checkpoint"


def test_valid_json_of_the_wrong_shape_is_named_and_left_out_by_the_report(tmp_path, capsys):
    """Before: a result.json whose `mechanism` is a string, or a diagnosis.json that is `null`, a list or has a
    string `fix`, stopped `python -m sweep.report` with an AttributeError traceback. Now the result.json is left
    out and named; a damaged diagnosis.json is named and its run kept (its diagnosis left out)."""
    from sweep.report.__main__ import main

    from .test_report_tables import diverged, write_run

    root = tmp_path / "s"
    write_run(root, 0, {"optim.lr": 1e-3}, {"status": "stable", "final_loss": 0.5})
    write_run(root, 1, {"optim.lr": 2e-3}, {**diverged("loss_spike", 3, "loss"), "mechanism": "boom"})
    for n, content in ((2, None), (3, [1]), (4, {"mechanism": "lr_too_high", "fix": "x"})):
        run_dir = write_run(root, n, {"optim.lr": n * 1e-3}, diverged("loss_spike", 3, "loss"))
        (run_dir / "diagnosis.json").write_text(json.dumps(content))
    assert main([str(root), "--no-html"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"{root}/1/result.json: mechanism is not an object or null" in err
    for n, why in (
        (2, "not a JSON object (a JSON null)"),
        (3, "not a JSON object (a JSON array)"),
        (4, "fix is not an object"),
    ):
        assert f"{root}/{n}/diagnosis.json: {why}" in err, err
    assert "4 runs from" in err and "(1 result.json, 3 diagnosis.json skipped" in err, err


@pytest.fixture(scope="module")
def spiked(tmp_path_factory):
    """A real 12-step run that spiked at lr 3e-2: its directory, and its result.json's text."""
    from .conftest import multirun_in_process

    root = tmp_path_factory.mktemp("spiked")
    multirun_in_process(root, "steps=12", "optim.lr=3e-2", "ledger.enabled=false")
    return root / "0", (root / "0" / "result.json").read_text()


@pytest.mark.parametrize(
    "change,words",
    [
        ({"cause": [1]}, "cause is not an object or null (a JSON array)"),
        ({"first_bad_step": "four"}, "first_bad_step is not a 64-bit integer or null (got 'four')"),
        ({"first_bad_step": 999}, "first_bad_step 999 is not a step of the run (steps 0 to 11)"),
        ({"seconds": "fast"}, "seconds is not a number or null (got 'fast')"),
        ({"headroom": "x"}, "headroom is not a list of objects or null"),
        ({"start_step": "x"}, "start_step is not a 64-bit integer or null"),
        ({"status": 3}, "status is not a string"),
    ],
)
def test_valid_json_of_the_wrong_shape_is_one_line_for_diagnose(spiked, capsys, change, words):
    """Before: each was a traceback from deep inside the diagnosis (AttributeError, ValueError, TypeError)."""
    from sweep.diagnose.__main__ import main

    run_dir, text = spiked
    (run_dir / "result.json").write_text(json.dumps({**json.loads(text), **change}))
    try:
        assert main([str(run_dir), "--no-fix"]) == 2
    finally:
        (run_dir / "result.json").write_text(text)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sweep.diagnose: ") and words in err[0], err


@pytest.fixture
def read_only_copy(spiked, tmp_path):
    """A copy of the spiked run in a sweep dir that cannot be written: a read-only bind mount as root (who ignores
    the mode bits), its mode bits otherwise. Skipped where neither can be staged."""
    import os
    import shutil
    import subprocess

    src = tmp_path / "src"
    shutil.copytree(spiked[0], src / "0")
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        shutil.copytree(src / "0", ro / "0")
        for p in (ro / "0", ro):
            p.chmod(0o555)
        yield ro
        for p in (ro, ro / "0"):
            p.chmod(0o755)
        return
    for args in (["mount", "--bind", str(src), str(ro)], ["mount", "-o", "remount,bind,ro", str(ro)]):
        proc = subprocess.run(args, capture_output=True, text=True)
        if proc.returncode != 0:
            subprocess.run(["umount", "-l", str(ro)], capture_output=True)
            pytest.skip(f"cannot mount a read-only bind here (needs root with CAP_SYS_ADMIN): {proc.stderr.strip()}")
    yield ro
    subprocess.run(["umount", "-l", str(ro)], check=False)


def test_read_only_run_dirs_are_one_line_or_written_elsewhere(read_only_copy, tmp_path, monkeypatch, capsys):
    """Before: `sweep.diagnose` on a read-only run dir had every trial fail to write and died reading a missing
    trial.json; `sweep.replay` and `sweep.report` printed their findings, then a traceback writing forensics.json
    or report.html. Now: the diagnosis says where it cannot write and what to do (--out DIR) before running
    anything; the replay and the report write into the current directory, as the data doctor does, and say so;
    a place given on the command line that cannot be written is one line, exit 1."""
    from sweep.diagnose.__main__ import main as diagnose
    from sweep.replay import main as replay
    from sweep.report.__main__ import main as report

    run_dir, cwd = read_only_copy / "0", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    capsys.readouterr()

    def one_line(rc: int, *words: str) -> None:
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and all(w in err[0] for w in words), err

    assert diagnose([str(run_dir), "--no-fix"]) == 2
    one_line(2, "is not writable (Read-only file system", "give --out DIR")
    assert not list(run_dir.glob("diagnosis*"))
    assert diagnose([str(run_dir), "--no-fix", "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "diagnosis.json").read_text())["mechanism"]
    capsys.readouterr()

    assert replay([str(run_dir)]) == 0
    one_line(0, "forensics.json: Read-only file system: wrote", str(cwd / "forensics.json"))
    assert json.loads((cwd / "forensics.json").read_text())["step"] == 4
    assert replay([str(run_dir), "--json", str(run_dir / "f.json")]) == 1
    one_line(1, "could not write the findings", "--json FILE")

    assert report([str(read_only_copy)]) == 0
    err = capsys.readouterr().err
    assert "report.html: Read-only file system: wrote report.html into the current directory" in err, err
    assert (cwd / "report.html").is_file() and list(cwd.glob("plotly-*.min.js"))  # the page's plotly.js there too
    assert report([str(read_only_copy), "--html", str(read_only_copy / "r.html")]) == 1
    one_line(1, "could not write r.html", "--no-html")


def signal_when(proc, needle: str, sig: int) -> tuple[str, str]:
    """Send `sig` to `proc` once `needle` is in its stdout; wait for it; (stdout, stderr)."""
    import threading
    import time

    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.time() + 300
    while proc.poll() is None and not any(needle in line for line in out) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    err = proc.stderr.read()
    proc.wait(timeout=120)
    reader.join(timeout=10)
    return "".join(out), err


def test_ctrl_c_during_a_diagnosis_stops_it_with_one_line_and_no_misleading_record(tmp_path):
    """Before: Ctrl-C during `python -m sweep.diagnose` (or the sweep's monitor.diagnose=auto) was a
    KeyboardInterrupt traceback, and the run in progress was recorded as `error`. Now the run stops after its
    step, recorded as `interrupted`; the diagnosis stops there with one line, exit 130, diagnosis.json not
    written. A 3000-step run that spikes at step 4: its fix runs 3000 steps, stopped by the signal."""
    import signal

    from .conftest import FAST, run_cli

    argv = ["-m", "sweep", "-m", *FAST, "threads=1", "steps=3000", "optim.lr=3e-2", "ledger.enabled=false"]
    sweep = run_cli(*argv, "monitor.diagnose=auto", f"hydra.sweep.dir={tmp_path}/s", background=True, cwd=tmp_path)
    out, err = signal_when(sweep, "fix 1/", signal.SIGINT)
    run_dir = tmp_path / "s" / "0"
    assert sweep.returncode == 130 and "Traceback" not in out + err, err[-3000:]
    assert f"sweep: SIGINT: stopped diagnosing {run_dir} (no diagnosis.json written" in err, err
    assert not (run_dir / "diagnosis.json").exists()
    fix = json.loads((run_dir / "diagnosis" / "fix_1" / "trial.json").read_text())
    assert fix["status"] == "interrupted", fix["reason"]

    diagnosis = run_cli("-m", "sweep.diagnose", str(run_dir), background=True, cwd=tmp_path)
    out, err = signal_when(diagnosis, "fix 1/", signal.SIGINT)
    assert diagnosis.returncode == 130 and "Traceback" not in out + err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("sweep.diagnose:")]
    assert len(lines) == 1 and "SIGINT: stopped" in lines[0] and "diagnosis.json is not written" in lines[0], err
    assert not (run_dir / "diagnosis.json").exists()
    assert json.loads((run_dir / "diagnosis" / "fix_1" / "trial.json").read_text())["status"] == "interrupted"


@pytest.mark.parametrize(
    "url,words",
    [
        ("notaurl", "ledger.storage: must be a database URL"),
        ("postgresql://me@127.0.0.1:9/x", "cannot open postgresql://me@127.0.0.1:9/x (OperationalError: connection"),
        ("sqlite:////proc/nowhere/x.db", "cannot open sqlite:////proc/nowhere/x.db (FileNotFoundError: "),
    ],
)
def test_the_optuna_sweeper_with_a_ledger_it_cannot_open_is_one_line(tmp_path, url, words):
    """Before: hydra/sweeper=optuna_sweep with a malformed ledger URL was a 40-line ValueError traceback, and with
    an unreachable server 160 lines of SQLAlchemy traceback. Now both are one line (ConfigError, exit 2 from
    `python -m sweep`), before any run."""
    from .conftest import multirun_in_process

    overrides = ["hydra/sweeper=optuna_sweep", "hydra.sweeper.sampler.name=grid", "optim.lr=choice(1e-3,2e-3)"]
    with pytest.raises(ConfigError, match=r"^ledger.storage: ") as err:
        multirun_in_process(tmp_path / "s", "steps=2", f"ledger.storage={url}", *overrides)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not list((tmp_path / "s").glob("*/result.json"))


def custom(target: str, *overrides: str):
    return make_run("model=custom", f"model.target=tests.custom_factories:{target}", *overrides)


@pytest.mark.parametrize(
    "target,words",
    [
        ("batch_of_two_only", "must return a prediction of x's shape (4, 3, 4, 8, 8), got (2, 3, 4, 8, 8)"),
        ("reshapes_to_two", "on a batch of shape (4, 3, 4, 8, 8) raised RuntimeError: shape '[2, 3, 4, 8, 8]'"),
        ("no_parameters", "the model has no parameter to train (0 parameters"),
        ("frozen", "the model has no parameter to train (1 parameters, none with requires_grad=True)"),
        ("no_grad_forward", "returns a prediction with no grad_fn (computed under torch.no_grad() or detached)"),
        ("detached_output", "returns a prediction with no grad_fn"),
    ],
)
def test_a_custom_model_that_passes_a_batch_2_forward_but_cannot_train_is_refused_before_any_run(target, words):
    """Before: these passed the probe (one no-grad forward on a batch of 2) and every run ended `error` with a
    traceback: the shape at the run's batch of 4, AdamW's "optimizer got an empty parameter list", backward's
    "element 0 of tensors does not require grad". The probe now runs its forward with autograd, also at the run's
    batch size, and checks there is something to train."""
    with pytest.raises(ConfigError) as err:
        check_inputs(custom(target, "model.kwargs={}"))
    assert str(err.value).startswith("model.target: ") and words in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "target,overrides,words",
    [
        ("batch_of_two_only", ["data.batch_size=2", "steps=1"], "x's shape (16, 3, 4, 8, 8), got (2, 3, 4, 8, 8)"),
        ("no_grad_forward", ["steps=2"], "returns a prediction with no grad_fn"),
        ("no_parameters", ["steps=2"], "model: no parameter to train (0 parameters"),
    ],
)
def test_what_the_probe_cannot_tell_is_an_error_of_one_line_per_run(tmp_path, caplog, target, overrides, words):
    """What reaches a run all the same (the eval batch of 16 of a model that works at 2 only; a run started without
    the probe) is `error` with one line: the reason, no traceback in the log (before: a traceback per run)."""
    from sweep.run.execute import execute

    r = execute(custom(target, "model.kwargs={}", *overrides), tmp_path, {})
    assert r.status == "error" and words in r.reason and "\n" not in r.reason, r.reason
    assert "Traceback" not in caplog.text and "run crashed" not in caplog.text, caplog.text[-2000:]
