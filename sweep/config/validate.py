"""The boundary and the value checks: a composed Hydra config in, a validated RunConfig out.

`to_run_config()` is the boundary: below it, code gets plain dataclasses, never a DictConfig.
`validate()` then rejects values no run can use (lr <= 0, steps <= 0, ...) with a one-line message that
names the dotted key: one check per section of the config, in a fixed order, the first bad value reported.
The model section's checks are in sweep/config/model_checks.py; the files a run will load are checked
later, just before the runs start (sweep/config/inputs.py).

Importing this module imports neither torch nor the models (validating a model does, once), so the grid
sweeper can validate every cell before the first run cheaply.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import os
import typing
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from sweep.config.enums import (
    LOWPREC_INSTALL,
    OPTIM_LIBRARY,
    CpuGemm,
    DataSource,
    Dtype,
    FaultKind,
    FinetuneMethod,
    OptimName,
    Param,
)
from sweep.config.model_checks import check_model, check_model_kind
from sweep.config.schema import (
    ConfigError,
    EvalConfig,
    LadderConfig,
    LedgerConfig,
    LoggerConfig,
    MonitorConfig,
    ObjectiveConfig,
    ReportConfig,
    RunConfig,
    ScenarioConfig,
    require,
)
from sweep.data.split import eval_files_problem
from sweep.run.sizes import STEPS_LIMIT
from sweep.search.conf import PRUNERS, PrunerConfig, PrunerName

MAX_THREADS = 1024
"""More than any machine this runs on has cores; torch.set_num_threads(100000) segfaults (rc 139).
A fixed bound, not os.cpu_count(): a Slurm sweep is validated on a smaller login node."""
MAX_SEED = 2**32 - 1
"""numpy's seed range, the narrowest of the seeds a run feeds (torch takes 64 bits); a seed of 10**26
also overflowed the ledger's SQLite integer and lost the run's trial."""
MAX_REPLICATES = 100
GRAPH_MODES = ("auto", "true", "false")
REPORT_TARGETS = ("cpu", "cuda")
"""The devices a recommendation can be for (`report.target`, sweep/report/target.py)."""


def to_run_config(cfg: DictConfig) -> RunConfig:
    """The boundary: a composed Hydra config (hydra node ignored) becomes a validated RunConfig."""
    if "hydra" in cfg:  # a sweeper's per-cell config still has it; drop it as Hydra does for the job
        cfg = copy.deepcopy(cfg)
        with read_write(cfg), open_dict(cfg):
            del cfg["hydra"]
    run = OmegaConf.to_object(cfg)
    if not isinstance(run, RunConfig):
        raise ConfigError("config root is not a RunConfig: conf/config.yaml must list run_schema first in its defaults")
    check_nodes(run)
    return validate(run)


def check_nodes(obj: Any, prefix: str = "") -> None:
    """Every config node is still a node: OmegaConf lets an interpolation (`checkpoint=${steps}`) or a
    deleted and re-added key (`~ledger ++ledger=3`) put a scalar where a section of the schema belongs."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), prefix + f.name
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            require(
                isinstance(value, type(default)),
                key,
                f"is a section of the config ({key}.{dataclasses.fields(default)[0].name}, ...),"
                f" not a value: got {value!r}",
            )
            check_nodes(value, key + ".")


def validate(run: RunConfig) -> RunConfig:
    """Reject values no run can use; each message names the dotted key."""
    for key, value in nonfinite_floats(run):  # the first one: one line names one key
        raise ConfigError(f"{key}: must be a finite number, got {value}")
    _check_run(run)
    _check_precision(run)
    _check_ladder(run.ladder)
    check_model(run)
    _check_data_shape(run)
    check_model_kind(run)  # after the data shape: it reads data.frames
    _check_data(run)
    _check_optim(run)
    _check_finetune(run)
    _check_objective(run.objective)
    _check_monitor(run.monitor)
    _check_scenario(run.scenario)
    _check_checkpoint(run)
    _check_eval(run.eval)
    _check_confirm(run)
    _check_ledger(run.ledger)
    _check_report(run.report)
    _check_logger(run.logger)
    _check_sizes(run)  # last: it assumes the sizes above are positive
    return run


def nonfinite_floats(node: Any, key: str = "") -> Iterator[tuple[str, float]]:
    """Every inf/nan float under a config object, as (dotted key, value), in field order.

    Hydra's grammar reads `inf` and `nan` as floats, so any float key (and any `+key=inf` added outside
    the schema, which OmegaConf.to_object keeps as an attribute) can hold one; no run can use one, and
    a comparison like `lr > 0` lets inf through. Walks the values, not a list of keys, so a field added
    to a schema later is covered without touching this.
    """
    if isinstance(node, float):
        if not math.isfinite(node):
            yield key, node
    elif is_dataclass(node):
        for name, value in vars(node).items():
            yield from nonfinite_floats(value, f"{key}.{name}" if key else name)
    elif isinstance(node, dict):
        for name, value in node.items():
            yield from nonfinite_floats(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from nonfinite_floats(value, f"{key}[{i}]")


def _check_run(run: RunConfig) -> None:
    """The top-level keys: steps, log_every, graph, threads, the seeds, replicates, device."""
    require(run.steps > 0, "steps", f"must be > 0, got {run.steps}")
    require(run.log_every > 0, "log_every", f"must be > 0, got {run.log_every}")
    run.graph = str(run.graph).lower()  # graph=true arrives as the bool True, stored as "True"
    require(run.graph in GRAPH_MODES, "graph", f"must be one of {', '.join(GRAPH_MODES)}, got {run.graph!r}")
    require(0 <= run.threads <= MAX_THREADS, "threads", f"must be in [0, {MAX_THREADS}] (0 = auto), got {run.threads}")
    for key, seed in (("seed", run.seed), ("data.seed", run.data.seed)):
        require(0 <= seed <= MAX_SEED, key, f"must be in [0, {MAX_SEED}] (2**32 - 1), got {seed}")
    require(
        1 <= run.replicates <= MAX_REPLICATES,
        "replicates",
        f"must be in [1, {MAX_REPLICATES}], got {run.replicates}",
    )
    require(
        run.seed + run.replicates - 1 <= MAX_SEED,
        "replicates",
        f"seeds {run.seed}..{run.seed + run.replicates - 1} go past {MAX_SEED} (2**32 - 1)",
    )
    require(
        run.device == "auto" or run.device == "cpu" or run.device.startswith("cuda"),
        "device",
        f"must be auto, cpu, cuda or cuda:N, got {run.device!r}",
    )


def _check_precision(run: RunConfig) -> None:
    """The loss scaler's knobs, and what compile=true cannot run (emulated GEMMs, fp32_modules)."""
    s = run.precision.scaler
    require(s.init_scale > 0, "precision.scaler.init_scale", f"must be > 0, got {s.init_scale}")
    require(
        0 < s.min_scale <= s.init_scale,
        "precision.scaler.min_scale",
        f"must be in (0, init_scale={s.init_scale}], got {s.min_scale}",
    )
    require(s.growth_factor >= 1, "precision.scaler.growth_factor", f"must be >= 1, got {s.growth_factor}")
    require(0 < s.backoff_factor < 1, "precision.scaler.backoff_factor", f"must be in (0, 1), got {s.backoff_factor}")
    require(s.growth_interval > 0, "precision.scaler.growth_interval", f"must be > 0, got {s.growth_interval}")
    require(s.hysteresis >= 1, "precision.scaler.hysteresis", f"must be >= 1, got {s.hysteresis}")
    require(
        s.max_consecutive_skips >= 1,
        "precision.scaler.max_consecutive_skips",
        f"must be >= 1, got {s.max_consecutive_skips}",
    )
    require(
        not (run.compile and run.precision.cpu_gemm is CpuGemm.emulated),
        "precision.cpu_gemm",
        "emulated is for eager runs; compile=true runs inductor's own kernels (use auto or native)",
    )
    _check_globs(run.precision.fp32_modules, "precision.fp32_modules")
    _check_globs(run.precision.fp8_keep, "precision.fp8_keep")
    require(
        run.precision.fp8 is None or not run.compile,
        "precision.fp8",
        "compile=true with fp8 is not checked against the eager fp8 run yet; run it with compile=false",
    )
    require(  # fp8 matmuls: torchao, imported only by such runs (sweep/run/fp8.py)
        run.precision.fp8 is None or importlib.util.find_spec("torchao") is not None,
        "precision.fp8",
        f"torchao is not installed: {LOWPREC_INSTALL} (docs/fp8.md)",
    )
    require(
        run.precision.fp8 is None or run.precision.autocast_dtype in (None, Dtype.bfloat16),
        "precision.fp8",
        f"runs on top of bf16 autocast (or fp32), got autocast_dtype={_value(run.precision.autocast_dtype)}",
    )
    require(
        not (run.compile and run.precision.fp32_modules),
        "precision.fp32_modules",
        "wraps modules in eager hooks; compile=true runs are not supported with it",
    )


LADDER_TARGET_MAX = 1_000_000
"""The largest width or depth a ladder extrapolates to (ladder.target, sweep.report --ladder-target): far beyond any
model's (the largest are ~10^4 wide and ~10^2 deep); a target of 1e308 or 10**320 overflowed the prediction."""


def ladder_target_problem(target) -> str | None:
    """Why `target` (an int from the config, a float from the command line) is no width or depth to extrapolate
    to, or None. Compared without a float conversion: 10**320 has none."""
    if isinstance(target, (int, float)) and not isinstance(target, bool) and 1 <= target <= LADDER_TARGET_MAX:
        return None
    if isinstance(target, int) and abs(target) >= 10**16:
        shown = f"an integer of {len(str(abs(target)))} digits"
    else:
        shown = f"{target:g}" if isinstance(target, (int, float)) else repr(target)
    return f"must be a width or depth from 1 to {LADDER_TARGET_MAX:,}, got {shown}"


def _check_ladder(lad: LadderConfig) -> None:
    problem = None if lad.target is None else ladder_target_problem(lad.target)
    require(problem is None, "ladder.target", str(problem))
    require(0 < lad.confidence < 1, "ladder.confidence", f"must be in (0, 1), got {lad.confidence}")


def _check_data_shape(run: RunConfig) -> None:
    """The data's sizes are positive and the patch size divides the frame."""
    m, d = run.model, run.data
    synthetic = d.source is DataSource.synthetic
    for key in ("num_samples",) * synthetic + ("frames", "channels", "height", "width", "batch_size"):
        require(getattr(d, key) > 0, f"data.{key}", f"must be > 0, got {getattr(d, key)}")
    require(
        d.height % m.patch_size == 0 and d.width % m.patch_size == 0,
        "model.patch_size",
        f"{m.patch_size} must divide data.height={d.height} and data.width={d.width}",
    )


def _check_data(run: RunConfig) -> None:
    """Fault injection, the range limit, skipped samples, held-out files, and a folder source's path."""
    d = run.data
    for i, f in enumerate(d.faults):
        require(
            0 <= f.index < d.num_samples,
            f"data.faults[{i}].index",
            f"must be in [0, data.num_samples={d.num_samples}), got {f.index}",
        )
        require(
            f.kind in FaultKind.__members__,
            f"data.faults[{i}].kind",
            f"must be one of {', '.join(FaultKind.__members__)}, got {f.kind!r}",
        )
    require(d.range_limit > 0, "data.range_limit", f"must be > 0, got {d.range_limit}")
    require(
        all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in d.skip_samples),
        "data.skip_samples",
        f"must be dataset indices >= 0, got {d.skip_samples}",
    )
    require(
        d.source is not DataSource.synthetic or all(i < d.num_samples for i in d.skip_samples),
        "data.skip_samples",
        f"indices must be < data.num_samples={d.num_samples}, got {d.skip_samples}",
    )
    require(
        not d.skip_samples or run.monitor.sync_every == 1,
        "data.skip_samples",
        "changes the batch size of the steps that draw them; windows (monitor.sync_every > 1) need one batch size",
    )
    problem = eval_files_problem(d.eval_files)  # checked for every source: a malformed value is never right
    require(problem is None, "data.eval_files", problem or "")
    if d.source is not DataSource.synthetic:
        require(bool(d.path), "data.path", f"data={d.source.value} reads a folder: set data.path=DIR")
        require(Path(d.path).is_dir(), "data.path", f"no such directory: {d.path}")
        require(not d.faults, "data.faults", "fault injection is for synthetic data; a folder's bad files are real")
    if d.source is DataSource.image_folder:  # one RGB frame per file (sweep/data/readers.py read_image)
        require(
            d.frames == 1,
            "data.frames",
            f"data=image_folder is one image per sample, for image models: must be 1, got {d.frames}",
        )
        require(
            d.channels == 3,
            "data.channels",
            f"data=image_folder reads images as RGB: must be 3, got {d.channels}",
        )


def _value(v) -> str:
    return "null" if v is None else str(getattr(v, "value", v))


def _check_globs(globs, key: str) -> None:
    for i, glob in enumerate(globs):
        require(
            isinstance(glob, str) and glob.strip() != "",
            f"{key}[{i}]",
            f"must be a module-name glob such as blocks.*.attn, got {glob!r}",
        )


def _check_optim(run: RunConfig) -> None:
    o = run.optim
    require(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}")
    name = o.name.value
    wanted = {OptimName.came: 3, OptimName.adafactor: None}.get(o.name, 2)
    if wanted is not None:
        require(
            len(o.betas) == wanted and all(0 <= b < 1 for b in o.betas),
            "optim.betas",
            f"optim={name} takes {'three' if wanted == 3 else 'two'} numbers in [0, 1), got {list(o.betas)}",
        )
    if o.name in (OptimName.adafactor, OptimName.came):
        require(o.eps is None, "optim.eps", f"optim={name} keeps its library's eps pair; leave optim.eps null")
    else:
        require(o.eps is not None and o.eps >= 0, "optim.eps", f"must be >= 0, got {o.eps}")
    require(
        o.name is OptimName.adamw or o.update_clip == 0,
        "optim.update_clip",
        f"is StableAdamW's clipping of our AdamW; optim={name} does not have it (use optim.grad_clip)",
    )
    require(o.min_8bit_size >= 1, "optim.min_8bit_size", f"must be >= 1, got {o.min_8bit_size}")
    require(o.d0 > 0, "optim.d0", f"must be > 0, got {o.d0}")
    require(o.d_coef > 0, "optim.d_coef", f"must be > 0, got {o.d_coef}")
    require(o.beta2_decay < 0, "optim.beta2_decay", f"must be < 0 (torch's default -0.8), got {o.beta2_decay}")
    if o.name is not OptimName.adamw:  # its package, imported only by the run (sweep/run/optimizers.py)
        package, module, _ = OPTIM_LIBRARY[name]
        require(
            importlib.util.find_spec(module.partition(".")[0]) is not None,
            "optim.name",
            f"optim={name} needs {package}, which is not installed: {LOWPREC_INSTALL} (docs/fp8.md)",
        )
    require(
        o.name is OptimName.adamw or run.monitor.sync_every == 1,
        "monitor.sync_every",
        f"optim={name} runs eagerly, one sync per step (only our adamw is capture-safe): must be 1, "
        f"got {run.monitor.sync_every}",
    )
    require(
        o.name is not OptimName.prodigy or o.lora_lr in (None, o.lr),
        "optim.lora_lr",
        f"optim=prodigy takes one lr for every parameter group (prodigyopt refuses others): leave it null or "
        f"{o.lr}, got {o.lora_lr}",
    )
    require(
        o.name is OptimName.adamw or run.model.param is not Param.mup,
        "optim.name",
        f"model.param=mup sets AdamW's per-group lr; optim={name} is not supported with it",
    )
    require(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
    require(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    require(o.grad_clip >= 0, "optim.grad_clip", f"must be >= 0 (0 = off), got {o.grad_clip}")
    require(o.update_clip >= 0, "optim.update_clip", f"must be >= 0 (0 = off), got {o.update_clip}")
    require(o.lora_lr is None or o.lora_lr > 0, "optim.lora_lr", f"must be > 0 (or null = optim.lr), got {o.lora_lr}")


def _check_finetune(run: RunConfig) -> None:
    f = run.finetune
    require(f.rank > 0, "finetune.rank", f"must be > 0, got {f.rank}")
    require(f.alpha > 0, "finetune.alpha", f"must be > 0, got {f.alpha}")
    require(0 <= f.dropout < 1, "finetune.dropout", f"must be in [0, 1), got {f.dropout}")
    require(
        f.method is FinetuneMethod.lora or run.optim.lora_lr is None, "optim.lora_lr", "only applies with finetune=lora"
    )
    if f.base_dtype is not None:
        require(
            f.method is not FinetuneMethod.none and not f.train_base,
            "finetune.base_dtype",
            "stores a frozen base: needs finetune=lora with finetune.train_base=false",
        )
        require(not run.compile, "finetune.base_dtype", "upcasts in eager hooks; compile=true is not supported with it")
        require(
            run.precision.fp8 is None,
            "finetune.base_dtype",
            f"stores the frozen base for bf16/fp32 matmuls; precision={run.precision.name}'s fp8 matmuls would"
            " quantise it again (not supported together: pick one)",
        )
    _check_globs(f.base_keep, "finetune.base_keep")


def _check_objective(j: ObjectiveConfig) -> None:
    require(j.num_train_timesteps > 1, "objective.num_train_timesteps", f"must be > 1, got {j.num_train_timesteps}")
    require(j.loss_weight > 0, "objective.loss_weight", f"must be > 0, got {j.loss_weight}")


def _check_monitor(mo: MonitorConfig) -> None:
    require(mo.spike_factor > 1, "monitor.spike_factor", f"must be > 1, got {mo.spike_factor}")
    require(0 <= mo.ema_beta < 1, "monitor.ema_beta", f"must be in [0, 1), got {mo.ema_beta}")
    require(mo.stall_window > 0, "monitor.stall_window", f"must be > 0, got {mo.stall_window}")
    require(mo.logit_every > 0, "monitor.logit_every", f"must be > 0, got {mo.logit_every}")
    require(mo.sync_every > 0, "monitor.sync_every", f"must be > 0, got {mo.sync_every}")
    require(
        math.isfinite(mo.diagnose_budget) and mo.diagnose_budget >= 0,
        "monitor.diagnose_budget",
        f"must be a finite number >= 0, got {mo.diagnose_budget}",
    )
    require(0 < mo.stall_fraction <= 1, "monitor.stall_fraction", f"must be in (0, 1], got {mo.stall_fraction}")
    require(mo.trend_samples >= 1, "monitor.trend_samples", f"must be >= 1, got {mo.trend_samples}")
    for key in ("trend_end_factor", "trend_rise"):
        require(getattr(mo, key) > 1, f"monitor.{key}", f"must be > 1, got {getattr(mo, key)}")
    require(mo.trend_rise_t > 0, "monitor.trend_rise_t", f"must be > 0, got {mo.trend_rise_t}")
    require(mo.trend_progress > 0, "monitor.trend_progress", f"must be > 0, got {mo.trend_progress}")
    require(mo.trend_weight_path > 0, "monitor.trend_weight_path", f"must be > 0, got {mo.trend_weight_path}")


def _check_scenario(sc: ScenarioConfig) -> None:
    for key in flatten(sc.pretrain_overrides):  # {data.batch_size: 16} or {data: {batch_size: 16}}
        require(_has_field(RunConfig, key), "scenario.pretrain_overrides", f"no config key {key!r}")


def _has_field(cls: type, dotted: str) -> bool:
    """Whether `dotted` (e.g. data.batch_size) names a field of the dataclass `cls`, node by node."""
    head, _, rest = dotted.partition(".")
    hints = typing.get_type_hints(cls)  # field types are strings here (postponed annotations)
    if head not in hints:
        return False
    return not rest or (is_dataclass(hints[head]) and _has_field(hints[head], rest))


def flatten(obj: Any, prefix: str = "") -> dict:
    """Nested dict -> {dotted.key: value}, for params and reports."""
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def _check_checkpoint(run: RunConfig) -> None:
    c = run.checkpoint
    require(c.every >= 0, "checkpoint.every", f"must be >= 0 (0 = never), got {c.every}")
    require(c.keep >= 0, "checkpoint.keep", f"must be >= 0 (0 = keep all), got {c.keep}")
    require(
        c.inject in (None, "bitflip", "nan"), "checkpoint.inject", f"must be null, bitflip or nan, got {c.inject!r}"
    )
    require(
        c.inject is None or c.resume_from or run.model.init_from,
        "checkpoint.inject",
        "corrupts the file being loaded: set checkpoint.resume_from or model.init_from too",
    )


def _check_eval(e: EvalConfig) -> None:
    require(e.every >= 0, "eval.every", f"must be >= 0 (0 = only at the end), got {e.every}")
    require(e.samples > 0, "eval.samples", f"must be > 0, got {e.samples}")
    require(e.batch_size > 0, "eval.batch_size", f"must be > 0, got {e.batch_size}")
    require(0 <= e.seed <= MAX_SEED, "eval.seed", f"must be in [0, {MAX_SEED}] (2**32 - 1), got {e.seed}")


def _check_confirm(run: RunConfig) -> None:
    """The confirmation's horizon lies beyond the sweep's own steps; its budget is a multiple >= 0 of its run time."""
    c = run.confirm
    require(c.factor > 1, "confirm.factor", f"must be > 1 (a multiple of steps beyond them), got {c.factor}")
    require(
        c.steps is None or c.steps > run.steps,
        "confirm.steps",
        f"must be > steps={run.steps} (a longer horizon than the sweep's), or null for confirm.factor x steps, got "
        f"{c.steps}",
    )
    if c.steps is not None:
        require(
            c.steps <= STEPS_LIMIT,
            "confirm.steps",
            f"{c.steps:,} is over the {STEPS_LIMIT:,} steps a run may have (each keeps a metrics row per step in "
            "memory)",
        )
    require(c.budget >= 0, "confirm.budget", f"must be >= 0 (a multiple of the sweep's run time), got {c.budget}")


def _check_ledger(lc: LedgerConfig) -> None:
    check_storage(lc.storage)
    validate_pruner(lc.pruner, "ledger.pruner")
    require(lc.lock_timeout_s > 0, "ledger.lock_timeout_s", f"must be > 0, got {lc.lock_timeout_s}")


def check_storage(st: str | None) -> None:
    """ledger.storage is a database URL or a journal file (also checked by the Optuna sweeper, which opens it)."""
    require(
        st is None or "://" in st or st.endswith((".log", ".jsonl", ".journal")),
        "ledger.storage",
        f"must be a database URL (sqlite:///..., postgresql://...) or a journal file ending in .log, got {st!r}",
    )


def _check_report(r: ReportConfig) -> None:
    require(
        r.target is None or r.target in REPORT_TARGETS,
        "report.target",
        f"must be null (the device the sweep ran on; cuda from a CPU sweep), cpu or cuda, got {r.target!r}",
    )
    require(isinstance(r.html, bool), "report.html", f"must be true or false, got {r.html!r}")


def validate_pruner(p: PrunerConfig, key: str) -> PrunerConfig:
    """Reject pruner settings Optuna would refuse mid-run; `key` is where they came from (ledger.pruner,
    hydra.sweeper.pruner)."""
    require(
        p.name in PRUNERS,
        f"{key}.name",
        f"must be one of {', '.join(PRUNERS)}, got {getattr(p.name, 'value', p.name)!r}",
    )
    p = dataclasses.replace(p, name=PrunerName(p.name))
    require(p.report_every > 0, f"{key}.report_every", f"must be > 0, got {p.report_every}")
    for field_name in ("n_startup_trials", "n_warmup_steps", "min_early_stopping_rate"):
        require(getattr(p, field_name) >= 0, f"{key}.{field_name}", f"must be >= 0, got {getattr(p, field_name)}")
    require(p.n_min_trials >= 1, f"{key}.n_min_trials", f"must be >= 1, got {p.n_min_trials}")
    require(0 < p.percentile < 100, f"{key}.percentile", f"must be in (0, 100), got {p.percentile}")
    if p.name == "threshold":
        require(p.lower is not None or p.upper is not None, f"{key}.upper", "the threshold pruner needs upper or lower")
    require(
        p.lower is None or p.upper is None or p.lower < p.upper,
        f"{key}.lower",
        f"must be < upper={p.upper}, got {p.lower}",
    )
    require(
        p.min_resource is None or p.min_resource >= 1,
        f"{key}.min_resource",
        f"must be >= 1 or null, got {p.min_resource}",
    )
    require(
        p.max_resource is None or p.max_resource >= 1,
        f"{key}.max_resource",
        f"must be >= 1 or null, got {p.max_resource}",
    )
    require(
        p.reduction_factor is None or p.reduction_factor >= 2,
        f"{key}.reduction_factor",
        f"must be >= 2 or null, got {p.reduction_factor}",
    )
    return p


def _check_logger(lg: LoggerConfig) -> None:
    require(lg.flush_every > 0, "logger.flush_every", f"must be > 0, got {lg.flush_every}")
    require(lg.flush_s >= 0, "logger.flush_s", f"must be >= 0, got {lg.flush_s}")
    require(lg.mlflow.timeout_s > 0, "logger.mlflow.timeout_s", f"must be > 0, got {lg.mlflow.timeout_s}")
    require(lg.mlflow.retries >= 0, "logger.mlflow.retries", f"must be >= 0, got {lg.mlflow.retries}")
    require(bool(lg.tensorboard.dir), "logger.tensorboard.dir", "must name a folder inside the run directory")
    require(
        _inside(lg.tensorboard.dir),
        "logger.tensorboard.dir",
        f"must name a folder inside the run directory (a relative path that stays inside), got {lg.tensorboard.dir!r}",
    )
    for name, package in (("tensorboard", "tensorboard"), ("mlflow", "mlflow")):
        require(
            not getattr(lg, name).enabled or importlib.util.find_spec(package) is not None,
            "logger",
            f"{name} is not installed: pip install -e '.[tracking]' (docs/loggers.md)",
        )


def _inside(folder: str) -> bool:
    """Whether a folder named relative to a run directory stays inside it: not absolute (nor `~`, which a
    reader may expand), and no `..` that climbs out of it once the path is normalised."""
    path = os.path.normpath(folder)
    return not (os.path.isabs(path) or path.startswith("~") or path == ".." or path.startswith(".." + os.sep))


def _check_sizes(run: RunConfig) -> None:
    """The batch, the synthetic data set and the model fit the memory limits (sweep/run/sizes.py)."""
    from sweep.run.sizes import SizeError, check_sizes

    try:
        check_sizes(run)
    except SizeError as e:
        raise ConfigError(f"{e.key}: {e}") from None
