"""model=custom: any nn.Module from `model.target=pkg.module:factory` behind the sweep's axes (models/custom.py)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from models.attention import FLASH_OPS, MATH_OP
from models.custom import build_custom_model
from models.modulate import MODULATE_OP
from sweep.config import ConfigError, check_inputs
from sweep.run.compiled import compile_unsupported_reason
from sweep.run.execute import execute
from sweep.run.packing import refusal
from tests.conftest import make_run, read_result, run_cli_refusals

FLASH_OP = FLASH_OPS["cpu"]
EXAMPLE = "model.target=examples.my_dit:build"
SMALL = "model.kwargs={dim:32,depth:2,heads:2}"  # the example at a test size: 2 blocks, 2 heads


def custom(target: str, *overrides: str):
    return make_run("model=custom", f"model.target={target}", *overrides)


def op_names(fn) -> dict[str, int]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


def example(attention: str = "math", modulate: str = "eager"):
    torch.manual_seed(0)
    return build_custom_model(
        "examples.my_dit:build",
        {"dim": 32, "depth": 2, "heads": 2},
        channels=3,
        frames=4,
        height=8,
        width=8,
        patch_size=2,
        attention=attention,
        modulate=modulate,
    )


def example_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 3, 4, 8, 8, generator=g), torch.tensor([10.0, 500.0])


# --- config errors: one line naming the key, before any run --------------------------------------------------


@pytest.mark.parametrize(
    "overrides,key,words",
    [
        (["model.target=examples.my_dit.build"], "model.target", "colon"),
        (["model.target=examples.nope:build"], "model.target", "cannot import module 'examples.nope'"),
        (["model.target=examples.my_dit:nope"], "model.target", "has no attribute 'nope'"),
        (["model.target=tests.custom_factories:NOT_CALLABLE"], "model.target", "not callable"),
        ([], "model.target", "needs the factory"),
        ([EXAMPLE, "model.size=S"], "model.size", "factory's business"),
        ([EXAMPLE, "model.qk_norm=true"], "model.qk_norm", "native models only"),
        ([EXAMPLE, "model.qk_gain=2.0"], "model.qk_gain", "native models only"),
        ([EXAMPLE, "model.name=dit"], "model.name", "only with model.arch=diffusers"),
        ([EXAMPLE, "model.kwargs={channels:4}"], "model.kwargs.channels", "comes from the config"),
        ([EXAMPLE, "data=synthetic_image", "data.frames=1"], "data.frames", "is a video model"),
        (["model.target=tests.custom_factories:image_tokens"], "data.frames", "is an image model"),
        ([EXAMPLE, "finetune=lora"], "finetune.target_modules", "no known attention projection names"),
    ],
)
def test_bad_custom_config_is_a_config_error_naming_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        make_run("model=custom", *overrides)
    message = str(err.value)
    assert message.startswith(f"{key}: ") and words in message and "\n" not in message, message


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["model.target=examples.my_dit:build"], "model.target"),
        (["model.kwargs={depth:2}"], "model.kwargs"),
    ],
)
def test_custom_keys_are_refused_on_other_models(overrides, key):
    with pytest.raises(ConfigError, match=f"^{key}: .*only with model=custom"):
        make_run(*overrides)


@pytest.mark.parametrize(
    "target,words",
    [
        ("tests.custom_factories:raises", "raised RuntimeError: no weights for this size"),
        ("tests.custom_factories:not_a_module_unannotated", "returned int 42, not a torch.nn.Module"),
        ("examples.my_dit:build", "raised ValueError: depth must be even"),
    ],
)
def test_a_failing_factory_is_a_config_error_before_any_run(target, words):
    run = custom(target, "model.kwargs={depth:3}" if target.startswith("examples") else "model.kwargs={}")
    with pytest.raises(ConfigError) as err:
        check_inputs(run)
    assert str(err.value).startswith("model.target: ") and words in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "target,words",
    [
        ("os:system", "Python's standard library"),
        ("builtins:eval", "Python's standard library"),
        ("numpy:add", "implemented in C"),
        ("tests.custom_factories:NotAModule", "not a torch.nn.Module subclass"),
        ("tests.custom_factories:not_a_module", "annotated to return int"),
        ("tests.custom_factories:returns_none_annotated", "annotated to return NoneType"),
        ("tests.custom_factories:returns_str_annotation", "annotated to return str"),
    ],
)
def test_what_cannot_be_a_factory_is_refused_before_it_is_called(target, words, tmp_path):
    """issue 33: `model.target=os:system model.kwargs={command:...}` ran the command while the config was
    validated, before the "not a torch.nn.Module" refusal. What cannot be a model factory is never called."""
    touched = tmp_path / "PWNED"
    kwargs = f"model.kwargs={{command:'touch {touched}'}}" if target.startswith("os:") else "model.kwargs={}"
    with pytest.raises(ConfigError) as err:
        check_inputs(custom(target, kwargs))
    assert str(err.value).startswith("model.target: ") and words in str(err.value), str(err.value)
    assert not touched.exists()


@pytest.mark.parametrize(
    "target,words",
    [
        (
            "tests.custom_factories:wrong_shape",
            "must return a prediction of x's shape (2, 3, 4, 8, 8), got (2, 1, 4, 8, 8)",
        ),
        ("tests.custom_factories:returns_a_tuple", "must return a tensor of x's shape (2, 3, 4, 8, 8), got tuple"),
        ("tests.custom_factories:forward_raises", "raised RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    ],
)
def test_a_forward_of_the_wrong_shape_or_kind_is_refused_before_any_run(target, words):
    """issue 33: these were runs ending `error` with a traceback (exit 0); the probe now runs one forward on a
    batch of 2 of the configured data shape and checks the output is a tensor of the input's shape."""
    with pytest.raises(ConfigError) as err:
        check_inputs(custom(target, "model.kwargs={}"))
    assert str(err.value).startswith("model.target: ") and words in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "target,kwargs,words",
    [
        ("os:popen", "{cmd:'touch {pwned}'}", "Python's standard library"),
        ("subprocess:run", "{args:[touch,'{pwned}']}", "Python's standard library"),
        ("shutil:rmtree", "{path:'{victim}'}", "Python's standard library"),
        ("os.path:join", "{a:x}", "Python's standard library"),
        ("tests.custom_factories:popen_alias", "{cmd:'touch {pwned}'}", "defined in Python's standard library (os)"),
        ("tests.custom_factories:partial_factory", "{}", "not a class or a function"),
        ("tests.custom_factories:callable_factory", "{}", "not a class or a function"),
    ],
)
def test_the_standard_library_and_what_is_no_class_or_function_is_never_called(target, kwargs, words, tmp_path):
    """issue 45: os:popen, subprocess:run and shutil:rmtree (it deleted a directory) all ran, twice, before "not a
    torch.nn.Module". A target in Python's standard library (or defined there, whatever module re-exports it), or
    anything that is not a class or a function, is refused before any call."""
    pwned, victim = tmp_path / "PWNED", tmp_path / "victim"
    victim.mkdir()
    kwargs = kwargs.replace("{pwned}", str(pwned)).replace("{victim}", str(victim))
    with pytest.raises(ConfigError) as err:
        check_inputs(custom(target, f"model.kwargs={kwargs}"))
    assert str(err.value).startswith("model.target: ") and words in str(err.value), str(err.value)
    assert not pwned.exists() and victim.is_dir()


def test_the_check_calls_a_factory_once_whatever_it_probes():
    """issue 45: the check called a factory on the meta device, again for real, again per pure precision and again
    for precision.fp32_modules; now once per distinct call (the runs then build their own)."""
    from tests import custom_factories

    kwargs = "model.kwargs={tag:once}"
    for precision in ("fp32", "bf16_pure", "fp16_pure"):
        check_inputs(
            custom(
                "tests.custom_factories:counted", kwargs, f"precision={precision}", "precision.fp32_modules=[model.out]"
            )
        )
    assert custom_factories.CALLS["once"] == 1


def test_a_custom_model_over_the_parameter_limit_is_refused_from_the_meta_device_in_seconds():
    """issue 33: a 4.3G-parameter factory was built for real and SIGKILLed after 86 s. It is now counted on
    the meta device against the native models' 1,000M limit (sweep/run/sizes.py) before any real build: the
    factory only ever runs under the meta device (what it allocates says so), not a timed bound."""
    from tests.custom_factories import HUGE_BUILT_ON

    HUGE_BUILT_ON.clear()
    with pytest.raises(
        ConfigError, match=r"^model.kwargs: .*huge would have 4,356.0M parameters \(counted on the meta"
    ):
        check_inputs(custom("tests.custom_factories:huge", "model.kwargs={}"))
    assert HUGE_BUILT_ON and set(HUGE_BUILT_ON) == {"meta"}, HUGE_BUILT_ON


def test_a_huge_model_built_with_an_explicit_device_is_counted_on_meta_not_built():
    """issue 45: a factory passing device="cpu" (and calling .to("cpu")) was built for real, 4.4 GB, before the
    refusal that said "counted on the meta device". Explicit devices are overridden while it is counted."""
    from tests.custom_factories import HUGE_WEIGHT_ON

    HUGE_WEIGHT_ON.clear()
    with pytest.raises(
        ConfigError, match=r"^model.kwargs: .*huge_on_cpu would have 1,089.0M parameters \(counted on the meta"
    ):
        check_inputs(custom("tests.custom_factories:huge_on_cpu", "model.kwargs={}"))
    assert HUGE_WEIGHT_ON == ["meta"], HUGE_WEIGHT_ON


def test_a_huge_model_that_reads_its_values_is_refused_with_what_was_counted():
    with pytest.raises(ConfigError, match=r"^model.kwargs: .*huge_then_reads makes over 1,000M values as it builds"):
        check_inputs(custom("tests.custom_factories:huge_then_reads", "model.kwargs={}"))


def test_a_factory_that_cannot_build_on_meta_is_built_for_real_and_counted():
    check_inputs(custom("tests.custom_factories:needs_real_tensors", "model.kwargs={}"))


def test_a_factory_with_an_unresolvable_or_optional_module_annotation_is_called():
    for target in ("tests.custom_factories:unresolvable_annotation", "tests.custom_factories:module_or_none"):
        check_inputs(custom(target, "model.kwargs={}"))


OUTPUT_DIRS = ["hydra.run.dir=DIR/run", "hydra.sweep.dir=DIR/sweep"]
CLI_MISTAKES = {
    "os_system": ["model=custom", "model.target=os:system", "model.kwargs={command:'touch DIR/PWNED'}", OUTPUT_DIRS[0]],
    "no_attribute": ["model.target=examples.my_dit:nope", "model=custom", *OUTPUT_DIRS],
    # a grid: the factory fails in one cell only, found before the first run
    "one_cell": ["-m", "model.kwargs.depth=2,3", "steps=1", "model=custom", EXAMPLE, *OUTPUT_DIRS],
}
"""Command lines `python -m sweep` refuses before any run; DIR stands for the case's own directory."""


@pytest.fixture(scope="module")
def cli_mistakes(tmp_path_factory) -> dict[str, tuple]:
    """Each of CLI_MISTAKES from a directory of its own, each in a fork of one warmed interpreter
    (conftest.run_cli_refusals: no interpreter start-up each): by name, its CompletedProcess and its directory."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in CLI_MISTAKES}
    argvs = [[a.replace("DIR", str(d)) for a in CLI_MISTAKES[name]] for name, d in dirs.items()]
    procs = run_cli_refusals(*zip(argvs, dirs.values()))
    return {name: (proc, d) for name, proc, d in zip(dirs, procs, dirs.values())}


@pytest.mark.xdist_group("custom_refusals")  # the module's `cli_mistakes` batch, run once: on one worker
def test_os_system_as_model_target_is_one_line_and_runs_nothing(cli_mistakes):
    proc, tmp_path = cli_mistakes["os_system"]
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "model.target: os:system is in Python's standard" in lines[0], (
        proc.stderr
    )
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.xdist_group("custom_refusals")  # the module's `cli_mistakes` batch, run once: on one worker
@pytest.mark.parametrize(
    "name,words",
    [
        ("no_attribute", "model.target: module 'examples.my_dit' has no attribute 'nope'"),
        ("one_cell", "raised ValueError: depth must be even (spatial, temporal pairs), got 3 (in the sweep cell"),
    ],
)
def test_cli_mistake_is_one_line_and_exit_2(name, words, cli_mistakes):
    proc, tmp_path = cli_mistakes[name]
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sweep: config error: ") and words in lines[0], proc.stderr
    assert not (tmp_path / "sweep" / "0").exists() and not (tmp_path / "run" / "result.json").exists()


# --- the attention axis: forced, counted, and proven by the profiler ------------------------------------------


def test_attention_axis_forces_the_sdpa_kernel_inside_the_custom_model():
    x, t = example_inputs()
    outs = {}
    for backend in ("flash", "math", "eager"):
        model = example(attention=backend)
        ops = op_names(lambda: outs.__setitem__(backend, model(x, t).detach()))  # noqa: B023  (called now)
        calls = model.route.calls_last_forward
        assert calls == 2  # one per block (depth 2: a spatial and a temporal attention)
        if backend == "flash":
            assert ops.get(FLASH_OP) == calls and MATH_OP not in ops
        elif backend == "math":
            assert ops.get(MATH_OP) == calls and FLASH_OP not in ops
        else:
            assert FLASH_OP not in ops and MATH_OP not in ops and ops.get("aten::softmax", 0) >= calls
        assert model.kernels()["sdpa_calls_per_forward"] == calls
    torch.testing.assert_close(outs["flash"], outs["math"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(outs["eager"], outs["math"], atol=1e-5, rtol=1e-4)


def test_a_run_records_the_kernels_that_ran(tmp_path):
    # device=cpu here and below where attention=flash meets fp32: CUDA's flash needs fp16/bf16 (skipped there)
    r = execute(custom("examples.my_dit:build", SMALL, "attention=flash", "steps=2", "device=cpu"), tmp_path, {})
    assert r.status == "stable", r.reason
    assert r.kernels["attention"] == "sdpa:FLASH_ATTENTION" and r.kernels["sdpa_calls_per_forward"] == 2
    assert r.kernels["modulate"] == "eager" and r.kernels["modulate_calls_per_forward"] == {"eager": 5}
    assert r.kernels["model"] == "examples.my_dit:build"
    assert read_result(tmp_path)["kernels"] == r.kernels


def test_a_model_without_sdpa_is_skipped_for_a_forced_attention(tmp_path):
    target = "tests.custom_factories:no_attention"
    r = execute(custom(target, "attention=flash", "steps=2", "device=cpu"), tmp_path / "flash", {})
    assert r.status == "skipped"
    assert "attention=flash" in r.reason and "made no torch.nn.functional.scaled_dot_product_attention" in r.reason
    r = execute(custom(target, "attention=math", "steps=2"), tmp_path / "math", {})  # the default claims nothing
    assert r.status == "stable", r.reason
    assert r.kernels["attention"].startswith("none") and r.kernels["sdpa_calls_per_forward"] == 0


# --- the modulate axis ----------------------------------------------------------------------------------------


def test_fused_modulate_runs_the_custom_op_where_the_model_calls_models_modulate():
    x, t = example_inputs()
    eager, fused = example(modulate="eager"), example(modulate="fused")
    fused.load_state_dict(eager.state_dict())
    for p in eager.parameters():  # adaLN-Zero starts at zero: give the modulation something to do
        torch.nn.init.normal_(p, std=0.05) if p.dim() > 1 else None
    fused.load_state_dict(eager.state_dict())
    ops = op_names(lambda: fused(x, t))
    assert ops.get(MODULATE_OP) == 5  # 2 per block x 2 blocks + the output layer
    assert fused.kernels()["modulate"] == MODULATE_OP and fused.kernels()["modulate_calls_per_forward"] == {"fused": 5}
    assert MODULATE_OP not in op_names(lambda: eager(x, t))
    torch.testing.assert_close(fused(x, t), eager(x, t), atol=1e-5, rtol=1e-4)
    buggy = example(modulate="fused_buggy")
    buggy.load_state_dict(eager.state_dict())
    assert not torch.allclose(buggy(x, t), eager(x, t), atol=1e-4)  # the axis really changes the computation


def test_modulate_impl_omitted_comes_from_the_adapter(tmp_path):
    r = execute(custom("tests.custom_factories:tokens", "modulate=fused", "steps=2"), tmp_path, {})
    assert r.status == "stable", r.reason
    assert r.kernels["modulate"] == MODULATE_OP and r.kernels["modulate_calls_per_forward"] == {"fused": 1}
    assert r.kernels["sdpa_calls_per_forward"] == 1


def test_a_model_without_models_modulate_is_skipped_for_fused(tmp_path):
    r = execute(custom("tests.custom_factories:no_attention", "modulate=fused", "steps=2"), tmp_path, {})
    assert r.status == "skipped" and "modulate=fused" in r.reason and "never called models.modulate" in r.reason


# --- the rest of the run: shapes, errors, what cannot run -----------------------------------------------------


def test_an_image_model_trains_on_images(tmp_path):
    r = execute(
        custom("tests.custom_factories:image_tokens", "data=synthetic_image", "data.frames=1", "steps=2"), tmp_path, {}
    )
    assert r.status == "stable", r.reason


def test_a_wrong_output_shape_is_an_error_with_one_message(tmp_path):
    r = execute(custom("tests.custom_factories:wrong_shape", "steps=1"), tmp_path, {})
    assert r.status == "error" and "must return a prediction of x's shape" in r.reason


def test_compile_and_packing_say_why_not():
    run = custom("examples.my_dit:build", SMALL)
    assert "model=custom" in refusal(run) or "custom model" in refusal(run)
    compiled = custom("examples.my_dit:build", SMALL, "compile=true")
    assert "model=custom" in compile_unsupported_reason(compiled, torch.device("cpu"))


def test_lora_on_a_custom_model_wraps_the_named_modules(tmp_path):
    run = custom("examples.my_dit:build", SMALL, "finetune=lora", "finetune.target_modules=[to_qkv,out]", "steps=2")
    r = execute(run, tmp_path, {})
    assert r.status == "stable", r.reason
    assert r.n_params > execute(custom("examples.my_dit:build", SMALL, "steps=1"), tmp_path / "base", {}).n_params


# --- the example gets the built-in model's verdicts -----------------------------------------------------------

CELLS = [("fp16_pure", lr, att) for lr in ("1e-4", "1e-3", "3e-2") for att in ("flash", "math")] + [
    (precision, "3e-2", att) for precision in ("fp32", "bf16_amp", "fp16_amp") for att in ("flash", "math")
]
"""The demo grid's fp16_pure cells and lr 3e-2 cells (conf/experiment/demo.yaml), at the test size; all diverge
(on the CPU, where these verdicts were recorded and fp32 flash runs: device=cpu below)."""
STABLE = [("fp32", "1e-4", "flash"), ("bf16_amp", "1e-3", "math")]
"""And two the built-in model survives, so the example is not just a model that always diverges."""


@pytest.mark.slow
@pytest.mark.parametrize("precision,lr,attention", CELLS + STABLE)
def test_the_example_gets_the_builtin_models_verdicts(precision, lr, attention, tmp_path):
    common = [f"precision={precision}", f"optim.lr={lr}", f"attention={attention}", "steps=15", "threads=1"]
    common.append("device=cpu")
    ours = execute(make_run("model=custom", EXAMPLE, *common), tmp_path / "custom", {})
    builtin = execute(make_run("model=video_dit_tiny", *common), tmp_path / "builtin", {})
    assert ours.status == builtin.status == ("stable" if (precision, lr, attention) in STABLE else "diverged")
    assert ours.verdict == builtin.verdict, (ours.verdict, ours.first_bad_step, builtin.verdict, builtin.first_bad_step)


# --- the pure-precision dtype contract: probed once before the sweep -------------------------------------------


OUTSIDE = ["model=custom", "model.target=tests.custom_factories:outside_dit", "data=synthetic_image", "data.frames=1"]


def test_a_float32_intermediate_under_a_pure_precision_names_the_module_and_the_cast():
    from sweep.run.dtype_contract import contract_problem

    why = contract_problem(make_run(*OUTSIDE, "precision=fp16_pure"))
    assert why.startswith(
        "precision=fp16_pure: t_embedder.mlp.0 (Linear, float16 weights) gets a float32 input (`mat1 and mat2 must"
    )
    assert (
        "`.to(self.t_embedder.mlp[0].weight.dtype)`" in why and "precision.fp32_modules=[model.t_embedder.mlp.0]" in why
    )
    assert "bfloat16 weights" in contract_problem(make_run(*OUTSIDE, "precision=bf16_pure"))
    # The fix it names works: that module kept in float32 (or the cast in the model: examples/my_dit.py) runs.
    assert (
        contract_problem(make_run(*OUTSIDE, "precision=fp16_pure", "precision.fp32_modules=[model.t_embedder]")) is None
    )
    assert contract_problem(make_run("model=custom", EXAMPLE, SMALL, "precision=fp16_pure")) is None
    assert contract_problem(make_run(*OUTSIDE, "precision=bf16_amp")) is None  # autocast casts for it


def test_a_sweep_skips_the_pure_cells_with_one_line_and_builds_none_of_them(tmp_path, caplog, capsys):
    """The trial: every fp16_pure run of an outside DiT ended `error: mat1 and mat2 must have the same dtype` with a
    traceback each. Now the grid's check probes fp16_pure once, says it once, and its cells are `skipped` with that
    reason without building their model; the other cells run."""
    from tests import custom_factories
    from tests.conftest import multirun_in_process, read_results

    before = custom_factories.FACTORY_CALLS["outside_dit"]
    caplog.set_level("INFO", logger="sweep")
    grid = ["precision=fp32,fp16_pure", "optim.lr=1e-4,1e-3", "steps=2", "ledger.enabled=false"]
    multirun_in_process(tmp_path / "sweep", *OUTSIDE, "data.height=4", "data.width=4", *grid)
    results = read_results(tmp_path / "sweep")
    statuses = sorted((r["params"]["precision"], r["status"]) for r in results)
    assert statuses == [("fp16_pure", "skipped")] * 2 + [("fp32", "stable")] * 2
    assert all("t_embedder.mlp.0 (Linear, float16 weights)" in r["reason"] for r in results if r["status"] == "skipped")
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "its runs are skipped" in r.getMessage()]
    jobs = capsys.readouterr().out  # the jobs log through Hydra's job logging, to stdout
    assert len(warned) == 1 and "Traceback" not in caplog.text + jobs and "run crashed" not in jobs
    assert jobs.count("skipped: precision=fp16_pure: t_embedder.mlp.0") == 2  # each skipped run's own line
    # the check's one build (counted, probed, and probed again under fp16_pure), one per fp32 run: none per skip
    assert custom_factories.FACTORY_CALLS["outside_dit"] - before == 3
