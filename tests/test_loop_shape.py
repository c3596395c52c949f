"""The shape of the training loop a reader follows (issue #47; docs/design.md, "The loop"): from `python -m sweep`
to the line where AdamW updates a weight, our own frames are few and named; train.py is one Loop class on a few
screens; no module of sweep/ grows past 600 lines."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

from .conftest import REPO

SPY = """
import os, runpy, sys, traceback
import sweep.run.adamw as adamw

real, seen = adamw.update_all_, []

def update_all_(*args, **kwargs):  # the multi-tensor AdamW update a default CPU run's DeviceAdamW.step calls
    if not seen:
        seen.append(1)
        ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith({repo!r})]
        ours = [f for f in ours if os.sep + ".venv" + os.sep not in f.filename]
        for f in ours:
            print("FRAME", os.path.relpath(f.filename, {repo!r}), f.name, file=sys.stderr)
    return real(*args, **kwargs)

adamw.update_all_ = update_all_
sys.argv = ["sweep", "steps=1", "progress=none", "ledger.enabled=false", "hydra.run.dir={out}"]
runpy.run_module("sweep", run_name="__main__", alter_sys=True)
"""


def test_from_python_m_sweep_to_the_adamw_update_are_six_frames_of_ours(tmp_path):
    """A default CPU run (sync_every=1, no graph): the module, the Hydra task, execute_runs, Loop.run, DeviceAdamW.step
    and the update itself. Windows, snapshots and device tables are not on the way."""
    code = SPY.format(repo=str(REPO), out=str(tmp_path / "run"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    frames = [line.split()[1:] for line in p.stderr.splitlines() if line.startswith("FRAME ")]
    frames.append(["sweep/run/adamw.py", "update_all_"])  # the spy stands in for it
    assert frames == [
        ["sweep/__main__.py", "<module>"],
        ["sweep/job.py", "run_job"],
        ["sweep/run/execute.py", "execute_runs"],
        ["sweep/run/train.py", "run"],
        ["sweep/run/adamw.py", "step"],
        ["sweep/run/adamw.py", "update_all_"],
    ], frames


def test_train_py_is_one_loop_class_in_at_most_200_lines():
    source = (REPO / "sweep" / "run" / "train.py").read_text()
    classes = [n.name for n in ast.parse(source).body if isinstance(n, ast.ClassDef)]
    assert classes == ["Loop"] and len(source.splitlines()) <= 200


def test_no_module_of_sweep_is_over_600_lines():
    long = {
        str(p.relative_to(REPO)): n
        for p in (REPO / "sweep").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert not long, long
