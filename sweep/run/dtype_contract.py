"""The pure-precision dtype contract of a custom model, probed once before its runs (issue #45).

Under a pure precision (bf16_pure, fp16_pure: weights in bf16/fp16, no autocast) a run casts every weight
to the low dtype and gives the model x in that dtype; t stays float32 (sweep/run/train.py). Whatever the
model computes in float32 itself (sinusoidal timestep features from t, a float32 buffer) must be cast to its
weights' dtype before it reaches a Linear, or the first forward raises "mat1 and mat2 must have the same
dtype". A user's trial met that in an outside DiT (its timestep embedder fed float32 features to a float16
Linear) as 24 `error` runs with a traceback each.

`contract_problem(run)` takes the run's model as the run builds it (a copy of the config check's one build
of it, sweep/config/inputs.py `checked_model`; the weights cast, `precision.fp32_modules` applied), forwards a
batch of 2 with x in the low dtype under no_grad, and when the forward raises a dtype mismatch says which
module and what to cast. Forward pre-hooks record, for each
module entered and not yet left, whether a floating input's dtype differs from its own weights'; when the
forward raises, the innermost such module is the one to fix (the innermost module still running, when no
input differed). A forward that fails for another reason is left to the run (a CPU without an fp16 kernel
for some op says nothing about the GPU the run may use).

The answer is kept per process for each model, low dtype and fp32_modules, so a grid probes each pure
precision once (sweep/config/inputs.py `check_inputs`, called for every cell before the first run), and its
runs are `skipped` with the sentence as their reason without being built (sweep/run/execute.py
`unsupported_reason`). The sentence is logged once, as a warning, when it is first found.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from sweep.run import fp32_modules
from sweep.run.once import say_once

log = logging.getLogger("sweep")

PROBE_BATCH = 2
_MISMATCH_WORDS = ("dtype", "scalar type", "same type", "should be the same")
"""Words of torch's dtype-mismatch messages ('mat1 and mat2 must have the same dtype', 'expected scalar type
Half but found Float', "Input type (float) and bias type (c10::Half) should be the same")."""
_ANSWERS: dict[str, str | None] = {}


def weights_dtype(run: Any) -> torch.dtype:
    """The run's param dtype (float32, bfloat16, float16: torch's own names; not sweep.run.precision, which imports
    sweep.config, which calls this module)."""
    return getattr(torch, run.precision.param_dtype.value)


def is_pure(run: Any) -> bool:
    """Weights in bf16/fp16 and no autocast: the policies whose forward gets x in the weights' dtype."""
    return run.precision.autocast_dtype is None and weights_dtype(run) != torch.float32


def contract_problem(run: Any, build: Callable[[], torch.nn.Module] | None = None) -> str | None:
    """Why this custom model cannot run under the run's pure precision (one sentence), or None: not a custom
    model, not a pure precision, or its forward runs (or fails for another reason). Probed once per process for
    each model, dtype and fp32_modules, on the model `build()` returns (a copy of the config check's build:
    sweep/config/inputs.py checked_model), by default sweep.run.model.build_run_model(run)."""
    if run.model.arch.value != "custom" or not is_pure(run):
        return None
    m = run.model
    key = repr((m.target, sorted(m.kwargs.items()), sorted(run.model_inputs.items()), run.precision.param_dtype.value))
    key += repr(list(run.precision.fp32_modules))
    if key not in _ANSWERS:
        _ANSWERS[key] = _probe(run, build)
        if _ANSWERS[key] is not None:
            say_once(log, logging.WARNING, "%s; its runs are skipped with this reason", _ANSWERS[key])
    return _ANSWERS[key]


def _probe(run: Any, build: Callable[[], torch.nn.Module] | None) -> str | None:
    from sweep.run.model import build_run_model

    dtype = weights_dtype(run)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = (build or (lambda: build_run_model(run)))().to(dtype=dtype)  # as sweep/run/build.py casts it
        fp32_modules.apply(model, run.precision.fp32_modules, dtype, dtype)
        d = run.data
        shape = (PROBE_BATCH, d.channels, *(() if run.model.is_image else (d.frames,)), d.height, d.width)
        x, t = torch.randn(shape).to(dtype), torch.tensor([10.0, 500.0])
        watch = InputDtypes(model)
        try:
            with torch.no_grad():
                model(x, t)
        except RuntimeError as e:
            return watch.explain(run.precision.name, dtype, e)
        except Exception:  # noqa: BLE001  (another failure is the run's to report, not this contract's)
            return None
        finally:
            watch.remove()
    return None


class InputDtypes:
    """Forward pre-hooks on every module: the stack of modules entered and not left, each with the dtype of a
    floating input that differs from its own weights' dtype (None when none does)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.stack: list[tuple[str, torch.nn.Module, torch.dtype | None]] = []
        self.handles = []
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._enter(name), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._leave, with_kwargs=True))

    def _enter(self, name: str):
        def hook(module, args, kwargs):
            own = weight_dtype(module)
            inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()]
            other = next((a.dtype for a in inputs if own is not None and a.dtype != own), None)
            self.stack.append((name, module, other))

        return hook

    def _leave(self, module, args, kwargs, output):
        self.stack.pop()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def explain(self, precision: str, dtype: torch.dtype, error: RuntimeError) -> str | None:
        """The sentence for a forward that raised `error`, or None when it is not a dtype mismatch."""
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        culprit = next(((n, m, o) for n, m, o in reversed(self.stack) if o is not None), None)
        if culprit is None and not any(w in message.lower() for w in _MISMATCH_WORDS):
            return None
        low = str(dtype).removeprefix("torch.")
        contract = (
            f"under a pure precision every weight is {low} and x comes in {low}: cast what the model computes in "
            "float32 itself (timestep features, a float32 buffer) to the weights' dtype"
        )
        if culprit is None:
            name, module = next(((n, m) for n, m, _ in reversed(self.stack) if n), ("", None))
            where = f" inside {_user_name(name)} ({type(module).__name__})" if module is not None else ""
            return f"precision={precision}: the forward raised `{message}`{where}; {contract} (docs/models.md)"
        name, module, got = culprit
        user, weight = _user_name(name), _own_weight(module)
        return (
            f"precision={precision}: {user} ({type(module).__name__}, {low} weights) gets a "
            f"{str(got).removeprefix('torch.')} input (`{message}`); {contract} before it reaches {user}, e.g. "
            f"`.to(self.{_python_path(user)}.{weight}.dtype)`, or keep that module in float32: "
            f"precision.fp32_modules=[{name}] (docs/models.md)"
        )


def weight_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the module's own floating parameters (None when it has none)."""
    return next((p.dtype for p in module.parameters(recurse=False) if p.is_floating_point()), None)


def _user_name(name: str) -> str:
    """A module's name in the user's own model: the adapter's `model.` prefix left out."""
    return name.removeprefix("model.") or "the model"


def _own_weight(module: torch.nn.Module) -> str:
    """The name of the module's first floating parameter (`weight` for a Linear)."""
    return next((n for n, p in module.named_parameters(recurse=False) if p.is_floating_point()), "weight")


def _python_path(name: str) -> str:
    """t_embedder.mlp.0 -> t_embedder.mlp[0]: the module as the model's code reaches it."""
    out = ""
    for part in name.split("."):
        out += f"[{part}]" if part.isdigit() else f".{part}"
    return out.lstrip(".")
