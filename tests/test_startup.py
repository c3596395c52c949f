"""What a process pays before its first step: torch, and not torch._dynamo unless the run compiles.

A mistake that fails composition exits before torch loads at all (sweep.job imports the runner at the first
run). torch imports torch._dynamo lazily (~2 s of CPU, with sympy), and four calls runs made used to trigger
it: a meta-device model build (sweep/run/sizes.py), torch.optim.Optimizer.add_param_group (wrapped in
torch._disable_dynamo), torch.use_deterministic_algorithms (which imports inductor's config) and, in a
bf16/fp16 run with emulated GEMMs, the dispatch mode's __torch_dispatch__ (wrapped too, sweep/run/gemm.py).
Every sweep, job and run process paid it; docs/overhead.md has the measurement.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from models.registry import build_model, count_params
from sweep.run import sizes
from sweep.run.build import set_deterministic

from .conftest import REPO, cli_env

RUN_IN_A_NEW_PROCESS = """
import sys, tempfile
from tests.conftest import make_run
from sweep.run.execute import execute
for overrides in (
    ["model=video_dit_tiny"],
    ["model=dit_tiny", "data=synthetic_image", "data.frames=1"],
    ["precision=bf16_amp", "precision.cpu_gemm=emulated"],
):
    with tempfile.TemporaryDirectory() as out:
        result = execute(make_run(*overrides, "device=cpu", "steps=2", "ledger.enabled=false"), out, {})
    assert result.status == "stable", result.reason
print("torch._dynamo" in sys.modules, "torch._inductor" in sys.modules)
"""


@pytest.mark.slow
def test_a_run_that_does_not_compile_never_imports_dynamo():
    proc = subprocess.run(
        [sys.executable, "-c", RUN_IN_A_NEW_PROCESS], cwd=REPO, env=cli_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("arch", ["dit", "video_dit"])
@pytest.mark.parametrize("width", [sizes.REAL_BUILD_WIDTH // 2, sizes.REAL_BUILD_WIDTH * 2])
def test_a_native_models_parameters_are_counted_exactly_on_either_side_of_the_real_build_width(arch, width):
    """Below REAL_BUILD_WIDTH the count comes from two real CPU builds, above it from two meta ones: both
    extrapolate to what the whole model has."""
    sizes.native_params.cache_clear()
    frames = None if arch == "dit" else 4
    counted = sizes.native_params(arch, "tiny", width, 6, 2, True, 4, frames or 1, 8)
    with torch.device("meta"):
        model = build_model(
            arch,
            "tiny",
            input_size=8,
            in_channels=4,
            num_frames=frames,
            patch_size=2,
            qk_norm=True,
            width=width,
            depth=6,
        )
    assert counted == count_params(model)


def test_a_huge_frame_is_counted_on_the_meta_device_not_built(monkeypatch):
    """A small width with 65536 x 65536 pixels: the sin-cos table alone would be hundreds of GB for real."""
    sizes.native_params.cache_clear()
    built = []

    def spy(*args, **kwargs):
        built.append(torch.empty(0).device.type)  # the device a new tensor gets where the model is built
        return build_model(*args, **kwargs)

    monkeypatch.setattr("models.registry.build_model", spy)
    assert sizes.native_params("dit", "tiny", 128, 2, 2, False, 4, 1, 65536) is not None
    assert built == ["meta", "meta"]
    sizes.native_params.cache_clear()


@pytest.fixture
def restore_determinism():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("mode", [True, False])
def test_set_deterministic_sets_torchs_flag_and_inductors_when_the_run_compiles(mode, restore_determinism):
    set_deterministic(mode, compiles=False)
    assert torch.are_deterministic_algorithms_enabled() is mode
    set_deterministic(mode, compiles=True)
    import torch._inductor.config as inductor_config

    assert torch.are_deterministic_algorithms_enabled() is mode and inductor_config.deterministic is mode


WITH_TORCH_REPORTED_AT_EXIT = (
    "import atexit, runpy, sys; atexit.register(lambda: print('torch' in sys.modules, file=sys.stderr)); "
    "sys.argv = ['sweep', *sys.argv[1:]]; runpy.run_module('sweep', run_name='__main__', alter_sys=True)"
)


@pytest.mark.parametrize("mistake", ["optim.lrr=1e-3", "precision=fp99"])
def test_a_command_line_that_does_not_compose_exits_before_torch_loads(mistake):
    """A typo'd key or an unknown option is one line and exit 2 in about a second, not after torch's import."""
    proc = subprocess.run(
        [sys.executable, "-c", WITH_TORCH_REPORTED_AT_EXIT, mistake],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[0].startswith("sweep: ") and lines[-1] == "False", proc.stderr
