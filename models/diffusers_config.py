"""A released diffusers transformer, shrunk, from its own config.json: `model=diffusers_config`.

    python -m sweep model=diffusers_config model.config=PATH/transformer/config.json \\
        'model.shrink={num_layers:2,num_attention_heads:2,attention_head_dim:32}'

The file is a released model's `transformer/config.json` on the user's disk (nothing is downloaded, no
weights are read). How the model is built:
  * the class is the file's `_class_name` (a legacy `Transformer2DModel` is remapped by its `norm_type`,
    as diffusers' from_pretrained does: ada_norm_single -> PixArt, ada_norm_zero -> DiT); the adapter's
    layout and conditioning are those of that class's ZOO spec (models/diffusers_zoo.py), so only the ten
    classes of the zoo are known;
  * its keyword arguments are, in order of precedence: the keys the tool sets (below), then
    `model.shrink`, then the file's values, then the class's defaults. File keys the class's `__init__`
    does not take (e.g. an old Transformer2DModel's `use_linear_projection`) are left out, as diffusers'
    from_config does;
  * the tool sets: the spec's `data_keys` (channels, sample size, frames, patch size from the data config
    and model.patch_size; the text/pooled widths and text length of the adapter's synthetic conditioning,
    at the zoo's values), its `fixed` keys (inputs the adapter never feeds turned off: Wan's image
    embedding, HunyuanVideo's image condition and guidance, CogVideoX 1.5's ofs), and its `hidden_tied`
    keys (cross_attention_dim = num_attention_heads * attention_head_dim where the class projects the text
    to the hidden size). A released out_channels of twice in_channels (learned variance: PixArt, DiT) is
    thus in_channels: the adapter predicts x's shape;
  * every other key (depth, heads, widths, norms, activation, rope, ...) is the file's, unless shrunk.

Mistakes are one line (DiffusersConfigError, which sweep/config.py turns into a config error): a missing
or non-JSON file, no `_class_name`, a class without a ZOO spec, a shrink key the class does not take or
that the tool sets, and a model over PARAM_BUDGET parameters (counted on the meta device, nothing
allocated), with the keys to shrink.

Torch and diffusers only: no sweep/ or Hydra imports (tests/test_layout.py).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from models.diffusers_zoo import ZOO, DiffusersAdapter, ZooSpec, wrap_transformer

PARAM_BUDGET = 100_000_000
"""The most parameters a model built from a released config may have: a proxy run is short and small (fp32
weights and AdamW state of 100M parameters are 1.6 GB). Above it the config is refused with the keys to shrink."""

CLASS_REMAPPING = {
    "Transformer2DModel": {"ada_norm_zero": "DiTTransformer2DModel", "ada_norm_single": "PixArtTransformer2DModel"}
}
"""diffusers' `_CLASS_REMAPPING_DICT` (models/model_loading_utils.py): old configs name the generic class, and
from_pretrained picks the subclass by norm_type. Copied so the config check does not import diffusers; a test
compares the two."""

SIZE_KEYS = (
    "num_layers",
    "num_single_layers",
    "num_refiner_layers",
    "num_attention_heads",
    "attention_head_dim",
    "num_cross_attention_heads",
    "cross_attention_head_dim",
    "ffn_dim",
    "time_embed_dim",
    "rope_axes_dim",
)
"""Keys named in the over-budget message, where the class takes them: what makes a released model big."""

SUGGESTED = {"num_layers": 2, "num_single_layers": 1, "num_refiner_layers": 1, "num_attention_heads": 2}


class DiffusersConfigError(ValueError):
    """The config file, its class or model.shrink is unusable (sweep/config.py: a ConfigError naming the key)."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key
        """The config key at fault: model.config or model.shrink[.name]."""


def read_config(path: str | None) -> dict:
    """The file's JSON object; DiffusersConfigError (key model.config) when it cannot be one."""
    if not path:
        raise DiffusersConfigError(
            "model.config", "model=diffusers_config needs the file: model.config=PATH/config.json"
        )
    p = Path(path)
    if not p.is_file():
        raise DiffusersConfigError("model.config", f"{_not_a_file(p)}: {path}")
    try:
        config = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise DiffusersConfigError("model.config", f"cannot read {path}: {type(e).__name__}: {e}") from None
    except json.JSONDecodeError as e:
        raise DiffusersConfigError("model.config", f"{path} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise DiffusersConfigError("model.config", f"{path} holds a JSON {type(config).__name__}, not an object")
    if not isinstance(config.get("_class_name"), str):
        raise DiffusersConfigError(
            "model.config", f"{path} has no _class_name: not a diffusers model config (a transformer/config.json)"
        )
    return config


def _not_a_file(p: Path) -> str:
    """What a path that is not a regular file is, in words (before, everything was "no such file")."""
    import errno
    import os

    try:
        os.stat(p)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop (it never reaches a file)"
        if e.errno == errno.ENOENT:
            return "a broken symlink (its target does not exist)" if p.is_symlink() else "no such file"
        if e.errno in (errno.EACCES, errno.EPERM):
            return "permission denied"
        if e.errno == errno.ENOTDIR:
            return "no such file (a part of the path is a file, not a folder)"
        return f"cannot be read ({os.strerror(e.errno) if e.errno else type(e).__name__})"
    if p.is_dir():
        hint = " (give its config.json)" if (p / "config.json").is_file() else ""
        return f"a directory, not a config.json file{hint}"
    return "not a regular file (a device, pipe or socket)"


def zoo_name(config: dict, path: str) -> str:
    """The ZOO key of the file's class (after diffusers' legacy remapping); DiffusersConfigError if none."""
    cls_name = config["_class_name"]
    remap = CLASS_REMAPPING.get(cls_name)
    if remap is not None:
        norm = config.get("norm_type")
        if norm not in remap:
            raise DiffusersConfigError(
                "model.config",
                f"{path}: class {cls_name} with norm_type={norm!r} has no adapter spec "
                f"(diffusers remaps it only for norm_type {', '.join(remap)})",
            )
        cls_name = remap[norm]
    for name, spec in ZOO.items():
        if spec.cls_name == cls_name:
            return name
    known = ", ".join(spec.cls_name for spec in ZOO.values())
    raise DiffusersConfigError(
        "model.config",
        f"class {cls_name} ({path}) has no adapter spec: the adapter knows the layout and conditioning of "
        f"{known} (models/diffusers_zoo.py)",
    )


def tool_keys(spec: ZooSpec) -> tuple[str, ...]:
    """The keys the tool sets, whatever the file or model.shrink say."""
    return spec.data_keys + tuple(k for k, _ in spec.fixed) + spec.hidden_tied


@dataclass
class Released:
    """A released config resolved for one run: its class and the keyword arguments to build it with."""

    path: str
    name: str
    """ZOO key of the class."""
    cls_name: str
    kwargs: dict
    shrink: dict = field(default_factory=dict)
    ignored: list = field(default_factory=list)
    """File keys the class's __init__ does not take (left out)."""

    @property
    def spec(self) -> ZooSpec:
        return ZOO[self.name]


def class_parameters(cls_name: str) -> dict[str, Any]:
    """The class's __init__ keyword arguments and their defaults (imports diffusers)."""
    import diffusers

    params = inspect.signature(getattr(diffusers, cls_name).__init__).parameters
    return {n: p.default for n, p in params.items() if n != "self" and p.kind is not p.VAR_KEYWORD}


def resolve(
    path: str | None, shrink: dict, *, channels: int, frames: int, height: int, width: int, patch_size: int
) -> Released:
    """The class and kwargs a run builds (see the module docstring); DiffusersConfigError naming the key."""
    config = read_config(path)
    name = zoo_name(config, str(path))
    spec = ZOO[name]
    params = class_parameters(spec.cls_name)
    set_by_tool = tool_keys(spec)
    for key in shrink:
        if key not in params:
            raise DiffusersConfigError(
                f"model.shrink.{key}",
                f"{spec.cls_name}.__init__ takes no {key!r} (it takes: {', '.join(sorted(params))})",
            )
        if key in set_by_tool:
            raise DiffusersConfigError(
                f"model.shrink.{key}",
                f"is set by the tool for {spec.cls_name} (from data.*, model.patch_size or the adapter's synthetic "
                f"conditioning), not by the file or model.shrink; the tool sets: {', '.join(set_by_tool)}",
            )
    kwargs = {k: v for k, v in params.items() if v is not inspect.Parameter.empty}
    kwargs.update({k: v for k, v in config.items() if k in params})
    kwargs.update(shrink)
    tiny = spec.config(channels, frames, height, width, patch_size)
    kwargs.update({k: tiny[k] for k in spec.data_keys})
    kwargs.update(dict(spec.fixed))
    heads, head_dim = kwargs.get("num_attention_heads"), kwargs.get("attention_head_dim")
    for key in spec.hidden_tied:
        if not (isinstance(heads, int) and isinstance(head_dim, int)):
            raise DiffusersConfigError(
                "model.shrink",
                f"{spec.cls_name}: num_attention_heads and attention_head_dim must be integers (they set {key}), "
                f"got {heads!r} and {head_dim!r}",
            )
        kwargs[key] = heads * head_dim
    ignored = sorted(k for k in config if not k.startswith("_") and k not in params)
    return Released(str(path), name, spec.cls_name, kwargs, dict(shrink), ignored)


DEPTH_KEYS = ("num_layers", "num_single_layers", "num_refiner_layers")
"""Block counts: a model's parameters grow linearly in each (its blocks of a kind are alike)."""

COUNT_DIRECTLY_UP_TO = 16
"""Total blocks up to which the model is built on the meta device as it is; above, it is counted at two small
depths per block kind and extrapolated (num_layers=100000 built 100000 meta blocks: 182 s to refuse)."""


def count_parameters(released: Released) -> int:
    """Parameters of the model `released` describes, built on the meta device (no memory, ~0.2 s). A deep one
    (over COUNT_DIRECTLY_UP_TO blocks) is counted as the native models are (sweep/run/sizes.py): at depths 2
    and 4 of each block kind, extrapolated linearly; if the class cannot be built that small, it is built as it is."""
    kw = released.kwargs
    depths = {k: kw[k] for k in DEPTH_KEYS if isinstance(kw.get(k), int) and not isinstance(kw.get(k), bool)}
    if sum(max(v, 0) for v in depths.values()) > COUNT_DIRECTLY_UP_TO:
        try:
            base = {k: 2 for k in depths}
            at_base = _meta_count(released, base)
            total = at_base
            for k, n in depths.items():
                per_two = _meta_count(released, {**base, k: 4}) - at_base
                total += per_two * (n - 2) // 2
            return total
        except DiffusersConfigError:
            pass  # a class that needs its real depths (a depth tied to another key): build it as it is
    return _meta_count(released, {})


def _meta_count(released: Released, depths: dict) -> int:
    import diffusers

    try:
        with torch.device("meta"):
            model = getattr(diffusers, released.cls_name)(**{**released.kwargs, **depths})
    except Exception as e:  # the class's own checks of its arguments: one line naming the class
        raise DiffusersConfigError("model.shrink", f"{_what(released)} cannot be built: {_one_line(e)}") from e
    return sum(p.numel() for p in model.parameters())


def _what(released: Released) -> str:
    return f"{released.cls_name} from {released.path} with model.shrink={released.shrink}"


def _one_line(e: Exception) -> str:
    message = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {message}"


def check_budget(released: Released, n_params: int, budget: int = PARAM_BUDGET) -> None:
    """DiffusersConfigError (model.shrink) naming the keys to shrink when the model exceeds the budget."""
    if n_params <= budget:
        return
    kw = released.kwargs
    present = [k for k in SIZE_KEYS if k in kw and kw[k] is not None]
    now = ", ".join(f"{k}={kw[k]}" for k in present)
    suggested = {**SUGGESTED, "attention_head_dim": 32}
    if kw.get("rope_axes_dim"):  # its axes must sum to the head dim: the released split, scaled to 32
        suggested["rope_axes_dim"] = _scaled_split(list(kw["rope_axes_dim"]), 32)
    example = ",".join(
        f"{k}:{json.dumps(v).replace(' ', '')}" for k, v in suggested.items() if k in kw and kw[k] is not None
    )
    raise DiffusersConfigError(
        "model.shrink",
        f"{released.cls_name} from {released.path} would have {n_params / 1e6:,.0f}M parameters, over the "
        f"{budget / 1e6:.0f}M a proxy run allows; shrink it, e.g. 'model.shrink={{{example}}}' (now {now})",
    )


def _scaled_split(parts: list[int], total: int) -> list[int]:
    """`parts` scaled to sum to `total`, each even (a rotary axis rotates pairs), the remainder on the last."""
    scaled = [max(2, 2 * round(p * total / sum(parts) / 2)) for p in parts[:-1]]
    return [*scaled, total - sum(scaled)]


def build_from_config(
    path: str,
    shrink: dict,
    *,
    channels: int,
    frames: int,
    height: int,
    width: int,
    patch_size: int,
    attention: str = "math",
    modulate: str = "eager",
    seed: int = 0,
) -> DiffusersAdapter:
    """The released model, shrunk, random init from the global RNG, wrapped like a zoo model."""
    import diffusers

    released = resolve(
        path, shrink, channels=channels, frames=frames, height=height, width=width, patch_size=patch_size
    )
    check_budget(released, count_parameters(released))
    transformer = getattr(diffusers, released.cls_name)(**released.kwargs)
    return wrap_transformer(released.name, transformer, attention, modulate, patch_size, seed)


def probe(path: str, shrink: dict, inputs: dict) -> None:
    """Build the model and run one forward on a batch of the data's shape, before any run: a shrink the class
    accepts but cannot run (HunyuanVideo's rope_axes_dim not summing to attention_head_dim, ...) is one
    DiffusersConfigError, not an `error` run. The global RNG is left as it was."""
    shape = dict(inputs, attention="math", modulate="eager")  # the axes are checked per run, not here
    with torch.random.fork_rng(devices=[]):
        model = build_from_config(path, shrink, **shape).eval()
        image = model.spec.is_image
        c, f, h, w = inputs["channels"], inputs["frames"], inputs["height"], inputs["width"]
        x = torch.zeros((1, c, h, w) if image else (1, c, f, h, w))
        try:
            with torch.no_grad():
                out = model(x, torch.tensor([500.0]))
        except Exception as e:  # the class's own code: any failure is one line naming the class
            raise DiffusersConfigError(
                "model.shrink",
                f"{model.spec.cls_name} from {path} with model.shrink={shrink} fails on a batch of the data's shape "
                f"{tuple(x.shape)}: {_one_line(e)}",
            ) from e
    if out.shape != x.shape:
        raise DiffusersConfigError(
            "model.config", f"{model.spec.cls_name} from {path} predicts {tuple(out.shape)} for x {tuple(x.shape)}"
        )
