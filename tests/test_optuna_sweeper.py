"""Our Optuna sweeper: search with diverging runs, resume without duplicates, grid cells, stale trials."""

from __future__ import annotations

import subprocess
import threading
import time

import optuna
import pytest
from optuna.trial import TrialState

from sweep.search.ledger import CONSTRAINTS_KEY
from sweep.search.space import parse

from .conftest import FAST, SMALL_MODEL, kill_mid_run, multirun_in_process, run_cli, sweep_forked

OPTUNA_SWEEP = ["-m", "sweep", "-m", "hydra/sweeper=optuna_sweep", *FAST, *SMALL_MODEL]


def sweep(tmp_path, *args, check=True):
    """`python -m sweep -m` with our Optuna sweeper into tmp_path/sweep; check: it must exit 0."""
    proc = run_cli(*OPTUNA_SWEEP, "steps=4", f"hydra.sweep.dir={tmp_path / 'sweep'}", *args, cwd=tmp_path)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def sweep_here(tmp_path, capsys, *args) -> str:
    """The same sweep through Hydra's multirun in this process (no interpreter start-up); what it printed."""
    capsys.readouterr()
    multirun_in_process(tmp_path / "sweep", *SMALL_MODEL, "hydra/sweeper=optuna_sweep", "steps=4", *args)
    return capsys.readouterr().out


def study(tmp_path):
    return optuna.load_study(
        study_name=str(tmp_path / "sweep"), storage=f"sqlite:///{tmp_path / 'sweep' / 'ledger.db'}"
    )


def test_search_space_syntax_matches_hydra():
    space, fixed = parse(
        [
            "optim.lr=tag(log,interval(1e-5,1e-1))",
            "precision=fp32,bf16_amp",
            "steps=range(10,40,10)",
            "optim.warmup_steps=int(interval(0,20))",
            "seed=3",
        ]
    )
    assert space["optim.lr"].log and space["optim.lr"].low == 1e-5
    assert space["precision"].choices == ("fp32", "bf16_amp")
    assert space["steps"].choices == (10, 20, 30)  # Hydra's range excludes its end, for every sampler
    assert (space["optim.warmup_steps"].low, space["optim.warmup_steps"].high) == (0, 20)
    assert fixed == ["seed=3"]


@pytest.mark.slow
def test_search_records_diverged_runs_as_infeasible_and_resumes_to_n_trials(tmp_path, capsys):
    args = [
        "hydra.sweeper.sampler.seed=0",
        "hydra.sweeper.n_jobs=2",
        "optim.lr=tag(log,interval(1e-4,1.0))",
        "precision=fp32,fp16_pure",
    ]
    out = sweep_here(tmp_path, capsys, "hydra.sweeper.n_trials=3", *args)
    assert "Divergence map" in out
    first = study(tmp_path).trials
    assert len(first) == 3 and all(t.state is TrialState.COMPLETE for t in first)
    diverged = [t for t in first if t.user_attrs["status"] == "diverged"]
    assert diverged and all(t.system_attrs[CONSTRAINTS_KEY] == [1.0] for t in diverged)
    assert all(t.params["precision"] == "fp16_pure" for t in diverged)

    sweep_here(tmp_path, capsys, "hydra.sweeper.n_trials=4", *args)  # the same command, more trials: only 1 more runs
    trials = study(tmp_path).trials
    assert len(trials) == 4 and [t.params for t in trials[:3]] == [t.params for t in first]
    assert len({t.user_attrs["run_dir"] for t in trials}) == 4


@pytest.mark.slow
def test_a_killed_sweeps_trial_too_young_to_be_stale_is_waited_for_and_its_cell_run(tmp_path, capsys):
    """The same command at once after kill -9: the killed trial still looks alive (beaten a moment ago).
    Before, the resume skipped its cell and exited 0 with 3 of 4 cells; now it waits until the trial is
    stale (stale_after_s), fails it and runs its cell. Two cells show it: the other one runs first (and stops the
    beats), the killed one's must follow."""
    args = ["hydra.sweeper.sampler.name=grid", "precision=fp32,fp16_pure", "optim.lr=choice(1e-3)"]
    url = f"sqlite:///{tmp_path / 'sweep' / 'ledger.db'}"
    (tmp_path / "sweep").mkdir()
    s = optuna.create_study(study_name=str(tmp_path / "sweep"), storage=url)
    dists = parse(args[1:])[0]
    s.enqueue_trial({"precision": "fp32", "optim.lr": 1e-3})
    young = s.ask(dists)  # RUNNING, beaten until the resume has started a run, then never again
    storage, started = optuna.storages.RDBStorage(url), threading.Event()

    def beat() -> None:  # the killed sweep, alive until the resume is under way
        while not started.is_set():
            storage.record_heartbeat(young._trial_id)
            started.wait(0.3)
            started.set() if list((tmp_path / "sweep").glob("*/result.json")) else None

    threading.Thread(target=beat, daemon=True).start()
    sweep_here(tmp_path, capsys, "hydra.sweeper.stale_after_s=2", "hydra.sweeper.heartbeat_s=1", *args)
    started.set()
    trials = study(tmp_path).trials
    assert trials[young.number].state is TrialState.FAIL and trials[young.number].system_attrs["stale"]
    finished = [tuple(sorted(t.params.items())) for t in trials if t.state is TrialState.COMPLETE]
    assert len(finished) == 2 == len(set(finished))


@pytest.mark.slow
def test_grid_runs_exactly_the_missing_cells_after_a_stale_trial(tmp_path, capsys):
    args = ["hydra.sweeper.sampler.name=grid", "precision=fp32,fp16_pure", "optim.lr=choice(1e-4,1e-3)"]
    url = f"sqlite:///{tmp_path / 'sweep' / 'ledger.db'}"
    (tmp_path / "sweep").mkdir()
    s = optuna.create_study(study_name=str(tmp_path / "sweep"), storage=url)
    dists = parse(args[1:])[0]
    s.add_trial(
        optuna.trial.create_trial(
            params={"precision": "fp32", "optim.lr": 1e-4},
            distributions=dists,
            value=0.5,
            user_attrs={"status": "stable"},
        )
    )
    s.enqueue_trial({"precision": "fp32", "optim.lr": 1e-3})
    stale = s.ask(dists)  # RUNNING, as a killed sweep leaves it: one heartbeat, then silence
    optuna.storages.RDBStorage(url).record_heartbeat(stale._trial_id)
    time.sleep(2)
    sweep_here(tmp_path, capsys, "hydra.sweeper.stale_after_s=1", *args)
    trials = study(tmp_path).trials
    assert trials[stale.number].state is TrialState.FAIL and trials[stale.number].system_attrs["stale"]
    finished = [tuple(sorted(t.params.items())) for t in trials if t.state is TrialState.COMPLETE]
    assert len(finished) == 4 == len(set(finished))  # every cell once: the stale cell re-ran, the done one did not


@pytest.mark.slow
def test_killed_sweep_resumes_with_nothing_lost_or_duplicated(tmp_path, capsys):
    args = [
        "hydra.sweeper.sampler.name=grid",
        "precision=fp32,bf16_amp",
        "optim.lr=choice(1e-4,1e-3)",
        "hydra.sweeper.heartbeat_s=1",
        "hydra.sweeper.stale_after_s=3",
    ]
    proc = run_cli(
        *OPTUNA_SWEEP,
        "steps=60",
        "progress=log",  # each step in the job's log: the kill below waits for one
        "log_every=1",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        *args,
        cwd=tmp_path,
        background=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    kill_mid_run(proc, tmp_path / "sweep", "step 3/60")  # the second trial RUNNING
    killed = study(tmp_path).trials
    assert any(t.state is TrialState.RUNNING for t in killed), [t.state for t in killed]
    done_before = {t.number: t.params for t in killed if t.state is TrialState.COMPLETE}
    time.sleep(3.5)  # past stale_after_s
    sweep_here(tmp_path, capsys, "steps=4", *args)  # a fixed override may change on resume; the cells may not
    trials = study(tmp_path).trials
    complete = [tuple(sorted(t.params.items())) for t in trials if t.state is TrialState.COMPLETE]
    assert len(complete) == 4 == len(set(complete))
    assert all(trials[n].params == p and trials[n].state is TrialState.COMPLETE for n, p in done_before.items())
    assert [t.system_attrs.get("stale") for t in trials if t.state is TrialState.FAIL] == [True]


def test_bracket_bisects_in_log_space_and_stops_within_the_factor():
    from sweep.search.frontier import Bracket, grid_runs

    b, true_frontier, probes = Bracket(1e-5, 1e-1), 3e-3, []
    while (lr := b.next_lr(2.0)) is not None:
        probes.append(lr)
        b.observe(lr, "stable" if lr <= true_frontier else "diverged")
    assert probes[:2] == [1e-1, 1e-5]
    assert b.stable <= true_frontier < b.diverged and b.diverged / b.stable <= 2
    assert len(probes) == 6 < grid_runs(1e-5, 1e-1, 2.0) == 15
    undecided = Bracket(1e-5, 1e-1)
    undecided.observe(1e-1, "skipped")
    assert undecided.next_lr(2.0) is None and "skipped" in undecided.verdict()


def test_a_bracket_whose_max_stable_lr_is_marginal_says_so(tmp_path):
    """The bisection's largest stable lr is where runs stop diverging; when it trains far worse than the best lr
    (marginal, sweep/report/marginal.py) the summary's frontier stops below it. frontier.csv's `marginal` says so
    for that combination and that lr only (before, the search's table and the summary gave two max stable lrs)."""
    import pandas as pd

    from sweep.search.frontier import marginal_edges

    from .test_report_tables import write_run

    evals = {"fp32": {1e-3: 0.38, 5.6e-3: 0.23, 1.3e-2: 0.71}, "bf16_amp": {1e-3: 0.38, 5.6e-3: 0.23, 1.3e-2: 0.51}}
    n = 0
    for precision, by_lr in evals.items():
        for lr, loss in [*by_lr.items(), (2e-2, None)]:
            diverged = {"status": "diverged", "verdict": "loss_spike"}
            result = {"eval_loss": loss, "final_loss": loss} if loss else diverged
            write_run(tmp_path, n, {"precision": precision, "optim.lr": lr}, result)
            n += 1
    table = pd.DataFrame(
        [
            {"precision": p, "max_stable": 1.3e-2, "min_diverged": 2e-2, "runs": 4, "verdict": "-"}
            for p in ("fp32", "bf16_amp")
        ]
        + [{"precision": "fp16_pure", "max_stable": None, "min_diverged": 1e-4, "runs": 2, "verdict": "-"}]
    )
    assert marginal_edges(tmp_path, table, "optim.lr") == [True, False, False]  # 0.71 is over 3x 0.23; 0.51 is not


@pytest.mark.slow
def test_frontier_search_finds_the_grid_boundary_with_fewer_runs(tmp_path, capsys):
    from sweep.run.execute import execute

    from .conftest import make_run

    # 10 steps: every run here that diverges does so by step 4, and the grid's verdicts and the frontier's trials
    # (lr, verdict, first bad step) were the same at 6 and at 20 steps.
    grid = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1]
    status = {
        lr: execute(
            make_run(*SMALL_MODEL, "precision=fp32", f"optim.lr={lr}", "steps=10"), tmp_path / f"g{lr}", {}
        ).status
        for lr in grid
    }
    grid_stable = max(lr for lr in grid if status[lr] == "stable")
    grid_diverged = min(lr for lr in grid if status[lr] == "diverged")
    out = sweep_here(
        tmp_path,
        capsys,
        "hydra.sweeper.mode=frontier",
        "hydra.sweeper.n_jobs=2",
        "precision=fp32,fp16_pure",
        "optim.lr=tag(log,interval(1e-4,1.0))",
        "steps=10",
    )
    assert "Frontier of optim.lr within 2x" in out
    import pandas as pd

    front = pd.read_csv(tmp_path / "sweep" / "frontier.csv").set_index("precision")
    fp32 = front.loc["fp32"]
    assert fp32.min_diverged / fp32.max_stable <= 2.0 + 1e-9
    assert fp32.max_stable < grid_diverged and fp32.min_diverged > grid_stable  # the same boundary as the grid
    assert pd.isna(front.loc["fp16_pure"].max_stable)  # diverges at the bottom: two runs and done
    assert not front.loc["fp16_pure"].marginal
    assert front.runs.sum() < 2 * 15 and front.loc["fp16_pure"].runs == 2


@pytest.mark.parametrize(
    "setting,message",
    [
        ({"frontier_factor": 0.5}, r"^hydra.sweeper.frontier_factor: must be a finite number > 1, got 0.5$"),
        ({"frontier_factor": float("nan")}, r"^hydra.sweeper.frontier_factor: must be a finite number > 1, got nan$"),
        ({"mode": "bisect"}, r"^hydra.sweeper.mode: must be search or frontier, got 'bisect'$"),
        ({"sampler": {"name": "tpee"}}, r"^hydra.sweeper.sampler.name: unknown sampler 'tpee'"),
        ({"mode": "frontier", "pruner": {"name": "median"}}, r"^hydra.sweeper.pruner: frontier mode needs every run"),
    ],
)
def test_bad_sweeper_settings_are_config_errors(setting, message):
    """The plugin builds the implementation; its settings fail as ConfigError, like every other config mistake."""
    from hydra_plugins.dit_sweep.optuna_sweep import OptunaSweeper
    from sweep.config import ConfigError

    settings = {"sampler": {}, "n_trials": 2, "n_jobs": 1, "heartbeat_s": 5, "stale_after_s": 30, **setting}
    with pytest.raises(ConfigError, match=message):
        OptunaSweeper(**settings)


def test_a_bad_sweeper_setting_is_one_line_and_exit_2(tmp_path):
    proc = sweep(tmp_path, "hydra.sweeper.frontier_factor=0.5", "optim.lr=tag(log,interval(1e-4,1e-2))", check=False)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and lines == [
        "sweep: config error: hydra.sweeper.frontier_factor: must be a finite number > 1, got 0.5"
    ]


@pytest.mark.parametrize("mode", ["search", "frontier"])
def test_an_optuna_sweep_without_the_ledger_is_refused_before_any_run(tmp_path, mode):
    """Its study is the ledger: with ledger.enabled=false no run recorded its verdict, every trial ended FAIL, and a
    frontier said "undecided: a run at lr=1 was error" for runs that had diverged."""
    argv = [*OPTUNA_SWEEP[2:], f"hydra.sweeper.mode={mode}", "optim.lr=tag(log,interval(1e-4,1.0))"]
    proc = sweep_forked(*argv, "ledger.enabled=false", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("sweep: config error: ledger.enabled=false: the optuna sweeper's study is the ledger")
    assert not list(tmp_path.rglob("result.json"))


def test_replicates_are_a_seed_axis_of_the_grid_sampler_and_refused_elsewhere(tmp_path, capsys):
    sweep_here(
        tmp_path, capsys, "hydra.sweeper.sampler.name=grid", "optim.lr=choice(1e-4,1e-3)", "replicates=2", "steps=2"
    )
    trials = study(tmp_path).trials
    cells = sorted((t.params["optim.lr"], t.params["seed"]) for t in trials if t.state is TrialState.COMPLETE)
    assert cells == [(1e-4, 0), (1e-4, 1), (1e-3, 0), (1e-3, 1)]
    (tmp_path / "tpe").mkdir()
    proc = sweep(tmp_path / "tpe", "optim.lr=tag(log,interval(1e-4,1e-2))", "replicates=2", check=False)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "replicates=2: the optuna sweeper runs replicates" in lines[0]


def test_each_run_of_an_optuna_sweep_says_k_of_n_and_the_sweeps_eta(tmp_path, capsys):
    """As the grid sweeper's runs do (issue 45, item 4): N is the grid's cells, or the trials left to n_trials."""
    import re

    out = sweep_here(
        tmp_path, capsys, "hydra.sweeper.sampler.name=grid", "precision=fp32,fp16_pure", "optim.lr=choice(1e-4,1e-3)"
    )
    said = [line.split(" - ", 1)[-1] for line in out.splitlines()]
    lines = [line for line in said if re.match(r"\d+/4 \[\d\] ", line)]
    assert [line.split(" ")[0] for line in lines] == ["1/4", "2/4", "3/4", "4/4"], said
    assert re.search(r"; 2 diverged; done in \d+", lines[-1]), lines[-1]
    out = sweep_here(tmp_path / "tpe", capsys, "hydra.sweeper.n_trials=2", "optim.lr=tag(log,interval(1e-4,1e-3))")
    assert [ln.split(" - ", 1)[-1].split(" ")[0] for ln in out.splitlines() if "/2 [" in ln] == ["1/2", "2/2"], out
