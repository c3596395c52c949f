"""model=diffusers_config: a released diffusers transformer built from its own config.json, shrunk, trains
like a zoo model (kernels counted, not assumed), and every mistake in the file or model.shrink is one line
naming the key before any run.

The five files under tests/data/diffusers_configs/ are the released models' transformer/config.json values
(tests/data/diffusers_configs/README.md says where each came from). At their released size they count the
published parameter numbers (test_the_files_describe_the_released_models).
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from models.diffusers_config import (
    CLASS_REMAPPING,
    PARAM_BUDGET,
    Released,
    build_from_config,
    class_parameters,
    count_parameters,
    read_config,
    zoo_name,
)
from models.diffusers_zoo import ZOO
from models.modulate import MODULATE_OP
from sweep.config import ConfigError, check_inputs
from sweep.run.execute import execute

from .conftest import FAST, REPO, make_run, sweep_forked

DIR = f"{REPO}/tests/data/diffusers_configs"
SHRINK = {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 32}
RELEASED = {  # file: (zoo class, the shrink that makes it tiny, published size of the released transformer)
    "cogvideox_2b": ("cogvideox", SHRINK, (1.69e9, 1.70e9)),  # "CogVideoX-2B"
    "wan2_1_t2v_1_3b": ("wan", {**SHRINK, "ffn_dim": 128}, (1.41e9, 1.43e9)),  # "1.3B"
    "sana_600m_1024px": (
        "sana",
        {**SHRINK, "num_cross_attention_heads": 2, "cross_attention_head_dim": 32},
        (0.59e9, 0.60e9),  # "600M"
    ),
    "pixart_sigma_xl_2_1024_ms": ("pixart", SHRINK, (0.61e9, 0.62e9)),  # "0.6B"
    "hunyuanvideo": (
        "hunyuan",
        {**SHRINK, "num_single_layers": 1, "num_refiner_layers": 1, "rope_axes_dim": [8, 12, 12]},
        (12.8e9, 12.9e9),  # "13B"
    ),
}
FLASH_OP, MATH_OP = "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math"


def path(stem: str) -> str:
    return f"{DIR}/{stem}.json"


def shrink_override(shrink: dict) -> str:
    return "model.shrink={" + ",".join(f"{k}:{json.dumps(v).replace(' ', '')}" for k, v in shrink.items()) + "}"


def released_run(stem: str, *extra: str, shrink: dict | None = None):
    return make_run(*released_run_overrides(stem, *extra, shrink=shrink))


def released_run_overrides(stem: str, *extra: str, shrink: dict | None = None) -> list[str]:
    name, default, _ = RELEASED[stem]
    data = ["data=synthetic_image", "data.frames=1"] if ZOO[name].is_image else []
    return [
        "model=diffusers_config",
        f"model.config={path(stem)}",
        shrink_override(default if shrink is None else shrink),
        *data,
        "data.batch_size=2",
        "threads=1",
        "eval.samples=2",
        *extra,
    ]


def op_names(fn) -> dict[str, int]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


# --- the files are the released models ------------------------------------------------------------------------


@pytest.mark.parametrize("stem", RELEASED)
def test_the_files_describe_the_released_models(stem):
    """Built as released (the file's keys only, on the meta device), each counts its published size."""
    config = read_config(path(stem))
    name = zoo_name(config, path(stem))
    assert name == RELEASED[stem][0]
    kwargs = {k: v for k, v in config.items() if k in class_parameters(ZOO[name].cls_name)}
    low, high = RELEASED[stem][2]
    assert low <= count_parameters(Released(path(stem), name, ZOO[name].cls_name, kwargs)) <= high


def test_the_legacy_class_remapping_is_diffusers_own():
    from diffusers.models.model_loading_utils import _CLASS_REMAPPING_DICT

    assert CLASS_REMAPPING == _CLASS_REMAPPING_DICT


# --- shrunk, they train, and record what ran --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stem", RELEASED)
def test_a_shrunk_released_config_trains_with_a_verdict(stem, tmp_path):
    name = RELEASED[stem][0]
    fused = bool(ZOO[name].routed)  # where the modulation is a module, the fused kernel must really run
    # device=cpu: the profiler check below names the CPU flash op, and fp32 flash is skipped on CUDA
    run = released_run(stem, "device=cpu", "attention=flash", "steps=3", *(["modulate=fused"] if fused else []))
    check_inputs(run)
    r = execute(run, tmp_path, {})
    assert r.status == "stable", (r.status, r.reason, r.verdict)
    assert math.isfinite(r.final_loss) and r.steps_run == 3 and r.n_params < 3_000_000
    assert r.kernels["attention"].endswith("sdpa:FLASH_ATTENTION") and r.kernels["sdpa_calls_per_forward"] > 0
    assert MODULATE_OP in r.kernels["modulate"] if fused else r.kernels["modulate"].startswith("eager")
    assert r.kernels["modulate_sites"] == ZOO[name].modulation

    # The count is the profiler's: the same model, one forward, flash ops only, as many as recorded.
    torch.manual_seed(0)
    model = build_from_config(
        path(stem), run.model.shrink, **{**run.model_inputs, "attention": "flash", "modulate": "eager"}
    ).eval()
    assert type(model.transformer).__name__ == ZOO[name].cls_name
    d = run.data
    x = torch.randn(
        (2, d.channels, d.height, d.width) if ZOO[name].is_image else (2, d.channels, d.frames, d.height, d.width)
    )
    ops = op_names(lambda: model(x, torch.tensor([10.0, 900.0])))
    assert ops.get(FLASH_OP) == r.kernels["sdpa_calls_per_forward"] == model.kernels()["sdpa_calls_per_forward"]
    assert MATH_OP not in ops
    assert r.n_params == sum(p.numel() for p in model.parameters())


def test_the_tool_sets_the_data_keys_and_the_shrink_the_rest():
    run = released_run("pixart_sigma_xl_2_1024_ms")
    from models.diffusers_config import resolve

    shape = {k: v for k, v in run.model_inputs.items() if k not in ("attention", "modulate")}
    kw = resolve(run.model.config, run.model.shrink, **shape).kwargs
    assert kw["in_channels"] == kw["out_channels"] == 3  # released: 4 in, 8 out (learned variance)
    assert kw["sample_size"] == 8 and kw["patch_size"] == 2 and kw["caption_channels"] == 32
    assert kw["num_layers"] == 2 and kw["num_attention_heads"] == 2 and kw["attention_head_dim"] == 32
    assert kw["cross_attention_dim"] == 64  # tied to the hidden size, which the shrink changed
    assert kw["interpolation_scale"] == 2 and kw["norm_eps"] == 1e-6  # the file's own
    assert "use_linear_projection" not in kw  # a legacy key the class does not take


def test_modulate_fused_on_an_inline_class_is_skipped(tmp_path):
    r = execute(released_run("pixart_sigma_xl_2_1024_ms", "modulate=fused", "steps=1"), tmp_path, {})
    assert r.status == "skipped" and "PixArtTransformer2DModel's adaLN modulation is inline" in r.reason


# --- mistakes: one line naming the key, before any run ------------------------------------------------------------


def _write(tmp_path, text: str) -> str:
    p = tmp_path / "config.json"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize(
    "content,overrides,key,words",
    [
        (None, [], "model.config", "model=diffusers_config needs the file"),
        (None, ["model.config=/nonexistent/config.json"], "model.config", "no such file: /nonexistent/config.json"),
        ("{not json", ["model.config=FILE"], "model.config", "is not JSON"),
        ("[1, 2]", ["model.config=FILE"], "model.config", "holds a JSON list, not an object"),
        ('{"num_layers": 2}', ["model.config=FILE"], "model.config", "has no _class_name"),
        (
            '{"_class_name": "FooTransformer3DModel"}',
            ["model.config=FILE"],
            "model.config",
            "class FooTransformer3DModel (",
        ),
        (
            '{"_class_name": "Transformer2DModel", "norm_type": "layer_norm"}',
            ["model.config=FILE"],
            "model.config",
            "class Transformer2DModel with norm_type='layer_norm' has no adapter spec",
        ),
        (
            None,
            [f"model.config={DIR}/cogvideox_2b.json", "model.shrink={num_blocks:2}"],
            "model.shrink.num_blocks",
            "CogVideoXTransformer3DModel.__init__ takes no 'num_blocks'",
        ),
        (
            None,
            [f"model.config={DIR}/cogvideox_2b.json", "model.shrink={in_channels:4}"],
            "model.shrink.in_channels",
            "is set by the tool for CogVideoXTransformer3DModel",
        ),
        (
            None,
            [f"model.config={DIR}/sana_600m_1024px.json"],
            "data.frames",
            f"SanaTransformer2DModel ({DIR}/sana_600m_1024px.json) is an image model",
        ),
        (None, [f"model.config={DIR}/cogvideox_2b.json", "model.qk_norm=true"], "model.qk_norm", "native models"),
    ],
)
def test_a_bad_config_or_shrink_is_one_line_naming_the_key(content, overrides, key, words, tmp_path):
    file = _write(tmp_path, content) if content is not None else None
    with pytest.raises(ConfigError) as err:
        make_run("model=diffusers_config", *[o.replace("FILE", file or "") for o in overrides])
    message = str(err.value)
    assert message.startswith(f"{key}: ") and words in message and "\n" not in message, message
    if "Foo" in words:
        assert "has no adapter spec" in message and "CogVideoXTransformer3DModel" in message  # and what is known


@pytest.mark.parametrize(
    "override,key",
    [(f"model.config={DIR}/cogvideox_2b.json", "model.config"), ("model.shrink={num_layers:2}", "model.shrink")],
)
def test_released_config_keys_are_refused_on_other_models(override, key):
    with pytest.raises(ConfigError, match=f"^{key}: .*only with model=diffusers_config"):
        make_run(override)


@pytest.mark.parametrize("stem", RELEASED)
def test_an_unshrunk_released_config_is_refused_with_the_keys_to_shrink(stem):
    run = released_run(stem, shrink={})
    with pytest.raises(ConfigError) as err:
        check_inputs(run)
    message = str(err.value)
    assert message.startswith("model.shrink: ") and f"over the {PARAM_BUDGET // 10**6}M" in message, message
    assert "model.shrink={num_layers:2," in message and "num_layers=" in message and "\n" not in message
    suggested = re.search(r"'(model\.shrink=\{.*?\})'", message).group(1)  # and the suggestion runs
    check_inputs(make_run(*[o for o in released_run_overrides(stem) if not o.startswith("model.shrink")], suggested))


def test_a_shrink_the_class_cannot_run_is_one_line_before_any_run():
    """HunyuanVideo's rope_axes_dim must sum to attention_head_dim: the class accepts the shrink, its forward
    does not. The one-batch probe finds it at check_inputs."""
    shrink = {**RELEASED["hunyuanvideo"][1]}
    del shrink["rope_axes_dim"]  # still the released [16, 56, 56], for heads of 32
    run = released_run("hunyuanvideo", shrink=shrink)
    with pytest.raises(ConfigError) as err:
        check_inputs(run)
    message = str(err.value)
    assert message.startswith("model.shrink: HunyuanVideoTransformer3DModel from ") and "fails on a batch" in message
    assert "\n" not in message


def test_a_shrink_value_the_class_refuses_is_one_line():
    run = released_run("cogvideox_2b", shrink={**SHRINK, "num_layers": "two"})
    with pytest.raises(ConfigError) as err:
        check_inputs(run)
    message = str(err.value)
    assert message.startswith("model.shrink: CogVideoXTransformer3DModel from ") and "cannot be built: " in message
    assert "TypeError" in message and "\n" not in message, message


def test_the_probe_leaves_the_global_rng_as_it_was():
    run = released_run("cogvideox_2b", "data.height=4", "data.width=4")  # a shape not probed before
    torch.manual_seed(123)
    check_inputs(run)
    after = torch.rand(1)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(1))


@pytest.mark.slow
def test_cli_unknown_class_in_a_grid_is_one_line_and_exit_2_before_any_run(tmp_path):
    (tmp_path / "foo.json").write_text('{"_class_name": "FooTransformer3DModel"}')
    proc = sweep_forked(
        "-m",
        "model=diffusers_config",
        f"model.config={DIR}/cogvideox_2b.json,{tmp_path}/foo.json",
        shrink_override(SHRINK),
        *FAST,
        "steps=1",
        f"hydra.sweep.dir={tmp_path}/sweep",
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("sweep: config error: model.config: class FooTransformer3DModel (") and (
        "has no adapter spec" in lines[0]
    ), lines[0]
    assert not (tmp_path / "sweep" / "0").exists()


def _other(value):
    """A different value of the same kind (None and strings stay: no other value is known to be valid)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return 2 * value + 2
    if isinstance(value, (tuple, list)):
        return [_other(v) for v in value]
    return value


@pytest.mark.parametrize("name", list(ZOO))
def test_a_zoo_models_own_config_as_a_file_builds_the_zoo_model(name, tmp_path):
    """For all ten classes: the zoo's tiny config, written as a config.json for another data shape and with
    every key the tool sets changed, built with no shrink at the run's shape, is the zoo model, weight for
    weight and buffer for buffer. So the keys the tool sets (ZooSpec.data_keys, fixed, hidden_tied) are all
    the data-dependent ones, and nothing else of the file is lost."""
    from models.diffusers_config import tool_keys
    from models.diffusers_zoo import build_diffusers_model

    spec = ZOO[name]
    shape = dict(channels=3, frames=1 if spec.is_image else 4, height=8, width=8, patch_size=2)
    other = dict(channels=5, frames=1 if spec.is_image else 6, height=16, width=16, patch_size=4)
    config = {"_class_name": spec.cls_name, **spec.config(*other.values())}
    config.update({k: _other(config[k]) for k in tool_keys(spec) if k in config})
    file = tmp_path / "config.json"
    file.write_text(json.dumps(config))
    torch.manual_seed(0)
    zoo = build_diffusers_model(name, **shape)
    torch.manual_seed(0)
    released = build_from_config(str(file), {}, **shape)
    assert type(released.transformer) is type(zoo.transformer)
    a = {**dict(zoo.named_parameters()), **dict(zoo.named_buffers())}
    b = {**dict(released.named_parameters()), **dict(released.named_buffers())}
    assert a.keys() == b.keys()
    assert all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a), [
        k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])
    ]


def test_lora_compile_and_packing_treat_it_as_a_diffusers_model(tmp_path):
    from sweep.run.compiled import compile_unsupported_reason
    from sweep.run.packing import refusal

    run = released_run("cogvideox_2b", "finetune=lora", "steps=2")
    r = execute(run, tmp_path, {})
    assert r.status == "stable", r.reason  # LoRA found diffusers' to_q/to_k/to_v/to_out.0 in the released class
    assert "cogvideox_2b.json is a diffusers model" in refusal(released_run("cogvideox_2b"))
    compiled = released_run("cogvideox_2b", "compile=true")
    assert "model.arch=diffusers_config" in compile_unsupported_reason(compiled, torch.device("cpu"))


@pytest.mark.parametrize("stem", ["cogvideox_2b", "hunyuanvideo"])
def test_a_very_deep_released_config_is_refused_without_building_it(stem, tmp_path, monkeypatch):
    """issue 33: `num_layers=100000` in the file, no shrink, built 100000 blocks on the meta device (182 s) to
    refuse. A deep model is counted at depths 2 and 4 of each block kind and extrapolated: the linear layers
    built are a few blocks' worth (counted, not timed), every one on the meta device."""
    built: list[str] = []
    linear_init = torch.nn.Linear.__init__

    def counted(self, *args, **kwargs):
        linear_init(self, *args, **kwargs)
        built.append(self.weight.device.type)

    config = json.loads(open(path(stem)).read())
    config["num_layers"] = 100_000
    deep = tmp_path / "config.json"
    deep.write_text(json.dumps(config))
    run = make_run(
        *[
            o if not o.startswith("model.config=") else f"model.config={deep}"
            for o in released_run_overrides(stem, shrink={})
        ]
    )
    monkeypatch.setattr(torch.nn.Linear, "__init__", counted)
    with pytest.raises(ConfigError, match=r"^model.shrink: .* would have [\d,]+M parameters, over the 100M"):
        check_inputs(run)
    assert 0 < len(built) < 1_000 and set(built) == {"meta"}, (len(built), set(built))


@pytest.mark.parametrize("stem", sorted(RELEASED))
def test_the_extrapolated_count_equals_the_built_count(stem):
    from models.diffusers_config import _meta_count, count_parameters, resolve

    released = resolve(path(stem), {}, channels=4, frames=4, height=8, width=8, patch_size=2)
    assert count_parameters(released) == _meta_count(released, {})


@pytest.mark.parametrize(
    "kind,words",
    [
        ("dir", "a directory, not a config.json file (give its config.json)"),
        ("loop", "a symlink loop (it never reaches a file)"),
        ("broken", "a broken symlink (its target does not exist)"),
        ("missing", "no such file"),
    ],
)
def test_model_config_that_is_no_file_says_what_it_is(kind, words, tmp_path):
    """issue 33: a directory or a symlink loop given as model.config said "no such file"."""
    target = tmp_path / "x"
    if kind == "dir":
        target.mkdir()
        (target / "config.json").write_text("{}")
    elif kind == "loop":
        os.symlink(tmp_path / "y", target)
        os.symlink(target, tmp_path / "y")
    elif kind == "broken":
        os.symlink(tmp_path / "gone.json", target)
    with pytest.raises(ConfigError) as err:
        make_run("model=diffusers_config", f"model.config={target}")
    assert str(err.value) == f"model.config: {words}: {target}", str(err.value)
