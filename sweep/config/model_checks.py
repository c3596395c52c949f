"""The checks of the model section, which depend on the kind of model (native, diffusers, a released
diffusers config, a custom factory) and on the data shape it trains on; called by sweep/config/validate.py.

The native models' sizes come from models/registry.py, the diffusers zoo from models/diffusers_zoo.py, a
released config from models/diffusers_config.py and a custom factory from models/custom.py, imported in
the check that needs them (they import torch, which composing a config never needs).
"""

from __future__ import annotations

from sweep.config.enums import Arch, DataSource, FinetuneMethod, Param
from sweep.config.schema import ConfigError, RunConfig, require


def check_model(run: RunConfig) -> None:
    """model.size, the native models' width, depth and µP settings, model.patch_size and model.qk_gain."""
    from models.registry import MODEL_SIZES, sized  # imports torch (models/), which composing a config never needs

    m = run.model
    require(m.size in MODEL_SIZES, "model.size", f"unknown size {m.size!r}; choose one of {', '.join(MODEL_SIZES)}")
    if m.arch in (Arch.dit, Arch.video_dit):
        for key, dims in (("width", {"width": m.width}), ("depth", {"depth": m.depth})):
            try:
                sized(m.size, **dims)
            except ValueError as e:
                raise ConfigError(f"model.{key}: {e}") from None
        require(
            m.depth is None or m.arch is Arch.dit or m.depth % 2 == 0,
            "model.depth",
            f"video_dit spends its blocks as (spatial, temporal) pairs: must be even, got {m.depth}",
        )
    else:
        for key in ("width", "depth"):
            require(
                getattr(m, key) is None,
                f"model.{key}",
                f"sizes the native models only (dit, video_dit), not model.arch={m.arch.value}",
            )
    require(m.base_width is None or m.base_width > 0, "model.base_width", f"must be > 0, got {m.base_width}")
    if m.param is Param.mup:
        require(
            m.arch in (Arch.dit, Arch.video_dit),
            "model.param",
            f"mup scales a model by its width: the native models only (dit, video_dit), not model.arch={m.arch.value}",
        )
        require(m.base_width is not None, "model.base_width", "model.param=mup needs a base width, e.g. 32")
        width = sized(m.size, m.width)["hidden_size"]
        require(
            m.base_width <= width,
            "model.base_width",
            f"must be <= the width ({width}), got {m.base_width}",
        )
    require(m.patch_size > 0, "model.patch_size", f"must be > 0, got {m.patch_size}")
    require(m.qk_gain > 0, "model.qk_gain", f"must be > 0, got {m.qk_gain}")


def check_model_kind(run: RunConfig) -> None:
    """The keys that belong to one kind of model only, and the data shape (image or video) each kind trains on."""
    m, d = run.model, run.data
    if m.arch == Arch.dit:
        require(
            d.frames == 1,
            "data.frames",
            f"model.arch=dit trains on images: use {_use(d, True)}, got {d.frames}",
        )
    _validate_diffusers(run)
    _validate_diffusers_config(run)
    _validate_custom(run)


def _use(d, image: bool) -> str:
    """What data an image (or video) model takes, said for the data source in use."""
    if d.source is DataSource.synthetic:
        return "data=synthetic_image (frames=1)" if image else "data=synthetic_video (frames > 1)"
    if image:
        return f"data.frames=1 (one image per file of data={d.source.value})"
    if d.source is DataSource.image_folder:
        return "a video folder or a latent folder of clips (data.frames > 1), not data=image_folder"
    return "data.frames > 1"


def _validate_diffusers(run: RunConfig) -> None:
    """model.name and the data shape a tiny diffusers transformer needs (models/diffusers_zoo.py)."""
    m, d = run.model, run.data
    if m.arch != Arch.diffusers:
        require(
            m.name is None, "model.name", f"names a diffusers model: only with model.arch=diffusers, got {m.name!r}"
        )
        return
    from models.diffusers_zoo import ZOO

    require(m.name in ZOO, "model.name", f"unknown diffusers model {m.name!r}; choose one of {', '.join(ZOO)}")
    require(
        m.size == "tiny",
        "model.size",
        f"diffusers models have one size, tiny (models/diffusers_zoo.py), got {m.size!r}",
    )
    require(
        not m.qk_norm,
        "model.qk_norm",
        "diffusers models keep their own query/key norm (models/diffusers_zoo.py): must be false",
    )
    require(m.qk_gain == 1.0, "model.qk_gain", f"is implemented for the native models only, got {m.qk_gain}")
    if m.is_image:
        require(
            d.frames == 1,
            "data.frames",
            f"model.name={m.name} trains on images: use {_use(d, True)}, got {d.frames}",
        )
    else:
        require(
            d.frames > 1,
            "data.frames",
            f"model.name={m.name} is a video model: use {_use(d, False)}, got {d.frames}",
        )


def _validate_diffusers_config(run: RunConfig) -> None:
    """model.config and model.shrink of a released diffusers config (models/diffusers_config.py): the file, its
    class and the shrink keys are checked here; the size budget and a forward in check_inputs."""
    m, d = run.model, run.data
    if m.arch is not Arch.diffusers_config:
        require(
            m.config is None,
            "model.config",
            f"names a released diffusers config: only with model=diffusers_config, got {m.config!r}",
        )
        require(
            not m.shrink, "model.shrink", f"shrinks a released config: only with model=diffusers_config, got {m.shrink}"
        )
        return
    from models.diffusers_config import DiffusersConfigError, resolve

    try:
        released = resolve(m.config, m.shrink, **{k: v for k, v in run.model_inputs.items() if k in _SHAPE_KEYS})
    except DiffusersConfigError as e:
        raise ConfigError(f"{e.key}: {e}") from None
    require(m.size == "tiny", "model.size", f"a released config's size is set by model.shrink, got {m.size!r}")
    for key, default in _CUSTOM_UNUSED.items():
        value = getattr(m, key)
        require(
            value == default,
            f"model.{key}",
            f"is implemented for the native models only; a diffusers model keeps its own (model.shrink), got {value}",
        )
    image = released.spec.is_image
    use = f"an image model: use {_use(d, True)}" if image else f"a video model: use {_use(d, False)}"
    require(
        (d.frames == 1) == image,
        "data.frames",
        f"{released.cls_name} ({m.config}) is {use}, got {d.frames}",
    )


_SHAPE_KEYS = ("channels", "frames", "height", "width", "patch_size")
_CUSTOM_UNUSED = {"qk_norm": False, "qk_gain": 1.0}


def _validate_custom(run: RunConfig) -> None:
    """model.target, model.kwargs and the keys a custom model does not use (models/custom.py, docs/models.md)."""
    m, d = run.model, run.data
    if m.arch is not Arch.custom:
        require(
            m.target is None, "model.target", f"names a custom model factory: only with model=custom, got {m.target!r}"
        )
        require(
            not m.kwargs,
            "model.kwargs",
            f"are a custom model's factory arguments: only with model=custom, got {m.kwargs}",
        )
        return
    from models.custom import FACTORY_INPUTS, CustomModelError, factory_is_image, load_factory

    require(bool(m.target), "model.target", "model=custom needs the factory: model.target=pkg.module:factory")
    try:
        image = factory_is_image(load_factory(m.target))
    except CustomModelError as e:
        raise ConfigError(f"model.target: {e}") from None
    require(
        m.size == "tiny",
        "model.size",
        f"a custom model's size is its factory's business (model.kwargs), got {m.size!r}",
    )
    for key, default in _CUSTOM_UNUSED.items():
        value = getattr(m, key)
        require(
            value == default,
            f"model.{key}",
            f"is implemented for the native models only; a custom model does this itself (model.kwargs), got {value}",
        )
    for key in m.kwargs:
        require(
            key not in FACTORY_INPUTS,
            f"model.kwargs.{key}",
            "comes from the config (data.channels/frames/height/width, model.patch_size, attention, modulate) "
            "when the factory's signature names it: set that instead",
        )
    if image:
        require(
            d.frames == 1,
            "data.frames",
            f"{m.target} is an image model (is_image=True): use {_use(d, True)}, got {d.frames}",
        )
    else:
        require(
            d.frames > 1,
            "data.frames",
            f"{m.target} is a video model (no is_image=True): use {_use(d, False)}, got {d.frames}",
        )
    f = run.finetune
    require(
        f.method is not FinetuneMethod.lora or bool(f.target_modules),
        "finetune.target_modules",
        "model=custom has no known attention projection names: give them, e.g. finetune.target_modules=[qkv,proj]",
    )
