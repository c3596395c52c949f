"""Issue 45, red-team finding 9: `steps` had no upper bound, its per-step tables were built before step 0, and a
stop signal during that set-up was ignored. Each test fails without its fix (checked when it was written)."""

from __future__ import annotations

import os
import signal

from .conftest import make_run, read_result


def test_a_signal_during_the_set_up_stops_the_run_before_step_0(tmp_path, monkeypatch):
    """Before: a signal while the run was built only set the stop request, which was read after a step: a run
    whose set-up took long (steps=1e11 building its tables) ignored SIGTERM; here the run trained its steps and
    ended stable. Now the set-up stops at once and the run is `interrupted` before step 0."""
    from sweep.run import execute as ex
    from sweep.run.interrupt import stopping_on_signals

    real = ex.prepare

    def prepare(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered here, in the middle of the set-up
        return real(*args, **kwargs)

    monkeypatch.setattr(ex, "prepare", prepare)
    with stopping_on_signals() as request:
        r = ex.execute(make_run("steps=4"), tmp_path, {})
    assert request.signum == signal.SIGTERM
    assert r.status == "interrupted" and r.reason == "SIGTERM during the set-up, before step 0", r.reason
    assert r.interrupted_at_step is None and not r.steps_run
    assert read_result(tmp_path)["status"] == "interrupted" and not (tmp_path / "metrics.csv").exists()
