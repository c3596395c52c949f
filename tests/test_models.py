"""DiT and video DiT: shapes, adaLN-Zero init, precision modes, kernel switching, token layout."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn as nn

from models import MODEL_SIZES, DiT, VideoDiT, build_model, count_params
from models.blocks import Attention, DiTBlock, FinalLayer, check_kernel_names
from models.embeddings import sincos_2d
from sweep.run import gemm

from .conftest import run_cli

FRAMES = 8
SIZE = 16
FLASH_CPU_OP = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH_OP = "aten::_scaled_dot_product_attention_math"


def make(arch: str, size: str = "tiny", **kwargs) -> nn.Module:
    num_frames = FRAMES if arch == "video_dit" else None
    return build_model(arch, size, input_size=SIZE, in_channels=3, num_frames=num_frames, **kwargs)


def inputs(arch: str, batch: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, 3, FRAMES, SIZE, SIZE) if arch == "video_dit" else (batch, 3, SIZE, SIZE)
    x = torch.randn(shape, generator=gen)
    t = torch.randint(0, 1000, (batch,), generator=gen)
    return x, t


def randomize_zero_init(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give the adaLN-Zero and output layers random weights so every block actually acts."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (DiTBlock, FinalLayer)):
                linear = module.adaLN_modulation[-1]
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * 0.05)
                linear.bias.copy_(torch.randn(linear.bias.shape, generator=gen) * 0.05)
        final = model.final_layer.linear
        final.weight.copy_(torch.randn(final.weight.shape, generator=gen) * 0.05)
    return model


def sgd_step(model: nn.Module, x: torch.Tensor, t: torch.Tensor, seed: int = 1) -> None:
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = (model(x, t) - target).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


ARCHS = ("dit", "video_dit")


@pytest.mark.parametrize("size", ["tiny", "S"])
@pytest.mark.parametrize("arch", ARCHS)
def test_builds_with_input_shape_and_zero_output_at_init(arch, size):
    torch.manual_seed(0)
    model = make(arch, size)
    assert isinstance(model, VideoDiT if arch == "video_dit" else DiT)
    assert model.hidden_size == MODEL_SIZES[size]["hidden_size"]
    assert len(model.blocks) == MODEL_SIZES[size]["depth"]
    x, t = inputs(arch, batch=1)
    with torch.no_grad():
        out = model(x, t)
    assert out.shape == x.shape
    assert out.dtype == x.dtype
    assert torch.count_nonzero(out) == 0  # adaLN-Zero: exactly 0, not merely small


def test_tiny_video_dit_is_about_a_million_parameters():
    model = make("video_dit")
    n = count_params(model)
    assert 500_000 <= n <= 2_000_000
    # The sin-cos tables are fixed buffers, not parameters; everything counted is trained.
    assert n == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert {name for name, _ in model.named_buffers()} == {"pos_embed", "temp_embed"}


def test_s_size_matches_dit_s():
    model = make("dit", "S")
    assert (model.hidden_size, len(model.blocks), model.num_heads) == (384, 12, 6)
    video = make("video_dit", "S")
    assert video.depth == 6 and len(video.blocks) == 12  # 6 (spatial, temporal) pairs
    # DiT-S/2 (facebookresearch/DiT) has ~33M parameters with class labels and learned sigma.
    assert 30e6 < count_params(model) < 36e6


@pytest.mark.parametrize("arch", ARCHS)
def test_one_sgd_step_makes_output_nonzero(arch):
    torch.manual_seed(0)
    model = make(arch)
    x, t = inputs(arch)
    sgd_step(model, x, t)
    with torch.no_grad():
        out = model(x, t)
    assert torch.isfinite(out).all()
    assert out.abs().mean() > 0


PRECISIONS = ("fp32", "autocast_bf16", "autocast_fp16", "pure_fp16", "pure_bf16")
KERNELS = (("math", "eager"), ("flash", "fused"), ("eager", "fused"))


def gemm_as_a_run_computes(dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """The bf16/fp16 GEMMs as a run's `precision.cpu_gemm=auto` computes them on this CPU: emulated where torch's
    native kernels crawl (an AVX2-only CPU: ~1.2 GFLOP/s against ~35 in fp32, sweep/run/gemm.py), natively where
    the CPU has the instructions. What this module checks (dtypes, shapes, finite gradients everywhere) is the
    model's, not the GEMM kernel's: the emulated GEMM's parity with the native one is tests/test_gemm.py's."""
    return gemm.mode(gemm.resolve("auto", torch.device("cpu"), dtype), dtype)


@pytest.mark.parametrize("attention,modulate_impl", KERNELS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("arch", ARCHS)
def test_backward_gives_finite_grads(arch, precision, attention, modulate_impl):
    torch.manual_seed(0)
    model = randomize_zero_init(make(arch, attention=attention, modulate=modulate_impl))
    x, t = inputs(arch)
    context = contextlib.nullcontext()
    expected_dtype = torch.float32
    if precision.startswith("autocast_"):
        expected_dtype = {"autocast_bf16": torch.bfloat16, "autocast_fp16": torch.float16}[precision]
        context = torch.autocast("cpu", dtype=expected_dtype)
    elif precision.startswith("pure_"):
        expected_dtype = {"pure_bf16": torch.bfloat16, "pure_fp16": torch.float16}[precision]
        model = model.to(expected_dtype)
        x = x.to(expected_dtype)
    with gemm_as_a_run_computes(expected_dtype):  # the forward's and the backward's GEMMs, as a run's step
        with context:
            out = model(x, t)
        assert out.dtype == expected_dtype
        assert out.shape == x.shape
        out.float().square().mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert param.grad.dtype == param.dtype, name
        assert torch.isfinite(param.grad).all(), name
    # With the zero-init layers randomised every parameter must receive some gradient.
    assert all(param.grad.abs().sum() > 0 for param in model.parameters())


def op_counts(fn) -> dict[str, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key: event.count for event in prof.key_averages()}


def set_kernels(model: nn.Module, attention: str | None = None, modulate: str | None = None) -> None:
    """Switch the attention backend and/or modulate impl of every block of a built model; None keeps the current
    one. An unknown name changes nothing. (Runs build their model with its kernels; only these tests switch.)"""
    check_kernel_names(attention, modulate)
    for module in model.modules():
        if attention is not None and isinstance(module, Attention):
            module.backend = attention
        if modulate is not None and isinstance(module, (DiTBlock, FinalLayer)):
            module.modulate_impl = modulate
    if attention is not None:
        model.attention_backend = attention
    if modulate is not None:
        model.modulate_impl = modulate


@pytest.mark.parametrize("arch", ARCHS)
def test_set_kernels_switches_every_block(arch):
    model = make(arch)
    x, t = inputs(arch, batch=1)
    n_blocks = len(model.blocks)
    assert model.kernels() == {"attention": "sdpa:MATH", "modulate": "eager"}

    set_kernels(model, attention="flash", modulate="fused")
    assert model.kernels() == {"attention": "sdpa:FLASH_ATTENTION", "modulate": "dit_sweep::modulate"}
    assert all(m.backend == "flash" for m in model.modules() if isinstance(m, Attention))
    assert all(m.modulate_impl == "fused" for m in model.modules() if isinstance(m, (DiTBlock, FinalLayer)))
    with torch.no_grad():
        counts = op_counts(lambda: model(x, t))
    # Two modulates per block plus the final layer; one attention per block.
    assert counts.get("dit_sweep::modulate") == 2 * n_blocks + 1
    assert counts.get(FLASH_CPU_OP) == n_blocks
    assert MATH_OP not in counts

    set_kernels(model, modulate="eager")  # attention stays as it was
    assert model.kernels() == {"attention": "sdpa:FLASH_ATTENTION", "modulate": "eager"}
    with torch.no_grad():
        counts = op_counts(lambda: model(x, t))
    assert "dit_sweep::modulate" not in counts
    assert counts.get(FLASH_CPU_OP) == n_blocks

    set_kernels(model, attention="math")
    with torch.no_grad():
        counts = op_counts(lambda: model(x, t))
    assert counts.get(MATH_OP) == n_blocks and FLASH_CPU_OP not in counts


def test_set_kernels_rejects_unknown_names_without_partial_change():
    model = make("dit")
    with pytest.raises(ValueError, match="unknown modulate impl"):
        set_kernels(model, attention="flash", modulate="triton")
    with pytest.raises(ValueError, match="unknown attention backend"):
        set_kernels(model, attention="xformers")
    assert model.kernels() == {"attention": "sdpa:MATH", "modulate": "eager"}
    assert all(m.backend == "math" for m in model.modules() if isinstance(m, Attention))


@pytest.mark.parametrize("attention,modulate_impl", KERNELS)
@pytest.mark.parametrize("arch", ARCHS)
def test_kernel_choices_agree_on_model_output(arch, attention, modulate_impl):
    torch.manual_seed(0)
    model = randomize_zero_init(make(arch))
    x, t = inputs(arch)
    with torch.no_grad():
        reference = model(x, t)
        set_kernels(model, attention=attention, modulate=modulate_impl)
        out = model(x, t)
    assert reference.abs().mean() > 1e-2  # the comparison is not between two zeros
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_qk_norm_adds_layernorms_and_runs(arch):
    torch.manual_seed(0)
    plain = make(arch)
    model = randomize_zero_init(make(arch, qk_norm=True))
    names = dict(model.named_modules())
    for i in range(len(model.blocks)):
        assert isinstance(names[f"blocks.{i}.attn.q_norm"], nn.LayerNorm)
        assert isinstance(names[f"blocks.{i}.attn.k_norm"], nn.LayerNorm)
        assert isinstance(dict(plain.named_modules())[f"blocks.{i}.attn.q_norm"], nn.Identity)
    head_dim = model.hidden_size // model.num_heads
    assert count_params(model) - count_params(plain) == len(model.blocks) * 2 * 2 * head_dim
    x, t = inputs(arch)
    out = model(x, t)
    assert out.shape == x.shape
    out.square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.blocks[0].attn.q_norm.weight.grad.abs().sum() > 0


def test_module_paths_and_block_kinds():
    video = make("video_dit")
    names = dict(video.named_modules())
    for path in ("blocks.0.attn", "blocks.1.attn", "blocks.1.mlp", "blocks.1.adaLN_modulation", "final_layer"):
        assert path in names, path
    kinds = [block.kind for block in video.blocks]
    assert kinds == ["spatial", "temporal"] * (len(kinds) // 2)
    image = make("dit")
    assert "blocks.0.attn" in dict(image.named_modules())
    assert all(block.kind == "spatial" for block in image.blocks)


def test_unknown_names_raise_value_error():
    with pytest.raises(ValueError, match="unknown arch"):
        make("unet")
    with pytest.raises(ValueError, match="unknown model size"):
        make("dit", "XXL")
    with pytest.raises(ValueError, match="unknown attention backend"):
        make("dit", attention="xformers")
    with pytest.raises(ValueError, match="unknown modulate impl"):
        make("video_dit", modulate="triton")
    with pytest.raises(ValueError, match="needs num_frames"):
        build_model("video_dit", "tiny", input_size=SIZE, in_channels=3)
    with pytest.raises(ValueError, match="num_frames must be None"):
        build_model("dit", "tiny", input_size=SIZE, in_channels=3, num_frames=FRAMES)


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_gives_bit_identical_models_and_outputs(arch):
    x, t = inputs(arch)
    outs, states = [], []
    for _ in range(2):
        torch.manual_seed(1234)
        model = make(arch)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
        sgd_step(model, x, t)  # outputs are exactly 0 at init; compare after one update
        with torch.no_grad():
            outs.append(model(x, t))
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert outs[0].abs().mean() > 0
    assert torch.equal(outs[0], outs[1])
    torch.manual_seed(4321)
    other = make(arch)
    assert not torch.equal(other.blocks[0].attn.qkv.weight, states[0]["blocks.0.attn.qkv.weight"])


def test_timestep_embedding_is_fp32_for_a_pure_fp16_model():
    model = make("dit").to(torch.float16)
    t = torch.tensor([999, 998])
    freq = model.t_embedder.timestep_embedding(t, model.t_embedder.frequency_embedding_size)
    assert freq.dtype == torch.float32
    # Must match fp64 to fp32 accuracy; computed in fp16 the fast channels near t=1000 are
    # off by up to ~0.25 rad (fp16 spacing there is 0.5).
    half = model.t_embedder.frequency_embedding_size // 2
    freqs = torch.exp(-torch.log(torch.tensor(10000.0, dtype=torch.float64)) * torch.arange(half) / half)
    args = t.double()[:, None] * freqs[None]
    expected = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    torch.testing.assert_close(freq.double(), expected, atol=1e-4, rtol=0)
    assert model.t_embedder(t).dtype == torch.float16


def test_batch_rows_are_independent_and_use_their_own_timestep():
    # Catches c.repeat vs c.repeat_interleave: with distinct t per sample, a wrongly tiled
    # conditioning would give sample 1 the timestep of sample 0 on some sequences.
    torch.manual_seed(0)
    model = randomize_zero_init(make("video_dit"))
    x, _ = inputs("video_dit", batch=3)
    t = torch.tensor([10, 500, 990])
    with torch.no_grad():
        batched = model(x, t)
        for b in range(3):
            alone = model(x[b : b + 1], t[b : b + 1])
            torch.testing.assert_close(batched[b : b + 1], alone, atol=1e-5, rtol=1e-5)


def zero_blocks_of_kind(model: nn.Module, kind: str) -> None:
    """Make every block of `kind` the identity (adaLN-Zero gates at 0)."""
    with torch.no_grad():
        for block in model.blocks:
            if block.kind == kind:
                block.adaLN_modulation[-1].weight.zero_()
                block.adaLN_modulation[-1].bias.zero_()


def changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).abs() > 1e-6


def test_spatial_blocks_mix_only_within_a_frame():
    torch.manual_seed(0)
    model = randomize_zero_init(make("video_dit"))
    zero_blocks_of_kind(model, "temporal")
    x, t = inputs("video_dit", batch=1)
    y = x.clone()
    y[:, :, 3, 0:2, 0:2] += 1.0  # perturb one patch of frame 3
    with torch.no_grad():
        diff = changed(model(x, t), model(y, t))  # (1, C, F, H, W)
    frames_changed = diff.flatten(3).any(-1).any(1)[0]  # (F,)
    assert frames_changed.tolist() == [f == 3 for f in range(FRAMES)]
    # Spatial attention spreads the perturbation to other patches of that frame.
    assert diff[0, :, 3, 8:, 8:].any()


def test_temporal_blocks_mix_only_across_frames_at_one_location():
    torch.manual_seed(0)
    model = randomize_zero_init(make("video_dit"))
    zero_blocks_of_kind(model, "spatial")
    x, t = inputs("video_dit", batch=1)
    y = x.clone()
    y[:, :, 3, 4:6, 6:8] += 1.0  # perturb the patch at grid (row 2, col 3) of frame 3
    with torch.no_grad():
        diff = changed(model(x, t), model(y, t)).any(1)[0]  # (F, H, W)
    location = torch.zeros(SIZE, SIZE, dtype=torch.bool)
    location[4:6, 6:8] = True
    assert not diff[:, ~location].any()  # no other spatial location is touched
    assert diff[:, location].any(-1).all()  # every frame at that location is


def test_positional_embeddings_break_symmetry():
    # Without the fixed sin-cos tables, identical frames (or identical patches) would get
    # identical outputs: attention alone is permutation-equivariant.
    torch.manual_seed(0)
    video = randomize_zero_init(make("video_dit"))
    frame = torch.randn(1, 3, 1, SIZE, SIZE)
    with torch.no_grad():
        out = video(frame.expand(1, 3, FRAMES, SIZE, SIZE).contiguous(), torch.tensor([500]))
    assert not torch.allclose(out[:, :, 0], out[:, :, 1])
    assert video.temp_embed.shape == (1, FRAMES, video.hidden_size)

    image = randomize_zero_init(make("dit"))
    patch = torch.randn(1, 3, 2, 2)
    with torch.no_grad():
        out = image(patch.repeat(1, 1, SIZE // 2, SIZE // 2), torch.tensor([500]))
    assert not torch.allclose(out[..., 0:2, 0:2], out[..., 0:2, 2:4])
    assert image.pos_embed.shape == (1, (SIZE // 2) ** 2, image.hidden_size)
    # Fixed tables are rebuilt on construction, so they stay out of checkpoints.
    assert "pos_embed" not in image.state_dict() and "temp_embed" not in video.state_dict()


@pytest.mark.parametrize("backend", ["math", "flash", "eager"])
def test_attention_module_matches_torch_multihead_attention(backend):
    # Independent reference for the qkv split and the head merge (a missing transpose
    # before the merge would still agree across backends, but not with this).
    torch.manual_seed(0)
    attn = Attention(64, 4, qk_norm=False, backend=backend)
    reference = nn.MultiheadAttention(64, 4, batch_first=True)
    with torch.no_grad():
        reference.in_proj_weight.copy_(attn.qkv.weight)
        reference.in_proj_bias.copy_(attn.qkv.bias)
        reference.out_proj.weight.copy_(attn.proj.weight)
        reference.out_proj.bias.copy_(attn.proj.bias)
    x = torch.randn(3, 10, 64)
    with torch.no_grad():
        expected, _ = reference(x, x, x, need_weights=False)
        torch.testing.assert_close(attn(x), expected, atol=1e-5, rtol=1e-5)


def _dit_numpy_2d_sincos(embed_dim: int, grid_size: int) -> np.ndarray:
    """facebookresearch/DiT get_2d_sincos_pos_embed, transcribed in numpy as the reference."""

    def one_d(dim, pos):
        omega = np.arange(dim // 2, dtype=np.float64) / (dim / 2.0)
        omega = 1.0 / 10000**omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    grid_h = np.arange(grid_size, dtype=np.float32)
    grid_w = np.arange(grid_size, dtype=np.float32)
    grid = np.stack(np.meshgrid(grid_w, grid_h), axis=0).reshape([2, 1, grid_size, grid_size])
    return np.concatenate([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])], axis=1)


def test_2d_sincos_matches_dit_reference():
    ours = sincos_2d(32, 8).numpy()
    np.testing.assert_allclose(ours, _dit_numpy_2d_sincos(32, 8), atol=1e-12)


def test_models_package_does_not_pull_in_hydra_or_omegaconf():
    # models/ must stay importable without the config stack (fresh interpreter: the test
    # session itself may already have hydra loaded for other tests).
    code = "import sys, models; print(sorted(m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf')))"
    result = run_cli("-c", code, check=True)
    assert result.stdout.strip() == "[]"
