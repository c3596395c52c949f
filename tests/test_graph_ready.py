"""What a CUDA graph of the step needs that a CPU can check: no host sync inside it, state at fixed addresses.

A CUDA graph replays the kernels it captured: a value the host reads in the middle of a step (`.item()`,
`bool(t)`, a data-dependent shape such as `nonzero`) cannot be captured, and a tensor the step replaces
instead of updating in place is not the one the next replay reads. A window's step (sweep/run/window.py)
is built to need neither: the batch is a gather on the device, the loss scaler decides there, clipping is a
multiply by a device factor, and AdamW takes its lr and bias corrections from device tables
(sweep/run/adamw.py). These tests hold that in place on the CPU by dispatching every op of the step, the
optimizer's update included, through a mode that records the ones that read a value back to the host.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sweep.data.batches import load_batch
from sweep.run.execute import prepare
from sweep.run.lone import Lone
from sweep.run.packed import Stacked
from sweep.run.results import RunResult
from sweep.run.scaler import DeviceLossScaler
from sweep.run.step import Row
from sweep.run.window import Snapshot

from .conftest import SMALL_MODEL, make_run

# The ops that hand a tensor's value to the host, or whose output shape depends on its values.
SYNCS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select", "unique"}
# And a tensor made from Python data (torch.tensor(...)): on a GPU a copy from pageable host memory, which a
# CUDA graph cannot capture.
SYNCS |= {"lift_fresh"}


class HostReads(TorchDispatchMode):
    """Records every op dispatched inside it that reads a value back to the host."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []
        self.ops = 0  # every op seen: a check that saw none would pass for nothing

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func.__name__.split(".")[0] in SYNCS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_mode_sees_a_host_read():
    """The check can fail: .item(), a data-dependent shape and a tensor from Python data are caught, plain
    arithmetic is not."""
    t = torch.ones(3)
    with HostReads() as reads:
        (t * 2).sum()
    assert reads.seen == []
    with HostReads() as reads:
        (t * 2).sum().item()
        torch.nonzero(t)
        torch.tensor([1.0, 2.0])  # a copy from the host
    assert len(reads.seen) == 3, reads.seen


STEP_CASES = {  # every branch of the step's device work: loss scaling and its skip, clipping, a bf16 GEMM path
    "fp16_amp_clip": ["precision=fp16_amp", "optim.grad_clip=0.05"],
    "fp16_amp_overflow": ["precision=fp16_amp", "objective.loss_weight=1e5"],
    "bf16_amp_flash": ["precision=bf16_amp", "attention=flash", "modulate=fused"],
    "fp32_flow": ["precision=fp32", "objective=flow"],
    "fp32_update_clip": ["precision=fp32", "optim.update_clip=1.0", "optim.weight_decay=0.1"],
}


@pytest.mark.parametrize("name", list(STEP_CASES))
def test_a_window_step_reads_nothing_back_to_the_host(tmp_path, name):
    """Batch gather and check, noise, forward, scaled backward, unscale, norm, scaler decision, clipping, AdamW."""
    run = make_run(*SMALL_MODEL, "device=cpu", "threads=1", "steps=4", "monitor.sync_every=4", *STEP_CASES[name])
    parts = prepare(run, tmp_path, RunResult(status="error"))
    loop = Lone([run], [parts], windows=True)
    assert loop.device_batches is not None  # synthetic data on the device
    parts.optimizer.at(0)  # the clock, set once: the step reads it on the device and moves it on
    for step in range(3):  # step 0 moves the DDPM schedule to the device once (not a sync)
        with HostReads() as reads:
            row, pred, batches = loop.device_step([0])  # step 0 creates AdamW's state (zeros on the device)
        assert reads.seen == [] and reads.ops > 500, (reads.seen, reads.ops)
        # No autograd graph outlives the step: a kept one keeps the weights' AccumulateGrad nodes of the stream
        # it ran on, and the capture on a side stream failed on an H200 ("operation failed ... during capture").
        assert pred.grad_fn is None
        assert row.shape == (len(Row) + 1, 1)  # the row and the batch's flag
        assert torch.equal(batches[0][0], load_batch(parts.dataset, parts.order.indices(step)))  # the clock's step
        assert parts.optimizer.clock.tolist() == [step + 1]
        parts.optimizer.zero_grad(set_to_none=True)


def test_a_pack_step_reads_nothing_back_to_the_host(tmp_path):
    """The pack's batch gather and checks, noise, vmapped forward, backward, record and AdamW, for runs with their
    own scales and clipping."""
    runs = [
        make_run(
            *SMALL_MODEL,
            "device=cpu",
            "threads=1",
            "steps=3",
            "precision=fp16_amp",
            f"seed={i}",
            f"optim.grad_clip={c}",
            "monitor.sync_every=3",
        )
        for i, c in enumerate([0.0, 0.05])
    ]
    parts = [prepare(r, tmp_path / str(i), RunResult(status="error")) for i, r in enumerate(runs)]
    pack = Stacked(runs, parts, windows=True)
    live = [0, 1]
    assert pack.device_batches is not None  # synthetic data on the device
    pack.optimizer.at(0)  # the clock, set once
    for step in range(2):
        with HostReads() as reads:
            row, pred, batches = pack.device_step(live)
        assert reads.seen == [] and reads.ops > 500, (reads.seen, reads.ops)
        assert pred.grad_fn is None  # no autograd graph outlives the step (see the lone test)
        assert row.shape == (len(Row) + 1, 2) and pack.clock.tolist() == [step + 1]  # rows and flags
        assert all(torch.equal(batches[k][0], load_batch(parts[k].dataset, parts[k].order.indices(step))) for k in live)
        pack.model.zero_grad()


def test_the_scaler_updates_its_state_in_place():
    """A graph replay reads the tensors it captured: update and restore must write into them, not replace them."""
    scaler = DeviceLossScaler([make_run("precision=fp16_amp").precision.scaler] * 2)
    tensors = {k: getattr(scaler, k) for k in DeviceLossScaler._STATE}
    before = scaler.state()
    scaler.update(torch.tensor([True, False]))
    assert all(getattr(scaler, k) is t for k, t in tensors.items())
    assert scaler.scale.tolist() != before["scale"].tolist() or scaler.consecutive_skips.tolist() == [1, 0]
    scaler.restore(before)
    assert all(getattr(scaler, k) is t for k, t in tensors.items())
    assert all(torch.equal(getattr(scaler, k), v) for k, v in before.items())


def test_adamw_updates_its_state_in_place(tmp_path):
    """The weights, moments and update counts a captured update writes are the ones the next replay reads."""
    run = make_run(*SMALL_MODEL, "device=cpu", "threads=1", "steps=3")
    parts = prepare(run, tmp_path, RunResult(status="error"))
    loop = Lone([run], [parts])
    seen = None
    for step in range(3):
        parts.optimizer.at(step)
        loop.forward_backward(loop.batches(step, [0])[0], [0])
        parts.optimizer.step()
        state = [(p, *parts.optimizer.state[p].values()) for p in loop.params]
        assert seen is None or all(a is b for old, new in zip(seen, state) for a, b in zip(old, new))
        seen = state
        if step == 1:
            snapshot = Snapshot.of(loop)
        parts.optimizer.zero_grad(set_to_none=True)
    assert float(parts.optimizer.state[loop.params[0]]["step"]) == 3
    snapshot.restore()  # a window taken back: its state is put back into the same tensors
    state = [(p, *parts.optimizer.state[p].values()) for p in loop.params]
    assert all(a is b for old, new in zip(seen, state) for a, b in zip(old, new))
    assert float(parts.optimizer.state[loop.params[0]]["step"]) == 2


def test_adamw_state_a_window_made_is_taken_back_in_place(tmp_path):
    """A window taken back before any update stood (fp16 overflow from the start) leaves AdamW's state in the
    tensors its first update made, zeroed: a graph captured from them keeps updating the optimizer's own state,
    and the step run again is the first step's, bit for bit. (Deleted instead, on an H100 the graph went on
    counting in tensors no restore reached, past the bias-correction tables: a device-side assert.)"""
    run = make_run(*SMALL_MODEL, "device=cpu", "threads=1", "steps=3")
    parts = prepare(run, tmp_path, RunResult(status="error"))
    loop = Lone([run], [parts])
    x0 = load_batch(parts.dataset, parts.order.indices(0))

    def first_step() -> list[torch.Tensor]:
        parts.optimizer.at(0)
        loop.forward_backward({0: (x0, *parts.objective.sample(x0, parts.noise_gen))}, [0])
        parts.optimizer.step()
        parts.optimizer.zero_grad(set_to_none=True)
        return [t.clone() for p in loop.params for t in (p, *parts.optimizer.state[p].values())]

    assert not parts.optimizer.state
    snapshot = Snapshot.of(loop)
    torch.manual_seed(0)
    once = first_step()
    keys = ("step", "exp_avg", "exp_avg_sq")
    made = [parts.optimizer.state[p][k] for p in loop.params for k in keys]
    snapshot.restore()
    assert all(k in parts.optimizer.state.get(p, {}) for p in loop.params for k in keys)
    state = [parts.optimizer.state[p][k] for p in loop.params for k in keys]
    assert all(a is b for a, b in zip(made, state, strict=True))
    assert not any(t.any() for t in state)  # moments and counts: a fresh state
    torch.manual_seed(0)
    again = first_step()
    assert all(torch.equal(a, b) for a, b in zip(once, again))


def test_graph_is_checked_at_composition_and_true_needs_cuda(tmp_path):
    """graph=yes fails at composition naming the key; graph=true on a CPU device is a skipped run with the reason."""
    from sweep.config import ConfigError
    from sweep.run.execute import execute

    with pytest.raises(ConfigError, match="graph: must be one of auto, true, false"):
        make_run("graph=yes")
    assert make_run("graph=true").graph == "true"  # the override arrives as a bool
    r = execute(make_run(*SMALL_MODEL, "device=cpu", "graph=true", "steps=2"), tmp_path / "run", params={})
    assert r.status == "skipped" and "graph=true" in r.reason and "not a CUDA device" in r.reason


def eager_and_graphed(tmp_path, *overrides: str) -> dict:
    """One CUDA run with graph=false and with graph=true: {"false"|"true": (its result, its metrics.csv bytes)}."""
    from sweep.run.execute import execute

    runs = {}
    for mode in ("false", "true"):
        r = execute(make_run(*SMALL_MODEL, "device=cuda", *overrides, f"graph={mode}"), tmp_path / mode, params={})
        rows = tmp_path / mode / "metrics.csv"
        runs[mode] = (r, rows.read_bytes() if rows.exists() else b"")  # a run that failed first has no rows
    return runs


@pytest.mark.cuda
@pytest.mark.parametrize(
    "overrides",
    [["precision=bf16_amp", "attention=flash", "modulate=fused"], ["precision=fp32", "attention=math"]],
    ids=["bf16_amp-flash-fused", "fp32-math"],
)
def test_a_graphed_run_is_the_eager_run_bit_for_bit(tmp_path, overrides):
    """graph=true replays the captures of the window step and of the logit step: the same metrics, byte for byte,
    as graph=false (sweep/run/graph.py)."""
    runs = eager_and_graphed(tmp_path, "steps=40", "monitor.sync_every=8", "optim.lr=1e-3", *overrides)
    got = {mode: (r.status, r.verdict, rows, r.sync["replayed"]) for mode, (r, rows) in runs.items()}
    assert got["true"][:3] == got["false"][:3]
    # Every step but step 0 (AdamW has no state yet) is replayed: 36 from the window step's graph and 3 from
    # the logit step's (10, 20, 30), whose attention statistics are in the metrics compared.
    assert got["false"][3] == 0 and got["true"][3] == 39, got["true"][3]


@pytest.mark.cuda
@pytest.mark.parametrize(
    "overrides",
    [
        # the VideoChat2 scenario: every fp16 step overflows, every window is taken back, scale collapse at 16
        ["attention=eager", "model.qk_gain=100.0", "steps=25", "data.frames=4", "data.height=8", "data.width=8"],
        ["attention=flash", "optim.lr=3e-2", "steps=30", "seed=1"],  # the demo's fp16_amp spike
        ["attention=math", "optim.lr=3e-2", "steps=30", "seed=1"],
    ],
    ids=["videochat2", "demo-flash", "demo-math"],
)
def test_a_graphed_run_whose_windows_are_taken_back_is_the_eager_run(tmp_path, overrides):
    """fp16 overflow in the first windows: they are taken back before any update stood, and the graph captured
    from the state the first window made must keep updating the optimizer's own (on an H100 these runs hit a
    device-side assert instead, sweep.run.adamw.DeviceAdamW.saved)."""
    runs = eager_and_graphed(tmp_path, "monitor.sync_every=8", "precision=fp16_amp", *overrides)
    assert all(r.status != "error" for r, _ in runs.values()), [r.reason for r, _ in runs.values()]
    got = {mode: (r.status, r.verdict, r.first_bad_step, rows) for mode, (r, rows) in runs.items()}
    assert got["true"] == got["false"]
    r = runs["true"][0]
    assert r.sync["taken_back"] > 0 and r.sync["replayed"] > 0, r.sync


GRAPHED_OPTIONS = {
    "warmup-cosine": ["optim.warmup_steps=5", "optim.schedule=cosine", "optim.weight_decay=0.05"],
    "grad-clip": ["optim.grad_clip=0.5", "precision=fp16_amp", "attention=flash"],
    "update-clip": ["optim.update_clip=1.0", "precision=bf16_amp", "attention=flash"],
    "lora": ["finetune=lora", "precision=bf16_amp", "attention=flash"],
    "fp32-modules": ["precision=bf16_amp", "attention=flash", "precision.fp32_modules=[blocks.*.attn]"],
    "bf16-pure": ["precision=bf16_pure", "attention=flash"],
    "eval-loss": ["eval.every=6", "precision=bf16_amp", "attention=flash"],
}
"""Options whose step a capture must hold too: the lr schedule and weight decay from device tables, clipping by
device factors, frozen weights, modules kept in fp32, low-precision weights, an eval loss between windows."""


@pytest.mark.cuda
@pytest.mark.parametrize("overrides", GRAPHED_OPTIONS.values(), ids=GRAPHED_OPTIONS.keys())
def test_a_graphed_run_with_each_option_is_the_eager_run(tmp_path, overrides):
    runs = eager_and_graphed(tmp_path, "steps=24", "monitor.sync_every=8", "optim.lr=1e-3", *overrides)
    assert all(r.status != "error" for r, _ in runs.values()), [r.reason for r, _ in runs.values()]
    got = {mode: (r.status, r.verdict, r.first_bad_step, rows) for mode, (r, rows) in runs.items()}
    assert got["true"] == got["false"]
    assert runs["true"][0].sync["replayed"] > 0, runs["true"][0].sync


@pytest.mark.cuda
def test_a_graphed_pack_is_the_eager_pack_bit_for_bit(tmp_path):
    """graph=true for a pack: each run's metrics byte for byte those of graph=false, with a run that leaves the
    pack at its first bad step (a compaction: the pack captures again) and window steps replayed."""
    from sweep.run.packing import execute_pack

    common = ["device=cuda", "steps=40", "monitor.sync_every=8", "precision=fp16_amp", "attention=flash"]
    got = {}
    for mode in ("false", "true"):
        runs = [
            make_run(*SMALL_MODEL, *common, f"graph={mode}", f"optim.lr={lr}", f"seed={i}")
            for i, lr in enumerate([1e-4, 1e-3, 0.5])
        ]
        dirs = [tmp_path / mode / str(i) for i in range(len(runs))]
        results = execute_pack(runs, dirs, [{}] * len(runs), [str(i) for i in range(len(runs))])
        got[mode] = [
            (r.status, r.verdict, r.first_bad_step, (d / "metrics.csv").read_bytes()) for r, d in zip(results, dirs)
        ]
        replayed = [r.sync["replayed"] for r in results]
    assert got["true"] == got["false"]
    assert replayed[0] >= 24 and any(v == "loss_spike" for _, v, _, _ in got["true"]), replayed


@pytest.mark.cuda
def test_a_capture_that_fails_on_cuda_leaves_an_eager_run_bit_for_bit(tmp_path, monkeypatch):
    """A step that cannot be captured (here a host read, only while capturing) fails the capture after its
    generator was registered with the graph: the run goes on eagerly with the same metrics as graph=false. (On
    an H200 the first such run crashed instead: the generator stayed mid-capture, "Offset increment outside graph
    capture encountered unexpectedly".)"""
    from sweep.run.execute import execute
    from sweep.run.graph import StepGraph

    captured_step = StepGraph._step

    def reads_the_host_while_capturing(self):
        out = captured_step(self)
        if torch.cuda.is_current_stream_capturing():
            out[0].sum().item()  # not capturable
        return out

    common = ["device=cuda", "steps=24", "monitor.sync_every=8", "precision=fp16_amp"]
    r0 = execute(make_run(*SMALL_MODEL, *common, "graph=false"), tmp_path / "false", params={})
    monkeypatch.setattr(StepGraph, "_step", reads_the_host_while_capturing)
    r1 = execute(make_run(*SMALL_MODEL, *common, "graph=true"), tmp_path / "true", params={})
    assert (r1.status, r1.verdict, r1.sync["replayed"]) == (r0.status, r0.verdict, 0), r1.reason
    assert (tmp_path / "true" / "metrics.csv").read_bytes() == (tmp_path / "false" / "metrics.csv").read_bytes()


@pytest.fixture
def capture_fails_after_warm_up(monkeypatch):
    """graph=true as on CUDA, on the CPU: the side stream is a stand-in, so StepGraph runs its warm-up steps and
    takes them back, then the capture itself fails (no CUDA graphs here) and the run goes on eagerly."""
    import contextlib

    from sweep.run import execute as execute_module
    from sweep.run import graph as graph_module
    from sweep.run import window as window_module

    class Stream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, other):
            pass

    def no_graph():
        raise RuntimeError("no CUDA graph on this machine (test)")

    cuda = graph_module.torch.cuda
    monkeypatch.setattr(cuda, "Stream", Stream)
    monkeypatch.setattr(cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "CUDAGraph", no_graph)
    monkeypatch.setattr(window_module, "wanted", lambda mode, device: mode == "true")
    monkeypatch.setattr(execute_module, "graph_unsupported_reason", lambda mode, device: None)  # not skipped


CAPTURED = ["steps=24", "monitor.sync_every=8", "precision=fp16_amp", "threads=1"]  # loss scaling, no overflow


def counted_run(out: Path, *overrides: str) -> tuple:
    """A lone run of CAPTURED: (status, verdict, metrics.csv's bytes, sync, the window steps it ran on the device)."""
    from sweep.run.execute import execute

    calls = {"n": 0}
    device_step = Lone.device_step

    def counted(self, *args, **kwargs):
        calls["n"] += 1
        return device_step(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Lone, "device_step", counted)
        r = execute(make_run(*SMALL_MODEL, *CAPTURED, *overrides), out, params={})
    return r.status, r.verdict, (out / "metrics.csv").read_bytes(), r.sync, calls["n"]


@pytest.fixture(scope="module")
def eager(tmp_path_factory) -> tuple:
    """CAPTURED with graph=false (counted_run's tuple): what both failed-capture tests of a lone run must equal.
    graph=false never reaches a capture or a logit graph, so neither test's patches would change it."""
    return counted_run(tmp_path_factory.mktemp("eager") / "false", "graph=false")


def test_a_failed_capture_takes_its_warm_up_back_and_the_run_goes_on(
    tmp_path, eager, capture_fails_after_warm_up, caplog
):
    """The warm-up steps (WARMUP of them, before the capture) change weights, AdamW, the scaler, the noise and the
    clock; taken back in place, the run's metrics are byte for byte those of graph=false."""
    from sweep.run.graph import WARMUP

    got = {"false": eager, "true": counted_run(tmp_path / "true", "graph=true")}
    assert got["false"][3]["taken_back"] == 0  # every window stands: nothing but the restore undoes the warm-up
    assert got["true"][:3] == got["false"][:3] and got["true"][3]["replayed"] == 0
    # The window step's capture warmed up once and failed: not retried, and the logit step's (step 10) not tried
    assert got["true"][4] == got["false"][4] + WARMUP
    assert "could not be captured as a CUDA graph" in caplog.text


def test_a_failed_logit_step_capture_keeps_its_attention_statistics(
    tmp_path, eager, capture_fails_after_warm_up, monkeypatch
):
    """The logit step's own capture (StepGraph with the LogitStats), tried alone: its warm-up steps' statistics are
    dropped and the eager step's put back, so the logit columns are byte for byte graph=false's."""
    from sweep.run.execute import execute
    from sweep.run.window import Windows

    def logit_graph_only(self, logits):
        return self.logit_graph if logits else None

    monkeypatch.setattr(Windows, "_graph_at", logit_graph_only)
    r = execute(make_run(*SMALL_MODEL, *CAPTURED, "graph=true"), tmp_path / "true", params={})
    got = {"false": eager[:3], "true": (r.status, r.verdict, (tmp_path / "true" / "metrics.csv").read_bytes())}
    assert got["true"] == got["false"]
    assert b"attn_max_logit" in got["true"][2]


def test_a_packs_failed_capture_takes_its_warm_up_back(tmp_path, capture_fails_after_warm_up, caplog):
    from sweep.run.packing import execute_pack

    got = {}
    for mode in ("false", "true"):
        runs = [
            make_run(*SMALL_MODEL, *CAPTURED, f"graph={mode}", f"optim.lr={lr}", f"seed={i}")
            for i, lr in enumerate([1e-4, 1e-3])
        ]
        dirs = [tmp_path / mode / str(i) for i in range(2)]
        results = execute_pack(runs, dirs, [{}] * 2, ["0", "1"])
        got[mode] = [(r.status, r.verdict, (d / "metrics.csv").read_bytes()) for r, d in zip(results, dirs)]
    assert got["true"] == got["false"]
    assert "could not be captured as a CUDA graph" in caplog.text
