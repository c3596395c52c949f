"""Issue #46's grid, as a user types it: fp8 matmuls x optimizers in one `python -m sweep -m`, every run ending
with a verdict and recording what ran (emulated fp8, the layers kept high, the optimizer's state dtypes)."""

from __future__ import annotations

import pytest

from .conftest import FAST, SMALL_MODEL, read_results, run_cli


@pytest.mark.slow
def test_fp8_precisions_times_optimizers_run_to_verdicts_and_say_what_ran(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        "-m",
        "sweep",
        "-m",
        "precision=bf16_amp,fp8_tensorwise,fp8_rowwise",
        "optim=adamw,adamw_8bit,adafactor",
        "optim.lr=1e-3",
        "steps=3",
        "device=cpu",
        "ledger.enabled=false",
        "report.html=false",
        *FAST,
        *SMALL_MODEL,
        f"hydra.sweep.dir={sweep_dir}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for noise in ("Enum subclass", "/torchao/_C_", "kernels-community", "Detected no triton"):  # sweep/__init__.py
        assert noise not in proc.stderr + proc.stdout
    results = read_results(sweep_dir)
    assert len(results) == 9
    stable = {(r["params"]["precision"], r["params"]["optim"]) for r in results if r["status"] == "stable"}
    assert {("bf16_amp", "adamw"), ("fp8_tensorwise", "adamw")} <= stable  # bf16 and fp8 end to end
    for r in results:
        assert r["status"] in ("stable", "diverged"), r["reason"]
        precision, optim = r["params"]["precision"], r["params"]["optim"]
        o = r["optimizer"]
        assert o["name"] == optim and o["eager"] is (optim != "adamw")
        assert ("uint8" in o["state_dtypes"]) is (optim == "adamw_8bit")
        if precision == "bf16_amp":
            assert r["fp8"] is None
            continue
        f = r["fp8"]
        assert f["emulated"] is True and f["recipe"] == precision.removeprefix("fp8_")
        assert len(f["converted"]) == 8 and "blocks.0.adaLN_modulation.1" in f["kept_high"]  # 4 in each block
        assert f["refused"] == {"final_layer.linear": "64 -> 12: out_features not a multiple of 16"}  # said
        assert f["layers"] and "evidence_step" in f
    out = " ".join(proc.stdout.split())
    assert "Divergence map" in out and "fp8_rowwise" in out and "adamw_8bit" in out
