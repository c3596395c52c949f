"""finetune.base_dtype: a LoRA run's frozen base linears stored in fp8 (per tensor or per 128-wide block) or bf16,
dequantised per layer in the forward (sweep/run/fp8_storage.py), against a reference written here; the record,
the bytes, a real LoRA run on an fp8 base, and its checkpoint round trip."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from sweep.config import BaseDtype
from sweep.run import fp8_storage
from sweep.run.build import build_parts
from sweep.run.execute import execute
from sweep.run.finetune import is_adapter
from sweep.run.precision import PrecisionPolicy

from .conftest import make_run

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BASE = ["threads=1", "ledger.enabled=false", "eval.enabled=false"]
LORA = [*BASE, "finetune=lora", "optim.lora_lr=1e-2"]


# ---- the reference: one block (or the whole tensor) at a time, with Python loops --------------------------------


def ref_quantise(w: torch.Tensor, dtype: torch.dtype, block: int | None):
    """(fp8 values, fp32 scales) the plain way: scale = amax / max (floored at 1e-8), w / scale clamped and cast."""
    top = torch.finfo(dtype).max
    w = w.float()
    if block is None:
        s = torch.clamp(w.abs().max() / top, min=1e-8)
        return torch.clamp(w / s, -top, top).to(dtype), s
    q = torch.empty(w.shape, dtype=dtype)
    scales = torch.empty(w.shape[0], -(-w.shape[1] // block))
    for r in range(w.shape[0]):
        for j in range(scales.shape[1]):
            seg = w[r, j * block : (j + 1) * block]
            s = torch.clamp(seg.abs().max() / top, min=1e-8)
            q[r, j * block : (j + 1) * block] = torch.clamp(seg / s, -top, top).to(dtype)
            scales[r, j] = s
    return q, scales


def ref_dequantise(q: torch.Tensor, scales: torch.Tensor, block: int | None) -> torch.Tensor:
    if block is None:
        return q.float() * scales
    w = torch.empty(q.shape)
    for r in range(q.shape[0]):
        for j in range(scales.shape[1]):
            w[r, j * block : (j + 1) * block] = q[r, j * block : (j + 1) * block].float() * scales[r, j]
    return w


def weight(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """A weight with outliers and an all-zero row, as trained weights have (and a block scale must survive)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.02
    w[1, 5] = 0.9  # an outlier: per tensor it sets every other element's scale
    w[2] = 0.0
    return w


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)  # torch.equal has no fp8 kernel; the bytes are what is stored


CASES = [
    (BaseDtype.fp8_e4m3, E4M3, None),
    (BaseDtype.fp8_e5m2, E5M2, None),
    (BaseDtype.fp8_e4m3_block, E4M3, 128),
]


@pytest.mark.parametrize("shape", [(6, 300), (5, 256)])  # a narrower last block, and whole blocks
@pytest.mark.parametrize("dtype, block", [(E4M3, None), (E5M2, None), (E4M3, 128), (E5M2, 128)])
def test_quantise_and_dequantise_match_the_reference_exactly(shape, dtype, block):
    w = weight(*shape)
    q, s = fp8_storage.quantise(w, dtype, block)
    rq, rs = ref_quantise(w, dtype, block)
    assert q.dtype == dtype and q.shape == w.shape and torch.equal(bits(q), bits(rq))
    assert s.dtype == torch.float32 and torch.equal(s, rs)
    assert torch.equal(fp8_storage.dequantise(q, s, torch.float32, block), ref_dequantise(rq, rs, block))
    assert torch.equal(fp8_storage.dequantise(q, s, torch.bfloat16, block), ref_dequantise(rq, rs, block).bfloat16())


def test_block_scales_keep_a_row_far_below_the_tensors_amax():
    """fp8 is floating point: one scale only shifts the exponent range, so it loses the values that fall below
    e4m3's smallest normal (amax / 448 / 2**6 down to subnormals and zero), e.g. a row 1e5 times smaller than the
    rest; a block's own scale keeps them. Elsewhere the two errors are alike (per element, the 3-bit mantissa)."""
    w = weight(6, 300)
    w[3] *= 1e-5
    err = {}
    for block in (None, 128):
        q, s = fp8_storage.quantise(w, E4M3, block)
        d = fp8_storage.dequantise(q, s, torch.float32, block) - w
        err[block] = (float(d[3].norm() / w[3].norm()), float(d.norm() / w.norm()))
    assert err[None][0] > 0.5 and err[128][0] < 0.05, err  # the small row: lost to one scale, kept by its blocks
    assert err[128][1] <= err[None][1] < 0.05, err


@pytest.mark.parametrize("base_dtype, dtype, block", CASES)
def test_a_stored_layer_computes_with_the_reference_weight(base_dtype, dtype, block):
    torch.manual_seed(0)
    layer = torch.nn.Linear(300, 6)
    with torch.no_grad():
        layer.weight.copy_(weight(6, 300))
    original = layer.weight.detach().clone()
    error = fp8_storage.store(layer, base_dtype)
    assert isinstance(layer, fp8_storage.StoredLinear) and layer.weight.dtype == dtype
    assert layer.weight.element_size() == 1 and not layer.weight.requires_grad
    ref = ref_dequantise(*ref_quantise(original, dtype, block), block)
    x = torch.randn(4, 300)
    assert torch.equal(layer(x), F.linear(x, ref, layer.bias))  # fp32: exact
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16_amp: the compute dtype is autocast's
        got, want = layer(x), F.linear(x, ref.bfloat16(), layer.bias)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    diff = ref - original
    assert error["rel_rms"] == pytest.approx(float(diff.norm() / original.norm()), rel=1e-6)
    assert error["max_abs"] == pytest.approx(float(diff.abs().max()), rel=1e-6)
    # a later cast of the model changes the compute dtype only: the stored bytes stay
    stored = bits(layer.weight).clone()
    layer.to(torch.bfloat16)
    assert torch.equal(bits(layer.weight), stored) and layer.bias.dtype == torch.bfloat16
    assert torch.equal(layer(x.bfloat16()), F.linear(x.bfloat16(), ref.bfloat16(), layer.bias))


def test_bf16_storage_under_bf16_autocast_is_the_unstored_forward_bit_for_bit():
    torch.manual_seed(0)
    plain = torch.nn.Linear(64, 32)
    stored = torch.nn.Linear(64, 32)
    stored.load_state_dict(plain.state_dict())
    fp8_storage.store(stored, BaseDtype.bf16)
    assert stored.weight.dtype == torch.bfloat16 and stored.scale_weight is None
    x = torch.randn(3, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(stored(x), plain(x))
    assert not torch.equal(stored(x), plain(x))  # in fp32 the bf16 weight shows


def test_a_state_of_another_storage_is_refused():
    a, b = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    fp8_storage.store(a, BaseDtype.fp8_e4m3)
    fp8_storage.store(b, BaseDtype.fp8_e5m2)
    with pytest.raises(RuntimeError, match="stored as torch.float8_e4m3fn .* holds torch.float8_e5m2"):
        a.load_state_dict(b.state_dict())


# ---- in a run ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A short run of the tiny video DiT whose weights the LoRA runs start from (model.init_from)."""
    out = tmp_path_factory.mktemp("pretrain")
    r = execute(make_run(*BASE, "steps=4", "checkpoint.every=4", "optim.lr=1e-3"), out, {})
    assert r.status == "stable", r.reason
    return out / "checkpoints" / "step_000004"


def lora_run(pretrained: Path, *overrides: str):
    return make_run(*LORA, f"model.init_from={pretrained}", *overrides)


def losses(run_dir: Path) -> dict[int, tuple[str, str]]:
    with open(run_dir / "metrics.csv") as f:
        return {int(r["step"]): (r["loss"], r["grad_norm"]) for r in csv.DictReader(f)}


@pytest.mark.parametrize("precision", ["fp32", "bf16_amp"])
def test_every_frozen_linear_is_stored_or_kept_and_the_bytes_shrink(pretrained, precision):
    run = lora_run(pretrained, f"precision={precision}", "finetune.base_dtype=fp8_e4m3_block")
    parts = build_parts(run, torch.device("cpu"), PrecisionPolicy.from_config(run.precision))
    rec = parts.base_storage
    assert (rec["dtype"], rec["block"]) == ("fp8_e4m3_block", 128)
    modules = dict(parts.model.named_modules())
    frozen = {n for n, m in modules.items() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad}
    assert set(rec["stored"]) | set(rec["kept"]) == frozen and not set(rec["stored"]) & set(rec["kept"])
    assert set(rec["error"]) == set(rec["stored"])
    assert rec["kept"]["final_layer.linear"] == "*final_layer*"
    assert rec["kept"]["blocks.0.adaLN_modulation.1"] == "*adaLN*" and rec["kept"]["t_embedder.mlp.0"] == "*t_embedder*"
    assert {"blocks.0.attn.qkv.base_layer", "blocks.0.attn.proj.base_layer", "blocks.0.mlp.fc1"} <= set(rec["stored"])
    for name in rec["stored"]:
        assert modules[name].weight.dtype == E4M3 and modules[name].weight.element_size() == 1
        assert 0 < rec["error"][name]["rel_rms"] < 0.06
    for name in rec["kept"]:
        assert modules[name].weight.dtype == torch.float32  # the param dtype of both policies
    stored_fp32 = sum(modules[n].weight.numel() * 4 for n in rec["stored"])
    scales = sum(modules[n].scale_weight.numel() * 4 for n in rec["stored"])
    assert rec["bytes"]["before"] - rec["bytes"]["after"] == stored_fp32 * 3 // 4 - scales
    adapters = [n for n, p in parts.model.named_parameters() if p.requires_grad]
    assert adapters and all(is_adapter(n) for n in adapters)
    assert all(p.dtype == torch.float32 for p in parts.model.parameters() if p.requires_grad)


def test_a_diffusers_models_sensitive_linears_are_kept_by_the_default_globs():
    """CogVideoX's names sit under `transformer.`: its final projection, time embedding and adaLN linears (in its
    norm modules) keep the param dtype; the attention projections under LoRA and the feed-forward are stored."""
    run = make_run(*LORA, "model=cogvideox_tiny", "finetune.base_dtype=fp8_e4m3")
    rec = build_parts(run, torch.device("cpu"), PrecisionPolicy.from_config(run.precision)).base_storage
    assert rec["kept"]["transformer.proj_out"] == "*proj_out*"
    assert rec["kept"]["transformer.time_embedding.linear_1"] == "*time_embed*"
    assert rec["kept"]["transformer.transformer_blocks.0.norm1.linear"] == "*norm*"
    assert {
        "transformer.transformer_blocks.0.attn1.to_q.base_layer",
        "transformer.transformer_blocks.0.ff.net.2",
    } <= set(rec["stored"])


def test_a_lora_run_on_an_fp8_block_base_trains_its_adapters_and_saves_fp8(pretrained, tmp_path):
    r = execute(
        lora_run(pretrained, "steps=3", "checkpoint.every=3", "finetune.base_dtype=fp8_e4m3_block"), tmp_path, {}
    )
    assert r.status == "stable", r.reason
    rec = json.loads((tmp_path / "result.json").read_text())["base_storage"]
    assert rec["dtype"] == "fp8_e4m3_block" and rec["stored"] and rec["kept"]
    saved = load_file(tmp_path / "checkpoints" / "step_000003" / "model.safetensors")
    init = load_file(pretrained / "model.safetensors")
    for name in rec["stored"]:  # on disk as in memory: fp8 values and their scales
        assert saved[f"{name}.weight"].dtype == E4M3 and saved[f"{name}.scale_weight"].dtype == torch.float32
        q, s = fp8_storage.quantise(init[name.replace(".base_layer", "") + ".weight"], E4M3, 128)
        assert torch.equal(bits(saved[f"{name}.weight"]), bits(q)) and torch.equal(saved[f"{name}.scale_weight"], s)
    lora_b = {k: v for k, v in saved.items() if ".lora_B." in k}
    assert lora_b and all(v.abs().max() > 0 for v in lora_b.values())  # B starts at zero: every one trained


def test_an_fp8_base_resumes_bit_for_bit_and_repeats_exactly(pretrained, tmp_path):
    fp8 = ["steps=4", "finetune.base_dtype=fp8_e4m3"]
    execute(lora_run(pretrained, *fp8), tmp_path / "full", {})
    execute(lora_run(pretrained, *fp8), tmp_path / "again", {})
    execute(lora_run(pretrained, *fp8, "checkpoint.every=2"), tmp_path / "half", {})
    ckpt = tmp_path / "half" / "checkpoints" / "step_000002"
    r = execute(lora_run(pretrained, *fp8, f"checkpoint.resume_from={ckpt}"), tmp_path / "rest", {})
    assert (r.status, r.start_step, r.steps_run) == ("stable", 2, 2), r.reason
    full = losses(tmp_path / "full")
    assert losses(tmp_path / "again") == full
    assert losses(tmp_path / "rest") == {s: full[s] for s in (2, 3)}
    plain = execute(lora_run(pretrained, "steps=4"), tmp_path / "plain", {})
    assert plain.status == "stable" and losses(tmp_path / "plain") != full  # the fp8 base is not the fp32 one


def test_bf16_storage_under_bf16_amp_trains_as_the_unstored_run(pretrained, tmp_path):
    """Autocast rounds an fp32 base weight to the bf16 value the storage holds: same losses, half the bytes."""
    amp = ["steps=2", "precision=bf16_amp"]
    execute(lora_run(pretrained, *amp), tmp_path / "plain", {})
    r = execute(lora_run(pretrained, *amp, "finetune.base_dtype=bf16"), tmp_path / "bf16", {})
    assert r.base_storage["bytes"]["after"] < r.base_storage["bytes"]["before"]
    assert losses(tmp_path / "bf16") == losses(tmp_path / "plain")


def test_the_diagnosis_of_an_fp8_base_run_asks_for_bf16_storage_from_the_start(pretrained):
    """The counterfactual row 'bf16 storage' (sweep/diagnose/counterfactual.py): the replayed state holds the fp8
    bytes, so the row trains from step 0 with the base in bf16, whatever checkpoint the other rows resume."""
    from sweep.diagnose.counterfactual import FP8_BASE_ROW, plan
    from sweep.diagnose.signals import RunRecord
    from sweep.diagnose.trials import with_overrides

    from .conftest import compose_cfg

    def rows(*overrides: str):
        config = compose_cfg([*LORA, f"model.init_from={pretrained}", *overrides])
        run = make_run(*LORA, f"model.init_from={pretrained}", *overrides)
        return config, {r.name: r for r in plan(RunRecord(Path("."), {}, [], config, run), [])}

    config, table = rows("finetune.base_dtype=fp8_e4m3_block")
    row = table[FP8_BASE_ROW]
    assert row.not_applicable is None
    run = with_overrides(config, ["checkpoint.resume_from=/somewhere/step_000010", *row.overrides])
    assert run.finetune.base_dtype is BaseDtype.bf16 and run.checkpoint.resume_from is None
    assert run.model.init_from == str(pretrained)
    assert FP8_BASE_ROW not in rows("finetune.base_dtype=bf16")[1] and FP8_BASE_ROW not in rows()[1]
    resumed = rows("finetune.base_dtype=fp8_e5m2", f"checkpoint.resume_from={pretrained}")[1][FP8_BASE_ROW]
    assert "no unquantised copy" in resumed.not_applicable


def test_an_fp8_base_with_fp8_matmuls_is_one_line():
    with pytest.raises(Exception, match=r"finetune.base_dtype: .* \(not supported together"):
        make_run("precision=fp8_tensorwise", "finetune=lora", "finetune.base_dtype=fp8_e4m3")


def test_a_checkpoint_of_an_fp8_base_resumes_only_into_the_same_storage(pretrained, tmp_path):
    """finetune.base_dtype is a RESUME_KEYS key: the saved base is fp8 with scales, which another storage cannot
    read; refused in one line before any run, not at the load."""
    from omegaconf import OmegaConf

    from sweep.config import check_inputs

    run = lora_run(pretrained, "steps=2", "checkpoint.every=2", "finetune.base_dtype=fp8_e4m3")
    execute(run, tmp_path, {})
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.structured(run), tmp_path / ".hydra" / "config.yaml")
    ckpt = tmp_path / "checkpoints" / "step_000002"
    with pytest.raises(Exception, match="finetune.base_dtype=fp8_e4m3 there, null here"):
        check_inputs(lora_run(pretrained, "steps=4", f"checkpoint.resume_from={ckpt}"))
    check_inputs(lora_run(pretrained, "steps=4", "finetune.base_dtype=fp8_e4m3", f"checkpoint.resume_from={ckpt}"))
