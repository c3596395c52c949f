"""µP (model.param=mup, models/mup.py) against its definition (Yang et al. 2022, Tensor Programs V, Table 3/8
for Adam; mup's MuReadout; Zheng et al. 2025 for DiT):

- at m = width / base_width = 1 it is SP bit for bit: same init, same outputs, same lr, same updates;
- at m = 4 every parameter's init std and Adam lr_scale follow from which of its dimensions grow with the
  width, worked out here from the shapes of the same model at the base width (not from the product's
  roles): both fans grow -> hidden: std / sqrt(m), lr / m, weight decay x m; only fan_out -> input:
  std and lr unchanged; only fan_in -> readout: zero init, lr unchanged, input x 1/m; vectors unchanged;
- the attention logits are scaled by sqrt(base_head_dim) / head_dim (1/d), SP's 1/sqrt(d) at m = 1.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from models import build_model
from models.blocks import Attention, FinalLayer
from models.dit import DiT
from models.mup import param_groups as mup_groups
from sweep.config import ConfigError
from sweep.run.adamw import DeviceAdamW
from sweep.run.finetune import param_groups

from .conftest import make_run, sweep_forked

VIDEO = dict(input_size=8, in_channels=3, num_frames=2)


def _video(width: int, param: str = "sp", base_width: int | None = None, seed: int = 0):
    torch.manual_seed(seed)
    return build_model("video_dit", "tiny", width=width, depth=2, param=param, base_width=base_width, **VIDEO)


def _train(model, groups, steps=2, seed=1):
    """A few AdamW steps on a fixed batch; returns the final output."""
    opt = DeviceAdamW(groups, lambda s: 1e-2, steps, (0.9, 0.999), 1e-8, 0.1, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 2, 8, 8, generator=g)
    t = torch.randint(0, 1000, (2,), generator=g).float()
    for step in range(steps):
        opt.at(step)
        loss = (model(x, t) - x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return model(x, t)


def _expected_role(wide: torch.Tensor, base: torch.Tensor) -> str:
    """The µP role by definition: which of fan_out (dim 0) and fan_in (the rest) grow with the width."""
    if wide.dim() < 2:
        return "vector"
    out_grows = wide.shape[0] != base.shape[0]
    in_grows = wide[0].numel() != base[0].numel()
    return {(True, True): "hidden", (True, False): "input", (False, True): "readout"}.get(
        (out_grows, in_grows), "vector"
    )


def test_mup_at_base_width_is_sp_bit_for_bit():
    """m = 1: same init, same lr (one group, lr_scale 1), same outputs after two AdamW steps (weight decay on)."""
    sp, mu = _video(64), _video(64, "mup", 64)
    for (n, a), (_, b) in zip(sp.state_dict().items(), mu.state_dict().items()):
        assert torch.equal(a, b), n
    groups = mup_groups(mu, 1e-2, 0.1)
    assert [g["lr_scale"] for g in groups] == [1.0] and groups[0]["weight_decay"] == 0.1
    out_sp = _train(sp, [{"params": list(sp.parameters()), "lr": 1e-2, "lr_scale": 1.0}])
    out_mu = _train(mu, groups)
    assert torch.equal(out_sp, out_mu)
    assert out_sp.abs().max() > 0  # the steps moved the zero-initialised output


def test_mup_at_base_width_is_sp_for_a_fixed_head_count():
    """A DiT built directly (fixed heads, the head dim grows): still SP bit for bit at m = 1."""
    kw = dict(input_size=8, in_channels=3, hidden_size=64, depth=2, num_heads=2)
    torch.manual_seed(0)
    sp = DiT(**kw)
    torch.manual_seed(0)
    mu = DiT(**kw, param="mup", base_width=64)
    assert all(torch.equal(a, b) for a, b in zip(sp.state_dict().values(), mu.state_dict().values()))
    assert all(m.scale is None for m in mu.modules() if isinstance(m, Attention))


def test_mup_at_width_multiplier_4_follows_the_table():
    base, sp_wide, wide = _video(32), _video(128), _video(128, "mup", 32)
    m = 4.0
    base_params, sp_params = dict(base.named_parameters()), dict(sp_wide.named_parameters())
    groups = mup_groups(wide, 1e-3, 0.1)
    lr_scale = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    seen = set()
    for name, p in wide.named_parameters():
        role = _expected_role(p, base_params[name])
        seen.add(role)
        assert lr_scale[id(p)] == (1 / m if role == "hidden" else 1.0), name
        assert decay[id(p)] == pytest.approx(0.1 * m if role == "hidden" else 0.1), name
        base_std = base_params[name].double().std().item() if p.numel() > 1 else 0.0
        if role == "hidden":
            want = base_std / math.sqrt(m)
        elif role == "input":
            want = base_std  # the base's init, not SP's at this width
        else:  # readout (zero: adaLN-Zero) and vectors (biases 0, norms 1)
            want = base_std
            if role == "readout":
                assert p.abs().max() == 0, name
        got = p.double().std().item() if p.numel() > 1 else 0.0
        assert got == pytest.approx(want, rel=0.15, abs=1e-12), (name, role, got, want)
    assert seen == {"hidden", "input", "readout", "vector"}
    # The input weight differs from SP's at this width (xavier would shrink it by fan_out).
    x_sp = sp_params["x_embedder.proj.weight"].std().item()
    x_mu = dict(wide.named_parameters())["x_embedder.proj.weight"].std().item()
    assert x_mu > 1.5 * x_sp
    assert wide.final_layer.readout_mult == 1 / m


def test_readout_multiplies_its_input_by_one_over_m():
    layer = FinalLayer(16, 2, 3, readout_mult=0.25)
    torch.nn.init.normal_(layer.linear.weight)
    torch.nn.init.normal_(layer.adaLN_modulation[-1].weight)
    x, c = torch.randn(2, 5, 16), torch.randn(2, 16)
    shift, scale = layer.adaLN_modulation(c).chunk(2, dim=1)
    h = layer.norm_final(x) * (1 + scale[:, None]) + shift[:, None]
    torch.testing.assert_close(layer(x, c), torch.nn.functional.linear(h / 4, layer.linear.weight, layer.linear.bias))


@pytest.mark.parametrize("backend", ["math", "eager", "flash"])
def test_attention_scale_is_one_over_head_dim(backend):
    """A fixed head count: the head dim grows 16 -> 64 with the width; the logits are q.k * sqrt(16) / 64."""
    torch.manual_seed(0)
    model = DiT(input_size=8, in_channels=3, hidden_size=128, depth=1, num_heads=2, param="mup", base_width=32)
    attn = model.blocks[0].attn
    assert attn.head_dim == 64 and attn.scale == pytest.approx(math.sqrt(16) / 64)
    attn.backend = backend
    x = torch.randn(2, 6, 128)
    q, k, v = attn.qkv(x).reshape(2, 6, 3, 2, 64).permute(2, 0, 3, 1, 4).unbind(0)
    logits = (q @ k.transpose(-2, -1)) / 16  # 1/d with d = 64, times sqrt(base head dim 16) = 4
    want = attn.proj((logits.softmax(-1) @ v).transpose(1, 2).reshape(2, 6, 128))
    torch.testing.assert_close(attn(x), want, rtol=1e-5, atol=1e-5)


def test_registry_widths_keep_the_head_dim_and_so_sp_attention():
    """build_model widens by adding heads at the size's head dim: µP's sqrt(base_hd)/hd is then SP's scale."""
    model = _video(128, "mup", 32)
    assert {m.head_dim for m in model.modules() if isinstance(m, Attention)} == {32}
    assert all(m.scale is None for m in model.modules() if isinstance(m, Attention))


def test_run_config_builds_mup_groups_and_leaves_sp_alone():
    sp = make_run("model.width=128")
    model = build_model("video_dit", "tiny", width=128, depth=2, **VIDEO)
    assert [(g["name"], g["lr_scale"]) for g in param_groups(sp, model)] == [("base", 1.0)]
    mu = make_run("model.width=128", "model.param=mup", "model.base_width=32")
    model = build_model("video_dit", "tiny", width=128, depth=2, param="mup", base_width=32, **VIDEO)
    got = sorted((g["name"], g["lr_scale"]) for g in param_groups(mu, model))
    assert got == [("base", 1.0), ("base/hidden", 0.25)]


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["model.param=mup", "model.base_width=0"], "model.base_width"),
        (["model.param=mup", "model.base_width=-32"], "model.base_width"),
        (["model.param=mup", "model.width=64", "model.base_width=128"], "model.base_width"),
        (["model.param=mup"], "model.base_width"),  # no base width
        (["model=latte_tiny", "model.param=mup", "model.base_width=32"], "model.param"),
        (
            ["model=custom", "model.target=examples.my_dit:build", "model.param=mup", "model.base_width=32"],
            "model.param",
        ),
    ],
)
def test_bad_mup_configs_are_one_line_errors(overrides, key):
    with pytest.raises(ConfigError, match="^" + re.escape(key) + ": "):
        make_run(*overrides)


def test_bad_mup_config_exits_2_with_one_line(tmp_path):
    proc = sweep_forked("model.param=mup", "model.base_width=1024", f"hydra.run.dir={tmp_path}/r", cwd=tmp_path)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "model.base_width" in lines[0], proc.stderr


class TinyMupModel(torch.nn.Module):
    """A user's model that does µP itself: hidden width `dim`, base `base_dim`, and declares its roles."""

    def __init__(self, dim: int = 64, base_dim: int = 16):
        super().__init__()
        self.width_mult = dim / base_dim
        self.inp = torch.nn.Linear(3, dim)
        self.hidden = torch.nn.Linear(dim, dim)
        self.out = torch.nn.Linear(dim, 3)

    def mup_roles(self):
        return {
            "inp.weight": "input",
            "inp.bias": "vector",
            "hidden.weight": "hidden",
            "hidden.bias": "vector",
            "out.weight": "readout",
            "out.bias": "vector",
        }

    def forward(self, x, t):
        h = self.hidden(self.inp(x.movedim(1, -1)).relu())
        return self.out(h / self.width_mult).movedim(-1, 1)


def test_a_custom_model_that_declares_its_roles_gets_the_mup_lr():
    """The cheap way in for model=custom (docs/models.md): `width_mult` and `mup_roles()` on the user's module."""
    from models.custom import build_custom_model

    shape = dict(channels=3, frames=2, height=8, width=8, patch_size=2)
    model = build_custom_model("tests.test_mup:TinyMupModel", {"dim": 64, "base_dim": 16}, **shape)
    groups = {g["name"]: g for g in mup_groups(model, 1e-3, 0.0)}
    assert groups["base/hidden"]["lr_scale"] == 0.25
    assert [id(p) for p in groups["base/hidden"]["params"]] == [id(model.model.hidden.weight)]
    plain = build_custom_model("examples.my_dit:build", {}, **shape)
    assert mup_groups(plain, 1e-3, 0.0) is None  # no roles declared: one group, as before


def test_mup_runs_pack():
    """StackedAdamW keeps one lr table per param group, so a µP run's hidden group is no reason to train alone."""
    from sweep.run.packing import refusal

    assert refusal(make_run("model.param=mup", "model.base_width=32", "model.width=64")) is None


def test_a_mup_run_builds_a_mup_model_and_its_groups():
    from sweep.run.build import build_parts
    from sweep.run.precision import PrecisionPolicy

    run = make_run("model.param=mup", "model.base_width=32", "model.width=128")
    parts = build_parts(run, torch.device("cpu"), PrecisionPolicy.from_config(run.precision))
    assert parts.model.width_mult == 4 and parts.model.final_layer.readout_mult == 0.25
    assert sorted(g["lr_scale"] for g in parts.optimizer.param_groups) == [0.25, 1.0]
    hidden = [g for g in parts.optimizer.param_groups if g["lr_scale"] == 0.25][0]
    assert hidden["weight_decay"] == 4 * run.optim.weight_decay
