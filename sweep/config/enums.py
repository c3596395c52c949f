"""The allowed values of the config's categorical keys (precision.param_dtype, attention.backend, model.arch, ...).

str Enums, so OmegaConf checks a value against them while Hydra composes and the YAML keeps plain words.
`Verdict` is here too: the monitor decides verdicts (sweep/run/monitor.py), a scenario's `expect` names them.
"""

from __future__ import annotations

from enum import Enum, StrEnum


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


class Fp8Recipe(str, Enum):
    """torchao's float8 training recipes (precision.fp8, sweep/run/fp8.py): how a converted linear's operands are
    scaled to fp8 (e4m3 forward, e5m2 gradients under tensorwise)."""

    tensorwise = "tensorwise"  # one scale per tensor, from its current amax
    rowwise = "rowwise"  # one scale per row (per column of the right operand)
    rowwise_gw_hp = "rowwise_gw_hp"  # rowwise, with the weight-gradient GEMM in high precision


class BaseDtype(str, Enum):
    """How a frozen base's weights are stored (finetune.base_dtype, sweep/run/fp8_storage.py), upcast per layer."""

    bf16 = "bf16"
    fp8_e4m3 = "fp8_e4m3"  # float8_e4m3fn, one scale per tensor
    fp8_e4m3_block = "fp8_e4m3_block"  # float8_e4m3fn, one scale per 128-wide block of a row (musubi-tuner's)
    fp8_e5m2 = "fp8_e5m2"  # float8_e5m2, one scale per tensor


class OptimName(str, Enum):
    """The optimizer (conf/optim/*.yaml, sweep/run/optimizers.py)."""

    adamw = "adamw"  # ours, torch's single-tensor AdamW bit for bit, graph-ready (sweep/run/adamw.py)
    adamw_8bit = "adamw_8bit"  # bitsandbytes' AdamW8bit: block-wise 8-bit moments
    adafactor = "adafactor"  # torch.optim.Adafactor: factored second moment, lr caps the relative step
    came = "came"  # came-pytorch's CAME (Sana, PixArt)
    prodigy = "prodigy"  # prodigyopt's Prodigy: lr multiplies its own step-size estimate d


OPTIM_LR_MEANING = {
    "adafactor": "caps the relative step size (min(lr, 1/sqrt(t)) x the weight's RMS)",
    "prodigy": "multiplies Prodigy's own step-size estimate d (1.0 = Prodigy's step)",
}
"""What optim.lr means for an optimizer whose lr is not its step size (others: the step size, as AdamW's). The
tables say it, and do not compare such an lr with AdamW's in grid steps (sweep/report/tables.py)."""


OPTIM_LIBRARY = {
    "adamw_8bit": ("bitsandbytes", "bitsandbytes.optim", "AdamW8bit"),
    "adafactor": ("torch", "torch.optim", "Adafactor"),
    "came": ("came-pytorch", "came_pytorch", "CAME"),
    "prodigy": ("prodigyopt", "prodigyopt", "Prodigy"),
}
"""A library optimizer's (package, module, class): what sweep/run/optimizers.py imports, what result.json names
with its version, and what validation checks is installed."""
LOWPREC_INSTALL = "pip install 'dit-precision-sweep[lowprec]'"
"""How to install the fp8 and optimizer libraries (pyproject's lowprec extra)."""


def lr_meaning(optim: str) -> str:
    return OPTIM_LR_MEANING.get(str(optim), "the step size")


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


class ConfirmMode(str, Enum):
    auto = "auto"  # after every multirun (sweep/confirm/)
    off = "off"


class Progress(str, Enum):
    auto = "auto"  # a bar on a terminal, nothing per step in CI or a pipe
    bar = "bar"
    log = "log"  # a line every `log_every` steps
    none = "none"


class DataSource(str, Enum):
    synthetic = "synthetic"
    video_folder = "video_folder"
    latent_folder = "latent_folder"
    image_folder = "image_folder"


class Resize(str, Enum):
    """How an image_folder image becomes data.height x data.width (sweep/data/readers.py RESIZE_MODES)."""

    crop = "crop"
    resize = "resize"


class LadderAxis(str, Enum):
    width = "width"
    depth = "depth"


class Verdict(StrEnum):
    """Why a diverged run diverged, in the order a step meets them (docs/design.md, section 3, "Verdicts").

    A StrEnum: `str(v)`, f-strings and json.dumps give the plain word, so result.json, the ledger and the tables
    hold the strings they always held, and a member equals its word as read back from those files (compare with
    `==`, never `is`: what a file gives back is a plain str)."""

    bad_input = "bad_input"  # the batch itself, before the forward (sweep.data.checks.check_batch)
    scale_collapse = "scale_collapse"  # the loss scaler at its floor, or too many skips in a row
    nonfinite_loss = "nonfinite_loss"
    nonfinite_grad = "nonfinite_grad"  # a finite loss with a non-finite gradient norm
    loss_spike = "loss_spike"
    stalled = "stalled"  # the weights stopped moving while updates were applied
    corrupt_checkpoint = "corrupt_checkpoint"  # refused before the first step (sweep/run/checkpoint.py)
    slow_divergence = "slow_divergence"  # at the end: far above its own minimum, or rising since (sweep/run/trend.py)
    no_progress = "no_progress"  # at the end: near its initial loss while its weights thrashed (sweep/run/trend.py)
