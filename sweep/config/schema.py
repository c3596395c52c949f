"""The typed schema Hydra composes a run's config into: one dataclass per config section, and RunConfig.

Every axis of a sweep is a config group under `conf/` (precision, attention, modulate, model, data,
optim, objective, monitor). Each group's YAML merges into the dataclass registered here
(`register_schemas`, run at import), so a typo'd key or a wrong type fails while Hydra composes
(OmegaConf checks keys and types against the schema). A field's docstring says what it does.
Also here: ConfigError, the one error every config check raises (`require`), and `enum_choices`.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from sweep.config.around import (
    ConfirmConfig,
    LedgerConfig,
    LoggerConfig,
    ReportConfig,
    ScenarioConfig,
)
from sweep.config.enums import (
    Arch,
    AttentionBackend,
    BaseDtype,
    BetaSchedule,
    CpuGemm,
    DataSource,
    DiagnoseMode,
    Dtype,
    FinetuneMethod,
    Fp8Recipe,
    LadderAxis,
    ModulateImpl,
    ObjectiveKind,
    OptimName,
    Param,
    Prediction,
    Progress,
    Resize,
    Schedule,
)


class ConfigError(ValueError):
    """A user mistake in the config: printed as one line, never as a traceback."""


def require(ok: bool, key: str, message: str) -> None:
    """Raise ConfigError("key: message") unless `ok`: every check's one-line failure."""
    if not ok:
        raise ConfigError(f"{key}: {message}")


HIGH_PRECISION_GLOBS = (
    "*t_embedder*",
    "*time_embed*",
    "*timestep*",
    "*adaLN*",
    "*norm*",
    "*final_layer*",
    "*proj_out*",  # a leading * also for the top-level names: a diffusers model's are under `transformer.`
)
"""Modules production fp8 recipes keep in high precision (finetrainers' layerwise upcasting, torchao's and TE's
DiT recipes): the timestep embedder, the adaLN / modulation linears, norms and the final projection, in the
native models' names (t_embedder, blocks.*.adaLN_modulation, final_layer) and diffusers' (time_embedding,
norm1.linear, norm_out, proj_out). The default of finetune.base_keep and of conf/precision/fp8_*.yaml's fp8_keep."""


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
    fp8: Optional[Fp8Recipe] = None
    """fp8 matmuls through torchao's float8 training (sweep/run/fp8.py), on top of autocast_dtype: every nn.Linear
    both of whose dims are multiples of 16, outside fp8_keep and fp32_modules, computes its three GEMMs in fp8.
    Emulated on a CPU, real kernels on CUDA capability >= 8.9, `skipped` elsewhere. null: no fp8."""
    fp8_keep: List[str] = field(default_factory=list)
    """fnmatch globs over module names kept in high precision under fp8 (conf/precision/fp8_*.yaml: the
    timestep embedder, adaLN / modulation linears, norms, the final layer, as production recipes keep them).
    A glob may match nothing (one list serves every model family); result.json records what each layer did."""


@dataclass
class AttentionConfig:
    backend: AttentionBackend = AttentionBackend.math
    """flash/math/efficient/cudnn force that SDPA backend (no silent fallback); eager is softmax(QK^T) in the
    working dtype."""


@dataclass
class ModulateConfig:
    impl: ModulateImpl = ModulateImpl.eager
    """eager: x * (1 + scale) + shift; fused: one fused kernel (custom op); fused_buggy: OpenDiT's Triton
    modulate as written (wrong shift/scale row per token, a backward to each sample's own row), for that case."""


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


@dataclass
class DataConfig:
    name: str = "synthetic_video"
    source: DataSource = DataSource.synthetic
    """synthetic clips made from a seed, or every video / latent / image file under data.path (sweep/data/folder.py)."""
    path: Optional[str] = None
    """The folder for video_folder / latent_folder / image_folder."""
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
    """Dataset indices (folder data: of its training files, in path order) left out of every batch that draws
    them; the order of the others is unchanged, so only those steps' batches change (smaller by the skipped
    samples). `python -m sweep.diagnose` proposes it for samples that broke a run."""
    eval_files: float = 0.1
    """Folder data: the files held out of training for the eval loss (sweep/data/split.py): a fraction in (0, 1)
    (at least one file), a count (a whole number >= 1), or 0 for none; chosen by a hash of each file's path
    relative to data.path, so adding files does not reshuffle them; at least one file always trains. The
    default, 0.1, holds out ~10% of a folder and keeps ~90% training (docs/eval_loss.md). Ignored by
    synthetic data, which holds out the clips after data.num_samples."""
    resize: Resize = Resize.crop
    """image_folder: how an image becomes height x width: crop (scale it to cover the size, aspect ratio kept, and
    cut out the centre) or resize (scale it to the size: the aspect ratio changes); bicubic either way."""


@dataclass
class OptimConfig:
    lr: float = 1e-4
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    """Two for AdamW, AdamW8bit and Prodigy; three for CAME; adafactor reads none (beta2_decay instead)."""
    eps: Optional[float] = 1e-8
    """AdamW's, AdamW8bit's and Prodigy's eps; null for adafactor and came, whose eps pairs keep their libraries'
    defaults."""
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
    name: OptimName = OptimName.adamw
    """Which optimizer (conf/optim/<name>.yaml, sweep/run/optimizers.py). adamw is ours (bit for bit torch's
    single-tensor AdamW, graph-ready); the others are their libraries' own and run eagerly (one sync per step,
    no windows or CUDA graphs), unpacked. For prodigy, lr multiplies its own step size (1.0 is the default);
    for adafactor it caps the relative step size."""
    min_8bit_size: int = 4096
    """adamw_8bit: tensors with fewer values keep 32-bit state (bitsandbytes' default 4096)."""
    beta2_decay: float = -0.8
    """adafactor: the second moment's decay exponent (torch's default)."""
    d0: float = 1e-6
    """prodigy: the initial step-size estimate."""
    d_coef: float = 1.0
    """prodigy: multiplies the estimated step size d."""
    safeguard_warmup: bool = False
    """prodigy: leave the lr out of the denominator of the d estimate during warmup (recommended with warmup)."""
    use_bias_correction: bool = False
    """prodigy: Adam's bias correction (recommended for diffusion by prodigy's README)."""


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
    base_dtype: Optional[BaseDtype] = None
    """How the frozen base's linear weights are stored (sweep/run/fp8_storage.py): bf16, or fp8 (e4m3 or e5m2)
    with one scale per tensor, or e4m3 with one per 128-wide block of a row (fp8_e4m3_block, musubi-tuner's
    fp8_scaled); upcast to the compute dtype in each layer's forward. null: the precision's param dtype."""
    base_keep: List[str] = field(default_factory=lambda: list(HIGH_PRECISION_GLOBS))
    """fnmatch globs over module names whose frozen weights keep the param dtype under base_dtype (the timestep
    embedder, adaLN / modulation linears, norms, the final layer, as finetrainers' layerwise upcasting keeps them).
    A glob may match nothing; result.json records which layers were stored how."""


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
    trend: bool = True
    """At the end of a run that reached its last step with no verdict, judge its whole curve (sweep/run/trend.py,
    docs/verdicts.md): slow_divergence or no_progress; result.json `trend` holds the numbers either way."""
    trend_samples: int = 60
    """Training samples per median of the smoothed curve: ceil(this / data.batch_size) steps, or a tenth of the run
    when that is more (at least 3); a run needs 2 of them to be judged."""
    trend_end_factor: float = 3.0
    """slow_divergence: the smoothed final loss at this multiple of the smoothed minimum or above."""
    trend_rise: float = 2.0
    """slow_divergence: after the minimum, the fitted line through log(loss) rises this many x or more ..."""
    trend_rise_t: float = 4.0
    """... with a t statistic of at least this (both, for a steady rise that has not yet reached trend_end_factor)."""
    trend_progress: float = 0.6
    """no_progress: the smoothed final loss at this fraction of the initial loss or above ..."""
    trend_weight_path: float = 1.0
    """... while the weights travelled at least this many times their initial norm (a low lr moves them far less)."""


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
    """Evaluate at all. Off, folder data still holds its data.eval_files out of training (the split does not
    depend on it, so the training curve is the same either way)."""
    every: int = 0
    """Also evaluate every this many steps (after the step's update); 0 = only at the end of a stable run."""
    samples: int = 16
    """Held-out clips: synthetic indices [data.num_samples, data.num_samples + samples), never trained on;
    folder data: this many (file, timestep) pairs over its held-out files, or one per file when there are more.
    16 costs <5% of a default 50-step run and of a demo run; two held-out sets then agree within ~0.4% on a
    default run's weights, but only within ~8% on better-trained weights (docs/eval_loss.md)."""
    batch_size: int = 16
    """Clips per evaluation forward (the result is the mean over all `samples`, whatever this is)."""
    seed: int = 0
    """Seed of the eval noise and (synthetic data) of which clips: seed s takes the clips after s * samples
    held-out ones. Folder data's held-out files are data.eval_files', whatever the seed."""


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
    confirm: ConfirmConfig = field(default_factory=ConfirmConfig)
    report: ReportConfig = field(default_factory=ReportConfig)

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


def enum_choices(dotted_key: str) -> Optional[list]:
    """The allowed values of an enum-typed config key (e.g. optim.schedule), else None."""
    node: Any = RunConfig
    for part in dotted_key.split("."):
        hints = typing.get_type_hints(node) if isinstance(node, type) else {}
        if part not in hints:
            return None
        node = hints[part]
        args = [a for a in typing.get_args(node) if a is not type(None)]
        node = args[0] if args else node  # Optional[X] -> X
    return [m.value for m in node] if isinstance(node, type) and issubclass(node, Enum) else None
