"""A window's step captured once as a CUDA graph and replayed as every later window step (`graph`, issue #15).

    python -m sweep device=cuda monitor.sync_every=8 graph=true

On a GPU a small run is launch-bound: thousands of kernel launches per step, each costing the host more than
the GPU's work. A window's step (the layout's `device_step`: sweep/run/lone.py, packed.py) reads nothing from
the host and takes its step number from a device clock, so one capture of it replays as any later step: the same
kernels on the same tensors, so the same numbers, bit for bit, as running it eagerly.

- Capture waits for AdamW's state to exist (the first update made it), so that the graph updates the
  optimizer's own tensors instead of allocating them; it happens at the first window after that, from a
  snapshot of the run (sweep.run.window.Snapshot): WARMUP eager steps on a side stream (lazy cuBLAS and
  autograd set-up), the snapshot put back in place, then the capture itself, which runs nothing.
- The noise generator is registered with the graph: each replay draws the next noise, as an eager step would.
- The gradients a replay writes live in the graph's memory pool; after each replay the weights' `.grad`
  point at them again, so the stall check and the explanation read them as after an eager step.
- A pack (sweep/run/packed.py) captures its vmapped step the same way, every live run's generator
  registered; when runs leave the pack its tensors are compacted (new tensors), so it captures again.
- A lone run's attention-logit step (every monitor.logit_every, anywhere in a window) is a second capture:
  the statistics it appends are that graph's outputs, handed back to the run's LogitStats after each replay
  and copied aside until the window's end (StepGraph's `stats`, sweep.run.window.Windows.parked). Eager, by
  estimate it was most of a tiny run's graphed step time on an H200 (docs/gpu.md).
- What stays eager: the steps run one sync each (the loop's own: windows taken back, the steps the host decides),
  batches read from files (`x0` comes from the host), and everything on the CPU.

graph=auto stays eager: on an H100 graph == eager held (tests/test_graph_ready.py's `cuda` tests) and the
graphed loop was 1.47-1.77x the bare step as one graph, and the demo grid and every scenario have not yet
been checked with graphs on a GPU since the fix to windows taken back (docs/gpu.md; issue #31). graph=true
asks for it on CUDA; a capture that fails falls back to eager steps with a warning, and the run goes on.
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol

import torch

from models import LogitStats
from sweep.data.step_table import SPAN

log = logging.getLogger("sweep")

WARMUP = 3
"""Eager steps run (and taken back) on a side stream before the capture, as torch's whole-network capture
example does."""


def table_span(sync_every: int) -> int:
    """The steps a run's per-step tables hold at once (sweep/data/step_table.py): a window of `sync_every` steps and
    a capture's warm-up after it must fit (each window moves them on before it runs)."""
    return max(SPAN, sync_every + WARMUP + 1)


def graph_unsupported_reason(mode: str, device: torch.device) -> str | None:
    """Why graph=true cannot run here (a `skipped` run), or None."""
    if mode == "true" and device.type != "cuda":
        return f"graph=true captures the step as a CUDA graph: device {device} is not a CUDA device"
    return None


def wanted(mode: str, device: torch.device) -> bool:
    """Whether a run captures its window steps: graph=true on CUDA (auto stays eager, see the module doc)."""
    return mode == "true" and device.type == "cuda"


class Capturable(Protocol):
    """What StepGraph captures: a loop's layout (sweep/run/lone.py, sweep/run/packed.py)."""

    clock: torch.Tensor
    """The device step index the window's step reads its batch and lr from, and moves on."""
    packed: list[int]
    """The runs in the layout's tensors."""
    params: list[torch.Tensor]
    """The weights whose `.grad` the step writes."""
    generators: list[torch.Generator]
    """The noise generators the step draws from."""

    def device_step(self, live: list[int], batches: dict | None = None, logits: bool = False) -> tuple:
        """One window step from device state alone: (row, pred, batches)."""

    def zero_grad(self) -> None:
        """Drop the gradients."""

    def has_state(self) -> bool:
        """Whether the optimizer's state exists (the first update made it)."""


class StepGraph:
    """A layout's window step (`device_step`, device state only) as a CUDA graph, or eager until captured.
    `steps` is the loop's last step + 1; `snapshot()` the loop's state as it is now (sweep.run.window.Snapshot).
    With `stats` (a lone run's LogitStats) the step is an attention-logit step: the statistics it appends are
    the capture's outputs, which each replay rewrites, put back after each replay for the window to read."""

    def __init__(self, layout: Capturable, steps: int, snapshot: Callable, stats: LogitStats | None = None):
        self.layout, self.steps, self.snapshot, self.stats = layout, steps, snapshot, stats
        self.graph: torch.cuda.CUDAGraph | None = None
        self.kept: tuple = ([], [])  # a logit step's statistics, as the last step left them
        self.failed: str | None = None
        """Why the capture failed (the run then stays eager), or None."""

    def ready(self, step: int) -> bool:
        """Captured, or worth capturing at `step`: the optimizer has its state, no capture failed before, and
        the run has the warm-up's steps left (their batches and lrs are table rows: none past the last step)."""
        if self.graph is not None:
            return True
        return self.failed is None and step + WARMUP < self.steps and self.layout.has_state()

    def reset(self) -> None:
        """The tensors the graph captured were replaced (a pack compacting): capture again when next asked."""
        self.graph = None

    def __call__(self) -> tuple:
        """The step the clock is at: replayed, captured first if need be."""
        if self.graph is None:
            self._capture()
            if self.graph is None:
                out = self._step()
                self._put_back()
                return out
        self.graph.replay()
        for p, g in zip(self.layout.params, self.grads):
            p.grad = g
        self._put_back()
        row, pred, batch = self.out
        return row.clone(), pred, batch  # the row is read after the window's later replays overwrote it

    def _step(self) -> tuple:
        """The layout's window step; a logit step's statistics are kept aside as its outputs (nothing appended
        before it is this step's, and a warm-up step's are not the run's)."""
        if self.stats is not None:
            self.stats.take()
        out = self.layout.device_step(self.layout.packed, None, self.stats is not None)
        if self.stats is not None:
            self.kept = self.stats.take()
        return out

    def _put_back(self) -> None:
        if self.stats is not None:
            self.stats.put(self.kept)

    def _capture(self) -> None:
        loop = self.layout  # the loop's layout
        snapshot, clock, device = self.snapshot(), loop.clock.clone(), loop.clock.device
        clean: list[tuple[torch.Generator, torch.Generator]] = []
        try:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP):
                    loop.zero_grad()
                    self._step()
            torch.cuda.current_stream(device).wait_stream(side)
            snapshot.restore()  # in place: the warm-up steps are gone, the tensors are the same
            loop.clock.copy_(clock)
            graph = torch.cuda.CUDAGraph()
            for generator in loop.generators:  # each replay draws the next noise, as an eager step does
                clean.append((generator, generator.clone_state()))
                graph.register_generator_state(generator)
            loop.zero_grad()  # the backward allocates the gradients in the graph's pool
            with torch.cuda.graph(graph):
                self.out = self._step()
            self.grads = [p.grad for p in loop.params]
            self.graph = graph
        except RuntimeError as e:  # a kernel or an op that cannot be captured: eager steps, same numbers
            first = e.__context__ or e  # torch.cuda.graph's exit reports "a previous error": name that one
            self.failed = f"{type(first).__name__}: {first}".splitlines()[0]
            log.warning(
                "graph=true: the step could not be captured as a CUDA graph (%s); running it eagerly", self.failed
            )
            for generator, state in clean:  # a broken capture leaves a registered generator mid-capture
                generator.graphsafe_set_state(state)
            snapshot.restore()
            loop.clock.copy_(clock)
