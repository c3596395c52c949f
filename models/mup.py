"""µP (the Maximal Update Parametrization) for the native DiT and video DiT: `model.param=mup`.

Under the standard parametrization (SP) the best and the largest stable lr move with the width, so a
lr found on a small proxy does not carry to the model you train. µP (Yang et al. 2022, "Tensor Programs
V", Table 3 and Table 8 for Adam) scales init, lr and one multiplier with the width multiplier
m = width / base_width so that every layer's update moves its activations by O(1) at any width; Zheng
et al. 2025 (arXiv 2505.15270) show the best lr then stays put across width for DiT, PixArt-α and MMDiT.
Every parameter falls in one of four roles, by which of its dimensions grow with the width:

| role    | which weights here                                  | init (vs. base)     | Adam lr | other            |
|---------|-----------------------------------------------------|---------------------|---------|------------------|
| input   | x_embedder.proj, t_embedder.mlp.0 (fan_out grows)   | unchanged (base's)  | x 1     |                  |
| hidden  | qkv, proj, fc1, fc2, t_embedder.mlp.2, every adaLN  | std x 1/sqrt(m)     | x 1/m   | weight decay x m |
|         | modulation Linear (fan_in and fan_out both grow)    |                     |         |                  |
| readout | final_layer.linear (fan_in grows)                   | zero (adaLN-Zero's) | x 1     | output x 1/m     |
| vector  | biases, qk-LayerNorm weights (no fan_in)            | unchanged           | x 1     |                  |

- hidden: DiT's xavier-uniform init has variance 2/(fan_in + fan_out), which for a weight whose fans
  both grow with the width is already the base's variance / m, so it is kept; only t_embedder.mlp.2
  (a fixed std 0.02 in DiT) is divided by sqrt(m). Weight decay is multiplied by m in those groups, as
  mup's MuAdamW does, so that lr x weight_decay, AdamW's per-step shrink, stays the base's.
- adaLN modulation (conditioning vector of the width -> 6 x width shift/scale/gate): both fans grow, so
  it is a hidden weight (lr / m), as Zheng et al. treat it. It starts at zero (adaLN-Zero) either way.
- input: xavier at width w would shrink the patch embedding's variance (2 / (fan_in + w)); µP keeps the
  base's, xavier computed with fan_out = base_width.
- readout: DiT already zero-initialises the final projection (adaLN-Zero); µP keeps that and multiplies
  the projection's input by 1/m, mup's MuReadout (its lr is then the base's).
- attention: logits are q·k x sqrt(base_head_dim) / head_dim instead of 1/sqrt(head_dim): 1/d scaling
  that equals SP's at the base head dim. `build_model` widens a size by adding heads at a fixed head
  dim, where this is SP's own scale; a DiT built directly with a fixed head count grows its head dim.

At m = 1 every rule above is the identity, and µP is SP bit for bit (tests/test_mup.py).

Why our own code rather than the `mup` package (microsoft/mup 1.0.0, on PyPI, last released 2022-03):
its optimizers (MuAdam, MuAdamW) build torch optimizers from `infshape` attributes that
`set_base_shapes` attaches after instantiating a base model, while runs here train with DeviceAdamW
(sweep/run/adamw.py), whose per-group `lr_scale` takes MuAdam's per-parameter rule directly; the package
also pulls in torchvision and seaborn. What it computes is a few lines given the roles above, which we
name per layer instead of inferring from a second model, and test against the definition. A custom
model may still use the package itself (docs/models.md).

Torch only: no sweep/ or Hydra imports.
"""

from __future__ import annotations

import math

PARAMETRIZATIONS = ("sp", "mup")
ROLES = ("input", "hidden", "readout", "vector")


def check_param(param: str, width: int, base_width: int | None) -> float:
    """The width multiplier m = width / base_width for `param` (1.0 under SP); ValueError when they do not fit."""
    if param not in PARAMETRIZATIONS:
        raise ValueError(f"unknown parametrization {param!r}; choose one of {PARAMETRIZATIONS}")
    if param == "sp":
        return 1.0
    if base_width is None or base_width <= 0:
        raise ValueError(f"mup needs a positive base_width, got {base_width}")
    if base_width > width:
        raise ValueError(f"base_width {base_width} is larger than the width {width}")
    return width / base_width


def adam_scales(role: str, mult: float) -> tuple[float, float]:
    """(lr_scale, weight_decay_scale) of a parameter of `role` at width multiplier `mult` under µP with Adam."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; choose one of {ROLES}")
    if role == "hidden":
        return 1.0 / mult, mult
    return 1.0, 1.0


def attention_scale(head_dim: int, base_head_dim: int) -> float | None:
    """µP's softmax scale sqrt(base_head_dim) / head_dim; None (SDPA's default 1/sqrt(head_dim)) when they are equal."""
    if head_dim == base_head_dim:
        return None
    return math.sqrt(base_head_dim) / head_dim


def param_groups(model, lr: float, weight_decay: float) -> list[dict] | None:
    """AdamW groups of `model`'s trainable parameters by µP role, each with its `lr_scale` and weight decay
    (sweep/run/adamw.py), or None when the model is not µP (it has no `mup_roles`, or they are None)."""
    roles_of = getattr(model, "mup_roles", None)
    roles = roles_of() if callable(roles_of) else None
    if roles is None:
        return None
    mult = model.width_mult
    groups: dict[tuple[float, float], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        lr_scale, wd_scale = adam_scales(roles[name], mult)
        key = (lr_scale, wd_scale)
        if key not in groups:
            label = "base" if key == (1.0, 1.0) else "base/hidden"
            groups[key] = dict(
                params=[], lr=lr * lr_scale, lr_scale=lr_scale, weight_decay=weight_decay * wd_scale, name=label
            )
        groups[key]["params"].append(p)
    return list(groups.values())
