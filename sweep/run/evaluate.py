"""The evaluation loss: the model's diffusion loss on held-out clips, fixed timesteps and fixed noise.

The training loss of one minibatch (4 clips at random timesteps) is mostly noise; this is the number a
sweep should compare runs by. The eval set (`EvalSet`) is a pure function of the data config and
`eval.seed`, the same for every run of a sweep whatever its run seed, lr or precision:
- clips, synthetic data: indices `[num_samples + seed * samples, ... + samples)`. The batch order draws
  from `range(num_samples)` only, so no training step sees them; each clip is rendered alone from its own
  generator (sweep/data/synthetic.py), so making them leaves the training clips' bits untouched;
- clips, folder data: the held-out files (`data.eval_files`, chosen by a hash of their paths:
  sweep/data/split.py), which the batch order never draws (the training set is the other files). The
  usable ones make n = max(eval.samples, usable files) (file, timestep) pairs, pair j the (j mod files)-th
  file, so each file is seen at timesteps spread over the schedule and every file at least once.
  Unusable held-out files (unreadable, wrong shape, NaN/Inf/out of range) are left out and named
  (`eval.unusable`); with none usable there is no eval loss, and `reason` says why;
- timesteps: stratified over the schedule, clip j at the midpoint of the j-th of n equal strata
  (DDPM: an integer timestep; flow: u = (j + 0.5) / n through the timestep shift);
- noise: one CPU generator seeded from (data.seed, eval.seed), drawn once.

`evaluate` runs the run's own forward (precision policy: param dtype, autocast, emulated GEMMs; the
model's forced kernels) under no_grad in eval mode, chunk by chunk in a fixed order, and draws no
random number: the training RNG streams, the batch order and the weights are untouched, so the
training loss curve is the same bit for bit with eval on or off (tests/test_eval_loss.py). The loss is
the plain MSE (objective.loss_weight is not applied: it is an underflow knob, not a quality measure),
averaged over the clips in float64.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from sweep.config import DataSource, EvalConfig, RunConfig
from sweep.data.folder import HeldOutFiles
from sweep.data.synthetic import generator, held_out_clips, sample_seed
from sweep.run.diffusion import DiffusionObjective, shift_sigmas
from sweep.run.precision import PrecisionPolicy

_EVAL_SALT = 0xE7A1_5E7


@dataclass
class EvalSet:
    """Held-out noisy inputs, timesteps and targets (float32, on the run's device), and which clips."""

    noisy: Tensor
    timesteps: Tensor
    target: Tensor
    indices: Sequence[int]
    """Synthetic data: the dataset indices of the clips, disjoint from range(data.num_samples). Folder data: each
    pair's held-out file, as an index into HeldOutFiles.usable."""

    def __len__(self) -> int:
        return len(self.indices)


def eval_settings(run: RunConfig, held_out: HeldOutFiles | None = None) -> dict:
    """What result.json records under `eval`: the settings, the clips (synthetic) or the held-out files (folder
    data, once the run is built: `held_out`), and why there is no eval (or null)."""
    e, d = run.eval, run.data
    reason = unavailable_reason(run, held_out)
    out = {"enabled": reason is None, "every": e.every, "samples": e.samples, "seed": e.seed}
    out["batch_size"] = e.batch_size
    if d.source is DataSource.synthetic and reason is None:
        first = d.num_samples + e.seed * e.samples
        out["clips"] = f"synthetic data.seed={d.seed} indices [{first}, {first + e.samples})"
    if held_out is not None:
        out["files"] = list(held_out.files)
        out["unusable"] = dict(held_out.unusable)
        out["pairs"] = max(e.samples, len(held_out.usable)) if held_out.usable else 0
    out["reason"] = reason
    return out


def unavailable_reason(run: RunConfig, held_out: HeldOutFiles | None = None) -> str | None:
    """Why this run has no eval loss (None when it has one, or when a folder's files are not known yet)."""
    d = run.data
    if not run.eval.enabled:
        return "eval.enabled=false"
    if d.source is DataSource.synthetic:
        return None
    if d.eval_files == 0:
        return "data.eval_files=0: every file of data.path trains, none is held out, so no eval loss"
    if held_out is None:
        return None
    if not held_out.files:
        return f"no file of data.path is held out ({held_out.note}), so no eval loss"
    if held_out.clips is None:
        n = len(held_out.files)
        return f"none of the {n} held-out files is usable (eval.unusable says why), so no eval loss"
    return None


def stratified_timesteps(objective: DiffusionObjective, n: int) -> Tensor:
    """n float32 timesteps, one at the middle of each of n equal strata of the schedule."""
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    if objective.kind == "ddpm":
        return torch.floor(u * objective.num_train_timesteps).to(torch.float32)
    sigma = shift_sigmas(u.to(torch.float32), objective.flow_shift)
    return (sigma * objective.num_train_timesteps).clamp(max=objective._below_t)


def build_eval_set(run: RunConfig, objective: DiffusionObjective, device: torch.device, as_images: bool) -> EvalSet:
    """The held-out set of this data config and eval seed, synthetic data (folder data: folder_eval_set)."""
    d, e = run.data, run.eval
    first = d.num_samples + e.seed * e.samples
    x0 = held_out_clips(d.seed, first, e.samples, d.channels, d.frames, d.height, d.width, as_images)
    return _noised(run, objective, x0, device, range(first, first + e.samples))


def folder_eval_set(run: RunConfig, clips: Tensor, objective: DiffusionObjective, device: torch.device) -> EvalSet:
    """The held-out set of folder data: n = max(eval.samples, files) (file, timestep) pairs over the usable
    held-out files' `clips` (path order), pair j the (j mod files)-th file at the j-th stratum."""
    which = [j % len(clips) for j in range(max(run.eval.samples, len(clips)))]
    return _noised(run, objective, clips[which], device, which)


def _noised(run: RunConfig, objective: DiffusionObjective, x0: Tensor, device: torch.device, indices) -> EvalSet:
    """x0 at stratified timesteps with the eval seed's noise, corrupted as training does; on `device`."""
    d, e = run.data, run.eval
    timesteps = stratified_timesteps(objective, len(x0))
    noise = torch.randn(x0.shape, generator=generator(sample_seed(d.seed, e.seed, _EVAL_SALT)), dtype=torch.float32)
    # On the CPU (the same bits on every device), with a copy: corrupt() moves the schedule to its input's device.
    noisy, target = copy.copy(objective).corrupt(x0, noise, timesteps)
    return EvalSet(noisy.to(device), timesteps.to(device), target.to(device), indices)


@torch.no_grad()
def eval_loss(
    forward: Callable[[Tensor, Tensor], Tensor],
    data: EvalSet,
    policy: PrecisionPolicy,
    device: torch.device,
    batch_size: int,
) -> float:
    """Mean MSE over the eval set of `forward(noisy, t)` under the policy, in chunks of batch_size."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for lo in range(0, len(data), batch_size):
        hi = min(lo + batch_size, len(data))
        with policy.gemm_mode():
            with policy.autocast(device):
                pred = forward(data.noisy[lo:hi].to(policy.param_dtype), data.timesteps[lo:hi])
            total += DiffusionObjective.loss(pred, data.target[lo:hi]).double() * (hi - lo)
    return float(total / len(data))


class Evaluator:
    """When and how one run evaluates: `due(step)` and `__call__(model)`; the measurements by step."""

    def __init__(self, run: RunConfig, eval_set: EvalSet, policy: PrecisionPolicy, device: torch.device):
        self.cfg: EvalConfig = run.eval
        self.steps, self.data, self.policy, self.device = run.steps, eval_set, policy, device
        self.losses: dict[int, float] = {}

    def due(self, step: int) -> bool:
        """After step `step`'s update: every eval.every steps, and after the last step."""
        every = self.cfg.every
        return step == self.steps - 1 or (every > 0 and (step + 1) % every == 0)

    def __call__(
        self, model: torch.nn.Module, step: int, forward: Callable[[Tensor, Tensor], Tensor] | None = None
    ) -> float:
        """The eval loss of the model's current weights, recorded as step `step`'s; training mode restored.
        `forward` (default: the model) is what computes the prediction, e.g. one run's slice of a pack."""
        was_training = model.training
        model.eval()
        try:
            # compile=true: the eager forward, as logit-watching steps do; the sealed compiled graph has no
            # no_grad variant and may not recompile (sweep/run/compiled.py).
            forward = forward or getattr(model, "eager_forward", model)
            loss = eval_loss(forward, self.data, self.policy, self.device, self.cfg.batch_size)
        finally:
            model.train(was_training)
        self.losses[step] = loss
        return loss

    def before(self, step: int | None) -> float | None:
        """The last eval loss measured after a step < `step` (all of them when None): the weights before it."""
        kept = [s for s in self.losses if step is None or s < step]
        return self.losses[max(kept)] if kept else None


def make_evaluator(run: RunConfig, parts) -> Evaluator | None:
    """The run's evaluator (`parts`: its sweep.run.build.RunParts), or None when it has no eval loss."""
    if unavailable_reason(run, parts.held_out) is not None:
        return None
    if parts.held_out is None:
        eval_set = build_eval_set(run, parts.objective, parts.device, run.model.is_image)
    else:
        eval_set = folder_eval_set(run, parts.held_out.clips, parts.objective, parts.device)
    return Evaluator(run, eval_set, parts.policy, parts.device)
