"""One run from config to files: skip what cannot run here, train, and record the outcome.

`execute` never raises: a divergence is a `diverged` result, a combination the device cannot run is
`skipped` with the reason, and a crash (a bug, an OOM) is `error` with its message, so a NaN or a bug
in one cell never aborts a sweep. Every outcome writes result.json (and metrics.csv once training
started). The statuses, verdicts and files are a contract: docs/design.md, "Verdicts" and "Files of one run".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

import torch

from models import KernelUnavailable, backend_unavailable_reason, count_params
from models.custom import CustomModelError
from models.diffusers_zoo import modulate_unsupported_reason
from sweep.config import RunConfig, Verdict
from sweep.data.checks import DataError
from sweep.diagnose.mechanism import of_run as mechanism_of
from sweep.run import fp8_evidence, optimizers
from sweep.run.build import RunParts, build_parts, build_weights, reset_process_state, resolve_device
from sweep.run.checkpoint import CheckpointHook, CorruptCheckpoint
from sweep.run.compiled import compile_run, compile_unsupported_reason
from sweep.run.dtype_contract import contract_problem
from sweep.run.evaluate import Evaluator, eval_settings, make_evaluator
from sweep.run.forensics import locate
from sweep.run.fp8 import unsupported_reason as fp8_unsupported_reason
from sweep.run.gemm import LOW_PRECISION
from sweep.run.graph import graph_unsupported_reason
from sweep.run.interrupt import SetUpInterrupted, setting_up
from sweep.run.monitor import Divergence
from sweep.run.precision import PrecisionPolicy
from sweep.run.progress import RunProgress
from sweep.run.results import RESULT_FILE, MetricSink, MetricsLog, RunResult, package_versions, write_result
from sweep.run.step import StepHook, Stop
from sweep.run.train import Loop
from sweep.run.trend import Context, Weights, judge, needs_initial_eval
from sweep.run.window import Syncs

log = logging.getLogger("sweep")


def execute(
    run: RunConfig,
    out_dir: Path,
    params: dict,
    label: str = "",
    hooks: Sequence[StepHook] = (),
    sinks: Sequence[MetricSink] = (),
    record: str = RESULT_FILE,
    history: Sequence[dict] = (),
) -> RunResult:
    """Run one config and write its files; the returned result is what result.json holds (`execute_runs`).

    `hooks` act after every training step (sweep.run.step.StepHook); `sinks` get the metrics rows as the run
    goes, and its verdict at the end (the trackers of `logger`, sweep/run/trackers.py). `record` names the
    result file: TRIAL_FILE for the runs a diagnosis or a confirmation makes, which are not runs of the sweep.
    `history`: the metrics rows of the steps before a resumed run's checkpoint (a confirmation continuing a grid
    run, sweep/confirm/): its metrics.csv, numbers and verdicts then cover the whole curve from step 0.
    """
    return execute_runs([run], [out_dir], [params], [label], hooks, [sinks], record, [history])[0]


def execute_runs(
    runs: Sequence[RunConfig],
    out_dirs: Sequence[Path],
    params: Sequence[dict],
    labels: Sequence[str],
    hooks: Sequence[StepHook] = (),
    sinks: Sequence[Sequence[MetricSink]] | None = None,
    record: str = RESULT_FILE,
    histories: Sequence[Sequence[dict]] | None = None,
    stacked: bool = False,
) -> list[RunResult]:
    """Train the runs in one loop (sweep.run.train.Loop: one run, or a pack when `stacked`, which
    sweep/run/packing.py plans) and write each run's files; each run's result, in order, as `execute` says.

    A run that cannot start (skipped here, refused at load, its set-up failed or interrupted) has its result at
    once and the others train without it; a crash in training makes every run of the loop an `error`."""
    start, n = time.perf_counter(), len(runs)
    results = [new_result(run, p) for run, p in zip(runs, params)]
    metrics = [new_metrics(run, Path(d), s) for run, d, s in zip(runs, out_dirs, sinks or [()] * n)]
    for rows, history in zip(metrics, histories or [()] * n):
        rows.rows.extend(dict(row) for row in history)
    # A stop signal stops a lone run's set-up at once; a pack in progress is what the packed launcher lets finish.
    guard = contextlib.nullcontext if stacked else setting_up
    built = [(i, b) for i in range(n) if (b := set_up(runs[i], Path(out_dirs[i]), results[i], guard)) is not None]
    members = [i for i, _ in built]
    if members:
        lead = runs[members[0]]
        label = f"pack of {len(members)}" if stacked else labels[members[0]]
        progress = RunProgress(max(runs[i].steps for i in members), lead.progress, lead.log_every, label)
        hooks = hooks if stacked else [*checkpoint_hooks(lead, Path(out_dirs[members[0]]), label), *hooks]
        syncs, evaluators = [Syncs() for _ in members], [evaluator for _, (_, evaluator) in built]
        try:
            each, train_start = [parts for _, (parts, _) in built], time.perf_counter()
            try:  # the progress bar ends whatever happens, the loop's set-up (device tables) included
                loop = Loop(
                    [runs[i] for i in members],
                    each,
                    [metrics[i] for i in members],
                    progress,
                    hooks,
                    evaluators,
                    syncs,
                    stacked=stacked,
                )
                loop.run(min(parts.start_step for parts in each))
            finally:
                progress.close()
            seconds = time.perf_counter() - train_start
            for j, (i, parts) in enumerate(zip(members, each)):
                results[i].packed = len(members) if stacked else None
                try:
                    conclude(
                        results[i],
                        runs[i],
                        parts,
                        loop.first[j],
                        metrics[i],
                        seconds,
                        loop.stopped[j],
                        evaluators[j],
                        syncs[j],
                    )
                except Exception as e:  # noqa: BLE001  (see fail)
                    fail(results[i], e)
        except Exception as e:  # noqa: BLE001  (a kernel that refused, or a bug: every run of the loop says so)
            for i in members:
                fail(results[i], e)
    for i, result in enumerate(results):
        write_outcome(Path(out_dirs[i]), result, metrics[i], start, record)
    return results


def set_up(
    run: RunConfig, out_dir: Path, result: RunResult, guard: Callable = setting_up
) -> tuple[RunParts, Evaluator | None] | None:
    """The run built, compiled when asked, and its evaluator; None when `result` is already final (skipped, refused
    at load, a set-up that failed, or a stop signal before step 0: `guard`, sweep.run.interrupt.setting_up)."""
    try:
        with guard():
            parts = prepare(run, out_dir, result)
            if parts is None:
                return None
            if run.compile:  # raises KernelUnavailable (skipped) when the compiled graph runs another kernel
                compile_run(run, parts)
            return parts, make_evaluator(run, parts)
    except SetUpInterrupted as e:  # Ctrl-C or SIGTERM before step 0: no step ran, nothing was measured
        result.status, result.reason = "interrupted", f"{e.name} during the set-up, before step {_start_step(run)}"
    except Exception as e:  # noqa: BLE001  (see fail; one run's bad file must not take a pack down)
        fail(result, e)
    return None


def checkpoint_hooks(run: RunConfig, out_dir: Path, label: str) -> list[StepHook]:
    """checkpoint.every's hook (a run trained alone: packs refuse checkpoints, sweep/run/packing.py)."""
    if not run.checkpoint.every:
        return []
    if run.monitor.sync_every > 1:  # said, not silent: the run syncs every step (README, sync_every)
        log.warning(
            "monitor.sync_every=%d: windows are off for %s, as checkpoint.every=%d saves each checkpoint "
            "from a step the host has seen; every step syncs once (result.json sync.every is 1)",
            run.monitor.sync_every,
            label or out_dir,
            run.checkpoint.every,
        )
    return [CheckpointHook(out_dir, run.checkpoint.every, run.checkpoint.keep)]


def new_result(run: RunConfig, params: dict) -> RunResult:
    """A run's result before anything happened: an error until something better is known."""
    result = RunResult(status="error", params=params, versions=package_versions(), seed=run.seed)
    result.eval = eval_settings(run)
    return result


def new_metrics(run: RunConfig, out_dir: Path, sinks: Sequence[MetricSink] = ()) -> MetricsLog:
    """The run's metrics rows, streamed to metrics.csv and the sinks in batches of `logger.flush_*`."""
    return MetricsLog(out_dir, sinks, run.logger.flush_every, run.logger.flush_s)


def unsupported_reason(run: RunConfig, device: torch.device, policy: PrecisionPolicy) -> str | None:
    """Why this combination cannot run here as asked (a `skipped` run), or None: the one "can it run here?" check.

    What only a forward can tell is KernelUnavailable from the model, also `skipped` (see `fail`): a forced SDPA
    kernel refusing a shape, or a custom model the attention/modulate axis did not reach (models/custom.py)."""
    diffusers = run.model.diffusers_name  # a zoo model or a released config's class
    return (
        policy.unsupported_reason(device)
        or fp8_unsupported_reason(run, device)  # fp8 matmuls: CPU (emulated) or CUDA capability >= 8.9
        or backend_unavailable_reason(run.attention.backend.value, device, policy.compute_dtype)
        or (modulate_unsupported_reason(diffusers, run.modulate.impl.value) if diffusers else None)
        or compile_unsupported_reason(run, device)
        or graph_unsupported_reason(run.graph, device)
        or contract_problem(run)  # a custom model that breaks the pure-precision dtype contract (probed once)
    )


def prepare(run: RunConfig, out_dir: Path, result: RunResult) -> RunParts | None:
    """Reset the process state and build the run; None when `result` is already final (skipped, refused)."""
    device = resolve_device(run.device)
    policy = PrecisionPolicy.from_config(run.precision, device, run.compile)
    result.device = str(device)
    reason = unsupported_reason(run, device, policy)
    if reason is not None:
        result.status, result.reason = "skipped", reason
        return None
    reset_process_state(run, policy)
    try:
        parts = build_parts(run, device, policy, scratch=out_dir)
    except CorruptCheckpoint as e:  # refused before any step: a result, not a crash
        result.status, result.verdict = "diverged", Verdict.corrupt_checkpoint
        result.first_bad_step = _start_step(run)
        result.cause = {"where": "checkpoint", "module": e.tensor, "detail": f"{e.file}: {e.detail}"}
        result.mechanism = mechanism_of(result.to_dict(), [], run)
        return None
    result.n_params, result.loaded, result.start_step = count_params(parts.model), parts.loaded, parts.start_step
    result.fp8, result.base_storage = parts.fp8, parts.base_storage  # what ran, recorded whatever the run does next
    result.eval = eval_settings(run, parts.held_out)  # folder data: the held-out files, now they are known
    return parts


def conclude(
    result: RunResult,
    run: RunConfig,
    parts: RunParts,
    divergence: Divergence | None,
    metrics: MetricsLog,
    train_seconds: float,
    stopped: object = None,
    evaluator: Evaluator | None = None,
    syncs: Syncs | None = None,
) -> None:
    """Fill `result` from a finished training: kernels, metrics, the verdict, the eval loss, forensics of a NaN,
    and how the steps met the host (`syncs`). `stopped`: what a hook returned that stopped the run (the loop's
    `stopped`): a pruner's or a signal's Stop says the run's status; anything else ended it early, stable."""
    # What the model ran (its kernels are forced: no fallback), or under compile=true what the profiled
    # compiled graph ran (sweep/run/compiled.py).
    result.kernels = parts.kernels or parts.model.kernels()
    result.optimizer = optimizers.describe(run.optim, parts.optimizer)
    if parts.policy.compute_dtype in LOW_PRECISION:  # bf16/fp16 GEMMs: native kernels or emulated (sweep/run/gemm.py)
        result.kernels = {**result.kernels, "gemm": parts.policy.gemm}
    _fill_from_metrics(result, metrics, train_seconds)
    # The weights before the first bad step (a loss spike's excursion began before the step that tripped it).
    result.eval_loss = evaluator.before(divergence.step if divergence else None) if evaluator else None
    if parts.fp8 is not None:  # fp8 matmuls: each converted layer's amax, scale, underflow, MSE (fp8_evidence.py)
        last = divergence.step if divergence else metrics.rows[-1]["step"] if metrics.rows else parts.start_step
        result.fp8 = {**parts.fp8, **fp8_evidence.measure(run, parts, last)}
    if divergence is None:
        result.status = "stable"
        if isinstance(stopped, Stop):  # a pruner (sweep/search/pruning.py) or a signal (sweep/run/interrupt.py)
            stopped.record(result)
        elif run.monitor.trend and metrics.rows and metrics.rows[-1]["step"] == run.steps - 1:
            judge_trend(result, run, parts, metrics, evaluator)
    else:
        result.status = "diverged"
        result.verdict, result.first_bad_step = divergence.verdict, divergence.step
        result.cause = divergence.to_dict()["cause"]
        result.steps_run = divergence.step + 1 - parts.start_step
        if run.monitor.forensics and result.cause["where"] in ("forward", "backward"):
            cause, headroom = locate(run, divergence.verdict, divergence.step, parts.device)
            result.cause = dataclasses.asdict(cause) if cause else result.cause
            result.headroom = headroom
        result.mechanism = mechanism_of(result.to_dict(), metrics.rows, run)
    if syncs is not None:  # the monitor's first bad step: a trend verdict's is decided after every step ran
        result.sync = syncs.close(divergence.step if divergence else None).to_dict()


def judge_trend(
    result: RunResult, run: RunConfig, parts: RunParts, metrics: MetricsLog, evaluator: Evaluator | None
) -> None:
    """The whole curve of a run that reached its last step with no verdict (sweep/run/trend.py): result.json
    `trend`, and a slow_divergence or no_progress verdict when the curve shows one."""
    m = parts.monitor
    weights = Weights(m.weight_norm0, m.weight_norm, m.travelled)
    # no_progress compares with an untrained model's loss: a run trained from its seed's init, from step 0 or
    # continued from its own earlier steps (a confirmation: metrics.rows start with the grid run's `history`)
    fresh = run.model.init_from is None and bool(metrics.rows) and metrics.rows[0]["step"] == 0
    ctx = Context(run.data.batch_size, fresh, result.eval_loss)
    if evaluator is not None and needs_initial_eval(weights, run.monitor, ctx):
        ctx.eval_initial = untrained_eval_loss(run, parts, evaluator)
    trend = judge(metrics.rows, weights, run.monitor, ctx)
    result.trend = trend.to_dict()
    if trend.verdict is not None:
        result.status, result.verdict, result.first_bad_step = "diverged", trend.verdict, trend.first_bad_step
        result.cause = {"where": "optimizer", "module": None, "detail": trend.detail}
        result.mechanism = mechanism_of(result.to_dict(), metrics.rows, run)


def untrained_eval_loss(run: RunConfig, parts: RunParts, evaluator: Evaluator) -> float:
    """The eval loss of the run's weights before its first step: built again as `prepare` built them (the same
    seed, so the same weights; a lone run's own were trained in place), on the evaluator's clips, timesteps and
    noise. Measured at the end, only for a run no_progress could apply to: no cost to any other run."""
    reset_process_state(run, parts.policy)
    # only the weights, from the seed (a continued run's checkpoint.resume_from is never loaded by build_weights):
    # the data is not read again, and what the first build said is not said again
    untrained, _, _ = build_weights(run, parts.device, parts.policy, init_from=None, warn=False)
    return Evaluator(run, evaluator.data, parts.policy, parts.device)(untrained, -1)


def fail(result: RunResult, e: Exception) -> None:
    """A forced kernel that refused its inputs is `skipped`; anything else (a bug, an OOM; data the run cannot use
    at all, sweep.data.checks.DataError, or a custom model that cannot train, models.custom.CustomModelError, both
    said in one line without a traceback) is `error`.

    Either way it is recorded, never raised into the sweep.
    """
    if isinstance(e, KernelUnavailable):  # not a bug, not a result
        result.status, result.reason = "skipped", str(e)
    elif isinstance(e, (DataError, CustomModelError)):  # the user's data or model, not a bug: one line, no traceback
        result.status, result.reason = "error", str(e)
        log.error("run refused: %s", e)
    else:
        result.status, result.reason = "error", f"{type(e).__name__}: {e}"
        log.error("run crashed:\n%s", "".join(traceback.format_exception(e)))


def write_outcome(
    out_dir: Path, result: RunResult, metrics: MetricsLog, start: float, record: str = RESULT_FILE
) -> None:
    """result.json always; metrics.csv once training started; then the trackers get the verdict and the files.

    A file system that refuses them (full, read-only) makes the run an `error` that names why and what the
    run had come to; it reaches the log and the ledger, and a resume runs the cell again. Never raises."""
    result.seconds = time.perf_counter() - start
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        if metrics.rows:
            metrics.write(out_dir)
        result.logging = dict(metrics.logging)
        write_result(out_dir, result, record)
    except OSError as e:
        outcome = result.headline()
        result.status, result.reason = (
            "error",
            f"{type(e).__name__}: {e} (writing the files of a run that ended {outcome})",
        )
        log.error("run files not written in %s: %s", out_dir, result.reason)
        with contextlib.suppress(OSError):  # result.json may still fit where metrics.csv did not
            write_result(out_dir, result, record)
    if metrics.finish(result, out_dir):  # a tracker failed at the very end: result.json says so
        result.logging = dict(metrics.logging)
        with contextlib.suppress(OSError):
            write_result(out_dir, result, record)


def _fill_from_metrics(result: RunResult, metrics: MetricsLog, train_seconds: float) -> None:
    losses = [r["loss"] for r in metrics.rows]
    finite = [x for x in losses if math.isfinite(x)]
    norms = [r["grad_norm"] for r in metrics.rows if math.isfinite(r["grad_norm"])]
    result.steps_run = len(metrics.rows)
    result.initial_loss = losses[0] if losses else None
    result.final_loss = losses[-1] if losses else None
    result.min_loss = min(finite) if finite else None
    result.max_grad_norm = max(norms) if norms else None
    trained = sum(r["step"] >= result.start_step for r in metrics.rows)  # not the rows of a `history`
    result.steps_per_second = trained / train_seconds if train_seconds > 0 and trained else None
    logits = [r["attn_max_logit"] for r in metrics.rows if _is_number(r.get("attn_max_logit"))]
    entropies = [r["attn_min_entropy"] for r in metrics.rows if _is_number(r.get("attn_min_entropy"))]
    result.max_attn_logit = max(logits) if logits else None
    result.min_attn_entropy = min(entropies) if entropies else None


def _is_number(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def _start_step(run: RunConfig) -> int:
    """The step a run refused at load would have started at: the checkpoint's, as its manifest says."""
    try:
        manifest = Path(run.checkpoint.resume_from or "") / "manifest.json"
        return int(json.loads(manifest.read_text())["step"]) if run.checkpoint.resume_from else 0
    except (OSError, ValueError, KeyError, TypeError):
        return 0
