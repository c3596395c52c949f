"""The recommendation reads the failures (issue #45 item 5): a sweep whose every run failed the data check is
pointed at the data and the doctor, not at the lr; each dominant cause gets its own fix."""

from __future__ import annotations

from sweep.report.recommend import recommend

from .test_noise_aware_tables import stable, write_sweep
from .test_report_tables import diverged

LRS = (1e-4, 1e-3, 1e-2)


def grid(result_of) -> list[tuple[dict, dict]]:
    return [({"precision": p, "optim.lr": lr}, result_of(p, lr)) for p in ("fp32", "bf16_amp") for lr in LRS]


def test_every_run_refused_by_the_data_check_points_at_the_data_and_the_doctor_not_the_lr(tmp_path):
    line = recommend(write_sweep(tmp_path / "s", grid(lambda p, lr: diverged("bad_input", 0, "input")))).line
    assert line.startswith("No stable run in this sweep, so nothing to recommend: all 6 failed runs: bad_input: ")
    assert "python -m sweep.doctor" in line and "not the lr" in line
    # a folder of clips of another size fails the same check: the doctor finds them only given the run's sizes
    assert "another shape or frame count" in line and "--channels C --frames F --height H --width W" in line
    assert "try lower optim.lr" not in line


def test_spikes_at_every_lr_say_the_smallest_lr_failed_too(tmp_path):
    line = recommend(write_sweep(tmp_path / "s", grid(lambda p, lr: diverged("loss_spike", 5, "optimizer")))).line
    assert "all 6 failed runs: loss_spike: a lower lr: the smallest lr tried (0.0001) failed too" in line


def test_a_diagnosed_mechanism_names_its_own_fix(tmp_path):
    def result(p, lr):
        return {**diverged("nonfinite_loss", 3, "forward"), "mechanism": {"name": "activation_overflow"}}

    line = recommend(write_sweep(tmp_path / "s", grid(result))).line
    assert "all 6 failed runs: activation_overflow: bf16 has fp32's range" in line


def test_errors_name_their_most_common_reason(tmp_path):
    def result(p, lr):
        return {"status": "error", "reason": "RuntimeError: mat1 and mat2 must have the same dtype"}

    line = recommend(write_sweep(tmp_path / "s", grid(result))).line
    assert "all 6 failed runs: error: errors, not verdicts" in line
    assert "mat1 and mat2 must have the same dtype" in line


def test_mixed_failures_have_no_dominant_cause(tmp_path):
    verdicts = {1e-4: "bad_input", 1e-3: "loss_spike", 1e-2: "nonfinite_grad"}
    line = recommend(write_sweep(tmp_path / "s", grid(lambda p, lr: diverged(verdicts[lr], 2, "forward")))).line
    assert "the 6 failed runs have no dominant cause" in line


def test_a_recommendation_also_names_the_failures_no_lr_fixes(tmp_path):
    def result(p, lr):
        return diverged("bad_input", 0, "input") if p == "bf16_amp" and lr == 1e-4 else stable(0.2 + lr)

    rec = recommend(write_sweep(tmp_path / "s", grid(result)))
    assert rec.settings
    assert "Whatever the lr: 1 run failed bad_input: the data, not the lr" in rec.line


def test_a_sweep_with_no_finished_run_says_so_not_lower_the_lr(tmp_path):
    from sweep.report.runs import runs_from_dirs

    from .test_report_tables import write_run

    for n, lr in enumerate(LRS):
        write_run(tmp_path / "s", n, {"optim.lr": lr}, None)  # started, no result.json yet
    line = recommend(runs_from_dirs(tmp_path / "s", starting_s=0)).line
    assert line == "No stable run in this sweep, so nothing to recommend: no run has finished (running or interrupted)."
