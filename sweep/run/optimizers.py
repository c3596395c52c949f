"""The optimizer axis (optim.name): our AdamW, or a library's optimizer behind the interface the loop uses.

    python -m sweep -m optim=adamw,adamw_8bit,adafactor,came,prodigy optim.lr=1e-4,1e-3

`adamw` is sweep/run/adamw.py's DeviceAdamW: torch's single-tensor AdamW bit for bit, its per-step scalars
on the device, so windows of steps and CUDA graphs can run it. The others are their libraries' own code, as
users train with them, wrapped by `LibraryOptimizer`:

- adamw_8bit: bitsandbytes' `AdamW8bit` (kohya, musubi-tuner, SimpleTuner). Both moments in 8 bits: a uint8
  code per value into a 256-entry dynamic map, one fp32 absmax per block of 256 values, dequantised for the
  update and quantised back. Tensors under `optim.min_8bit_size` values keep fp32 state.
- adafactor: `torch.optim.Adafactor`. A factored second moment (row and column variances), no first moment;
  its step is relative to the weight's RMS and `lr` caps the relative step size: min(lr, 1/sqrt(t)).
- came: came-pytorch's `CAME` (Sana, PixArt-alpha): Adafactor's factors plus a factored confidence term.
- prodigy: prodigyopt's `Prodigy`. Adam whose step size d it estimates from the gradients; `lr` multiplies d
  (1.0 is Prodigy's own step), so an lr axis over prodigy sweeps a multiplier, as the tables say.

A library optimizer reads its lr from its param groups on the host, so `at(step)` sets each group's lr to the
schedule's (warmup, cosine) times its `lr_scale` (LoRA adapters' lr ratio) before the step. Its updates are
not graph-safe: such a run runs eagerly, one sync per step (optim.name other than adamw with monitor.sync_every
> 1 is refused at composition), and is never packed (sweep/run/packing.py). result.json's `optimizer` section
(`describe`) records which ran, eager or capture-safe, the dtype of its state, and its health at the end.

Why these libraries and not our own: each is the code users train with (their NaNs are those libraries'
numerics), and bitsandbytes' CPU backend runs the same block-wise algorithm as its CUDA kernel.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import math
from collections import Counter
from typing import Callable, Sequence

import torch

from sweep.config import ConfigError, OptimConfig, OptimName
from sweep.config.enums import LOWPREC_INSTALL, OPTIM_LIBRARY, lr_meaning


def _library_class(name: OptimName):
    """The optimizer class, imported only when a run asks for it (bitsandbytes' import costs ~1 s). Validation
    checked its package is installed; a failing import still says how to install it."""
    package, module, cls = OPTIM_LIBRARY[name.value]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise ConfigError(f"optim={name.value}: needs {package} ({e}); install it with {LOWPREC_INSTALL}") from None


def library_options(o: OptimConfig) -> dict:
    """The keyword arguments of optim.name's library optimizer from the optim section (lr set per step by `at`)."""
    if o.name is OptimName.adamw_8bit:
        return dict(betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, min_8bit_size=o.min_8bit_size)
    if o.name is OptimName.adafactor:
        return dict(beta2_decay=o.beta2_decay, weight_decay=o.weight_decay, foreach=False)
    if o.name is OptimName.came:
        return dict(betas=tuple(o.betas), weight_decay=o.weight_decay)
    return dict(  # prodigy
        betas=tuple(o.betas),
        eps=o.eps,
        weight_decay=o.weight_decay,
        d0=o.d0,
        d_coef=o.d_coef,
        safeguard_warmup=o.safeguard_warmup,
        use_bias_correction=o.use_bias_correction,
    )


class LibraryOptimizer:
    """A library's optimizer with the members of DeviceAdamW the loop, the checkpoints and the forensics use:
    `at(step)` (the lr of the next update), `step()`, `zero_grad()`, `state`, `param_groups`, `state_set()`, and
    a `clock` (the step of the next update; no window or graph reads it here)."""

    capture_safe = False
    """Its update reads host values (its lr, Python step counts): it runs eagerly, one sync per step."""

    def __init__(self, name: OptimName, groups: list[dict], lr_at: Callable[[int], float], options: dict, device):
        self.name, self.lr_at = name, lr_at
        self.inner = _library_class(name)(groups, lr=lr_at(0) * groups[0].get("lr_scale", 1.0), **options)
        self.clock = torch.zeros(1, dtype=torch.long, device=device)

    @property
    def state(self):
        return self.inner.state

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def at(self, step: int, stop: int | None = None) -> None:
        for group in self.inner.param_groups:
            group["lr"] = self.lr_at(step) * group.get("lr_scale", 1.0)
        self.clock.fill_(step)

    def step(self, stepping: Sequence[bool] | None = None) -> None:
        """The library's update; `stepping` as DeviceAdamW.step's ([False]: none)."""
        if stepping is None or stepping[0]:
            self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_set(self) -> None:
        """State set from outside (a checkpoint loaded): nothing to learn, the library reads it as it is."""


def build_optimizer(o: OptimConfig, groups: list[dict], lr_at: Callable[[int], float], device):
    """optim.name's library optimizer over `groups` (sweep.run.finetune.param_groups)."""
    return LibraryOptimizer(o.name, groups, lr_at, library_options(o), device)


GROUP_KEYS = {
    OptimName.prodigy: ("d", "d_max", "d_numerator", "d_denom", "d_hat", "k"),
}
"""Per-group state a library keeps in its param groups rather than per weight (Prodigy's estimate of d and its
sums): a checkpoint saves and restores them with the per-weight state."""


def weights(optimizer) -> list[torch.Tensor]:
    """Every weight `optimizer` updates, group after group: a weight's index here names it in host_state, health and
    a checkpoint's host-side record."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def host_state(optimizer) -> dict:
    """What a checkpoint keeps besides the state's tensors (sweep/run/checkpoint.py): per weight index, its
    non-tensor state values (bitsandbytes' and Prodigy's step counts are Python ints); per group, GROUP_KEYS."""
    if not isinstance(optimizer, LibraryOptimizer):
        return {}
    per_weight = {}
    for i, p in enumerate(weights(optimizer)):
        plain = {k: v for k, v in optimizer.state.get(p, {}).items() if not torch.is_tensor(v)}
        if plain:
            per_weight[str(i)] = plain
    keys = GROUP_KEYS.get(optimizer.name, ())
    groups = [{k: g[k] for k in keys if k in g} for g in optimizer.param_groups]
    return {"weights": per_weight, "groups": groups}


def set_host_state(optimizer, saved: dict) -> None:
    """Put back what `host_state` saved (after the state's tensors are in place)."""
    if not isinstance(optimizer, LibraryOptimizer) or not saved:
        return
    params = weights(optimizer)
    for i, values in saved.get("weights", {}).items():
        optimizer.state[params[int(i)]].update(values)
    for group, values in zip(optimizer.param_groups, saved.get("groups", [])):
        group.update(values)


BNB_BLOCK = 256
"""Values per absmax in bitsandbytes' block-wise 8-bit optimizer state (its Optimizer8bit's blocksize)."""


def adamw_state_from_8bit(saved: dict[str, torch.Tensor], count: int) -> dict[str, torch.Tensor]:
    """An AdamW8bit weight's state as torch's AdamW holds it: {"step", "exp_avg", "exp_avg_sq"} in fp32.
    bitsandbytes' block-wise state: value j = qmap[code j] x absmax[j // BNB_BLOCK] over the flattened tensor; a
    tensor under min_8bit_size keeps fp32 `state1` / `state2` of its own shape."""
    moments = {}
    for k, out in (("1", "exp_avg"), ("2", "exp_avg_sq")):
        state = saved[f"state{k}"]
        if state.dtype != torch.uint8:
            moments[out] = state.float()
            continue
        absmax, qmap = saved[f"absmax{k}"].float(), saved[f"qmap{k}"].float()
        if -(-state.numel() // BNB_BLOCK) != absmax.numel():
            raise ValueError(
                f"8-bit state of {state.numel()} values with {absmax.numel()} blocks: not {BNB_BLOCK} a block"
            )
        flat = qmap[state.reshape(-1).long()]
        scale = absmax.repeat_interleave(BNB_BLOCK)[: flat.numel()]
        moments[out] = (flat * scale).reshape(state.shape)
    return {"step": torch.tensor(float(count)), **moments}


def describe(o: OptimConfig, optimizer) -> dict:
    """result.json's `optimizer`: which ran, where its lr means something else, how it ran, its state's dtypes
    (tensors counted by dtype, over the state's tensors of every weight) and the state's health (`health`)."""
    library = OPTIM_LIBRARY.get(o.name.value, (None,))[0]
    record = {
        "name": o.name.value,
        "library": f"{library} {_version(library)}" if library else "sweep (sweep/run/adamw.py)",
        "eager": not getattr(optimizer, "capture_safe", True),
        "lr_means": lr_meaning(o.name.value),
    }
    if not isinstance(optimizer, LibraryOptimizer):
        # AdamW's two moments are in the weights' dtype by construction (a pack's live in its StackedAdamW)
        dtypes = [_short(p.dtype) for p in weights(optimizer) for _ in range(2)]
        return {**record, "state_dtypes": dict(Counter(dtypes))}
    tensors = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    record.update(state_dtypes=dict(Counter(_short(v.dtype) for v in tensors)), health=health(optimizer))
    if o.name is OptimName.prodigy:
        record["d"] = [float(g.get("d", math.nan)) for g in optimizer.param_groups]
    return record


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def health(optimizer) -> dict:
    """The optimizer state's health, read at the end of a run (or at its first bad step):

    - `nonfinite`: state tensors holding NaN or Inf (by "<weight index>.<key>", at most 10 named), e.g. an 8-bit
      block's absmax gone non-finite, after which every value of the block dequantises to NaN;
    - `v_zero_m_nonzero`: for 8-bit state (bitsandbytes' state1/state2), the share of values whose second moment
      dequantises to exactly 0 while their first moment does not: their next update is m / eps, up to 1e8 x the
      step size. A block's absmax scales its 256 codes, so one large value in a block can quantise the small
      second moments next to it to 0 (the dynamic map's smallest non-zero code is ~1e-7 of the absmax)."""
    nonfinite, zeroed, total = [], 0, 0
    for i, p in enumerate(weights(optimizer)):
        state = optimizer.state.get(p, {})
        for k, v in state.items():
            if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                nonfinite.append(f"{i}.{k}")
        if "state2" in state and state["state2"].dtype == torch.uint8:
            m_zero = state["qmap1"][state["state1"].long()] == 0
            v_zero = state["qmap2"][state["state2"].long()] == 0
            zeroed += int((v_zero & ~m_zero).sum())
            total += state["state2"].numel()
    out: dict = {"nonfinite": nonfinite[:10], "nonfinite_count": len(nonfinite)}
    if total:
        out["v_zero_m_nonzero"] = zeroed / total
    return out
