"""Property: any command line either runs (exit 0, a verdict in result.json) or is one line and exit 2.

Hypothesis draws overrides from the config schema (tests/cli_fuzz.py): wrong types, out-of-range and
non-finite numbers, unknown keys and options, odd unicode, empty strings, huge and negative integers.
CI checks a seeded, bounded sample through the command's own path up to the first step, and really
runs a few valid draws; `python bench/fuzz_cli.py --examples 10000` runs many more.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, seed, settings

from .cli_fuzz import COMMAND, Composer, outcome, run_job_in_process, runnable_command
from .conftest import read_result

CI = settings(deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def composer():
    with Composer() as c:
        yield c


@seed(21)
@settings(CI, max_examples=200)
@given(overrides=COMMAND)
@example(overrides=["finetune=null"])  # found by bench/fuzz_cli.py: Hydra's ValueError, a traceback
@example(overrides=["data=latent_folder", "data.path='a\nb'"])  # found too: a newline split the line
@example(overrides=["checkpoint=${steps}"])  # found too: a scalar where a section belongs, AttributeError
@example(overrides=["~ledger", "++ledger=3"])  # likewise
@example(overrides=["modulate=' a\x00b'"])  # found too: a NUL byte in an option, os.path's ValueError
def test_every_command_line_runs_or_is_one_line_and_exit_2(composer, overrides):
    kind, text = outcome(composer, overrides)
    assert kind != "traceback", f"{overrides}: {text}"
    if kind == "exit2":
        assert text.count("\n") == 1 and text.startswith("sweep: config error: "), (overrides, text)


@seed(21)
@settings(CI, max_examples=3)
@given(overrides=runnable_command())
def test_valid_draws_run_to_a_verdict(tmp_path_factory, overrides):
    run_dir = tmp_path_factory.mktemp("run")
    assert run_job_in_process(run_dir, ["steps=2", "eval.enabled=false", *overrides]) == 0
    result = read_result(run_dir)
    assert result["status"] in ("stable", "diverged", "skipped"), (overrides, result.get("reason"))
    assert (result["verdict"] is None) == (result["status"] != "diverged")
