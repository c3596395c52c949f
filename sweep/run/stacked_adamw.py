"""Every packed run's AdamW as one update of the stacked weights (sweep/run/packed.py): sweep/run/adamw.py's
update, each run at its own scalars, so a pack's update is each run's own bit for bit (tests/test_adamw.py)."""

from __future__ import annotations

from typing import Sequence

import torch

from sweep.run.adamw import Hyper, Saved, copies, copy_back, per_step_scalars, update_


def group_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Each of `model`'s weights in `optimizer` by name: the index of its param group (StackedAdamW's `groups`)."""
    index = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    return {n: index[id(p)] for n, p in model.named_parameters() if id(p) in index}


class StackedAdamW:
    """Every run's AdamW as one update of the stacked weights: update_ (sweep/run/adamw.py), run k with the scalars
    of its own optimizer (its lr table, betas, eps and weight decay: sweep.run.adamw.DeviceAdamW) and its
    own update count. So each run's update is the one it takes alone, bit for bit, and pure fp16 still turns
    eps=1e-8 into 0 and divides 0 by 0. A run whose step is skipped (overflow, verdict) keeps its weights,
    moments and count untouched.

    The runs' optimizers have the same param groups (a pack's runs build one model: sweep.run.packing.pack_key),
    e.g. µP's base and hidden groups (models/mup.py), each with its own lr scale and weight decay: `groups` names
    each weight's group (`group_of`; None: every weight in group 0), and a weight takes its group's scalars."""

    def __init__(self, parts: Sequence, params: dict[str, torch.Tensor], groups: dict[str, int] | None = None):
        count = len(parts[0].optimizer.param_groups)
        if any(len(p.optimizer.param_groups) != count for p in parts) or (groups is None and count != 1):
            raise ValueError(f"StackedAdamW: the runs' optimizers must have the same param groups (the first: {count})")
        self.hyper = [Hyper.stack([p.optimizer.hyper[g] for p in parts]) for g in range(count)]
        """Per param group, its runs' hyperparameters stacked (a row per run)."""
        self.groups = groups or {}
        self.beta2 = [p.optimizer.param_groups[0]["betas"][1] for p in parts]
        self.decays = any(g["weight_decay"] != 0 for p in parts for g in p.optimizer.param_groups)
        self.params = params
        """The stacked weights by name (PackedModel.params; the pack compacting replaces them)."""
        self.moments = {n: (torch.zeros_like(w), torch.zeros_like(w)) for n, w in params.items() if w.requires_grad}
        self.device = next(iter(params.values())).device
        self.counts = torch.zeros(len(parts), dtype=torch.long, device=self.device)
        """Each packed run's update count, in pack order."""
        self.clock = torch.zeros(1, dtype=torch.long, device=self.device)

    def keep(self, positions: list[int]) -> None:
        index = torch.tensor(positions, dtype=torch.long, device=self.device)
        self.moments = {n: (m[index], v[index]) for n, (m, v) in self.moments.items()}
        self.hyper, self.counts = [h.keep(index) for h in self.hyper], self.counts[index]

    def second_moment(self, position: int, run: int) -> tuple[float, int, float]:
        """Run `run`'s (at `position` in the pack) sum of v, update count and beta2, as
        sweep.run.adam_lag.adamw_second_moment."""
        return (
            sum(float(v[position].float().sum()) for _, v in self.moments.values()),
            int(self.counts[position]),
            self.beta2[run],
        )

    def at(self, step: int, stop: int | None = None) -> None:
        """The next update is step `step`'s (each run's lr of that step); as DeviceAdamW.at."""
        for h in self.hyper:
            h.lr.cover(step, stop if stop is not None else step + 1)
        self.clock.fill_(step)

    def saved(self, into: Sequence[torch.Tensor] | None = None) -> Saved:
        """A copy of the moments and counts as they are now, which puts them back in place when called (a window's
        snapshot, sweep/run/window.py; `into`: the last one's buffers, see `copies`)."""
        tensors = [t for m, v in self.moments.values() for t in (m, v)] + [self.counts]
        saved = copies(tensors, into)

        def restore() -> None:
            with torch.no_grad():
                copy_back(tensors, saved)

        return Saved(saved, restore)

    @torch.no_grad()
    def step(self, stepping: list[bool] | None = None) -> None:
        """Update the packed runs whose `stepping` is True (in pack order; None: every run, with nothing from
        the host, as a window's step does) with their lr of the step the clock is at."""
        params = self.params
        keep = [i for i, go in enumerate(stepping) if not go] if stepping is not None else []
        self.counts += torch.tensor(stepping, device=self.device) if keep else 1
        counts = self.counts.clamp(min=1)
        # per group, (len(PerStep), K): a column per run; a skipped run's go unused
        per_step = [per_step_scalars(h.lr.at(self.clock).view(-1), h, counts) for h in self.hyper]
        for name, (m, v) in self.moments.items():
            w, g = params[name].detach(), params[name].grad
            if g is None:
                continue
            saved = [t[keep].clone() for t in (w, m, v)] if keep else None
            group = self.groups.get(name, 0)
            h = self.hyper[group]
            update_(w, g, m, v, per_step[group], h.consts, self.decays, h.update_clip)
            if saved:
                for t, old in zip((w, m, v), saved):
                    t[keep] = old
