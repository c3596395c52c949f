"""fp8 matmuls (precision=fp8_*, sweep/run/fp8.py): parity with bf16 autocast and fp32, the filter's record, the
evidence (sweep/run/fp8_evidence.py), and runs through execute (a multirun of fp8 x optimizers, as a user types
it: tests/test_lowprec_sweep.py).

Parity tolerances are docs/fp8_groundwork.md's (section b, measured on these shapes with margin): the forward output
within rel 1e-2 of bf16 autocast and not equal to it (a silent bypass would be equal), each converted weight's
gradient within rel 0.15 and cosine 0.99 of fp32, and the recipes ordered rowwise_gw_hp <= rowwise <= tensorwise on
the median gradient error. Emulated fp8 costs ~3x bf16: the runs here are few and 2-3 steps long.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from sweep.config import ConfigError
from sweep.run import fp8, fp8_evidence
from sweep.run.build import build_parts, reset_process_state
from sweep.run.execute import execute, unsupported_reason
from sweep.run.model import build_run_model
from sweep.run.packed_model import PackedModel
from sweep.run.precision import PrecisionPolicy

from .conftest import SMALL_MODEL, make_run, read_result

pytest.importorskip("torchao")

CPU = torch.device("cpu")
RECIPES = ("tensorwise", "rowwise", "rowwise_gw_hp")
BLOCK = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
IMAGE = ("model=dit_tiny", "data=synthetic_image", "data.frames=1")
MODELS = {"dit": IMAGE, "video_dit": ()}


def built(*overrides: str):
    run = make_run("device=cpu", "threads=1", *overrides)
    policy = PrecisionPolicy.from_config(run.precision, CPU)
    reset_process_state(run, policy)
    return run, policy, build_parts(run, CPU, policy)


# The filter and its record


def test_the_default_keep_list_converts_the_block_matmuls_and_records_every_linear():
    _, _, parts = built("precision=fp8_tensorwise")
    rec = parts.fp8
    assert rec["recipe"] == "tensorwise" and rec["emulated"] is True
    assert rec["converted"] == [f"blocks.{i}.{n}" for i in range(4) for n in BLOCK]
    assert rec["refused"] == {"final_layer.linear": "128 -> 12: out_features not a multiple of 16"}
    assert rec["kept_high"]["t_embedder.mlp.0"] == "*t_embedder*"
    assert rec["kept_high"]["blocks.2.adaLN_modulation.1"] == "*adaLN*"
    assert rec["fp32_modules"] == []
    linears = [n for n, m in parts.model.named_modules() if isinstance(m, torch.nn.Linear)]
    sorted_into = [*rec["converted"], *rec["kept_high"], *rec["refused"], *rec["fp32_modules"]]
    assert sorted(sorted_into) == sorted(linears)  # each exactly once
    assert fp8.float8_layers(parts.model) == rec["converted"]


def test_dimensions_refuse_before_keep_globs_and_fp32_modules_before_both():
    """final_layer.linear (128 -> 12) is refused on the CPU too, where emulation would take it; a layer inside a
    precision.fp32_modules match computes in fp32 and is never converted."""
    _, _, parts = built(
        "precision=fp8_rowwise", "precision.fp8_keep=[final_layer*]", "precision.fp32_modules=[blocks.1.attn]"
    )
    rec = parts.fp8
    assert rec["fp32_modules"] == ["blocks.1.attn.qkv", "blocks.1.attn.proj"]
    assert list(rec["refused"]) == ["final_layer.linear"]
    assert rec["kept_high"] == {"final_layer.adaLN_modulation.1": "final_layer*"}
    assert "t_embedder.mlp.0" in rec["converted"] and "blocks.1.attn.qkv" not in rec["converted"]


def test_a_filter_that_converts_nothing_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="sweep"):
        _, _, parts = built("precision=fp8_tensorwise", "precision.fp8_keep=[*]")
    assert parts.fp8["converted"] == [] and fp8.float8_layers(parts.model) == []
    assert any("converts no layer to fp8" in r.message and "trains in bfloat16" in r.message for r in caplog.records)


# Parity (emulated, on fixed inputs)


def _inputs(model_overrides, seed: int = 1):
    run = make_run("device=cpu", *model_overrides)
    model = build_run_model(run)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # adaLN-Zero's zeros give most weights a zero gradient: as after some training instead
        for p in model.parameters():
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    d = run.data
    shape = (4, d.channels, d.height, d.width) if run.model.is_image else (4, d.channels, d.frames, d.height, d.width)
    g = torch.Generator().manual_seed(seed)
    x, t = torch.randn(shape, generator=g), torch.randint(0, 1000, (4,), generator=g).float()
    return run, model, (x, t, torch.randn(shape, generator=g))


def _fwd_bwd(model, x, t, target, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        pred = model(x, t)
    F.mse_loss(pred.float(), target).backward()
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return pred.detach().float(), {n: m.weight.grad.float() for n, m in linears}


def _rel(a, ref) -> float:
    return ((a - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module", params=list(MODELS))
def parity(request):
    """Per recipe: the fp8 output's rel error vs bf16 autocast, whether it equals it, and per converted layer the
    weight gradient's (rel, cosine) vs fp32."""
    run, model, (x, t, target) = _inputs(MODELS[request.param])
    ref32 = _fwd_bwd(copy.deepcopy(model), x, t, target, autocast=False)
    ref16 = _fwd_bwd(copy.deepcopy(model), x, t, target, autocast=True)
    out = {}
    for recipe in RECIPES:
        fp8_run = make_run("device=cpu", *MODELS[request.param], f"precision=fp8_{recipe}", "precision.fp8_keep=[]")
        converted = copy.deepcopy(model)
        names = fp8.convert(converted, fp8_run.precision, CPU)["converted"]
        pred, grads = _fwd_bwd(converted, x, t, target, autocast=True)
        errors = {n: (_rel(grads[n], ref32[1][n]), F.cosine_similarity(grads[n].flatten(), ref32[1][n].flatten(), 0))
                  for n in names}  # fmt: skip
        out[recipe] = (_rel(pred, ref16[0]), torch.equal(pred, ref16[0]), errors)
    return out


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_forward_is_within_1e_2_of_bf16_autocast_and_not_equal_to_it(parity, recipe):
    rel, equal, errors = parity[recipe]
    assert rel <= 1e-2 and not equal, (rel, equal)
    assert len(errors) == 23  # every linear but final_layer.linear (128 -> 12)


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_converted_weight_gradient_is_within_0_15_and_cosine_0_99_of_fp32(parity, recipe):
    errors = parity[recipe][2]
    worst = max(errors.items(), key=lambda kv: kv[1][0])
    assert all(rel <= 0.15 and cos >= 0.99 for rel, cos in errors.values()), worst
    assert min(rel for rel, _ in errors.values()) > 5e-3, "as close as bf16: the weights were not quantised"


def test_the_recipes_order_by_gradient_error(parity):
    median = {r: torch.tensor([rel for rel, _ in parity[r][2].values()]).median().item() for r in RECIPES}
    assert median["rowwise_gw_hp"] <= median["rowwise"] <= median["tensorwise"], median


def test_rowwise_gw_hp_runs_under_cpu_autocast_and_a_converted_layer_outputs_bf16():
    """Without the cast hook torchao's Float8Linear casts its input only under CUDA autocast: this backward raised."""
    _, policy, parts = built("precision=fp8_rowwise_gw_hp")
    seen = {}

    def record(module, args, output):
        seen.setdefault("fc1", output.dtype)

    parts.model.blocks[0].mlp.fc1.register_forward_hook(record)
    x = torch.stack([parts.dataset[i] for i in range(2)])
    with policy.gemm_mode(), policy.autocast(CPU):
        pred = parts.model(x, torch.tensor([3.0, 500.0]))
    pred.float().square().mean().backward()
    assert seen == {"fc1": torch.bfloat16}


# Runs


def test_a_short_run_ends_with_a_verdict_and_records_fp8_and_its_evidence(tmp_path):
    r = execute(make_run("device=cpu", "threads=1", "steps=3", "precision=fp8_tensorwise"), tmp_path, params={})
    assert r.status == "stable", (r.status, r.reason)
    rec = read_result(tmp_path)["fp8"]
    assert rec["recipe"] == "tensorwise" and rec["emulated"] is True and rec["evidence_step"] == 2
    assert rec["layers_measured"] == len(rec["converted"]) == len(rec["layers"]) == 16
    stats = rec["layers"]["blocks.0.mlp.fc1"]
    assert [stats[op]["dtype"] for op in ("input", "weight", "grad_output")] == ["e4m3fn", "e4m3fn", "e5m2"]
    # the whole GEMM against the same linear in bf16: e4m3's 3-bit mantissa, a few % (not 0: fp8 really ran)
    assert 1e-3 < stats.pop("output")["rel"] < 0.1
    for s in stats.values():  # tensorwise: one scale, fp8's largest value over the operand's amax
        assert 0 <= s["underflow_pct"] <= 100 and s["mse"] >= 0
        largest = 448 if s["dtype"] == "e4m3fn" else 57344
        assert s["scale_min"] == s["scale_max"] == pytest.approx(largest / s["amax"], rel=2e-3)
    assert set(rec["flagged"]) <= set(rec["converted"])


def test_rowwise_records_a_scale_per_row():
    _, _, parts = built("precision=fp8_rowwise", "steps=1")
    layers = fp8_evidence.measure(make_run("device=cpu", "steps=1", "precision=fp8_rowwise"), parts, 0)["layers"]
    s = layers["blocks.0.attn.qkv"]
    assert s["grad_output"]["dtype"] == "e4m3fn"  # rowwise quantises gradients to e4m3 too
    assert s["input"]["scale_min"] < s["input"]["scale_max"]


def test_the_evidence_leaves_no_gradient_and_draws_from_no_run_generator():
    run, _, parts = built("precision=fp8_tensorwise")
    noise_state, global_state = parts.noise_gen.get_state(), torch.get_rng_state()
    assert "layers" in fp8_evidence.measure(run, parts, 0)
    assert all(p.grad is None for p in parts.model.parameters())
    assert torch.equal(parts.noise_gen.get_state(), noise_state) and torch.equal(torch.get_rng_state(), global_state)


def test_an_outlier_that_sets_a_tensorwise_scale_flushes_the_rest_and_is_flagged():
    """One value 1e6 times the others: tensorwise e4m3 (range ~2^17.8 with subnormals) flushes them to zero."""
    _, _, parts = built("precision=fp8_tensorwise")
    layer = parts.model.blocks[0].mlp.fc1
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 1e-2
    x[0, 0] = 1e4
    stats = {"input": fp8_evidence.operand_stats(layer, "input", x)}
    assert stats["input"]["underflow_pct"] > 50
    assert fp8_evidence.over_limits(stats).startswith("input underflow")
    rowwise = built("precision=fp8_rowwise")[2].model.blocks[0].mlp.fc1
    assert fp8_evidence.operand_stats(rowwise, "input", x)["underflow_pct"] < 2  # one row pays, not the tensor


def test_the_same_config_twice_gives_identical_metrics_and_windows_change_nothing(tmp_path):
    """Twice with one sync per step, once in windows of 4 steps (one sync each): the same curve bit for bit."""
    for i, sync_every in enumerate((1, 1, 4)):
        run = make_run(
            *SMALL_MODEL,
            "device=cpu",
            "threads=1",
            "steps=4",
            "precision=fp8_rowwise",
            f"monitor.sync_every={sync_every}",
        )
        assert execute(run, tmp_path / str(i), params={}).status == "stable"
    first = (tmp_path / "0" / "metrics.csv").read_bytes()
    assert all((tmp_path / str(i) / "metrics.csv").read_bytes() == first for i in (1, 2))
    assert read_result(tmp_path / "0")["fp8"]["layers"] == read_result(tmp_path / "1")["fp8"]["layers"]
    assert read_result(tmp_path / "2")["sync"]["windows"] == 1


def test_emulated_bf16_gemms_leave_torchao_tensors_to_torchao(tmp_path):
    """precision.cpu_gemm=emulated (auto picks it on AVX2 CPUs): its dispatch mode widened torchao's fp8 tensors and
    raised `aten.to.dtype is not supported` (sweep/run/gemm.py)."""
    run = make_run("device=cpu", "threads=1", "steps=2", "precision=fp8_tensorwise", "precision.cpu_gemm=emulated")
    r = execute(run, tmp_path, params={})
    assert r.status == "stable" and r.kernels["gemm"] == "emulated", (r.status, r.reason)


def test_lora_adapters_train_on_fp8_base_layers():
    """peft wraps the nn.Linear it targets; the filter then converts its base_layer (a plain nn.Linear) and leaves
    the rank-4 adapters (128 -> 4) refused by dimension. Gradients reach the adapters through the fp8 base."""
    run, policy, parts = built("precision=fp8_tensorwise", "finetune=lora", "finetune.train_base=true")
    rec, rank = parts.fp8, run.finetune.rank
    assert "blocks.0.attn.qkv.base_layer" in rec["converted"] and rank % 16
    assert rec["refused"]["blocks.0.attn.qkv.lora_A.default"] == f"128 -> {rank}: out_features not a multiple of 16"
    with torch.no_grad():
        for p in parts.model.parameters():
            if not p.any():
                p.add_(torch.randn_like(p) * 0.02)
    x = torch.stack([parts.dataset[i] for i in range(2)])
    with policy.gemm_mode(), policy.autocast(CPU):
        pred = parts.model(x, torch.tensor([3.0, 500.0]))
    pred.float().square().mean().backward()
    adapter = parts.model.blocks[0].attn.qkv.lora_A["default"].weight
    assert adapter.grad is not None and adapter.grad.abs().sum() > 0


# Refusals


def test_packed_model_refuses_float8_layers():
    _, _, parts = built("precision=fp8_tensorwise")
    with pytest.raises(ValueError, match="cannot pack fp8 matmuls .*Float8Linear"):
        PackedModel([parts.model, copy.deepcopy(parts.model)])


def test_a_gpu_below_capability_8_9_is_skipped_with_the_reason(monkeypatch):
    run = make_run("device=cpu", "precision=fp8_rowwise")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    reason = fp8.unsupported_reason(run, torch.device("cuda"))
    assert reason.startswith("precision=fp8_rowwise: fp8 matmuls need CUDA compute capability >= 8.9")
    assert reason.endswith("NVIDIA A100 has 8.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8.unsupported_reason(run, torch.device("cuda")) is None
    assert "CPU (emulated)" in fp8.unsupported_reason(run, torch.device("mps"))
    policy = PrecisionPolicy.from_config(run.precision, CPU)
    assert unsupported_reason(run, CPU, policy) is None


def test_without_torchao_it_is_one_config_line_naming_the_extra(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a)
    )
    line = r"^precision.fp8: torchao is not installed: pip install 'dit-precision-sweep\[lowprec\]'"
    with pytest.raises(ConfigError, match=line):
        make_run("precision=fp8_tensorwise")
    make_run("precision=bf16_amp")  # fp32/bf16 runs do not need it


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_on_a_gpu_fp8_runs_native_kernels_or_is_skipped_below_8_9(tmp_path, recipe):
    """`make test-gpu`: on capability >= 8.9 the run uses torch._scaled_mm (emulated: false) and its forward stays
    within 1e-2 of the emulated one on the same weights (fast accumulation and the kernels are what emulation cannot
    show); below 8.9 the run is `skipped` with the reason."""
    gpu = torch.device("cuda")
    run = make_run("device=cuda", "steps=3", f"precision=fp8_{recipe}")
    r = execute(run, tmp_path, params={})
    if torch.cuda.get_device_capability(gpu) < fp8.MIN_CAPABILITY:
        assert r.status == "skipped" and "capability >= 8.9" in r.reason
        return
    assert r.status == "stable", (r.status, r.reason)
    rec = read_result(tmp_path)["fp8"]
    assert rec["emulated"] is False and rec["device_capability"] == "{}.{}".format(*torch.cuda.get_device_capability())
    _, model, (x, t, _) = _inputs(())
    native, emulated = copy.deepcopy(model).to(gpu), copy.deepcopy(model)
    fp8.convert(native, run.precision, gpu)
    fp8.convert(emulated, run.precision, CPU)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        on_gpu = native(x.to(gpu), t.to(gpu)).float().cpu()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        on_cpu = emulated(x, t).float()
    assert _rel(on_gpu, on_cpu) <= 1e-2
