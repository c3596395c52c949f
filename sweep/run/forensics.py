"""Where a run first went wrong: replay it to its bad step with hooks on every module.

The fast loop carries no per-module hooks. When a run diverges with a non-finite loss or gradient
that the cheap checks could not pin on the data or the optimizer, the run is replayed from the start
(runs are bit-reproducible, so the replay reaches the same state) and only the bad step runs under
`ModuleProbe`, which records, in execution order:

- forward: the first module whose output is non-finite while its inputs were finite (the module that
  made the NaN/Inf, not one that passed it on), and each module's activation headroom: max |output|
  over the largest finite value of its dtype (1.0 = at the overflow edge; fp16's is 65504);
- backward: the first module whose input gradient is non-finite while its output gradient was finite.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from sweep.config import Progress, RunConfig, Verdict
from sweep.run.build import build_parts, reset_process_state
from sweep.run.monitor import Cause
from sweep.run.precision import PrecisionPolicy
from sweep.run.progress import RunProgress
from sweep.run.results import MetricsLog
from sweep.run.train import train

# Our hooks sit on every module, including the input embedder whose inputs need no gradient.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    return []


def _finite(ts: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts if t.is_floating_point())


def _amax(ts: list[torch.Tensor]) -> float:
    vals = [
        t.detach().abs().nan_to_num(nan=0.0, posinf=0.0).amax().item()
        for t in ts
        if t.is_floating_point() and t.numel()
    ]
    return max(vals, default=0.0)


class ModuleProbe:
    """Forward and backward hooks on every submodule, for one step."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.forward_origin: tuple[str, str] | None = None  # (module, detail)
        self.backward_origin: tuple[str, str] | None = None
        self.headroom: dict[str, tuple[float, float, str]] = {}  # module -> (ratio, amax, dtype)
        self._handles: list = []

    def __enter__(self) -> "ModuleProbe":
        for name, module in self.model.named_modules():
            if name:
                self._handles.append(module.register_forward_hook(self._forward_hook(name)))
                self._handles.append(module.register_full_backward_hook(self._backward_hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _forward_hook(self, name: str):
        def hook(module, inputs, output):
            outs = _tensors(output)
            floats = [t for t in outs if t.is_floating_point()]
            if not floats:
                return
            amax = _amax(floats)
            dtype = floats[0].dtype
            self.headroom[name] = (amax / torch.finfo(dtype).max, amax, str(dtype).replace("torch.", ""))
            if self.forward_origin is None and not _finite(floats) and _finite(_tensors(inputs)):
                self.forward_origin = (
                    name,
                    f"{name} ({type(module).__name__}) output is non-finite with finite "
                    f"inputs in {str(dtype).replace('torch.', '')}"
                    + (f"; finite max |x| {amax:.3g}" if amax else "; no finite value left"),
                )

        return hook

    def _backward_hook(self, name: str):
        def hook(module, grad_input, grad_output):
            if self.backward_origin is None and not _finite(_tensors(grad_input)) and _finite(_tensors(grad_output)):
                self.backward_origin = (
                    name,
                    f"{name} ({type(module).__name__}) turned a finite output gradient "
                    f"into a non-finite input gradient",
                )

        return hook

    def closest_to_overflow(self, n: int = 5) -> list[dict]:
        """The modules whose activations came closest to their dtype's max at the probed step."""
        top = sorted(self.headroom.items(), key=lambda kv: -kv[1][0])[:n]
        return [{"module": k, "headroom": r, "amax": a, "dtype": d} for k, (r, a, d) in top]


def replay(run: RunConfig, bad_step: int, device: torch.device) -> ModuleProbe:
    """Re-run `run` from the start to `bad_step`, probing that step only."""
    policy = PrecisionPolicy.from_config(run.precision, device, run.compile)
    reset_process_state(run, policy)
    parts = build_parts(run, device, policy)
    probe = ModuleProbe(parts.model)
    short = dataclasses.replace(
        run, steps=bad_step + 1, monitor=dataclasses.replace(run.monitor, stop_on_divergence=True)
    )
    train(short, parts, MetricsLog(), RunProgress(short.steps, Progress.none, 1), probe=(bad_step, probe))
    return probe


def locate(run: RunConfig, verdict: str | None, bad_step: int, device: torch.device) -> tuple[Cause | None, list[dict]]:
    """The cause a replay finds for a non-finite loss or gradient, and the overflow headroom table. `verdict` is the
    run's `Verdict`, or its word as result.json holds it (sweep.replay)."""
    probe = replay(run, bad_step, device)
    top = probe.closest_to_overflow()
    edge = next((t for t in top if t["dtype"] == "float16" and t["headroom"] > 0.5), None)
    overflow = f"; fp16 headroom: {edge['module']} reached {edge['amax']:.3g} of 65504" if edge else ""
    if verdict in (Verdict.nonfinite_loss, Verdict.scale_collapse) and probe.forward_origin:
        module, detail = probe.forward_origin
        return Cause("forward", module, detail + overflow), top
    if probe.backward_origin:
        module, detail = probe.backward_origin
        return Cause("backward", module, detail + overflow), top
    if verdict == Verdict.nonfinite_loss and probe.forward_origin is None:
        return Cause("loss", None, "every module output was finite; the loss itself went non-finite"), top
    return None, top
