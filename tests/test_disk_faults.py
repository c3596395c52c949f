"""A disk that fills up, or turns read-only, in the middle of a sweep: every result.json written before
stands, the run that could not write its files ends `error` naming the cause (in the log and the ledger),
and the sweep stops with one line instead of a traceback. Needs a small tmpfs (root with CAP_SYS_ADMIN,
as in CI's container); elsewhere the tests are skipped, saying why."""

from __future__ import annotations

import errno
import subprocess

import optuna
import pytest

import sweep.run.execute

from .conftest import FAST, multirun_in_process, read_result, sweep_forked


@pytest.fixture
def mount(tmp_path):
    """A 2 MiB tmpfs of this test's own (unmounted afterwards)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {proc.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path) -> None:
    """Write into `path` until the file system says it is full."""
    with open(path / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC


def read_only_over(run_dir) -> None:
    """Put a read-only file system over the job directory (a remount of the whole tmpfs is refused while
    the sweep holds files open for writing in it)."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(run_dir)], check=True)


def sweep_with_fault(monkeypatch, tmp_path, mnt, job: str, fault) -> tuple[list, BaseException | None]:
    """A 2-cell grid in `mnt`, the ledger outside it; `fault(the job's dir)` strikes while that job trains."""
    real = sweep.run.execute.execute_runs

    def execute_runs(runs, out_dirs, *args, **kwargs):
        if out_dirs[0].name == job:
            fault(out_dirs[0])
        return real(runs, out_dirs, *args, **kwargs)

    monkeypatch.setattr(sweep.run.execute, "execute_runs", execute_runs)
    raised = None
    try:
        multirun_in_process(
            mnt / "sweep", "optim.lr=1e-3,2e-3", "steps=3", f"ledger.storage=sqlite:///{tmp_path / 'ledger.db'}"
        )
    except OSError as e:
        raised = e
    finally:
        subprocess.run(["umount", "-l", str(mnt / "sweep" / job)], capture_output=True)
    study = optuna.load_study(study_name=str(mnt / "sweep"), storage=f"sqlite:///{tmp_path / 'ledger.db'}")
    return study.trials, raised


@pytest.mark.slow
def test_a_disk_that_fills_mid_sweep_keeps_every_written_result_and_names_the_cause(monkeypatch, tmp_path, mount):
    trials, raised = sweep_with_fault(monkeypatch, tmp_path, mount, "1", lambda _: fill(mount))
    assert raised is None  # the summary cannot be saved either: logged, the sweep ends as usual

    sweep_dir = mount / "sweep"
    first = read_result(sweep_dir / "0")  # written before the fault: intact
    assert first["status"] == "stable" and first["steps_run"] == 3
    assert not (sweep_dir / "1" / "result.json").exists() and not (sweep_dir / "1" / "result.tmp").exists()
    by_dir = {t.user_attrs["run_dir"]: t for t in trials}
    failed = by_dir[str((sweep_dir / "1").resolve())]  # its outcome reached the ledger, with the cause
    assert failed.state is optuna.trial.TrialState.FAIL and failed.user_attrs["status"] == "error"
    reason = failed.user_attrs["reason"]
    assert "No space left on device" in reason and "a run that ended stable" in reason
    assert len(trials) == 2


def test_a_run_dir_that_turns_read_only_mid_sweep_is_an_error_and_the_sweep_goes_on(monkeypatch, tmp_path, mount):
    trials, raised = sweep_with_fault(monkeypatch, tmp_path, mount, "0", read_only_over)
    assert raised is None
    sweep_dir = mount / "sweep"
    by_dir = {t.user_attrs["run_dir"]: t.user_attrs for t in trials}
    assert [by_dir[str((sweep_dir / n).resolve())]["status"] for n in "01"] == ["error", "stable"]
    assert "Read-only file system" in by_dir[str((sweep_dir / "0").resolve())]["reason"]
    assert read_result(sweep_dir / "1")["status"] == "stable"


@pytest.mark.slow
def test_a_read_only_sweep_dir_is_one_line_not_a_traceback(tmp_path, mount):
    subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
    proc = sweep_forked("-m", *FAST, "steps=2", "optim.lr=1e-3,2e-3", f"hydra.sweep.dir={mount}/sweep")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert f"sweep: stopped: Read-only file system: {mount}/sweep" in proc.stderr
