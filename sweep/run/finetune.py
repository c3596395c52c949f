"""Fine-tuning methods: LoRA adapters with peft (finetune=lora), and the optimizer's parameter groups.

The way diffusers' training scripts do it (train_cogvideox_lora.py): the base model is built, its
pretrained weights loaded (here `model.init_from`, done by sweep.run.build before this module runs),
then `transformer.add_adapter(LoraConfig(r, lora_alpha, target_modules=[to_q, to_k, to_v, to_out.0]))`
adds the adapters and leaves only them trainable. The adapters get their own lr (`optim.lora_lr`);
with `finetune.train_base=true` the base weights train too, at `optim.lr`.

    python -m sweep model=cogvideox_tiny finetune=lora model.init_from=<run dir>/checkpoints/step_000050 \
        -m optim.lora_lr=1e-4,1e-3,1e-2

Each optimizer group carries `lr_scale` (its lr / optim.lr): its lr at a step is the warmup/schedule's
times that (sweep.run.adamw.DeviceAdamW's table), so both groups follow the same schedule.
"""

from __future__ import annotations

import logging

import torch

from models import mup
from sweep.config import Arch, FinetuneMethod, RunConfig

log = logging.getLogger("sweep")

LORA_TARGETS = {
    "diffusers": ["to_q", "to_k", "to_v", "to_out.0"],  # diffusers' Attention projections
    "native": ["qkv", "proj"],  # models/blocks.py Attention
}


def lora_targets(run: RunConfig) -> list[str]:
    """The module names LoRA wraps: finetune.target_modules, else the architecture's attention projections."""
    if run.finetune.target_modules:
        return list(run.finetune.target_modules)
    if run.model.arch is Arch.custom:  # validate() already refuses this: a custom model's names are unknown
        raise ValueError("model=custom: finetune.target_modules must name the modules LoRA wraps")
    return LORA_TARGETS["diffusers" if run.model.arch in (Arch.diffusers, Arch.diffusers_config) else "native"]


def apply_finetune(run: RunConfig, model: torch.nn.Module, dtype: torch.dtype, warn: bool = True) -> torch.nn.Module:
    """Add LoRA adapters (in `dtype`, the policy's param dtype) and freeze the base; a no-op for finetune=none.
    `warn=False`: the same run built a second time, whose first build gave the warning below."""
    f = run.finetune
    if f.method is FinetuneMethod.none:
        return model
    from peft import LoraConfig, inject_adapter_in_model

    if warn and not (run.model.init_from or run.checkpoint.resume_from or f.train_base):
        # the adapters then sit on untrained weights: behind adaLN-Zero's zero gates they get no gradient at all,
        # and the run stalls at the first stall check whatever its lr (sweep/diagnose says so too)
        log.warning(
            "finetune=lora without model.init_from: the adapters train on weights that were never trained "
            "(a DiT's zero-initialised gates pass them no gradient); give it pretrained weights"
        )

    config = LoraConfig(
        r=f.rank, lora_alpha=f.alpha, lora_dropout=f.dropout, init_lora_weights=True, target_modules=lora_targets(run)
    )
    model.requires_grad_(False)
    transformer = getattr(model, "transformer", None)
    if transformer is not None and hasattr(transformer, "add_adapter"):
        transformer.add_adapter(config)  # diffusers' PeftAdapterMixin, as its training scripts call it
    else:
        inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) or f.train_base)
    return model.to(dtype=dtype)


def is_adapter(name: str) -> bool:
    """Whether a parameter name belongs to a LoRA adapter (peft names them lora_A / lora_B)."""
    return ".lora_A." in name or ".lora_B." in name


def param_groups(run: RunConfig, model: torch.nn.Module) -> list[dict]:
    """AdamW groups: trainable base weights at optim.lr, LoRA adapters at optim.lora_lr (default optim.lr).
    Under µP (model.param=mup) the base weights split by role: the hidden ones at lr / m (models/mup.py)."""
    o = run.optim
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    base = [p for n, p in named if not is_adapter(n)]
    adapters = [p for n, p in named if is_adapter(n)]
    groups = [{"params": base, "lr": o.lr, "lr_scale": 1.0, "name": "base"}] if base else []
    mup_groups = mup.param_groups(model, o.lr, o.weight_decay)
    if mup_groups is not None:
        adapter_ids = {id(p) for p in adapters}
        for g in mup_groups:
            g["params"] = [p for p in g["params"] if id(p) not in adapter_ids]
        groups = [g for g in mup_groups if g["params"]]
    if adapters:
        lora_lr = o.lr if o.lora_lr is None else o.lora_lr
        groups.append({"params": adapters, "lr": lora_lr, "lr_scale": lora_lr / o.lr, "name": "lora"})
    return groups
