"""Any nn.Module behind the sweep's interface: `model=custom model.target=pkg.module:factory`.

The protocol (docs/models.md, "Your own model"):
  * `factory(**model.kwargs, **shape)` returns an nn.Module whose `forward(x, t)` returns a prediction
    of x's shape; x is (B, C, F, H, W) for video data or (B, C, H, W) for image data, t a float
    timestep tensor (B,). Conditioning, if any, is the model's own business.
  * `shape` holds the names of FACTORY_INPUTS that the factory's signature names explicitly
    (channels, frames, height, width, patch_size from the data and model config; attention and
    modulate, the axes' values); a `**kwargs` catch-all gets none of them, and model.kwargs may not
    set them (they come from the config, so the data and the model cannot disagree).
  * image or video: `factory.is_image = True` declares an image model (a function attribute, or a
    class attribute when the factory is the class); without it the model is a video model.
  * attention axis: `CustomAdapter.forward` runs the model under `SdpaRoute`, so every
    `torch.nn.functional.scaled_dot_product_attention` call inside is forced to the asked backend
    (or replaced by the eager formula) and counted.
  * modulate axis: the model calls `models.modulate.modulate(x, shift, scale, impl)` with the
    `modulate` it was given, or with impl omitted (the adapter's `ModulateCount` supplies it); the
    calls are counted per impl.
  * honesty: after the first forward, an attention other than the default (math) with no SDPA call,
    or a modulate other than eager with no call of that impl, raises KernelUnavailable (the run is
    `skipped` with the reason): the axis did not reach the model, so the run would claim a kernel
    that never ran.

Torch only: no sweep/ or Hydra imports (tests/test_layout.py).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
import types
import typing
from typing import Any, Callable

import torch
import torch.nn as nn
from torch import Tensor
from torch.overrides import TorchFunctionMode

from models.attention import KernelUnavailable
from models.modulate import MODULATE_KERNELS, ModulateCount
from models.sdpa_route import SdpaRoute

FACTORY_INPUTS = ("channels", "frames", "height", "width", "patch_size", "attention", "modulate")
"""Keyword names the factory gets from the config when its signature names them."""

DEFAULT_ATTENTION = "math"
"""The attention value a model without SDPA calls may run under (it is the config default): no claim is made."""


class CustomModelError(ValueError):
    """The target or the factory does not meet the protocol (sweep/config.py turns it into a ConfigError)."""


def load_factory(target: str) -> Callable[..., Any]:
    """`pkg.module:attr` -> the callable; CustomModelError naming what is wrong."""
    if not isinstance(target, str) or ":" not in target:
        raise CustomModelError(f"must be pkg.module:factory (a colon between module and attribute), got {target!r}")
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise CustomModelError(f"must be pkg.module:factory (module and attribute both named), got {target!r}")
    if in_standard_library(module_name):
        raise CustomModelError(
            f"{target} is in Python's standard library ({module_name}), not a model factory: name a class or a "
            "function of your own code (it is never imported or called)"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import failure of user code is a config mistake, one line
        raise CustomModelError(f"cannot import module {module_name!r}: {type(e).__name__}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CustomModelError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CustomModelError(f"{target} is a {type(obj).__name__}, not callable")
    check_factory_kind(obj, target)
    return obj


_C_CALLABLES = (
    types.BuiltinFunctionType,
    types.BuiltinMethodType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.MethodDescriptorType,
    types.ClassMethodDescriptorType,
)


def in_standard_library(module_name: str | None) -> bool:
    """Whether a module (or a submodule: os.path) is Python's standard library, builtins included."""
    return str(module_name or "").split(".")[0] in sys.stdlib_module_names


def check_factory_kind(obj: Any, target: str) -> None:
    """Refuse, before it is ever called, what cannot be a model factory: validating the config must not
    run a callable with the user's kwargs (`model.target=os:system model.kwargs={command:...}` ran a shell
    command, and `shutil:rmtree` deleted a directory, before the "not a torch.nn.Module" refusal). Only a class
    (an nn.Module subclass) or a Python function (a method too) defined outside Python's standard library is
    called: refused are a builtin or any other callable implemented in C (a ufunc), a class or function defined in
    the standard library whatever module re-exports it (`mymod:popen = os.popen`), what is neither a class nor a
    function (a functools.partial, a callable object), and a function whose return annotation says it returns
    something other than an nn.Module. A function without a return annotation, or with one that cannot be
    resolved, is called once by the check, and what it returns is checked then (docs/models.md)."""
    inner = obj
    if inspect.isclass(inner):
        _check_not_stdlib(inner, target)
        if not issubclass(inner, nn.Module):
            raise CustomModelError(f"{target} is the class {inner.__qualname__}, not a torch.nn.Module subclass")
        return
    if inspect.isbuiltin(inner) or isinstance(inner, _C_CALLABLES):
        raise CustomModelError(f"{target} is a builtin ({type(inner).__name__}), not a model factory")
    if inspect.ismethod(inner):
        inner = inner.__func__
    if not inspect.isfunction(inner):
        call = inspect.getattr_static(type(inner), "__call__", None)
        if not isinstance(inner, functools.partial) and not inspect.isfunction(call):
            raise CustomModelError(f"{target} is a {type(inner).__name__} implemented in C, not a model factory")
        raise CustomModelError(
            f"{target} is a {type(inner).__name__}, not a class or a function: name the class or function itself "
            "(model.kwargs gives its arguments)"
        )
    _check_not_stdlib(inner, target)
    returns = _return_annotation(inner)
    if returns is not None and not _may_be_module(returns):
        raise CustomModelError(
            f"{target} is annotated to return {_annotation_name(returns)}, not a torch.nn.Module: not a model factory"
        )


def _check_not_stdlib(obj: Any, target: str) -> None:
    module = getattr(obj, "__module__", None)
    if in_standard_library(module):
        raise CustomModelError(
            f"{target} is {module}.{obj.__qualname__}, defined in Python's standard library ({module}), not a model "
            "factory: name a class or a function of your own code"
        )


def _return_annotation(fn: Callable[..., Any]) -> Any:
    """The function's return annotation, string annotations resolved in its module; None when it has none
    or it cannot be resolved (then nothing is claimed)."""
    raw = getattr(fn, "__annotations__", {}).get("return", inspect.Signature.empty)
    if raw is inspect.Signature.empty:
        return None
    try:
        return typing.get_type_hints(fn).get("return", None if raw is None else raw)
    except Exception:  # noqa: BLE001  (a name the module does not define, a typing construct it cannot evaluate)
        return raw if not isinstance(raw, str) else None


def _may_be_module(annotation: Any) -> bool:
    """Whether a value of this annotated type may be an nn.Module (Any, a TypeVar, a Union with one...)."""
    if annotation is None or annotation is type(None):
        return False
    if annotation is Any or isinstance(annotation, (typing.TypeVar, str)):
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_may_be_module(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _may_be_module(typing.get_args(annotation)[0])
    if inspect.isclass(origin or annotation):
        cls = origin or annotation
        return issubclass(cls, nn.Module) or issubclass(nn.Module, cls)  # nn.Module itself, or object
    return True  # a typing form we do not know: do not refuse on a guess


def _annotation_name(annotation: Any) -> str:
    return getattr(annotation, "__qualname__", None) or repr(annotation)


def factory_is_image(factory: Callable[..., Any]) -> bool:
    """Whether the factory declares an image model (`factory.is_image = True`); video otherwise."""
    value = getattr(factory, "is_image", False)
    if not isinstance(value, bool):
        raise CustomModelError(f"the factory's is_image must be True or False, got {value!r}")
    return value


def factory_inputs(factory: Callable[..., Any]) -> tuple[str, ...]:
    """The FACTORY_INPUTS the factory's signature names explicitly (so it gets them)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: it gets model.kwargs only
        return ()
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return tuple(n for n in FACTORY_INPUTS if n in named)


def factory_arguments(factory: Callable[..., Any], kwargs: dict, inputs: dict) -> dict:
    """model.kwargs plus the config values (of `inputs`) the factory's signature names."""
    clash = sorted(set(kwargs) & set(FACTORY_INPUTS))
    if clash:
        raise CustomModelError(
            f"{clash[0]} comes from the config (data.*, model.patch_size, attention, modulate), not model.kwargs"
        )
    return {**kwargs, **{n: inputs[n] for n in factory_inputs(factory)}}


def call_factory(target: str, kwargs: dict, inputs: dict, within: Any = None) -> nn.Module:
    """The user's module, built (inside `within`, a context such as CountingBuild, when given); CustomModelError (one
    line) when the factory raises or returns a non-module."""
    factory = load_factory(target)
    arguments = factory_arguments(factory, kwargs, inputs)
    try:
        with within if within is not None else contextlib.nullcontext():
            module = factory(**arguments)
    except Exception as e:  # the user's code: any failure is reported in one line
        shown = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CustomModelError(f"{target}({shown}) raised {type(e).__name__}: {message}") from e
    if not isinstance(module, nn.Module):
        raise CustomModelError(f"{target} returned {type(module).__name__} {module!r:.40}, not a torch.nn.Module")
    return module


class CustomAdapter(nn.Module):
    """The user's module as `model(x, t) -> prediction`, its forward under the attention route and the
    modulate counter. Its state_dict is the user's under `model.`."""

    def __init__(self, model: nn.Module, target: str, attention: str, modulate: str, is_image: bool):
        super().__init__()
        self.model = model
        self.target, self.attention, self.modulate, self.is_image = target, attention, modulate, is_image
        self.route = SdpaRoute(attention)
        self.counter = ModulateCount(modulate)
        self.modulate_calls: dict[str, int] = {}
        self.forwards = 0

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        with self.route, self.counter:
            out = self.model(x, t)
        self.modulate_calls = dict(self.counter.calls)
        if not isinstance(out, Tensor) or out.shape != x.shape:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise CustomModelError(
                f"{self.target}: forward(x, t) must return a prediction of x's shape {tuple(x.shape)}, got {got}"
            )
        if torch.is_grad_enabled() and not out.requires_grad and any(p.requires_grad for p in self.parameters()):
            raise CustomModelError(
                f"{self.target}: forward(x, t) returns a prediction with no grad_fn (computed under torch.no_grad() "
                "or detached), so no gradient reaches the model's weights"
            )
        if self.forwards == 0:
            self._check_axes_reached()
        self.forwards += 1
        return out

    @property
    def width_mult(self) -> float:
        """µP's width multiplier of the user's model (its own `width_mult`), 1 when it has none."""
        return float(getattr(self.model, "width_mult", 1.0))

    def mup_roles(self) -> dict[str, str] | None:
        """The user's model's µP roles (models/mup.py), when it declares them with a `mup_roles()` method, under
        this adapter's names (`model.`): then its hidden weights train at lr / width_mult (docs/models.md)."""
        roles_of = getattr(self.model, "mup_roles", None)
        roles = roles_of() if callable(roles_of) else None
        return None if roles is None else {f"model.{name}": role for name, role in roles.items()}

    def _check_axes_reached(self) -> None:
        """KernelUnavailable (a `skipped` run) when a requested kernel never ran in the first forward."""
        if self.route.calls_last_forward == 0 and self.attention != DEFAULT_ATTENTION:
            raise KernelUnavailable(
                f"attention={self.attention}: {self.target} made no torch.nn.functional.scaled_dot_product_attention "
                "call in its forward, so the forced kernel would not run (only the default attention=math runs it)"
            )
        if self.modulate != "eager" and not self.modulate_calls.get(self.modulate):
            seen = f" (it called it with {self.modulate_calls})" if self.modulate_calls else ""
            raise KernelUnavailable(
                f"modulate={self.modulate}: {self.target} never called models.modulate.modulate with impl "
                f"{self.modulate!r}{seen}, so the fused kernel would not run"
            )

    def kernels(self) -> dict:
        """What ran in the last forward, counted: the SDPA kernel and calls, the modulate impl and calls."""
        n = self.route.calls_last_forward
        out: dict = {
            "attention": self.route.kernel_name if n else "none: no scaled_dot_product_attention call",
            "sdpa_calls_per_forward": n,
        }
        if self.modulate_calls.get(self.modulate):
            out["modulate"] = MODULATE_KERNELS[self.modulate]
        else:
            out["modulate"] = "eager (the model's own code: no models.modulate.modulate call)"
        out["modulate_calls_per_forward"] = dict(self.modulate_calls)
        out["model"] = self.target
        return out


def build_custom_model(
    target: str,
    kwargs: dict,
    *,
    channels: int,
    frames: int,
    height: int,
    width: int,
    patch_size: int,
    attention: str = "math",
    modulate: str = "eager",
    module: nn.Module | None = None,
) -> CustomAdapter:
    """factory(**kwargs, **the config values its signature names), wrapped in CustomAdapter; `module` is that call's
    result already made (the config check's model: sweep/config/inputs.py), wrapped as it is, not built again."""
    inputs = dict(
        channels=channels,
        frames=frames,
        height=height,
        width=width,
        patch_size=patch_size,
        attention=attention,
        modulate=modulate,
    )
    if module is None:
        module = call_factory(target, dict(kwargs), inputs)
    return CustomAdapter(module, target, attention, modulate, factory_is_image(load_factory(target)))


PROBE_BATCH = 2
"""Samples in the probe's forward: 2, so a model that mixes up the batch axis shows it (design.md, OpenDiT)."""


class CustomModelTooBig(CustomModelError):
    """The factory's model has more parameters than the limit (sweep/run/sizes.py PARAMS_LIMIT)."""


def probe_factory(target: str, kwargs: dict, inputs: dict, params_limit: int | None = None) -> nn.Module:
    """Build the model once, counted as it is built (CountingBuild) against `params_limit`, and run one forward on a
    tiny batch of the configured data shape, leaving the global RNG as it was; returns the model built. Raises
    CustomModelError when the factory fails, when forward(x, t) raises or does not return a tensor of x's shape
    (before, each run ended `error` with a traceback), or CustomModelTooBig over the limit (before, a
    4.3G-parameter factory was built for real and SIGKILLed after 86 s).

    One call of the factory: what it builds up to the limit is real (the probe's model), and past the limit the
    rest is built on the meta device, explicit devices included, so a huge model is counted, never allocated (a
    factory passing device="cpu" was built for real, 4.4 GB, by the `with torch.device("meta")` count before). Only
    a model whose parameters fit but whose build made more values than the limit in passing (temporaries) is
    then built again, for real.
    """
    with torch.random.fork_rng(devices=[]):
        counting = CountingBuild(params_limit) if params_limit is not None else None
        try:
            module = call_factory(target, dict(kwargs), inputs, within=counting)
        except CustomModelError as e:
            if counting is None or not counting.on_meta:
                raise
            cause = e.__cause__ if e.__cause__ is not None else e
            said = (str(cause).strip().splitlines() or [""])[0]
            raise CustomModelTooBig(
                f"{target} makes over {params_limit / 1e6:,.0f}M values as it builds (counted on the meta device, "
                f"where it then raised {type(cause).__name__}: {said}), over the {params_limit / 1e6:,.0f}M limit: "
                "lower its size through model.kwargs"
            ) from None
        if counting is not None and counting.on_meta:
            _check_params(target, _params(module), params_limit, "counted on the meta device")
            module = call_factory(target, dict(kwargs), inputs)  # its parameters fit; its temporaries did not
        if params_limit is not None:
            _check_params(target, _params(module), params_limit, "built")
        probe_forward(module, target, inputs, factory_is_image(load_factory(target)))
    return module


_CONSTRUCTORS = frozenset(
    (
        *(getattr(torch, name) for name in ("empty", "zeros", "ones", "full", "rand", "randn", "randint", "randperm")),
        *(getattr(torch, name) for name in ("arange", "linspace", "logspace", "eye", "tensor", "as_tensor")),
        *(getattr(torch, name) for name in ("empty_strided", "scalar_tensor")),
        *(getattr(torch, f"{kind}_like") for kind in ("empty", "zeros", "ones", "full", "rand", "randn", "randint")),
        *(getattr(Tensor, f"new_{kind}") for kind in ("empty", "zeros", "ones", "full", "tensor")),
    )
)
"""What makes a new tensor of a size its arguments give (and takes a device): what CountingBuild counts."""
_MOVES = frozenset((Tensor.to, Tensor.cpu, Tensor.cuda))


class CountingBuild(TorchFunctionMode):
    """While a factory builds its model: each new tensor's values are counted before it is made (the call made once
    on the meta device first, which allocates nothing); once they pass `limit`, that tensor and every later one are
    made on the meta device whatever device the factory names (device="cpu", .to("cpu"), .cuda()), so the model is
    counted without being allocated. Until then the build is the factory's own, for real."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.values, self.on_meta = limit, 0, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _CONSTRUCTORS:
            on_meta = {**{k: v for k, v in kwargs.items() if k not in ("generator", "out")}, "device": "meta"}
            if not self.on_meta:
                try:
                    ahead = func(*args, **on_meta)
                except Exception:  # noqa: BLE001  (what it cannot say ahead it counts once made)
                    ahead = None
                if ahead is None or self.values + ahead.numel() <= self.limit:
                    made = func(*args, **kwargs)
                    self.values += made.numel() if isinstance(made, Tensor) else 0
                    return made
                self.on_meta = True
            return func(*args, **on_meta)
        if self.on_meta and func in _MOVES and isinstance(args[0], Tensor) and args[0].is_meta:
            dtype = torch._C._nn._parse_to(*args[1:], **kwargs)[1] if func is Tensor.to else None
            return args[0] if dtype is None else func(args[0], dtype=dtype)
        return func(*args, **kwargs)


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _check_params(target: str, n: int, limit: int, how: str) -> None:
    if n > limit:
        raise CustomModelTooBig(
            f"{target} would have {n / 1e6:,.1f}M parameters ({how}), over the {limit / 1e6:,.0f}M limit: "
            "lower its size through model.kwargs"
        )


def probe_forward(module: nn.Module, target: str, inputs: dict, is_image: bool) -> None:
    """The model's forward as training calls it, on CPU in float32: on (PROBE_BATCH, C, [F,] H, W) and t (B,) with
    autograd on, then, when the run trains at another batch size (`inputs["batch_size"]`), on a batch of that size
    without gradients. CustomModelError (one line) when a forward raises or does not return a tensor of x's shape,
    when the model has no parameter to train (none, or every one frozen, unless a finetune brings its own:
    `inputs["finetune"]`), or when its prediction has no grad_fn (a forward under torch.no_grad(), a detached
    output: no gradient reaches the weights). Each of the last three passed a batch-2 no-grad probe and ended every
    run `error` with a traceback (issue 45)."""
    trains = [p for p in module.parameters() if p.requires_grad]
    if not trains and inputs.get("finetune", "none") == "none":
        n = sum(p.numel() for p in module.parameters())
        raise CustomModelError(
            f"{target}: the model has no parameter to train ({n} parameters, none with requires_grad=True): "
            "AdamW would have nothing to update"
        )
    batch = inputs.get("batch_size") or PROBE_BATCH
    for size, grad in ((PROBE_BATCH, True), *(((batch, False),) if batch != PROBE_BATCH else ())):
        out = _probe_batch(module, target, inputs, is_image, size, grad)
        if grad and trains and not out.requires_grad:
            raise CustomModelError(
                f"{target}: forward(x, t) returns a prediction with no grad_fn (computed under torch.no_grad() or "
                "detached), so no gradient reaches the model's weights: training needs the forward to build the graph"
            )


def _probe_batch(module: nn.Module, target: str, inputs: dict, is_image: bool, size: int, grad: bool) -> Tensor:
    """One forward on a random batch of `size` (autograd on when `grad`): the output, checked to be x's shape."""
    shape = (size, inputs["channels"], *(() if is_image else (inputs["frames"],)), inputs["height"], inputs["width"])
    torch.manual_seed(0)
    x, t = torch.randn(shape), torch.linspace(10.0, 500.0, size)
    was_training = module.training
    try:
        with torch.set_grad_enabled(grad):
            out = module(x, t)
    except Exception as e:  # the user's code: one line
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CustomModelError(
            f"{target}: forward(x, t) on a batch of shape {tuple(shape)} raised {type(e).__name__}: {message}"
        ) from e
    finally:
        module.train(was_training)
    if not isinstance(out, Tensor):
        raise CustomModelError(
            f"{target}: forward(x, t) must return a tensor of x's shape {tuple(shape)}, got {type(out).__name__}"
        )
    if tuple(out.shape) != tuple(shape):
        raise CustomModelError(
            f"{target}: forward(x, t) must return a prediction of x's shape {tuple(shape)}, got {tuple(out.shape)}"
        )
    return out
