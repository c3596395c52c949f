"""Issue 45, red-team finding 8: inputs that ended in a traceback, each now one clear line or a correct result.

Each test says what it was before; each fails without its fix (checked when it was written)."""

from __future__ import annotations

import json

import pytest

from sweep.config import ConfigError, check_inputs

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
