"""python -m sweep.parity: passes our kernels, catches OpenDiT's modulate row-index bug, takes user kernels."""

from __future__ import annotations

import torch

from sweep.parity import check, main, resolve
from sweep.run.execute import execute

from .conftest import make_run


def row_zero_modulate(x, shift, scale):
    """A user kernel with OpenDiT's bug, given by import path."""
    return x * (1 + scale[:1, None]) + shift[:1, None]


def test_our_kernels_pass_every_dtype_and_batch(capsys):
    assert main(["--modulate", "fused", "--attention", "flash", "eager", "math"]) == 0
    out = capsys.readouterr().out
    assert "MISMATCH" not in out and out.count(" ok") == 4 * 3 * 4


def test_fused_buggy_passes_at_batch_one_and_fails_above():
    fn = resolve("modulate", "fused_buggy")
    for dtype in ("fp32", "bf16", "fp16"):
        assert max(check("modulate", fn, dtype, batch=1)) <= 1
        assert max(check("modulate", fn, dtype, batch=2)) > 1
    assert main(["--modulate", "fused_buggy"]) == 1


def test_a_user_kernel_by_import_path(capsys):
    assert main(["--modulate", "tests.test_parity_cli:row_zero_modulate", "--batches", "1,3"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_usage_errors_exit_2(capsys):
    assert main(["--modulate", "triton"]) == 2
    assert main(["--attention", "no_such_module:fn"]) == 2
    assert main(["--dtypes", "fp8"]) == 2


def test_fused_buggy_is_a_modulate_option_of_the_runner(tmp_path):
    r = execute(make_run("modulate=fused_buggy", "steps=2"), tmp_path, params={})
    assert r.status == "stable" and r.kernels["modulate"].startswith("fused_buggy")
    assert torch.ops.dit_sweep.modulate  # the real fused op is untouched
