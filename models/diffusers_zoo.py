"""Tiny diffusers transformers behind the native interface: `model(x, t) -> prediction` of x's shape.

Ten of diffusers' image/video transformers (DiT, PixArt, Sana, Latte, CogVideoX, Wan, LTX-Video,
HunyuanVideo, Allegro, Mochi) are built here from small configs with random init (nothing is
downloaded): the same classes, attention processors and normalisation modules as the released
models, at ~0.1-0.5M parameters. `DiffusersAdapter` gives them the native sweep interface:

  * layout: x is (B, C, H, W) for the image models and (B, C, F, H, W) for the video models; the
    adapter permutes to CogVideoX's (B, F, C, H, W) and packs LTX's tokens (B, F*H/p*W/p, C*p*p),
    and unpacks the prediction back to x's shape;
  * conditioning: a fixed synthetic text embedding (seeded buffer, the same in every run), its
    all-ones mask, pooled projections (HunyuanVideo) and a fixed class label (DiT) stand in for a
    text encoder's output;
  * attention axis: every forward runs under `SdpaRoute` (models/sdpa_route.py), which
    forces one SDPA backend (flash/math) or replaces each SDPA call by softmax(QK^T) in the
    working dtype (eager), and counts the SDPA calls, so a run records what really ran;
  * modulate axis: where the adaLN modulation lives in a replaceable module (AdaLayerNormZero,
    CogVideoXLayerNormZero, MochiRMSNormZero, ...), `modulate=fused` routes it through
    models.modulate; where it is inline in a block's forward, `modulate_unsupported_reason` says
    so and the run is `skipped`.

The model itself is `adapter.transformer` (a diffusers ModelMixin, so peft's `add_adapter` works on it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch import Tensor

from models.modulate import MODULATE_KERNELS
from models.sdpa_route import SdpaRoute

# models.diffusers_kernels (which imports diffusers, ~1 s) loads only when a model is built, so the
# config validation can read ZOO cheaply.

TEXT_LEN = 8
"""Tokens of the synthetic text embedding (CogVideoX's max_text_seq_length and Mochi's max_sequence_length)."""
TEXT_DIM = 32
"""Channels of the synthetic text embedding (each model's caption_channels / text_embed_dim)."""
POOLED_DIM = 16
HEADS, HEAD_DIM = 2, 32  # hidden size 64 in every model


@dataclass(frozen=True)
class ZooSpec:
    """One diffusers transformer: its class, tiny config and how the adapter talks to it."""

    cls_name: str
    layout: str
    """image (B,C,H,W) | bcfhw (B,C,F,H,W) | bfchw (CogVideoX) | packed (LTX tokens)."""
    config: Callable[[int, int, int, int, int], dict]
    """(channels, frames, height, width, patch_size) -> kwargs of the class."""
    modulation: str
    """Where its adaLN modulation lives, in words (docs and result.kernels)."""
    routed: tuple[str, ...]
    """Class names of its modulation modules that `modulate=fused` routes; empty = all inline."""
    self_attention: str = "sdpa"
    """sdpa, or a description of the self-attention when it is not SDPA (Sana's linear attention)."""
    data_keys: tuple[str, ...] = ()
    """Keys of `config` that a released config cannot choose (models/diffusers_config.py): the data shape,
    patch size and the widths of the adapter's synthetic conditioning. Built from a released config, they
    take `config`'s values."""
    fixed: tuple[tuple[str, object], ...] = ()
    """Keys a released config cannot choose either, at fixed values: inputs the adapter never feeds
    (an image condition, guidance) turned off, and what the layout code assumes."""
    hidden_tied: tuple[str, ...] = ()
    """Keys that must equal the hidden size num_attention_heads * attention_head_dim (the width the class
    projects the text to), so shrinking the heads does not leave them at the released width."""

    @property
    def is_image(self) -> bool:
        return self.layout == "image"


def _common(c: int) -> dict:
    return dict(num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=c, out_channels=c)


ZOO: dict[str, ZooSpec] = {
    "dit": ZooSpec(
        "DiTTransformer2DModel",
        "image",
        lambda c, f, h, w, p: dict(_common(c), num_layers=2, sample_size=h, patch_size=p, num_embeds_ada_norm=10),
        modulation=(
            "AdaLayerNormZero (attention input) + inline in BasicTransformerBlock (MLP input) and the output layer"
        ),
        routed=("AdaLayerNormZero",),
        data_keys=("in_channels", "out_channels", "sample_size", "patch_size"),
    ),
    "pixart": ZooSpec(
        "PixArtTransformer2DModel",
        "image",
        lambda c, f, h, w, p: dict(
            _common(c),
            num_layers=2,
            sample_size=h,
            patch_size=p,
            cross_attention_dim=64,
            caption_channels=TEXT_DIM,
            use_additional_conditions=False,
        ),
        modulation="inline in BasicTransformerBlock.forward (ada_norm_single: scale_shift_table)",
        routed=(),
        data_keys=(
            "in_channels",
            "out_channels",
            "sample_size",
            "patch_size",
            "caption_channels",
            "use_additional_conditions",
        ),
        hidden_tied=("cross_attention_dim",),
    ),
    "sana": ZooSpec(
        "SanaTransformer2DModel",
        "image",
        lambda c, f, h, w, p: dict(
            _common(c),
            num_layers=2,
            sample_size=h,
            patch_size=p,
            num_cross_attention_heads=HEADS,
            cross_attention_head_dim=HEAD_DIM,
            cross_attention_dim=64,
            caption_channels=TEXT_DIM,
        ),
        modulation="inline in SanaTransformerBlock.forward (scale_shift_table)",
        routed=(),
        self_attention="linear attention (SanaLinearAttnProcessor2_0, no SDPA)",
        data_keys=("in_channels", "out_channels", "sample_size", "patch_size", "caption_channels"),
        fixed=(("guidance_embeds", False),),
        hidden_tied=("cross_attention_dim",),
    ),
    "latte": ZooSpec(
        "LatteTransformer3DModel",
        "bcfhw",
        lambda c, f, h, w, p: dict(
            _common(c),
            num_layers=1,
            sample_size=h,
            patch_size=p,
            cross_attention_dim=64,
            caption_channels=TEXT_DIM,
            norm_type="ada_norm_single",
            num_embeds_ada_norm=1000,
            activation_fn="gelu-approximate",
            norm_elementwise_affine=False,
            norm_eps=1e-6,
            video_length=f,
        ),
        modulation="inline in BasicTransformerBlock.forward (ada_norm_single: scale_shift_table)",
        routed=(),
        data_keys=("in_channels", "out_channels", "sample_size", "patch_size", "caption_channels", "video_length"),
        hidden_tied=("cross_attention_dim",),
    ),
    "cogvideox": ZooSpec(
        "CogVideoXTransformer3DModel",
        "bfchw",
        lambda c, f, h, w, p: dict(
            _common(c),
            num_layers=2,
            time_embed_dim=64,
            text_embed_dim=TEXT_DIM,
            sample_width=w,
            sample_height=h,
            sample_frames=(f - 1) * 4 + 1,
            patch_size=p,
            max_text_seq_length=TEXT_LEN,
        ),
        modulation="CogVideoXLayerNormZero (norm1, norm2: video and text tokens) + AdaLayerNorm output layer (inline)",
        routed=("CogVideoXLayerNormZero",),
        data_keys=(
            "in_channels",
            "out_channels",
            "sample_width",
            "sample_height",
            "sample_frames",
            "patch_size",
            "text_embed_dim",
            "max_text_seq_length",
        ),
        # sample_frames above is (frames - 1) * 4 + 1; no temporal patches, no ofs input (CogVideoX 1.5 I2V).
        fixed=(("temporal_compression_ratio", 4), ("patch_size_t", None), ("ofs_embed_dim", None)),
    ),
    "wan": ZooSpec(
        "WanTransformer3DModel",
        "bcfhw",
        lambda c, f, h, w, p: dict(
            _common(c), patch_size=(1, p, p), text_dim=TEXT_DIM, freq_dim=32, ffn_dim=256, num_layers=2
        ),
        modulation="inline in WanTransformerBlock.forward (scale_shift_table, in fp32)",
        routed=(),
        data_keys=("in_channels", "out_channels", "patch_size", "text_dim"),
        fixed=(("image_dim", None), ("added_kv_proj_dim", None), ("pos_embed_seq_len", None)),  # no image input
    ),
    "ltx": ZooSpec(
        "LTXVideoTransformer3DModel",
        "packed",
        lambda c, f, h, w, p: dict(
            _common(c * p * p),
            patch_size=p,
            patch_size_t=1,
            cross_attention_dim=64,
            caption_channels=TEXT_DIM,
            num_layers=2,
        ),
        modulation="inline in LTXVideoTransformerBlock.forward (scale_shift_table)",
        routed=(),
        data_keys=("in_channels", "out_channels", "patch_size", "patch_size_t", "caption_channels"),
        hidden_tied=("cross_attention_dim",),
    ),
    "hunyuan": ZooSpec(
        "HunyuanVideoTransformer3DModel",
        "bcfhw",
        lambda c, f, h, w, p: dict(
            _common(c),
            num_layers=1,
            num_single_layers=1,
            num_refiner_layers=1,
            patch_size=p,
            patch_size_t=1,
            guidance_embeds=False,
            text_embed_dim=TEXT_DIM,
            pooled_projection_dim=POOLED_DIM,
            rope_axes_dim=(8, 12, 12),
        ),
        modulation="AdaLayerNormZero (dual-stream norm1/norm1_context), AdaLayerNormZeroSingle (single-stream) "
        "+ inline MLP modulation in the dual-stream block and the token refiner",
        routed=("AdaLayerNormZero", "AdaLayerNormZeroSingle"),
        data_keys=(
            "in_channels",
            "out_channels",
            "patch_size",
            "patch_size_t",
            "guidance_embeds",
            "text_embed_dim",
            "pooled_projection_dim",
        ),
        fixed=(("image_condition_type", None),),
    ),
    "allegro": ZooSpec(
        "AllegroTransformer3DModel",
        "bcfhw",
        lambda c, f, h, w, p: dict(
            _common(c),
            patch_size=p,
            patch_size_t=1,
            num_layers=2,
            cross_attention_dim=64,
            sample_height=h,
            sample_width=w,
            sample_frames=f,
            caption_channels=TEXT_DIM,
        ),
        modulation="inline in AllegroTransformerBlock.forward (scale_shift_table)",
        routed=(),
        data_keys=(
            "in_channels",
            "out_channels",
            "patch_size",
            "patch_size_t",
            "sample_height",
            "sample_width",
            "sample_frames",
            "caption_channels",
        ),
        hidden_tied=("cross_attention_dim",),
    ),
    "mochi": ZooSpec(
        "MochiTransformer3DModel",
        "bcfhw",
        lambda c, f, h, w, p: dict(
            num_attention_heads=HEADS,
            attention_head_dim=HEAD_DIM,
            in_channels=c,
            out_channels=c,
            patch_size=p,
            num_layers=2,
            pooled_projection_dim=POOLED_DIM,
            text_embed_dim=TEXT_DIM,
            time_embed_dim=32,
            max_sequence_length=TEXT_LEN,
        ),
        modulation="MochiRMSNormZero (norm1, norm1_context; scale only, in fp32) + inline MLP modulation",
        routed=("MochiRMSNormZero",),
        data_keys=(
            "in_channels",
            "out_channels",
            "patch_size",
            "pooled_projection_dim",
            "text_embed_dim",
            "max_sequence_length",
        ),
    ),
}

DIFFUSERS_MODELS = tuple(ZOO)


def modulate_unsupported_reason(name: str, impl: str) -> str | None:
    """Why `modulate=impl` cannot apply to this model (inline modulation), or None."""
    spec = ZOO[name]
    if impl == "eager" or spec.routed:
        return None
    return (
        f"modulate={impl}: {spec.cls_name}'s adaLN modulation is {spec.modulation}; there is no replaceable "
        "module to route through models.modulate, so the fused kernel would not run"
    )


class DiffusersAdapter(nn.Module):
    """A diffusers transformer as `model(x, t) -> prediction` (x: (B,C,H,W) image or (B,C,F,H,W) video)."""

    def __init__(
        self, name: str, transformer: nn.Module, attention: str, modulate: str, patch_size: int, seed: int = 0
    ):
        super().__init__()
        self.name, self.spec, self.attention, self.modulate, self.patch_size = (
            name,
            ZOO[name],
            attention,
            modulate,
            patch_size,
        )
        self.transformer = transformer
        self.route = SdpaRoute(attention)
        # Synthetic conditioning, identical in every run (its own generator): not weights, not saved.
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("text", torch.randn(1, TEXT_LEN, TEXT_DIM, generator=g), persistent=False)
        self.register_buffer("pooled", torch.randn(1, POOLED_DIM, generator=g), persistent=False)

    def _conditioning(self, batch: int, dtype: torch.dtype) -> dict:
        text = self.text.expand(batch, -1, -1).to(dtype)  # (B, L, TEXT_DIM)
        mask = torch.ones(batch, TEXT_LEN, device=text.device)  # (B, L): every token valid
        name = self.name
        if name == "dit":
            return dict(class_labels=torch.zeros(batch, dtype=torch.long, device=text.device))
        if name == "pixart":
            return dict(encoder_hidden_states=text, added_cond_kwargs={"resolution": None, "aspect_ratio": None})
        if name in ("sana", "cogvideox", "wan", "allegro", "latte"):
            return dict(encoder_hidden_states=text)
        if name == "hunyuan":
            return dict(
                encoder_hidden_states=text,
                encoder_attention_mask=mask,
                pooled_projections=self.pooled.expand(batch, -1).to(dtype),
            )
        if name in ("ltx", "mochi"):
            return dict(encoder_hidden_states=text, encoder_attention_mask=mask)
        raise AssertionError(name)

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        b = x.shape[0]
        kwargs = self._conditioning(b, x.dtype)
        layout, p = self.spec.layout, self.patch_size
        if layout == "bfchw":
            inp = x.permute(0, 2, 1, 3, 4)  # (B, F, C, H, W)
        elif layout == "packed":
            _, c, f, h, w = x.shape
            inp = (
                x.reshape(b, c, f, h // p, p, w // p, p)
                .permute(0, 2, 3, 5, 1, 4, 6)
                .reshape(b, f * (h // p) * (w // p), c * p * p)
            )  # (B, F*H/p*W/p, C*p*p), LTX's _pack_latents
            kwargs.update(num_frames=f, height=h // p, width=w // p)
        else:
            inp = x
        with self.route:
            out = self.transformer(inp, timestep=t, return_dict=False, **kwargs)[0]
        if layout == "bfchw":
            return out.permute(0, 2, 1, 3, 4)  # (B, C, F, H, W)
        if layout == "packed":
            _, c, f, h, w = x.shape
            return (
                out.reshape(b, f, h // p, w // p, c, p, p).permute(0, 4, 1, 2, 5, 3, 6).reshape(b, c, f, h, w)
            )  # LTX's _unpack_latents
        return out

    def kernels(self) -> dict:
        """What ran in the last forward: the attention kernel per attention kind, and the modulation route."""
        spec = self.spec
        sdpa = self.route.kernel_name
        attention = sdpa if spec.self_attention == "sdpa" else f"self: {spec.self_attention}; cross: {sdpa}"
        out = {"attention": attention, "sdpa_calls_per_forward": self.route.calls_last_forward}
        if self.modulate == "eager":
            out["modulate"] = "eager (diffusers' own modulation code)"
        else:
            out["modulate"] = f"{MODULATE_KERNELS[self.modulate]} in {', '.join(spec.routed)}"
        out["modulate_sites"] = spec.modulation
        return out


def build_diffusers_model(
    name: str,
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
    """A tiny `name` from ZOO, random init from the global RNG, wrapped in DiffusersAdapter."""
    import diffusers

    if name not in ZOO:
        raise ValueError(f"unknown diffusers model {name!r}; choose one of {DIFFUSERS_MODELS}")
    spec = ZOO[name]
    transformer = getattr(diffusers, spec.cls_name)(**spec.config(channels, frames, height, width, patch_size))
    return wrap_transformer(name, transformer, attention, modulate, patch_size, seed)


def wrap_transformer(
    name: str, transformer: nn.Module, attention: str, modulate: str, patch_size: int, seed: int = 0
) -> DiffusersAdapter:
    """A built ZOO[name]-class transformer, its modulation routed for `modulate`, as a DiffusersAdapter."""
    from models.diffusers_kernels import route_modulation

    spec = ZOO[name]
    reason = modulate_unsupported_reason(name, modulate)
    if reason is not None:
        raise ValueError(reason)
    if modulate != "eager":
        routed = route_modulation(transformer, spec.routed, modulate)
        if routed == 0:
            raise AssertionError(f"{spec.cls_name}: no {spec.routed} module found to route")
    return DiffusersAdapter(name, transformer, attention, modulate, patch_size, seed=seed)
