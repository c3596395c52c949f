"""`precision.fp32_modules` (sweep/run/fp32_modules.py): the matched modules compute in fp32, the rest as before.

Under autocast a matched module runs with autocast off on fp32 inputs (its Linear computes in fp32 while an
unmatched sibling's computes in bf16); under a pure policy its weights and AdamW state stay fp32 and its outputs
go back to the policy's dtype; under fp32 nothing changes, byte for byte. A glob that matches nothing is one
line and exit 2 before any run; the key sweeps like any other and packs only with runs of the same list.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser

from sweep.config import ConfigError, check_inputs
from sweep.run.build import build_parts, reset_process_state
from sweep.run.execute import execute
from sweep.run.fp32_modules import matching, unmatched
from sweep.run.packing import execute_pack, pack_key, refusal
from sweep.run.precision import PrecisionPolicy

from .conftest import SMALL_MODEL, make_run, multirun_in_process, read_results, sweep_forked

CPU = torch.device("cpu")
ATTN = "precision.fp32_modules=[blocks.*.attn]"


def built(*overrides: str):
    run = make_run("device=cpu", "threads=1", *overrides)
    policy = PrecisionPolicy.from_config(run.precision, CPU)
    reset_process_state(run, policy)
    return run, policy, build_parts(run, CPU, policy)


def linear_dtypes(model: torch.nn.Module, names: list[str], forward) -> dict[str, torch.dtype]:
    """The dtype each named module outputs in one forward (a Linear outputs the dtype it computed in)."""
    seen, modules = {}, dict(model.named_modules())

    def record(name):
        def hook(module, args, output):
            seen.setdefault(name, output.dtype)

        return hook

    hooks = [modules[n].register_forward_hook(record(n)) for n in names]
    try:
        forward()
    finally:
        for h in hooks:
            h.remove()
    return seen


def one_forward(parts, policy):
    x = torch.stack([parts.dataset[i] for i in range(2)]).to(policy.param_dtype)
    t = torch.tensor([3, 500])
    with policy.gemm_mode(), policy.autocast(CPU):
        return parts.model(x, t)


def test_matching_keeps_the_outermost_and_names_what_matches_nothing():
    names = ["", "blocks", "blocks.0", "blocks.0.attn", "blocks.0.attn.qkv", "blocks.1.attn", "final_layer"]
    assert matching(names, ["blocks.*.attn", "blocks.0.attn.qkv"]) == ["blocks.0.attn", "blocks.1.attn"]
    assert matching(names, ["blocks.0*"]) == ["blocks.0"]  # blocks.0.attn and its qkv are inside it
    assert unmatched(names, ["blocks.*.atn", "final_layer", "*"]) == ["blocks.*.atn"]


def test_under_autocast_a_matched_module_computes_in_fp32_and_its_sibling_in_bf16():
    names = ["blocks.0.attn", "blocks.0.attn.qkv", "blocks.0.mlp", "blocks.0.mlp.fc1"]
    _, policy, parts = built("precision=bf16_amp", ATTN)
    seen = linear_dtypes(parts.model, names, lambda: one_forward(parts, policy))
    assert seen == {
        "blocks.0.attn": torch.float32,
        "blocks.0.attn.qkv": torch.float32,
        "blocks.0.mlp": torch.bfloat16,
        "blocks.0.mlp.fc1": torch.bfloat16,
    }


def test_under_bf16_pure_the_matched_weights_and_adamw_state_stay_fp32_and_a_step_is_finite():
    _, policy, parts = built("precision=bf16_pure", "precision.fp32_modules=[blocks.*.attn,final_layer]")
    dtypes = {n: p.dtype for n, p in parts.model.named_parameters()}
    fp32 = {n for n, d in dtypes.items() if d == torch.float32}
    assert fp32 and all(n.startswith("final_layer.") or ".attn." in n for n in fp32)
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if n not in fp32)
    out = one_forward(parts, policy)
    assert out.dtype == torch.bfloat16  # final_layer's fp32 output cast back for the loss
    seen = linear_dtypes(
        parts.model, ["blocks.0.attn", "blocks.0.attn.qkv", "blocks.0.mlp"], lambda: one_forward(parts, policy)
    )
    assert seen == {"blocks.0.attn": torch.bfloat16, "blocks.0.attn.qkv": torch.float32, "blocks.0.mlp": torch.bfloat16}
    loss = out.float().square().mean()
    loss.backward()
    parts.optimizer.at(0)
    parts.optimizer.step()
    assert torch.isfinite(loss)
    for p in parts.model.parameters():
        state = parts.optimizer.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == p.dtype
        assert torch.isfinite(p).all()


def test_under_fp32_it_changes_nothing_byte_for_byte(tmp_path):
    plain = execute(make_run(*SMALL_MODEL, "device=cpu", "threads=1", "steps=3"), tmp_path / "plain", params={})
    kept = execute(make_run(*SMALL_MODEL, "device=cpu", "threads=1", "steps=3", ATTN), tmp_path / "kept", params={})
    assert plain.status == kept.status == "stable"
    assert (tmp_path / "plain" / "metrics.csv").read_bytes() == (tmp_path / "kept" / "metrics.csv").read_bytes()


@pytest.mark.parametrize("precision", ["bf16_amp", "bf16_pure"])
def test_a_run_with_fp32_modules_ends_stable_the_same_in_windows(tmp_path, precision):
    """A short run through execute, one sync per step and in windows of 4 (the hooks read nothing back)."""
    rows = []
    for sync_every in (1, 4):
        out = tmp_path / f"sync{sync_every}"
        run = make_run(
            *SMALL_MODEL,
            "device=cpu",
            "threads=1",
            "steps=8",
            f"precision={precision}",
            ATTN,
            f"monitor.sync_every={sync_every}",
        )
        r = execute(run, out, params={})
        assert r.status == "stable", (r.verdict, r.cause)
        rows.append((out / "metrics.csv").read_bytes())
    assert rows[0] == rows[1]


def test_a_diffusers_model_too():
    glob = "transformer.transformer_blocks.*.attn1"
    names = ["transformer.transformer_blocks.0.attn1", "transformer.transformer_blocks.0.attn1.to_q"]
    names += ["transformer.transformer_blocks.0.ff", "transformer.transformer_blocks.0.attn2.to_q"]
    image = ["model=pixart_tiny", "data=synthetic_image", "data.frames=1"]
    _, policy, parts = built(*image, "precision=bf16_amp", f"precision.fp32_modules=[{glob}]")
    seen = linear_dtypes(parts.model, names, lambda: one_forward(parts, policy))
    assert [seen[n] for n in names] == [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]
    _, policy, parts = built(*image, "precision=bf16_pure", f"precision.fp32_modules=[{glob}]")
    loss = one_forward(parts, policy).float().square().mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert parts.model.transformer.transformer_blocks[0].attn1.to_q.weight.dtype == torch.float32
    assert parts.model.transformer.transformer_blocks[0].ff.net[0].proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "value,key",
    [
        ("[blocks.*.atn]", "precision.fp32_modules: 'blocks.*.atn' matches no module of video_dit_tiny"),
        ("['']", "precision.fp32_modules[0]: "),
    ],
)
def test_a_bad_glob_is_a_config_error_naming_it(value, key):
    with pytest.raises(ConfigError) as e:
        check_inputs(make_run(f"precision.fp32_modules={value}"))
    assert str(e.value).startswith(key) and "\n" not in str(e.value), str(e.value)


def test_compile_is_refused_with_it():
    with pytest.raises(ConfigError, match="^precision.fp32_modules: .*compile=true"):
        make_run("compile=true", ATTN)


def test_a_glob_matching_nothing_is_one_line_and_exit_2_before_any_run(tmp_path):
    proc = sweep_forked(
        "-m", "steps=1", "precision=bf16_amp", "precision.fp32_modules=[],[blocks.*.atn]",
        f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/sweep", cwd=tmp_path,
    )  # fmt: skip
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("sweep: config error: precision.fp32_modules: 'blocks.*.atn' matches no module")
    assert "blocks.0.attn" in lines[0]
    assert not list(tmp_path.rglob("result.json")), "no run may start when a glob matches nothing"


def test_it_sweeps_as_a_list_valued_axis_and_is_recorded_in_params(tmp_path):
    override = "precision.fp32_modules=[],[blocks.*.attn]"
    values = list(OverridesParser.create().parse_overrides([override])[0].sweep_iterator())
    assert values == [[], ["blocks.*.attn"]]
    multirun_in_process(tmp_path, *SMALL_MODEL, "steps=2", "device=cpu", "precision=bf16_amp", override)
    params = [r["params"] for r in read_results(tmp_path)]
    assert sorted(p["precision.fp32_modules"] for p in params) == [[], ["blocks.*.attn"]]


def test_runs_pack_only_with_runs_of_the_same_list():
    cpu = "device=cpu"  # device=auto is CUDA on a GPU machine, where bf16 math packs are refused
    a, b = make_run(cpu, "precision=bf16_amp", ATTN), make_run(cpu, "precision=bf16_amp", ATTN)
    c = make_run(cpu, "precision=bf16_amp")
    assert refusal(a) is None and pack_key(a) == pack_key(b) != pack_key(c)


@pytest.mark.parametrize("precision", ["bf16_amp", "bf16_pure"])
def test_a_pack_with_fp32_modules_trains_as_its_runs_alone(tmp_path, precision):
    runs = [
        make_run(*SMALL_MODEL, "device=cpu", "threads=1", "steps=6", f"precision={precision}", ATTN, f"optim.lr={lr}")
        for lr in (1e-4, 1e-3)
    ]
    alone = [execute(r, tmp_path / f"alone{i}", {}) for i, r in enumerate(runs)]
    packed = execute_pack(runs, [tmp_path / f"packed{i}" for i in range(2)], [{}, {}], ["", ""])
    assert [r.status for r in packed] == [r.status for r in alone] == ["stable", "stable"]
    assert all(r.packed == 2 for r in packed)
    for i in range(2):
        a, p = (pd.read_csv(tmp_path / f"{kind}{i}" / "metrics.csv") for kind in ("alone", "packed"))
        assert (abs(a.loss - p.loss) / a.loss).max() < 1e-2
