"""Sweep progress: k/N on every run's line with the sweep's counts and ETA, a bar at a terminal, a watcher for
runs in other processes; and the lines every run would repeat, said once per sweep."""

from __future__ import annotations

import json
import logging
import os
import re
import time

import torch
from safetensors.torch import save_file

from sweep.config import Progress
from sweep.run import build
from sweep.run.progress import RunProgress, SweepProgress, close_sweep, open_sweep

from .conftest import SMALL_MODEL, multirun_in_process, read_results


def test_a_grid_prefixes_k_of_n_counts_diverged_and_says_its_data_lines_once(tmp_path, capsys, monkeypatch):
    """The trial saw `#k :` lines and one line per run with no "k of N" and no ETA, and the same two data lines
    for each of 96 runs. Now each run's line starts k/N and ends with the sweep's counts and ETA, and the folder
    data's lines (the training files, drop_bad's left-out samples) are said once for the sweep, the runs of its
    diagnosis and confirmation included."""
    root = tmp_path / "latents"
    root.mkdir()
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        x = torch.rand(3, 4, 8, 8, generator=g) * 1.8 - 0.9
        x[0, 0, 0, 0] = 1.5 if i == 2 else x[0, 0, 0, 0]
        save_file({"latents": x}, str(root / f"z{i}.safetensors"))
    data = ["data=latent_folder", f"data.path={root}", "data.channels=3", "data.drop_bad=true", "data.eval_files=0"]
    grid = ["precision=fp32,fp16_pure", "optim.lr=1e-4,1e-3", "steps=2", "ledger.enabled=false"]
    grid += ["monitor.diagnose=auto", "confirm.mode=auto", "report.html=false"]  # their runs load the data too
    build_log = SaidLog(build.log)  # what the runs' set-up said, the diagnosis's and confirmation's runs included
    monkeypatch.setattr(build, "log", build_log)
    capsys.readouterr()
    multirun_in_process(tmp_path / "sweep", *SMALL_MODEL, *data, *grid)
    out = capsys.readouterr()
    said = [line.split(" - ", 1)[-1] for line in (out.out + out.err).splitlines()]  # without the log prefix
    results = read_results(tmp_path / "sweep")
    assert sorted(r["status"] for r in results) == ["diverged", "diverged", "stable", "stable"]
    lines = [line for line in said if re.match(r"\d+/4 \[\d\] ", line)]
    assert [line.split(" ")[0] for line in lines] == ["1/4", "2/4", "3/4", "4/4"]
    assert all(re.search(r"so far, ETA \d+(m\d\ds)?s$", line) for line in lines[:3]), lines
    assert re.search(r"; 2 diverged; done in \d+", lines[3]), lines[3]
    assert (tmp_path / "sweep" / "confirmation.json").exists()
    assert list((tmp_path / "sweep").glob("*/diagnosis.json")), "a diagnosis ran"
    assert sum(line.startswith("data: 6 training files from") for line in build_log.said) == 1, build_log.said
    dropped = [line for line in said if line.startswith("data.drop_bad: left out 1 of 6 samples: 1 x values outside")]
    assert len(dropped) == 1, said


class SaidLog:
    """A logger that keeps what is said at INFO or above (say_once says a repeat at debug)."""

    def __init__(self, log: logging.Logger):
        self.real, self.said = log, []

    def log(self, level: int, msg: str, *args) -> None:
        if level >= logging.INFO:
            self.said.append(msg % args if args else msg)
        self.real.log(level, msg, *args)

    def __getattr__(self, name: str):
        return getattr(self.real, name)


def test_sweep_progress_counts_each_run_once_and_estimates_what_is_left(monkeypatch):
    clock = iter([100.0, 110.0, 125.0, 130.0])
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    sweep = SweepProgress(4, Progress.none)  # starts at t=100
    assert sweep.finished(2, "stable") and not sweep.finished(2, "stable")  # t=110
    assert sweep.position() == "1/4"
    assert sweep.counts() == "0 diverged so far, ETA 15s"  # t=125: 10 s a run, 3 left, 15 s into the next
    assert sweep.finished(0, "diverged")  # t=130
    assert sweep.bar is None


def test_the_bar_of_a_sweep_shows_the_run_in_progress(capsys):
    sweep = open_sweep(3, Progress.bar)
    try:
        run = RunProgress(5, Progress.bar, 1, "run")
        assert run._bar is None and run.sweep is sweep  # one bar: the sweep's
        run.update(0, 0.5)
        assert "0 diverged so far, ETA - | step 1/5 loss 0.5" in str(sweep.bar)
        run.close()
        assert RunProgress(5, Progress.none, 1).sweep is None  # forensics' and diagnosis' quiet runs draw nothing
    finally:
        close_sweep()
    assert "step 1/5" in capsys.readouterr().err


def test_runs_in_other_processes_are_counted_from_their_job_directories(tmp_path, caplog):
    """joblib/submitit run jobs elsewhere: the grid sweeper's process watches their result.json files."""
    from hydra_plugins.dit_sweep.grid_sweeper import ResultWatcher

    dirs = {n: tmp_path / str(n) for n in range(3)}
    for d in dirs.values():
        d.mkdir()
    stale = dirs[2] / "result.json"  # a resumed cell's earlier attempt: not this launch's
    stale.write_text(json.dumps({"status": "error"}))
    os.utime(stale, (time.time() - 60, time.time() - 60))
    caplog.set_level(logging.INFO, logger="sweep")
    sweep = open_sweep(3, Progress.none)
    try:
        with ResultWatcher(dirs, every=0.05):
            (dirs[1] / "result.json").write_text(json.dumps({"status": "diverged"}))
            time.sleep(0.3)
            (dirs[0] / "result.json").write_text(json.dumps({"status": "stable"}))
        assert sweep.done == {1: "diverged", 0: "stable"}
    finally:
        close_sweep()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sweep: ")]
    assert said[0].startswith("sweep: 1/3 finished: [1] diverged; 1 diverged so far, ETA ")
    assert said[1].startswith("sweep: 2/3 finished: [0] stable; 1 diverged so far, ETA ")
