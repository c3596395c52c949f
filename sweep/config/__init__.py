"""Typed configuration of one run: the schemas Hydra composes into, and their validation.

Every axis of a sweep is a config group under `conf/` (precision, attention, modulate, model, data,
optim, objective, monitor). Each group's YAML merges into the dataclass registered here, so a typo'd
key or a wrong type fails while Hydra composes (OmegaConf checks keys and types against the schema),
and `validate()` rejects bad values (lr <= 0, steps <= 0, ...) with a one-line message that names the
dotted key. `to_run_config()` is the boundary: below it, code gets plain dataclasses, never a DictConfig.

Importing this package registers the schema (`run_schema`) and imports neither torch nor the models
(validating a diffusers model name does, once), so the grid sweeper can validate every cell before the
first run cheaply. Its modules:
- `enums.py`: the allowed values of the categorical keys;
- `schema.py`: the dataclasses, RunConfig, `register_schemas`, ConfigError and `enum_choices`;
- `validate.py`: `to_run_config` and `validate`, one check per section (`model_checks.py`: the model's);
- `inputs.py`: `check_inputs` (files, model probes), `check_device`, `check_output_dir`, `make_output_dir`;
- `recorded.py`: a recorded run's config read back (what a checkpoint resume must match, retired keys);
- `secrets.py`: the command line and the composed config spell out no password (`check_no_literal_secrets`);
- `compose_speed.py`: two costs of every Hydra composition taken out (installed on import), and
  `compose_memo.py`: the defaults list and its merge kept per group choices (installed with them).
Every name is re-exported here: import from `sweep.config`.
"""

from sweep.config.around import (
    ConfirmConfig,
    LedgerConfig,
    LoggerConfig,
    MlflowConfig,
    ReportConfig,
    ScenarioConfig,
    ScenarioExpect,
    TensorBoardConfig,
)
from sweep.config.compose_speed import install as _install_compose_speed
from sweep.config.enums import (
    Arch,
    AttentionBackend,
    BaseDtype,
    BetaSchedule,
    ConfirmMode,
    CpuGemm,
    DataSource,
    DiagnoseMode,
    Dtype,
    FaultKind,
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
    Verdict,
)
from sweep.config.inputs import (
    REMOTE_LAUNCHERS,
    ROOM_INSIDE,
    WEIGHT_SUFFIXES,
    check_device,
    check_device_name,
    check_inputs,
    check_launcher,
    check_no_chdir,
    check_output_dir,
    launches_here,
    make_output_dir,
    model_label,
)
from sweep.config.recorded import RESUME_KEYS, RETIRED_KEYS, resume_mismatches, without_retired
from sweep.config.schema import (
    AttentionConfig,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    EvalConfig,
    FaultConfig,
    FinetuneConfig,
    LadderConfig,
    LossScalerConfig,
    ModelConfig,
    ModulateConfig,
    MonitorConfig,
    ObjectiveConfig,
    OptimConfig,
    PrecisionConfig,
    RunConfig,
    enum_choices,
    register_schemas,
)
from sweep.config.validate import (
    GRAPH_MODES,
    MAX_REPLICATES,
    MAX_SEED,
    MAX_THREADS,
    check_nodes,
    check_storage,
    flatten,
    nonfinite_floats,
    to_run_config,
    validate,
    validate_pruner,
)
from sweep.search.conf import PRUNERS, PrunerConfig, PrunerName

_install_compose_speed()

__all__ = [
    "GRAPH_MODES",
    "MAX_REPLICATES",
    "MAX_SEED",
    "MAX_THREADS",
    "PRUNERS",
    "REMOTE_LAUNCHERS",
    "RESUME_KEYS",
    "RETIRED_KEYS",
    "ROOM_INSIDE",
    "WEIGHT_SUFFIXES",
    "Arch",
    "AttentionBackend",
    "AttentionConfig",
    "BetaSchedule",
    "CheckpointConfig",
    "ConfirmConfig",
    "ConfirmMode",
    "ConfigError",
    "CpuGemm",
    "DataConfig",
    "DataSource",
    "DiagnoseMode",
    "Dtype",
    "EvalConfig",
    "FaultConfig",
    "FaultKind",
    "FinetuneConfig",
    "BaseDtype",
    "FinetuneMethod",
    "Fp8Recipe",
    "OptimName",
    "LadderAxis",
    "LadderConfig",
    "LedgerConfig",
    "LoggerConfig",
    "LossScalerConfig",
    "MlflowConfig",
    "ModelConfig",
    "ModulateConfig",
    "ModulateImpl",
    "MonitorConfig",
    "ObjectiveConfig",
    "ObjectiveKind",
    "OptimConfig",
    "Param",
    "PrecisionConfig",
    "ReportConfig",
    "Prediction",
    "Progress",
    "Resize",
    "PrunerConfig",
    "PrunerName",
    "RunConfig",
    "ScenarioConfig",
    "ScenarioExpect",
    "Schedule",
    "TensorBoardConfig",
    "Verdict",
    "check_device",
    "check_device_name",
    "check_inputs",
    "check_launcher",
    "check_no_chdir",
    "check_nodes",
    "check_output_dir",
    "make_output_dir",
    "enum_choices",
    "flatten",
    "launches_here",
    "model_label",
    "nonfinite_floats",
    "register_schemas",
    "resume_mismatches",
    "to_run_config",
    "validate",
    "validate_pruner",
    "check_storage",
    "without_retired",
]
