"""Trial packing: K runs trained as one vmapped computation end like the same runs trained alone."""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path

import optuna
import pandas as pd
import pytest
import torch
from torch.func import vmap

from models.modulate import modulate
from sweep.config import RunConfig
from sweep.run.execute import execute
from sweep.run.packing import alone_lines, execute_pack, pack_key, plan, refusal

from .conftest import SMALL_MODEL, make_run, multirun_in_process, read_results

# A grid of 8 lrs: the small ones stable, the large ones spike or go NaN within 8 steps.
LRS = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1]
# Loss curves of a packed run and the same run alone: the batched matmuls round differently. Well inside
# the stable region (lr <= 3e-3 here) that stays within these relative tolerances over 8 steps; near
# the divergence boundary it grows chaotically (measured on tiny: bf16 at lr 1e-2, 20% by step 11), so there
# only the verdict and the first bad step are compared (docs/packing.md).
RTOL = {"fp32": 1e-4, "bf16_amp": 1e-2, "fp16_amp": 1e-2}
STABLE_REGION = 3e-3


def alone_and_packed(tmp_path, runs):
    alone = [execute(r, tmp_path / f"alone{i}", {"i": i}) for i, r in enumerate(runs)]
    packed = execute_pack(
        runs,
        [tmp_path / f"packed{i}" for i in range(len(runs))],
        [{"i": i} for i in range(len(runs))],
        [""] * len(runs),
    )
    curves = [
        (pd.read_csv(tmp_path / f"alone{i}" / "metrics.csv"), pd.read_csv(tmp_path / f"packed{i}" / "metrics.csv"))
        for i in range(len(runs))
    ]
    return alone, packed, curves


def with_lr_and_seed(run: RunConfig, lr: float, seed: int) -> RunConfig:
    """`run` composed again with optim.lr=`lr` and seed=`seed` (equal RunConfigs: nothing in conf/ interpolates
    either), without a Hydra composition per run (~0.15 s of CPU each)."""
    return dataclasses.replace(run, seed=seed, optim=dataclasses.replace(run.optim, lr=lr))


def outcome(r):
    detail = (r.cause or {}).get("detail", "")
    adam = detail.split("AdamW's second moment ")[1].split(":")[0] if "AdamW's second moment " in detail else None
    return r.status, r.verdict, r.first_bad_step, (r.cause or {}).get("where"), adam  # adam: lagged | kept up


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16_amp", "fp16_amp"])
def test_packed_runs_get_the_verdicts_of_the_runs_alone(tmp_path, precision):
    # The attention kernel that packs on this device: on CUDA bf16 math does not (cuda_vmap_failure), flash does.
    attention = "flash" if refusal(make_run(f"precision={precision}", "attention=math")) else "math"
    run = make_run(
        *SMALL_MODEL, f"precision={precision}", f"attention={attention}", "steps=8", "threads=1", "data.batch_size=2",
        "monitor.forensics=false",
    )  # fmt: skip
    runs = [with_lr_and_seed(run, lr, i) for i, lr in enumerate(LRS)]
    alone, packed, curves = alone_and_packed(tmp_path, runs)
    assert [outcome(r) for r in packed] == [outcome(r) for r in alone]
    statuses = {r.status for r in alone}
    assert statuses == {"stable", "diverged"}  # the pack really mixes both
    assert all(r.packed == len(LRS) for r in packed) and all(r.packed is None for r in alone)
    for lr, (a, b) in zip(LRS, curves):
        assert len(a) == len(b)
        if lr <= STABLE_REGION:
            torch.testing.assert_close(
                torch.tensor(b.loss.values), torch.tensor(a.loss.values), rtol=RTOL[precision], atol=0
            )
            assert list(b.skipped) == list(a.skipped) and list(b.loss_scale.fillna(0)) == list(a.loss_scale.fillna(0))


@pytest.mark.slow
def test_mup_runs_pack_with_their_hidden_weights_at_their_own_lr(tmp_path):
    # µP (m = 64 / 16 = 4): the hidden weights train at lr / 4 in a second param group, which the pack's
    # StackedAdamW takes per weight (tests/test_adamw.py checks its update bit for bit). Packed, the curves stay within
    # 1.1e-7 of the lone ones (relative; measured); with every weight at the base lr, the lr 1e-2 one ended 13% off.
    run = make_run(
        *SMALL_MODEL, "model.param=mup", "model.base_width=16", "steps=8", "threads=1", "data.batch_size=2",
        "monitor.forensics=false",
    )  # fmt: skip
    assert refusal(run) is None
    lrs = [1e-3, 1e-2, 3e-1, 1.0]
    alone, packed, curves = alone_and_packed(tmp_path, [with_lr_and_seed(run, lr, i) for i, lr in enumerate(lrs)])
    assert [outcome(r) for r in packed] == [outcome(r) for r in alone]
    assert {r.status for r in alone} == {"stable", "diverged"} and all(r.packed == len(lrs) for r in packed)
    for a, b in curves[:2]:
        torch.testing.assert_close(torch.tensor(b.loss.values), torch.tensor(a.loss.values), rtol=RTOL["fp32"], atol=0)


@pytest.mark.slow
def test_an_overflow_in_one_packed_run_leaves_the_others_scale_alone(tmp_path):
    # loss_weight 1e5 makes run 0's scaled fp16 gradients overflow at the initial scale 65536: its scaler
    # must skip and back off on its own, while run 1 (same pack) steps every time at 65536.
    runs = [
        make_run(
            *SMALL_MODEL, "precision=fp16_amp", "objective.loss_weight=1e5", "steps=6", "data.batch_size=2", "threads=1"
        ),
        make_run(*SMALL_MODEL, "precision=fp16_amp", "seed=1", "steps=6", "data.batch_size=2", "threads=1"),
    ]
    alone, packed, curves = alone_and_packed(tmp_path, runs)
    overflowing, (calm_alone, calm) = curves[0][1], curves[1]
    assert overflowing.skipped.sum() > 0 and overflowing.loss_scale.iloc[-1] < 65536
    assert calm.skipped.sum() == 0 and set(calm.loss_scale) == {65536.0}
    torch.testing.assert_close(
        torch.tensor(calm.loss.values), torch.tensor(calm_alone.loss.values), rtol=1e-2, atol=1e-6
    )
    assert [outcome(r) for r in packed] == [outcome(r) for r in alone]


@pytest.mark.slow
def test_a_bad_sample_stops_only_its_own_run_at_its_own_step(tmp_path):
    runs = [
        make_run(*SMALL_MODEL, "data.faults=[{index:3,kind:nan}]", "steps=12", "threads=1"),
        make_run(*SMALL_MODEL, "seed=1", "steps=12", "threads=1"),
        make_run(*SMALL_MODEL, "optim.lr=0.3", "seed=2", "steps=12", "threads=1"),
    ]
    alone, packed, _ = alone_and_packed(tmp_path, runs)
    assert [outcome(r) for r in packed] == [outcome(r) for r in alone]
    assert packed[0].verdict == "bad_input" and packed[1].status == "stable" and packed[1].steps_run == 12
    assert packed[2].status == "diverged"


def module_output_dtypes(model: torch.nn.Module, forward) -> dict[str, torch.dtype]:
    """Each submodule's output dtype during one forward (hooks see through vmap's batched tensors)."""
    seen = {}

    def record(name):
        def hook(module, inputs, output):
            seen.setdefault(name, getattr(output, "dtype", None))  # returns None: the output stays

        return hook

    hooks = [m.register_forward_hook(record(name)) for name, m in model.named_modules() if name]
    try:
        forward()
    finally:
        for h in hooks:
            h.remove()
    return {n: d for n, d in seen.items() if isinstance(d, torch.dtype)}


@pytest.mark.parametrize("precision", ["bf16_amp", "fp16_amp"])
def test_packed_autocast_gives_every_module_the_dtype_it_has_alone(precision):
    """Under vmap a linear with batched weights is matmul + add and autocast casts only the matmul, so an
    fp32 bias would lift the packed activations to fp32 (pytorch#192617): a packed fp16 run that never
    overflows where the lone one does. Every module must output what it outputs alone."""
    from sweep.run.build import build_parts, reset_process_state
    from sweep.run.packed_model import PackedModel
    from sweep.run.precision import PrecisionPolicy

    run = make_run(*SMALL_MODEL, f"precision={precision}", "threads=1")
    policy = PrecisionPolicy.from_config(run.precision)
    reset_process_state(run, policy)
    device = torch.device("cpu")
    parts = [build_parts(run, device, policy) for _ in range(2)]
    models = [p.model for p in parts]
    x0 = torch.stack([parts[0].dataset[i] for i in range(2)])  # (B, ...)
    x, t = torch.stack([x0, x0]), torch.tensor([[3, 500], [3, 500]])  # (K=2, B, ...), (K, B)
    packed = PackedModel(models)
    with policy.autocast(device):
        alone = module_output_dtypes(models[0], lambda: models[0](x[0], t[0]))
        together = module_output_dtypes(packed.base, lambda: packed(x, t))
    assert together == alone
    assert torch.float32 in alone.values() and policy.compute_dtype in alone.values()  # both really occur


def softmax_dtypes(forward_and_backward) -> set[tuple[str, tuple]]:
    """The dtypes every softmax and softmax backward of one forward+backward ran in (ops below autocast)."""
    seen = set()

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "softmax" in func.__name__:
                seen.add(
                    (func.__name__, tuple(a.dtype if torch.is_tensor(a) else a for a in args if not isinstance(a, int)))
                )
            return func(*args, **(kwargs or {}))

    with Spy():
        forward_and_backward()
    return seen


@pytest.mark.parametrize("precision", ["bf16_amp", "fp16_amp"])
def test_packed_math_attention_runs_its_softmax_in_the_dtype_it_has_alone(precision):
    from sweep.run.build import build_parts, reset_process_state
    from sweep.run.packed_model import PackedModel
    from sweep.run.precision import PrecisionPolicy

    run = make_run(*SMALL_MODEL, f"precision={precision}", "attention=math", "device=cpu", "threads=1")
    device = torch.device("cpu")
    policy = PrecisionPolicy.from_config(run.precision, device)
    reset_process_state(run, policy)
    parts = [build_parts(run, device, policy) for _ in range(2)]
    models = [p.model for p in parts]
    x0 = torch.stack([parts[0].dataset[i] for i in range(2)])  # (B, ...)
    x, t = torch.stack([x0, x0]), torch.tensor([[3, 500], [3, 500]])  # (K=2, B, ...), (K, B)
    packed = PackedModel(models)

    def step(forward):
        def run_it():
            with policy.autocast(device):
                out = forward()
            out.float().sum().backward()

        return run_it

    alone = softmax_dtypes(step(lambda: models[0](x[0], t[0])))
    together = softmax_dtypes(step(lambda: packed(x, t)))
    assert alone == {
        ("_safe_softmax.default", (torch.float32,)),
        ("_softmax_backward_data.default", (torch.float32,) * 3),
    }
    assert together == alone


def test_plan_packs_runs_of_one_computation_and_leaves_the_rest_alone():
    fp32 = [make_run(f"optim.lr={lr}", f"seed={s}", "optim.grad_clip=1.0") for lr in (1e-4, 1e-3) for s in (0, 1)]
    other = [
        make_run("precision=bf16_amp"),
        make_run("attention=flash"),
        make_run("checkpoint.every=5"),
        make_run("compile=true"),
    ]
    assert len({pack_key(r) for r in fp32}) == 1  # lr, seed, clipping are per run
    assert len({pack_key(r) for r in fp32 + other[:2]}) == 3  # precision and kernels are not
    assert refusal(other[2]) and refusal(other[3]) and refusal(fp32[0]) is None
    assert plan(fp32 + other, pack=3) == [[0, 1, 2], [3], [4], [5], [6], [7]]
    assert plan(fp32, pack=1) == [[0], [1], [2], [3]]


def test_a_packed_sweep_says_which_runs_train_alone_and_why():
    runs = [make_run(), make_run("compile=true"), make_run("compile=true", "seed=1"), make_run("optim=adafactor")]
    assert alone_lines(runs) == [
        "2 of 4 runs train alone: compile=true: a compiled run trains alone",
        "1 of 4 runs train alone: optim=adafactor runs eagerly with its library's optimizer: not packed",
    ]
    assert alone_lines(runs[:1]) == []


def test_kernels_whose_vmap_fails_on_cuda_train_alone_there_and_only_there():
    """Measured on an H100 (torch 2.11): packed forward+backward fails for SDPA efficient (any dtype) and
    for SDPA math in bf16; everything else packs (docs/packing.md). The CPU is unaffected."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    refused = [("efficient", "fp16_amp"), ("efficient", "fp32"), ("math", "bf16_amp"), ("math", "bf16_pure")]
    packed = [("math", "fp16_amp"), ("math", "fp32"), ("math", "tf32"), ("flash", "bf16_amp"), ("eager", "bf16_amp")]
    for attention, precision in refused:
        run = make_run(f"attention={attention}", f"precision={precision}")
        assert f"attention={attention}" in refusal(run, cuda) and refusal(run, cpu) is None
    for attention, precision in packed:
        assert refusal(make_run(f"attention={attention}", f"precision={precision}"), cuda) is None


def test_fused_modulate_vmaps_to_one_call_with_the_per_row_result():
    k, b, n, d = 3, 2, 5, 8
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        g = torch.Generator().manual_seed(0)
        x, shift, scale = (torch.randn(k, b, *s, generator=g).to(dtype).requires_grad_() for s in ((n, d), (d,), (d,)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch warns when it falls back to a per-run loop
            out = vmap(lambda *a: modulate(*a, "fused"))(x, shift, scale)
        grad = torch.randn(out.shape, generator=g).to(dtype)
        out.backward(grad)
        for i in range(k):
            xi, si, ci = (t[i].detach().requires_grad_() for t in (x, shift, scale))
            ref = modulate(xi, si, ci, "fused")  # the op called on run i alone (its parity with eager: test_kernels.py)
            ref.backward(grad[i])
            assert torch.equal(out[i], ref)
            for got, want in ((x.grad[i], xi.grad), (shift.grad[i], si.grad), (scale.grad[i], ci.grad)):
                assert torch.equal(got, want)


@pytest.mark.slow
def test_packed_launcher_writes_every_run_and_trial(tmp_path, capsys):
    sweep_dir = tmp_path / "sweep"
    multirun_in_process(
        sweep_dir,
        *SMALL_MODEL,
        "hydra/launcher=packed",
        "hydra.launcher.pack=4",
        "precision=fp32,fp16_pure",
        "optim.lr=1e-4,1e-3,3e-2",
        "steps=6",
    )
    results = read_results(sweep_dir)
    assert len(results) == 6 and all(r["packed"] == 3 for r in results)
    assert all(
        (p.parent / "metrics.csv").is_file() and (p.parent / ".hydra" / "overrides.yaml").is_file()
        for p in sweep_dir.glob("*/result.json")
    )
    by = {(r["params"]["precision"], r["params"]["optim.lr"]): r for r in results}
    assert by["fp32", 1e-4]["status"] == "stable" and by["fp16_pure", 1e-4]["verdict"] == "nonfinite_loss"
    (study,) = optuna.get_all_study_summaries(f"sqlite:///{sweep_dir / 'ledger.db'}")
    trials = optuna.load_study(study_name=study.study_name, storage=f"sqlite:///{sweep_dir / 'ledger.db'}").trials
    assert len(trials) == 6 and {Path(t.user_attrs["run_dir"]).name for t in trials} == {str(i) for i in range(6)}
    assert all(math.isfinite(t.value) for t in trials)
    assert "Divergence map" in capsys.readouterr().out


@pytest.mark.slow
def test_pure_low_precision_updates_stall_and_nan_in_a_pack_as_alone(tmp_path):
    # The stacked AdamW must round like torch's: pure bf16 loses sub-resolution updates (stalled), pure
    # fp16 turns eps=1e-8 into 0 and divides 0 by 0 on its first update (nonfinite_loss at step 1).
    bf16 = make_run(*SMALL_MODEL, "precision=bf16_pure", "steps=10", "monitor.stall_window=10", "threads=1")
    runs = [with_lr_and_seed(bf16, lr, i) for i, lr in enumerate([6e-6, 1e-3])]
    alone, packed, _ = alone_and_packed(tmp_path / "bf16", runs)
    assert [outcome(r) for r in packed] == [outcome(r) for r in alone]
    assert packed[0].verdict == "stalled" and packed[1].status == "stable"
    fp16 = make_run(*SMALL_MODEL, "precision=fp16_pure", "steps=4", "threads=1")
    runs = [with_lr_and_seed(fp16, lr, 0) for lr in (1e-4, 1e-2)]
    alone, packed, _ = alone_and_packed(tmp_path / "fp16", runs)
    assert (
        [outcome(r) for r in packed]
        == [outcome(r) for r in alone]
        == [("diverged", "nonfinite_loss", 1, "optimizer", None)] * 2
    )
