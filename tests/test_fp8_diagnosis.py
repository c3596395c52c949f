"""The diagnosis of an fp8 run: its counterfactual rows (bf16 matmuls; the layers whose fp8 operands underflowed kept
in bf16) and its bisection, which looks for the modules to keep out of fp8 (precision.fp8_keep) rather than in
fp32."""

from __future__ import annotations

from pathlib import Path

from sweep.diagnose.bisect import Islands
from sweep.diagnose.counterfactual import fp8_rows
from sweep.diagnose.signals import RunRecord, computes_in_fp32

from .conftest import make_run


def record(run, fp8: dict | None) -> RunRecord:
    result = {"status": "diverged", "verdict": "loss_spike", "first_bad_step": 9, "fp8": fp8}
    return RunRecord(Path("."), result, [], None, run)


def test_an_fp8_run_gets_a_bf16_row_and_its_underflowing_layers_kept_high():
    run = make_run("precision=fp8_tensorwise", "precision.fp8_keep=[final_layer*]")
    layers = {
        "blocks.0.attn.qkv": {"input": {"underflow_pct": 0.1}, "grad_output": {"underflow_pct": 15.4}},
        "blocks.1.mlp.fc1": {"input": {"underflow_pct": 0.2}, "grad_output": {"underflow_pct": 4.9}},
    }
    rows = {r.name: r for r in fp8_rows(record(run, {"layers": layers}))}
    assert rows["bf16 matmuls"].overrides == ["precision.fp8=null"]
    assert rows["underflowing layers in bf16"].overrides == ["precision.fp8_keep=['final_layer*','blocks.0.attn.qkv']"]
    calm = {"blocks.1.mlp.fc1": layers["blocks.1.mlp.fc1"]}
    assert (
        "no fp8 operand underflowed"
        in {r.name: r for r in fp8_rows(record(run, {"layers": calm}))}["underflowing layers in bf16"].not_applicable
    )
    assert fp8_rows(record(make_run("precision=bf16_amp"), None)) == []


def test_the_overrides_apply_to_a_recorded_config_with_the_default_globs():
    """The default keep globs start with * (a YAML alias when bare): the rows' overrides must still apply (a diagnosis
    of a diverged fp8 run ended in a traceback on its first row)."""
    from omegaconf import OmegaConf

    from sweep.config import RunConfig
    from sweep.diagnose.trials import with_overrides

    run = make_run("precision=fp8_tensorwise")
    config = OmegaConf.structured(run)
    layers = {"blocks.0.attn.qkv": {"grad_output": {"underflow_pct": 15.4}}}
    for row in fp8_rows(record(run, {"layers": layers})):
        changed = with_overrides(config, row.overrides)
        assert isinstance(changed, RunConfig)
    kept = with_overrides(config, fp8_rows(record(run, {"layers": layers}))[1].overrides).precision.fp8_keep
    assert kept == [*run.precision.fp8_keep, "blocks.0.attn.qkv"] and kept[0] == "*t_embedder*"
    assert (
        with_overrides(config, Islands.of(run).overrides(["blocks.1.attn"])).precision.fp8_keep[-1] == "blocks.1.attn.*"
    )


def test_the_bisection_of_an_fp8_run_keeps_modules_in_bf16_not_fp32():
    fp8 = make_run("precision=fp8_rowwise", "precision.fp8_keep=[final_layer*]")
    islands = Islands.of(fp8)
    assert (islands.high, islands.everything) == ("bf16", ["precision.fp8=null"])
    assert islands.overrides(["blocks.1.attn"]) == [
        "precision.fp8_keep=['final_layer*','blocks.1.attn','blocks.1.attn.*']"
    ]
    bf16 = Islands.of(make_run("precision=bf16_amp"))
    assert bf16.overrides(["blocks.1.attn", "final_layer"]) == ["precision.fp32_modules=[blocks.1.attn,final_layer]"]
    # fp8 over fp32 weights without autocast still has a lower precision to take away
    assert not computes_in_fp32(make_run("precision=fp8_tensorwise", "precision.autocast_dtype=null"))
    assert computes_in_fp32(make_run("precision=fp32"))
