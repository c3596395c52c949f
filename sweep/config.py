"""Typed configuration of one run: the schemas Hydra composes into, and their validation.

Every axis of a sweep is a config group under `conf/` (precision, attention, modulate, model, data,
optim, objective, monitor). Each group's YAML merges into the dataclass registered here, so a typo'd
key or a wrong type fails while Hydra composes (OmegaConf checks keys and types against the schema),
and `validate()` rejects bad values (lr <= 0, steps <= 0, ...) with a one-line message that names the
dotted key. `to_run_config()` is the boundary: below it, code gets plain dataclasses, never a DictConfig.

Importing this module imports neither torch nor the models (validating a diffusers model name does,
once), so the grid sweeper can validate every cell before the first run cheaply.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import os
import typing
from dataclasses import dataclass, field, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from sweep.search.conf import PRUNERS, PrunerConfig, PrunerName


class ConfigError(ValueError):
    """A user mistake in the config: printed as one line, never as a traceback."""


class Dtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class AttentionBackend(str, Enum):
    flash = "flash"
    math = "math"
    eager = "eager"
    efficient = "efficient"
    cudnn = "cudnn"


class ModulateImpl(str, Enum):
    eager = "eager"
    fused = "fused"
    fused_buggy = "fused_buggy"


class Param(str, Enum):
    """How the native models scale with the width (models/mup.py)."""

    sp = "sp"  # the standard parametrization: DiT's init, one lr
    mup = "mup"  # µP relative to model.base_width


class Arch(str, Enum):
    dit = "dit"
    video_dit = "video_dit"
    diffusers = "diffusers"  # a tiny diffusers transformer, named by model.name (models/diffusers_zoo.py)
    custom = "custom"  # the user's own nn.Module, built by model.target (models/custom.py, docs/models.md)
    diffusers_config = "diffusers_config"  # a released diffusers transformer, shrunk, from model.config (config.json)


class FaultKind(str, Enum):
    nan = "nan"
    inf = "inf"
    range = "range"


class ObjectiveKind(str, Enum):
    ddpm = "ddpm"
    flow = "flow"


class CpuGemm(str, Enum):
    auto = "auto"  # emulated where the CPU lacks matrix instructions for the compute dtype (sweep/run/gemm.py)
    native = "native"
    emulated = "emulated"


class OptimName(str, Enum):
    adamw = "adamw"


class FinetuneMethod(str, Enum):
    none = "none"  # every weight trains
    lora = "lora"  # LoRA adapters on a frozen base (sweep/run/finetune.py)


class BetaSchedule(str, Enum):
    """DDPM beta schedules (diffusers' names)."""

    linear = "linear"
    scaled_linear = "scaled_linear"
    squaredcos_cap_v2 = "squaredcos_cap_v2"


class Prediction(str, Enum):
    epsilon = "epsilon"
    v_prediction = "v_prediction"


class Schedule(str, Enum):
    constant = "constant"
    cosine = "cosine"


class DiagnoseMode(str, Enum):
    auto = "auto"
    off = "off"


class Progress(str, Enum):
    auto = "auto"  # a bar on a terminal, nothing per step in CI or a pipe
    bar = "bar"
    log = "log"  # a line every `log_every` steps
    none = "none"


@dataclass
class LossScalerConfig:
    """Dynamic loss scaling for fp16 (torch GradScaler semantics plus DeepSpeed's minimum and hysteresis)."""

    enabled: bool = False
    init_scale: float = 65536.0
    """Scale at step 0 (torch's default 2**16)."""
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    """Clean steps in a row before the scale grows."""
    min_scale: float = 1.0
    """Floor of the scale; an overflow at the floor is a `scale_collapse` when `stop_at_min`."""
    hysteresis: int = 1
    """Overflows tolerated before backing off (1 = back off at every overflow, as torch; DeepSpeed uses 2)."""
    stop_at_min: bool = True
    """DeepSpeed's "Current loss scale already at minimum": stop the run instead of skipping forever."""
    max_consecutive_skips: int = 50
    """More skipped steps in a row than this is a `scale_collapse` too."""


@dataclass
class PrecisionConfig:
    """One precision policy: every knob spelled out."""

    name: str = "fp32"
    param_dtype: Dtype = Dtype.float32
    """Dtype of the weights and of the optimizer state ("pure" low precision when not float32)."""
    autocast_dtype: Optional[Dtype] = None
    """Dtype torch.autocast runs the forward in; null runs the model in param_dtype."""
    tf32: bool = False
    """Allow TF32 tensor cores for fp32 matmuls/convs (CUDA Ampere+ only)."""
    scaler: LossScalerConfig = field(default_factory=LossScalerConfig)
    cpu_gemm: CpuGemm = CpuGemm.auto
    """bf16/fp16 GEMMs on a CPU: native kernels, or emulated as fp32 GEMMs on the rounded inputs, rounded
    once (sweep/run/gemm.py: same numerics up to summation order, ~30x faster on CPUs without AVX512-BF16/FP16
    or AMX). auto emulates exactly there; GPU runs, fp32 and compile=true runs are always native."""
    fp32_modules: List[str] = field(default_factory=list)
    """fnmatch globs over model.named_modules() names (`blocks.*.attn`, `final_layer`): those modules compute in
    fp32 (autocast off, inputs cast to fp32; under a pure policy their weights and AdamW state stay fp32 and their
    outputs are cast back), outermost match only; a no-op under fp32/tf32 (sweep/run/fp32_modules.py). A glob
    matching no module is an error before any run."""


@dataclass
class AttentionConfig:
    backend: AttentionBackend = AttentionBackend.math
    """flash/math/efficient/cudnn force that SDPA backend (no silent fallback); eager is softmax(QK^T) in the
    working dtype."""


@dataclass
class ModulateConfig:
    impl: ModulateImpl = ModulateImpl.eager
    """eager: x * (1 + scale) + shift; fused: one fused kernel (custom op); fused_buggy: OpenDiT's
    per-block scale/shift indexing bug (sample 0's row for every sample), to reproduce that case."""


@dataclass
class ModelConfig:
    arch: Arch = Arch.video_dit
    size: str = "tiny"
    """A key of models.MODEL_SIZES."""
    name: Optional[str] = None
    """arch=diffusers only: which one (dit, pixart, sana, latte, cogvideox, wan, ltx, hunyuan, allegro, mochi)."""
    patch_size: int = 2
    qk_norm: bool = False
    """LayerNorm on queries and keys: the standard fix for attention-logit growth."""
    qk_gain: float = 1.0
    """Multiplies the initial query/key weights: a model whose attention logits are already large,
    as in a pretrained checkpoint whose logits grew (the VideoChat2 case: fp16 overflows from step 0)."""
    init_from: Optional[str] = None
    """Initial weights: a checkpoint directory (manifest verified) or a .safetensors/.pt weights file."""
    target: Optional[str] = None
    """arch=custom only: `pkg.module:factory`, a callable returning an nn.Module with forward(x, t) (docs/models.md)."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """arch=custom only: keyword arguments of the factory (data shape and axes come from the config, not here)."""
    width: Optional[int] = None
    """Native models: the hidden size instead of the named size's, its head dim kept (heads = width / head
    dim): the size axis of `+ladder=width` (docs/ladder.md). null = the size's own."""
    depth: Optional[int] = None
    """Native models: the number of blocks instead of the named size's (even for video_dit: spatial +
    temporal pairs): the size axis of `+ladder=depth`. null = the size's own."""
    param: Param = Param.sp
    """Native models: sp (DiT's own init and one lr) or mup (µP: init, per-layer Adam lr, readout multiplier
    and attention scale follow width / base_width, models/mup.py), so a lr found at one width carries to another."""
    base_width: Optional[int] = None
    """model.param=mup: the width whose lr the others inherit (m = width / base_width); ignored under sp."""
    config: Optional[str] = None
    """arch=diffusers_config only: a released model's transformer/config.json (models/diffusers_config.py)."""
    shrink: Dict[str, Any] = field(default_factory=dict)
    """arch=diffusers_config only: keyword arguments that override the file's, e.g. {num_layers: 2}."""

    @property
    def diffusers_name(self) -> Optional[str]:
        """The ZOO key (models/diffusers_zoo.py) of a diffusers model, built tiny or from a released config."""
        if self.arch is Arch.diffusers:
            return self.name
        if self.arch is Arch.diffusers_config:
            from models.diffusers_config import read_config, zoo_name

            return zoo_name(read_config(self.config), self.config)
        return None

    @property
    def is_image(self) -> bool:
        """Whether the model trains on images (B, C, H, W) rather than clips (B, C, F, H, W)."""
        if self.arch in (Arch.diffusers, Arch.diffusers_config):
            from models.diffusers_zoo import ZOO  # models imports torch; composing a config does not need it

            return ZOO[self.diffusers_name].is_image
        if self.arch is Arch.custom:  # the factory declares it: `factory.is_image = True` (models/custom.py)
            from models.custom import factory_is_image, load_factory

            return factory_is_image(load_factory(self.target))
        return self.arch is Arch.dit


@dataclass
class FaultConfig:
    index: int = 0
    kind: str = "nan"
    """nan | inf | range. A str, not an enum: Hydra's override grammar reads a bare `nan`/`inf` as a
    float, which a str field turns back into "nan"/"inf", so `data.faults=[{index:3,kind:nan}]` works."""


class DataSource(str, Enum):
    synthetic = "synthetic"
    video_folder = "video_folder"
    latent_folder = "latent_folder"


@dataclass
class DataConfig:
    name: str = "synthetic_video"
    source: DataSource = DataSource.synthetic
    """synthetic clips made from a seed, or every video / latent file under data.path (sweep/data/folder.py)."""
    path: Optional[str] = None
    """The folder for video_folder / latent_folder."""
    num_samples: int = 256
    frames: int = 8
    """1 gives single images (for arch=dit)."""
    channels: int = 3
    height: int = 16
    width: int = 16
    batch_size: int = 4
    seed: int = 0
    """Seed of the dataset content (the data order follows the run seed)."""
    faults: List[FaultConfig] = field(default_factory=list)
    """Samples to corrupt: [{index: 17, kind: nan}, ...]."""
    range_limit: float = 1.001
    """A batch with |x| above this is bad input (data is expected in [-1, 1])."""
    check: bool = True
    """Check every batch before the forward (one reduction): a bad sample is `bad_input`, named. Off, it
    reaches the model the way it does in most training scripts, and forensics still names it afterwards."""
    drop_bad: bool = False
    """Scan every sample once when the data is built (the data doctor's check) and leave the bad ones out."""
    skip_samples: List[int] = field(default_factory=list)
    """Dataset indices left out of every batch that draws them; the order of the others is unchanged, so
    only those steps' batches change (smaller by the skipped samples). `python -m sweep.diagnose` proposes it
    for samples that broke a run."""


@dataclass
class OptimConfig:
    name: OptimName = OptimName.adamw
    lr: float = 1e-4
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: Schedule = Schedule.constant
    grad_clip: float = 0.0
    """Max global grad norm; 0 turns clipping off."""
    update_clip: float = 0.0
    """StableAdamW update clipping (Wortsman et al. 2023b, arXiv 2304.13013): per weight tensor, the step size is
    divided by max(1, RMS / update_clip), RMS = sqrt(mean(g**2 / max(v_hat, eps**2))) with this step's
    bias-corrected second moment v_hat (sweep/run/adamw.py); 1.0 is the paper's; 0 turns it off."""
    lora_lr: Optional[float] = None
    """lr of the LoRA adapters (finetune=lora); null = optim.lr. optim.lr stays the base weights' lr."""


@dataclass
class FinetuneConfig:
    """How the model is trained: all weights (none), or LoRA adapters on a frozen base (sweep/run/finetune.py)."""

    method: FinetuneMethod = FinetuneMethod.none
    rank: int = 4
    alpha: float = 4.0
    """LoRA scaling is alpha / rank."""
    dropout: float = 0.0
    target_modules: Optional[List[str]] = None
    """Module names LoRA wraps; null = the attention projections (to_q, to_k, to_v, to_out.0 in diffusers models)."""
    train_base: bool = False
    """Train the base weights too, at optim.lr (the adapters at optim.lora_lr)."""


@dataclass
class ObjectiveConfig:
    kind: ObjectiveKind = ObjectiveKind.ddpm
    num_train_timesteps: int = 1000
    beta_schedule: BetaSchedule = BetaSchedule.linear
    """ddpm only."""
    prediction: Prediction = Prediction.epsilon
    """ddpm only: the regression target (flow always predicts the velocity)."""
    flow_shift: float = 1.0
    loss_weight: float = 1.0
    """Multiplies the loss: a tiny weight reproduces fp16 gradient underflow without loss scaling."""


@dataclass
class MonitorConfig:
    """When a run counts as diverged."""

    spike_factor: float = 10.0
    """loss_spike: the smoothed loss above this multiple of its running minimum, or a loss above it x the initial
    loss."""
    ema_beta: float = 0.9
    """Smoothing of the loss for the spike test (an EMA; 0.9 averages ~10 steps)."""
    stall_window: int = 20
    """Every this many steps, compare the weights with the previous check."""
    stall_fraction: float = 0.9
    """stalled: at least this fraction of the weights, weighted by |w|, unchanged over a window."""
    stop_on_divergence: bool = True
    """Stop at the first bad step (the verdict and first_bad_step are the same either way)."""
    forensics: bool = True
    """On a non-finite loss/gradient, replay the run to its bad step with module hooks to find where."""
    logit_every: int = 10
    """Every this many steps, record the max attention logit and the lowest attention entropy (one extra
    QK^T per layer on those steps): logit growth is the classic small-transformer instability."""
    sync_every: int = 1
    """Fetch the steps' numbers from the device every this many steps (one sync per window, not per step).
    Verdicts, first bad steps and metrics are the same for any value (sweep/run/window.py): a window with a
    step the host must decide runs again one sync per step. 1 on the CPU, where a sync costs nothing."""
    diagnose: DiagnoseMode = DiagnoseMode.auto
    """At the end of a multirun, auto diagnoses the diverged runs (sweep/diagnose: counterfactual runs and a fix
    confirmed from step 0), one per distinct failure (verdict, mechanism and every swept value but the lr and
    the seed; its smallest lr), within diagnose_budget; off leaves each run its mechanism from its recorded
    signals only. `python -m sweep.diagnose RUN_DIR` diagnoses any run by hand."""
    diagnose_budget: float = 1.0
    """auto's time limit, as a multiple of the sweep's own run time (its runs' seconds added up); the largest
    failure is diagnosed whatever its cost, 0 diagnoses none."""


@dataclass
class CheckpointConfig:
    """Saving and resuming runs (sweep/run/checkpoint.py): safetensors files plus a SHA-256 manifest."""

    every: int = 0
    """Save a checkpoint every this many steps into <run dir>/checkpoints/step_NNNNNN; 0 = never."""
    keep: int = 0
    """Keep only the newest this many checkpoints; 0 keeps all."""
    resume_from: Optional[str] = None
    """A checkpoint directory: continue from its step with its model, optimizer, scaler and RNG states."""
    resume_optimizer: bool = True
    """False: resume weights, step, scaler, monitor and RNG, but start AdamW's moments afresh (a trainer's
    "reset optimizer"): a changed batch size or data mix then gets a second moment estimated from its own
    gradients, not the old ones (the adamw_beta2_loss_spike scenario)."""
    verify: bool = True
    """Check the manifest's SHA-256 sums and scan for non-finite values before loading anything (a bad
    file is verdict `corrupt_checkpoint` before any step). Off, files load as they are."""
    inject: Optional[str] = None
    """Fault injection: `bitflip` or `nan` corrupts one tensor of a copy of the file being loaded,
    as a bad download or disk would (the Hallo case)."""
    inject_tensor: Optional[str] = None
    """The tensor `inject` corrupts; null = the first attention weight."""


class LadderAxis(str, Enum):
    width = "width"
    depth = "depth"


@dataclass
class LadderConfig:
    """The frontier across sizes (`+ladder=width|depth`, sweep/report/ladder.py, docs/ladder.md)."""

    axis: Optional[LadderAxis] = None
    """Which size the sweep steps through (model.width or model.depth); null = no ladder."""
    target: Optional[int] = None
    """The width (or depth) to extrapolate the largest stable lr to."""
    confidence: float = 0.9
    """Of the prediction interval at the target."""


@dataclass
class EvalConfig:
    """The evaluation loss (sweep/run/evaluate.py, docs/eval_loss.md): the model's loss on held-out clips,
    at fixed timesteps stratified over the schedule and fixed noise, the same set for every run of a sweep."""

    enabled: bool = True
    """Evaluate at all. Folder data has no held-out files: there eval_loss is null with a reason."""
    every: int = 0
    """Also evaluate every this many steps (after the step's update); 0 = only at the end of a stable run."""
    samples: int = 16
    """Held-out clips: synthetic indices [data.num_samples, data.num_samples + samples), never trained on.
    16 costs <5% of a default 50-step run and of a demo run; two held-out sets then agree within ~0.4% on a
    default run's weights, but only within ~8% on better-trained weights (docs/eval_loss.md)."""
    batch_size: int = 16
    """Clips per evaluation forward (the result is the mean over all `samples`, whatever this is)."""
    seed: int = 0
    """Seed of the eval noise and of which clips: seed s takes the clips after s * samples held-out ones."""


@dataclass
class LedgerConfig:
    """Where runs are recorded as Optuna trials (sweep/search/ledger.py)."""

    enabled: bool = True
    storage: Optional[str] = None
    """Optuna storage URL (sqlite:///, postgresql://, mysql://) or a journal file path ending in .log;
    null = sqlite:///<sweep dir>/ledger.db."""
    study_name: Optional[str] = None
    """null = the sweep directory's path."""
    trial_number: Optional[int] = None
    """Set by our Optuna sweeper: the trial this run finishes (null: the run adds a trial of its own)."""
    pruner: PrunerConfig = field(default_factory=PrunerConfig)
    """Set by our Optuna sweeper (hydra.sweeper.pruner): report the loss to the trial, stop when pruned."""
    lock_timeout_s: float = 30.0
    """How long recording a run waits for a ledger another process holds locked (a SQLite write transaction)
    before it logs a warning and leaves the trial to be recorded later (sweep/search/pending.py)."""


@dataclass
class TensorBoardConfig:
    """Event files per run (sweep/run/tensorboard_sink.py): `tensorboard --logdir <sweep dir>` shows them all."""

    enabled: bool = False
    dir: str = "tensorboard"
    """The event files' folder, inside the run directory."""


@dataclass
class MlflowConfig:
    """Each run an MLflow run, nested under one parent run per sweep (sweep/run/mlflow_sink.py)."""

    enabled: bool = False
    tracking_uri: Optional[str] = None
    """null = $MLFLOW_TRACKING_URI, else sqlite:///<sweep dir>/mlflow.db. A password goes in the environment
    (MLFLOW_TRACKING_PASSWORD, or tracking_uri='${oc.env:MY_URI}'), never on the command line."""
    experiment: Optional[str] = None
    """The MLflow experiment of the sweep; null = the sweep directory's path (as the ledger's study)."""
    timeout_s: int = 10
    """Per HTTP request to the tracking server; a server that does not answer costs this once per run."""
    retries: int = 1
    """HTTP retries per request (MLflow's own default of 7 with backoff waits minutes on a dead server)."""


@dataclass
class LoggerConfig:
    """Trackers that get every run's curves and verdict (conf/logger/, docs/loggers.md): logger=none (default),
    tensorboard, mlflow, or several as a list: 'logger=[tensorboard,mlflow]'."""

    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    flush_every: int = 50
    """Rows sent to the trackers (and appended to metrics.csv) in one batch ..."""
    flush_s: float = 10.0
    """... or after this many seconds, whichever comes first; the rest at the end of the run."""


@dataclass
class ScenarioExpect:
    """One expected outcome of a scenario: the runs whose params match `when` must end like this."""

    when: Dict[str, Any] = field(default_factory=dict)
    """Swept params to match, e.g. {precision: fp16_amp}; {} matches every run."""
    status: str = "stable"
    verdict: Optional[str] = None
    cause_where: Optional[str] = None
    cause_module: Optional[str] = None
    """A prefix of cause.module, e.g. blocks (any block) or blocks.1.attn."""
    same_step: bool = False
    """Every matching run diverges at the same first_bad_step (a data fault does not care about lr)."""
    max_attn_logit_above: Optional[float] = None
    """The run's largest attention logit exceeded this (logit growth)."""
    max_attn_logit_below: Optional[float] = None
    mechanism: Optional[str] = None
    """Why it diverged, as the run's result.json names it from its recorded signals (sweep/diagnose/mechanism.py)."""
    modulate_parity: Optional[str] = None
    """ok | mismatch: the kernel parity check (sweep.parity, batch 1-4, fp32/bf16/fp16) of the run's swept
    `modulate` impl. A wrong kernel can train without any verdict (OpenDiT's fused_buggy): parity catches it."""


@dataclass
class ScenarioConfig:
    """A known failure reproduced on a tiny model, and its fix (conf/scenario/*.yaml, sweep/scenario.py)."""

    name: Optional[str] = None
    case: str = ""
    """The real-world post-mortem this reproduces, in one sentence."""
    fix: str = ""
    """The documented fix, as the override that applies it."""
    pretrain_steps: int = 0
    """> 0: before the sweep, train the scenario's model this long and save it as <sweep dir>/pretrained
    (its checkpoint is <sweep dir>/pretrained/checkpoints/step_<pretrain_steps>), for runs that start from
    "pretrained" weights."""
    pretrain_overrides: Dict[str, Any] = field(default_factory=dict)
    """Dotted keys set for the pretraining run only, e.g. {data.batch_size: 16}: the earlier stage of
    training differed from the resumed one (more GPUs, a lower resolution)."""
    expect: List[ScenarioExpect] = field(default_factory=list)


@dataclass
class RunConfig:
    """Everything one run needs; the root of the composed config."""

    seed: int = 0
    replicates: int = 1
    """Multirun only: run every combination with this many seeds, seed .. seed + replicates - 1; the tables
    show their mean, spread and "k of n diverged" (sweep/search/replicates.py, sweep/report/noise.py)."""
    steps: int = 50
    device: str = "auto"
    """auto, cpu, cuda or cuda:N."""
    deterministic: bool = True
    """torch.use_deterministic_algorithms: the same config gives the same loss curve bit for bit."""
    threads: int = 0
    """torch intra-op threads; 0 keeps torch's default."""
    compile: bool = False
    """torch.compile (inductor) the model's forward, once per run before step 0; the compiled graph is profiled
    and the run records the kernels it really ran, or is skipped when that is not the requested one
    (sweep/run/compiled.py, docs/compile.md)."""
    graph: str = "auto"
    """auto, true or false: on CUDA, capture a window's step (monitor.sync_every > 1, synthetic data) as one CUDA
    graph and replay it; same kernels, same numbers. auto is eager until a GPU run has verified the capture
    (sweep/run/graph.py); true on a CPU device is a skipped run."""
    log_every: int = 10
    progress: Progress = Progress.auto
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    modulate: ModulateConfig = field(default_factory=ModulateConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ladder: LadderConfig = field(default_factory=LadderConfig)
    scenario: ScenarioConfig = field(default_factory=ScenarioConfig)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)

    @property
    def model_inputs(self) -> dict:
        """What a diffusers or custom model is built for: the data shape, patch size and kernel choices."""
        d = self.data
        return dict(
            channels=d.channels,
            frames=d.frames,
            height=d.height,
            width=d.width,
            patch_size=self.model.patch_size,
            attention=self.attention.backend.value,
            modulate=self.modulate.impl.value,
        )


def register_schemas() -> None:
    """Register the schema so `conf/config.yaml` can name it first in its defaults list."""
    node = OmegaConf.structured(RunConfig)
    # model.kwargs are the custom factory's own keys: Hydra's struct mode would refuse every new one
    # ('model.kwargs={depth:2}' would need a `+`), so that one node is open.
    OmegaConf.set_struct(node.model.kwargs, False)
    OmegaConf.set_struct(node.model.shrink, False)  # likewise the released class's keys
    ConfigStore.instance().store(name="run_schema", node=node)


register_schemas()


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _has_field(cls: type, dotted: str) -> bool:
    """Whether `dotted` (e.g. data.batch_size) names a field of the dataclass `cls`, node by node."""
    head, _, rest = dotted.partition(".")
    hints = typing.get_type_hints(cls)  # field types are strings here (postponed annotations)
    if head not in hints:
        return False
    return not rest or (is_dataclass(hints[head]) and _has_field(hints[head], rest))


MAX_THREADS = 1024
"""More than any machine this runs on has cores; torch.set_num_threads(100000) segfaults (rc 139).
A fixed bound, not os.cpu_count(): a Slurm sweep is validated on a smaller login node."""
MAX_SEED = 2**32 - 1
"""numpy's seed range, the narrowest of the seeds a run feeds (torch takes 64 bits); a seed of 10**26
also overflowed the ledger's SQLite integer and lost the run's trial."""


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


MAX_REPLICATES = 100


GRAPH_MODES = ("auto", "true", "false")


def validate(run: RunConfig) -> RunConfig:
    """Reject values no run can use; each message names the dotted key."""
    from models.registry import MODEL_SIZES, sized  # imports torch (models/), which composing a config never needs

    for key, value in nonfinite_floats(run):  # the first one: one line names one key
        raise ConfigError(f"{key}: must be a finite number, got {value}")
    _require(run.steps > 0, "steps", f"must be > 0, got {run.steps}")
    _require(run.log_every > 0, "log_every", f"must be > 0, got {run.log_every}")
    run.graph = str(run.graph).lower()  # graph=true arrives as the bool True, stored as "True"
    _require(run.graph in GRAPH_MODES, "graph", f"must be one of {', '.join(GRAPH_MODES)}, got {run.graph!r}")
    _require(0 <= run.threads <= MAX_THREADS, "threads", f"must be in [0, {MAX_THREADS}] (0 = auto), got {run.threads}")
    for key, seed in (("seed", run.seed), ("data.seed", run.data.seed)):
        _require(0 <= seed <= MAX_SEED, key, f"must be in [0, {MAX_SEED}] (2**32 - 1), got {seed}")
    _require(
        1 <= run.replicates <= MAX_REPLICATES,
        "replicates",
        f"must be in [1, {MAX_REPLICATES}], got {run.replicates}",
    )
    _require(
        run.seed + run.replicates - 1 <= MAX_SEED,
        "replicates",
        f"seeds {run.seed}..{run.seed + run.replicates - 1} go past {MAX_SEED} (2**32 - 1)",
    )
    _require(
        run.device == "auto" or run.device == "cpu" or run.device.startswith("cuda"),
        "device",
        f"must be auto, cpu, cuda or cuda:N, got {run.device!r}",
    )
    s = run.precision.scaler
    _require(s.init_scale > 0, "precision.scaler.init_scale", f"must be > 0, got {s.init_scale}")
    _require(
        0 < s.min_scale <= s.init_scale,
        "precision.scaler.min_scale",
        f"must be in (0, init_scale={s.init_scale}], got {s.min_scale}",
    )
    _require(s.growth_factor >= 1, "precision.scaler.growth_factor", f"must be >= 1, got {s.growth_factor}")
    _require(0 < s.backoff_factor < 1, "precision.scaler.backoff_factor", f"must be in (0, 1), got {s.backoff_factor}")
    _require(s.growth_interval > 0, "precision.scaler.growth_interval", f"must be > 0, got {s.growth_interval}")
    _require(s.hysteresis >= 1, "precision.scaler.hysteresis", f"must be >= 1, got {s.hysteresis}")
    _require(
        s.max_consecutive_skips >= 1,
        "precision.scaler.max_consecutive_skips",
        f"must be >= 1, got {s.max_consecutive_skips}",
    )
    _require(
        not (run.compile and run.precision.cpu_gemm is CpuGemm.emulated),
        "precision.cpu_gemm",
        "emulated is for eager runs; compile=true runs inductor's own kernels (use auto or native)",
    )
    for i, glob in enumerate(run.precision.fp32_modules):
        _require(
            isinstance(glob, str) and glob.strip() != "",
            f"precision.fp32_modules[{i}]",
            f"must be a module-name glob such as blocks.*.attn, got {glob!r}",
        )
    _require(
        not (run.compile and run.precision.fp32_modules),
        "precision.fp32_modules",
        "wraps modules in eager hooks; compile=true runs are not supported with it",
    )
    lad = run.ladder
    _require(lad.target is None or lad.target > 0, "ladder.target", f"must be > 0, got {lad.target}")
    _require(lad.target is None or math.isfinite(lad.target), "ladder.target", f"must be finite, got {lad.target}")
    _require(0 < lad.confidence < 1, "ladder.confidence", f"must be in (0, 1), got {lad.confidence}")
    m = run.model
    _require(m.size in MODEL_SIZES, "model.size", f"unknown size {m.size!r}; choose one of {', '.join(MODEL_SIZES)}")
    if m.arch in (Arch.dit, Arch.video_dit):
        for key, dims in (("width", {"width": m.width}), ("depth", {"depth": m.depth})):
            try:
                sized(m.size, **dims)
            except ValueError as e:
                raise ConfigError(f"model.{key}: {e}") from None
        _require(
            m.depth is None or m.arch is Arch.dit or m.depth % 2 == 0,
            "model.depth",
            f"video_dit spends its blocks as (spatial, temporal) pairs: must be even, got {m.depth}",
        )
    else:
        for key in ("width", "depth"):
            _require(
                getattr(m, key) is None,
                f"model.{key}",
                f"sizes the native models only (dit, video_dit), not model.arch={m.arch.value}",
            )
    _require(m.base_width is None or m.base_width > 0, "model.base_width", f"must be > 0, got {m.base_width}")
    if m.param is Param.mup:
        _require(
            m.arch in (Arch.dit, Arch.video_dit),
            "model.param",
            f"mup scales a model by its width: the native models only (dit, video_dit), not model.arch={m.arch.value}",
        )
        _require(m.base_width is not None, "model.base_width", "model.param=mup needs a base width, e.g. 32")
        width = sized(m.size, m.width)["hidden_size"]
        _require(
            m.base_width <= width,
            "model.base_width",
            f"must be <= the width ({width}), got {m.base_width}",
        )
    _require(m.patch_size > 0, "model.patch_size", f"must be > 0, got {m.patch_size}")
    _require(m.qk_gain > 0, "model.qk_gain", f"must be > 0, got {m.qk_gain}")
    d = run.data
    synthetic = d.source is DataSource.synthetic
    for key in ("num_samples",) * synthetic + ("frames", "channels", "height", "width", "batch_size"):
        _require(getattr(d, key) > 0, f"data.{key}", f"must be > 0, got {getattr(d, key)}")
    _require(
        d.height % m.patch_size == 0 and d.width % m.patch_size == 0,
        "model.patch_size",
        f"{m.patch_size} must divide data.height={d.height} and data.width={d.width}",
    )
    if m.arch == Arch.dit:
        _require(
            d.frames == 1,
            "data.frames",
            f"model.arch=dit trains on images: use data=synthetic_image (frames=1), got {d.frames}",
        )
    _validate_diffusers(run)
    _validate_diffusers_config(run)
    _validate_custom(run)
    for i, f in enumerate(d.faults):
        _require(
            0 <= f.index < d.num_samples,
            f"data.faults[{i}].index",
            f"must be in [0, data.num_samples={d.num_samples}), got {f.index}",
        )
        _require(
            f.kind in FaultKind.__members__,
            f"data.faults[{i}].kind",
            f"must be one of {', '.join(FaultKind.__members__)}, got {f.kind!r}",
        )
    _require(d.range_limit > 0, "data.range_limit", f"must be > 0, got {d.range_limit}")
    _require(
        all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in d.skip_samples),
        "data.skip_samples",
        f"must be dataset indices >= 0, got {d.skip_samples}",
    )
    _require(
        d.source is not DataSource.synthetic or all(i < d.num_samples for i in d.skip_samples),
        "data.skip_samples",
        f"indices must be < data.num_samples={d.num_samples}, got {d.skip_samples}",
    )
    _require(
        not d.skip_samples or run.monitor.sync_every == 1,
        "data.skip_samples",
        "changes the batch size of the steps that draw them; windows (monitor.sync_every > 1) need one batch size",
    )
    if d.source is not DataSource.synthetic:
        _require(bool(d.path), "data.path", f"data={d.source.value} reads a folder: set data.path=DIR")
        _require(Path(d.path).is_dir(), "data.path", f"no such directory: {d.path}")
        _require(not d.faults, "data.faults", "fault injection is for synthetic data; a folder's bad files are real")
    o = run.optim
    _require(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}")
    _require(
        len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
        "optim.betas",
        f"must be two numbers in [0, 1), got {list(o.betas)}",
    )
    _require(o.eps >= 0, "optim.eps", f"must be >= 0, got {o.eps}")
    _require(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
    _require(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    _require(o.grad_clip >= 0, "optim.grad_clip", f"must be >= 0 (0 = off), got {o.grad_clip}")
    _require(o.update_clip >= 0, "optim.update_clip", f"must be >= 0 (0 = off), got {o.update_clip}")
    _require(o.lora_lr is None or o.lora_lr > 0, "optim.lora_lr", f"must be > 0 (or null = optim.lr), got {o.lora_lr}")
    f = run.finetune
    _require(f.rank > 0, "finetune.rank", f"must be > 0, got {f.rank}")
    _require(f.alpha > 0, "finetune.alpha", f"must be > 0, got {f.alpha}")
    _require(0 <= f.dropout < 1, "finetune.dropout", f"must be in [0, 1), got {f.dropout}")
    _require(f.method is FinetuneMethod.lora or o.lora_lr is None, "optim.lora_lr", "only applies with finetune=lora")
    j = run.objective
    _require(j.num_train_timesteps > 1, "objective.num_train_timesteps", f"must be > 1, got {j.num_train_timesteps}")
    _require(j.loss_weight > 0, "objective.loss_weight", f"must be > 0, got {j.loss_weight}")
    mo = run.monitor
    _require(mo.spike_factor > 1, "monitor.spike_factor", f"must be > 1, got {mo.spike_factor}")
    _require(0 <= mo.ema_beta < 1, "monitor.ema_beta", f"must be in [0, 1), got {mo.ema_beta}")
    _require(mo.stall_window > 0, "monitor.stall_window", f"must be > 0, got {mo.stall_window}")
    _require(mo.logit_every > 0, "monitor.logit_every", f"must be > 0, got {mo.logit_every}")
    _require(mo.sync_every > 0, "monitor.sync_every", f"must be > 0, got {mo.sync_every}")
    _require(
        math.isfinite(mo.diagnose_budget) and mo.diagnose_budget >= 0,
        "monitor.diagnose_budget",
        f"must be a finite number >= 0, got {mo.diagnose_budget}",
    )
    _require(0 < mo.stall_fraction <= 1, "monitor.stall_fraction", f"must be in (0, 1], got {mo.stall_fraction}")
    for key in flatten(run.scenario.pretrain_overrides):  # {data.batch_size: 16} or {data: {batch_size: 16}}
        _require(_has_field(RunConfig, key), "scenario.pretrain_overrides", f"no config key {key!r}")
    c = run.checkpoint
    _require(c.every >= 0, "checkpoint.every", f"must be >= 0 (0 = never), got {c.every}")
    _require(c.keep >= 0, "checkpoint.keep", f"must be >= 0 (0 = keep all), got {c.keep}")
    _require(
        c.inject in (None, "bitflip", "nan"), "checkpoint.inject", f"must be null, bitflip or nan, got {c.inject!r}"
    )
    _require(
        c.inject is None or c.resume_from or m.init_from,
        "checkpoint.inject",
        "corrupts the file being loaded: set checkpoint.resume_from or model.init_from too",
    )
    e = run.eval
    _require(e.every >= 0, "eval.every", f"must be >= 0 (0 = only at the end), got {e.every}")
    _require(e.samples > 0, "eval.samples", f"must be > 0, got {e.samples}")
    _require(e.batch_size > 0, "eval.batch_size", f"must be > 0, got {e.batch_size}")
    _require(0 <= e.seed <= MAX_SEED, "eval.seed", f"must be in [0, {MAX_SEED}] (2**32 - 1), got {e.seed}")
    st = run.ledger.storage
    _require(
        st is None or "://" in st or st.endswith((".log", ".jsonl", ".journal")),
        "ledger.storage",
        f"must be a database URL (sqlite:///..., postgresql://...) or a journal file ending in .log, got {st!r}",
    )
    validate_pruner(run.ledger.pruner, "ledger.pruner")
    lg = run.logger
    _require(lg.flush_every > 0, "logger.flush_every", f"must be > 0, got {lg.flush_every}")
    _require(lg.flush_s >= 0, "logger.flush_s", f"must be >= 0, got {lg.flush_s}")
    _require(lg.mlflow.timeout_s > 0, "logger.mlflow.timeout_s", f"must be > 0, got {lg.mlflow.timeout_s}")
    _require(lg.mlflow.retries >= 0, "logger.mlflow.retries", f"must be >= 0, got {lg.mlflow.retries}")
    _require(bool(lg.tensorboard.dir), "logger.tensorboard.dir", "must name a folder inside the run directory")
    for name, package in (("tensorboard", "tensorboard"), ("mlflow", "mlflow")):
        _require(
            not getattr(lg, name).enabled or importlib.util.find_spec(package) is not None,
            "logger",
            f"{name} is not installed: pip install -e '.[tracking]' (docs/loggers.md)",
        )
    lt = run.ledger.lock_timeout_s
    _require(lt > 0, "ledger.lock_timeout_s", f"must be > 0, got {lt}")
    from sweep.run.sizes import SizeError, check_sizes  # last: it assumes the sizes above are positive

    try:
        check_sizes(run)
    except SizeError as e:
        raise ConfigError(f"{e.key}: {e}") from None
    return run


WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
"""The weights files model.init_from takes besides a checkpoint directory (sweep/run/checkpoint.py)."""


def check_inputs(run: RunConfig) -> RunConfig:
    """Files a run will load must be there: checked just before the runs start, not in validate().

    The grid sweeper calls this for every cell before the first run, and sweep.job for each run, so a
    missing or wrong-kind path is one line and exit status 2, not a run error found at load time. It
    is not part of validate() because a config names files that do not exist yet when it is composed:
    a scenario's `${hydra:sweep.dir}/pretrained/...` checkpoint is written by its pretraining, after
    composition and before the sweep (sweep/scenario.py). What is inside the files is the checkpoint
    verifier's business (a bad one is verdict `corrupt_checkpoint`).
    """
    init = run.model.init_from
    if init is not None:
        path = Path(init)
        _require(path.exists(), "model.init_from", f"no such file or directory: {init}")
        _require(
            path.is_dir() or path.suffix in WEIGHT_SUFFIXES,
            "model.init_from",
            f"{init} is not a checkpoint directory or a {'/'.join(WEIGHT_SUFFIXES)} weights file",
        )
    resume = run.checkpoint.resume_from
    if resume is not None:
        _require(Path(resume).is_dir(), "checkpoint.resume_from", f"no such checkpoint directory: {resume}")
        differ = resume_mismatches(run, Path(resume))
        _require(
            not differ,
            "checkpoint.resume_from",
            f"{resume} was saved by a run with other shapes or dtypes: "
            + ", ".join(f"{k}={saved} there, {now} here" for k, saved, now in differ),
        )
    if run.model.arch is Arch.custom:
        _probe_custom(run)
    if run.model.arch is Arch.diffusers_config:
        _probe_diffusers_config(run)
    if run.precision.fp32_modules:
        _probe_fp32_modules(run)
    return run


REMOTE_LAUNCHERS = ("slurm", "ray")
"""Launchers whose jobs run on other machines (hydra.launcher._target_ holds one of these): the sweep's own
process (a login node) cannot tell whether the device a run asks for is there, so only the job checks it."""


def launches_here(config: Any) -> bool:
    """Whether the Hydra config's launcher runs jobs on this machine (basic, joblib, submitit_local, packed)."""
    target = str(OmegaConf.select(config, "hydra.launcher._target_", default="") or "").lower()
    return not any(name in target for name in REMOTE_LAUNCHERS) or "local" in target


def check_device(run: RunConfig) -> RunConfig:
    """device=cuda (or cuda:N) where torch sees no such device is one line and exit 2 before any run (before,
    each run ended `error` with a traceback). Call it where the run will run: in the job, and in the sweep's
    process when its launcher runs the jobs there (launches_here)."""
    check_device_name(run.device)
    return run


def check_device_name(device: str) -> None:
    """check_device for a device name (raises ConfigError)."""
    if not str(device).startswith("cuda"):
        return
    import torch

    built = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", built without CUDA")
    _require(
        torch.cuda.is_available(),
        "device",
        f"{device} asked for, but torch sees no CUDA device on this machine ({built}); use device=auto or cpu",
    )
    try:
        index = torch.device(device).index
    except RuntimeError:
        raise ConfigError(f"device: must be auto, cpu, cuda or cuda:N, got {device!r}") from None
    count = torch.cuda.device_count()
    _require(
        index is None or index < count,
        "device",
        f"{device} asked for, but torch sees {count} CUDA device(s) here (cuda:0..cuda:{count - 1})",
    )


RESUME_KEYS = (
    "model.arch",
    "model.size",
    "model.name",
    "model.width",
    "model.depth",
    "model.patch_size",
    "model.qk_norm",
    "model.config",
    "model.target",
    "model.kwargs",
    "model.shrink",
    "data.channels",
    "data.frames",
    "data.height",
    "data.width",
    "precision.param_dtype",
    "precision.fp32_modules",
    "finetune.method",
    "finetune.rank",
    "finetune.target_modules",
)
"""What the saved weights and optimizer state depend on: a checkpoint is resumed only into the same."""


def resume_mismatches(run: RunConfig, checkpoint: Path) -> list[tuple[str, Any, Any]]:
    """(key, saved, now) for each RESUME_KEYS value that differs from the run that saved `checkpoint`
    (`<run dir>/checkpoints/step_N`: its run's .hydra/config.yaml). Empty when that config is not there
    (a checkpoint copied elsewhere: the load itself then says what does not fit)."""
    saved_path = checkpoint.parent.parent / ".hydra" / "config.yaml"
    try:
        saved = OmegaConf.load(saved_path)
    except Exception:  # noqa: BLE001  (missing or unreadable: nothing to compare with)
        return []
    now = OmegaConf.structured(run)
    differ = []
    for key in RESUME_KEYS:
        was = OmegaConf.select(saved, key, default=None, throw_on_missing=False)
        is_ = OmegaConf.select(now, key, default=None, throw_on_missing=False)
        was, is_ = (OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for v in (was, is_))
        was, is_ = (v.value if isinstance(v, Enum) else v for v in (was, is_))
        if (was or None) != (is_ or None) and not (was in (None, {}, []) and is_ in (None, {}, [])):
            differ.append((key, _plain(was), _plain(is_)))
    return differ


def _plain(value: Any) -> str:
    return "null" if value is None else str(value)


_PROBED: dict[str, None] = {}
"""Custom-model factory calls already probed in this process (key: target, kwargs and config inputs)."""


def _probe_once(key: str, probe: Callable[[], None]) -> None:
    """Run `probe` (it raises ConfigError for a model that cannot be built) once per distinct key in this process."""
    if key not in _PROBED:
        probe()
        _PROBED[key] = None


def _probe_custom(run: RunConfig) -> None:
    """Build the custom model once (per distinct call): a factory that raises or returns no nn.Module, a model
    over the 1,000M-parameter limit (counted on the meta device first), or a forward that does not return a
    tensor of x's shape is one line and exit 2 before any run, not a crash in the middle of a sweep. Costs one
    model construction and one forward on a batch of 2."""
    from models.custom import CustomModelError, CustomModelTooBig, probe_factory
    from sweep.run.sizes import PARAMS_LIMIT

    m, inputs = run.model, run.model_inputs

    def probe() -> None:
        try:
            probe_factory(m.target, m.kwargs, inputs, params_limit=PARAMS_LIMIT)
        except CustomModelTooBig as e:
            raise ConfigError(f"model.kwargs: {e}") from None
        except CustomModelError as e:
            raise ConfigError(f"model.target: {e}") from None

    _probe_once(repr((m.target, sorted(m.kwargs.items()), sorted(inputs.items()))), probe)


def _probe_diffusers_config(run: RunConfig) -> None:
    """Count the released model's parameters (meta device) against the budget, then build it and run one
    forward at the data's shape (per distinct file, shrink and data shape): over budget, or a shrink the class
    cannot run, is one line and exit 2 before any run."""
    from models.diffusers_config import DiffusersConfigError, probe

    m, inputs = run.model, run.model_inputs

    def check() -> None:
        try:
            probe(m.config, m.shrink, inputs)
        except DiffusersConfigError as e:
            raise ConfigError(f"{e.key}: {e}") from None

    _probe_once(repr(("diffusers_config", m.config, sorted(m.shrink.items()), sorted(inputs.items()))), check)


def _probe_fp32_modules(run: RunConfig) -> None:
    """Build the model on the meta device (no storage, no init cost) once per distinct model and glob list:
    a `precision.fp32_modules` glob that matches no module is one line and exit 2 before any run, not a run
    that silently computes everything in low precision."""
    from sweep.run.fp32_modules import example_names, unmatched
    from sweep.run.model import build_run_model

    globs = list(run.precision.fp32_modules)

    def probe() -> None:
        import torch

        try:
            with torch.device("meta"):
                names = [n for n, _ in build_run_model(run).named_modules()]
        except Exception:  # noqa: BLE001  (a builder that needs real storage: build it for real, once)
            names = [n for n, _ in build_run_model(run).named_modules()]
        for glob in unmatched(names, globs):
            raise ConfigError(
                f"precision.fp32_modules: {glob!r} matches no module of {model_label(run)} "
                f"(modules look like: {', '.join(example_names(names))}, ...)"
            )

    m = run.model
    key = (m.arch.value, m.size, m.name, m.width, m.depth, m.patch_size, m.qk_norm, m.config, m.target)
    shape = (sorted(m.shrink.items()), sorted(m.kwargs.items()), sorted(run.model_inputs.items()))
    _probe_once(repr(("fp32_modules", key, shape, globs)), probe)


def model_label(run: RunConfig) -> str:
    """The model in words: video_dit_tiny, diffusers pixart, a config file or a factory."""
    m = run.model
    if m.arch in (Arch.dit, Arch.video_dit):
        return f"{m.arch.value}_{m.size}"
    return f"model.arch={m.arch.value} ({m.name or m.config or m.target})"


ROOM_INSIDE = 64
"""Bytes kept free under PATH_MAX for what a run writes inside its directory
(checkpoints/step_000010.tmp/optimizer.safetensors)."""


def check_output_dir(path: str, key: str) -> None:
    """A run or sweep directory the file system can create: Hydra makes it before any of our code runs,
    so a 300-character name would end in `OSError: File name too long` (a traceback, or a run error)."""
    name_max, path_max = _path_limits(path)
    for part in Path(path).parts:
        size = len(os.fsencode(part))
        _require(
            size <= name_max,
            key,
            f"a path component of {size} bytes is longer than the file system's limit of {name_max}: {part[:24]}...",
        )
    size = len(os.fsencode(os.path.abspath(path)))
    _require(
        size + ROOM_INSIDE <= path_max,
        key,
        f"the path is {size} bytes; the file system allows {path_max} with the files a run writes inside",
    )


def _path_limits(path: str) -> tuple[int, int]:
    """(NAME_MAX, PATH_MAX) of the file system the path would be created on (its nearest existing parent)."""
    probe = Path(os.path.abspath(path))
    while not os.path.exists(probe) and probe != probe.parent:  # os.path: False, not a raise, on a too-long name
        probe = probe.parent
    try:
        return os.pathconf(probe, "PC_NAME_MAX"), os.pathconf(probe, "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):  # no pathconf (Windows) or no answer: the common limits
        return 255, 4096


def validate_pruner(p: PrunerConfig, key: str) -> PrunerConfig:
    """Reject pruner settings Optuna would refuse mid-run; `key` is where they came from (ledger.pruner,
    hydra.sweeper.pruner)."""
    _require(
        p.name in PRUNERS,
        f"{key}.name",
        f"must be one of {', '.join(PRUNERS)}, got {getattr(p.name, 'value', p.name)!r}",
    )
    p = dataclasses.replace(p, name=PrunerName(p.name))
    _require(p.report_every > 0, f"{key}.report_every", f"must be > 0, got {p.report_every}")
    for field_name in ("n_startup_trials", "n_warmup_steps", "min_early_stopping_rate"):
        _require(getattr(p, field_name) >= 0, f"{key}.{field_name}", f"must be >= 0, got {getattr(p, field_name)}")
    _require(p.n_min_trials >= 1, f"{key}.n_min_trials", f"must be >= 1, got {p.n_min_trials}")
    _require(0 < p.percentile < 100, f"{key}.percentile", f"must be in (0, 100), got {p.percentile}")
    if p.name == "threshold":
        _require(
            p.lower is not None or p.upper is not None, f"{key}.upper", "the threshold pruner needs upper or lower"
        )
    _require(
        p.lower is None or p.upper is None or p.lower < p.upper,
        f"{key}.lower",
        f"must be < upper={p.upper}, got {p.lower}",
    )
    _require(
        p.min_resource is None or p.min_resource >= 1,
        f"{key}.min_resource",
        f"must be >= 1 or null, got {p.min_resource}",
    )
    _require(
        p.max_resource is None or p.max_resource >= 1,
        f"{key}.max_resource",
        f"must be >= 1 or null, got {p.max_resource}",
    )
    _require(
        p.reduction_factor is None or p.reduction_factor >= 2,
        f"{key}.reduction_factor",
        f"must be >= 2 or null, got {p.reduction_factor}",
    )
    return p


def _validate_diffusers(run: RunConfig) -> None:
    """model.name and the data shape a tiny diffusers transformer needs (models/diffusers_zoo.py)."""
    m, d = run.model, run.data
    if m.arch != Arch.diffusers:
        _require(
            m.name is None, "model.name", f"names a diffusers model: only with model.arch=diffusers, got {m.name!r}"
        )
        return
    from models.diffusers_zoo import ZOO

    _require(m.name in ZOO, "model.name", f"unknown diffusers model {m.name!r}; choose one of {', '.join(ZOO)}")
    _require(
        m.size == "tiny",
        "model.size",
        f"diffusers models have one size, tiny (models/diffusers_zoo.py), got {m.size!r}",
    )
    _require(
        not m.qk_norm,
        "model.qk_norm",
        "diffusers models keep their own query/key norm (models/diffusers_zoo.py): must be false",
    )
    _require(m.qk_gain == 1.0, "model.qk_gain", f"is implemented for the native models only, got {m.qk_gain}")
    if m.is_image:
        _require(
            d.frames == 1,
            "data.frames",
            f"model.name={m.name} trains on images: use data=synthetic_image (frames=1), got {d.frames}",
        )
    else:
        _require(
            d.frames > 1,
            "data.frames",
            f"model.name={m.name} is a video model: use data=synthetic_video (frames > 1), got {d.frames}",
        )


def _validate_diffusers_config(run: RunConfig) -> None:
    """model.config and model.shrink of a released diffusers config (models/diffusers_config.py): the file, its
    class and the shrink keys are checked here; the size budget and a forward in check_inputs."""
    m, d = run.model, run.data
    if m.arch is not Arch.diffusers_config:
        _require(
            m.config is None,
            "model.config",
            f"names a released diffusers config: only with model=diffusers_config, got {m.config!r}",
        )
        _require(
            not m.shrink, "model.shrink", f"shrinks a released config: only with model=diffusers_config, got {m.shrink}"
        )
        return
    from models.diffusers_config import DiffusersConfigError, resolve

    try:
        released = resolve(m.config, m.shrink, **{k: v for k, v in run.model_inputs.items() if k in _SHAPE_KEYS})
    except DiffusersConfigError as e:
        raise ConfigError(f"{e.key}: {e}") from None
    _require(m.size == "tiny", "model.size", f"a released config's size is set by model.shrink, got {m.size!r}")
    for key, default in _CUSTOM_UNUSED.items():
        value = getattr(m, key)
        _require(
            value == default,
            f"model.{key}",
            f"is implemented for the native models only; a diffusers model keeps its own (model.shrink), got {value}",
        )
    image = released.spec.is_image
    use = "an image model: use data=synthetic_image (frames=1)" if image else "a video model: use data=synthetic_video"
    _require(
        (d.frames == 1) == image,
        "data.frames",
        f"{released.cls_name} ({m.config}) is {use}{'' if image else ' (frames > 1)'}, got {d.frames}",
    )


_SHAPE_KEYS = ("channels", "frames", "height", "width", "patch_size")
_CUSTOM_UNUSED = {"qk_norm": False, "qk_gain": 1.0}


def _validate_custom(run: RunConfig) -> None:
    """model.target, model.kwargs and the keys a custom model does not use (models/custom.py, docs/models.md)."""
    m, d = run.model, run.data
    if m.arch is not Arch.custom:
        _require(
            m.target is None, "model.target", f"names a custom model factory: only with model=custom, got {m.target!r}"
        )
        _require(
            not m.kwargs,
            "model.kwargs",
            f"are a custom model's factory arguments: only with model=custom, got {m.kwargs}",
        )
        return
    from models.custom import FACTORY_INPUTS, CustomModelError, factory_is_image, load_factory

    _require(bool(m.target), "model.target", "model=custom needs the factory: model.target=pkg.module:factory")
    try:
        image = factory_is_image(load_factory(m.target))
    except CustomModelError as e:
        raise ConfigError(f"model.target: {e}") from None
    _require(
        m.size == "tiny",
        "model.size",
        f"a custom model's size is its factory's business (model.kwargs), got {m.size!r}",
    )
    for key, default in _CUSTOM_UNUSED.items():
        value = getattr(m, key)
        _require(
            value == default,
            f"model.{key}",
            f"is implemented for the native models only; a custom model does this itself (model.kwargs), got {value}",
        )
    for key in m.kwargs:
        _require(
            key not in FACTORY_INPUTS,
            f"model.kwargs.{key}",
            "comes from the config (data.channels/frames/height/width, model.patch_size, attention, modulate) "
            "when the factory's signature names it: set that instead",
        )
    if image:
        _require(
            d.frames == 1,
            "data.frames",
            f"{m.target} is an image model (is_image=True): use data=synthetic_image (frames=1), got {d.frames}",
        )
    else:
        _require(
            d.frames > 1,
            "data.frames",
            f"{m.target} is a video model (no is_image=True): use data=synthetic_video (frames > 1), got {d.frames}",
        )
    f = run.finetune
    _require(
        f.method is not FinetuneMethod.lora or bool(f.target_modules),
        "finetune.target_modules",
        "model=custom has no known attention projection names: give them, e.g. finetune.target_modules=[qkv,proj]",
    )


def enum_choices(dotted_key: str) -> Optional[list]:
    """The allowed values of an enum-typed config key (e.g. optim.schedule), else None."""
    import typing

    node: Any = RunConfig
    for part in dotted_key.split("."):
        hints = typing.get_type_hints(node) if isinstance(node, type) else {}
        if part not in hints:
            return None
        node = hints[part]
        args = [a for a in typing.get_args(node) if a is not type(None)]
        node = args[0] if args else node  # Optional[X] -> X
    return [m.value for m in node] if isinstance(node, type) and issubclass(node, Enum) else None


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
            _require(
                isinstance(value, type(default)),
                key,
                f"is a section of the config ({key}.{dataclasses.fields(default)[0].name}, ...),"
                f" not a value: got {value!r}",
            )
            check_nodes(value, key + ".")


def flatten(obj: Any, prefix: str = "") -> dict:
    """Nested dict -> {dotted.key: value}, for params and reports."""
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}
