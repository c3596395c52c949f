"""The checks made just before runs start, not in validate(): the files a run will load exist and fit
(model.init_from, checkpoint.resume_from), a custom or released model and the precision.fp32_modules globs
build (probed once per distinct model), a custom model's forward under each pure precision asked for (its
runs are skipped with the reason when it breaks the dtype contract), the device is there, and the output
directory can be created.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

from sweep.config.enums import Arch
from sweep.config.recorded import resume_mismatches
from sweep.config.schema import ConfigError, RunConfig, require

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
        require(path.exists(), "model.init_from", f"no such file or directory: {init}")
        require(
            path.is_dir() or path.suffix in WEIGHT_SUFFIXES,
            "model.init_from",
            f"{init} is not a checkpoint directory or a {'/'.join(WEIGHT_SUFFIXES)} weights file",
        )
        require(not path.is_dir() or is_checkpoint_dir(path), "model.init_from", not_a_checkpoint(path))
    resume = run.checkpoint.resume_from
    if resume is not None:
        require(Path(resume).is_dir(), "checkpoint.resume_from", f"no such checkpoint directory: {resume}")
        require(is_checkpoint_dir(Path(resume)), "checkpoint.resume_from", not_a_checkpoint(Path(resume)))
        differ = resume_mismatches(run, Path(resume))
        require(
            not differ,
            "checkpoint.resume_from",
            f"{resume} was saved by a run with other shapes or dtypes: "
            + ", ".join(f"{k}={saved} there, {now} here" for k, saved, now in differ),
        )
        _check_resume_step(run, Path(resume))
    if run.model.arch is Arch.custom:
        _probe_custom(run)
        _probe_pure_precision(run)
    if run.model.arch is Arch.diffusers_config:
        _probe_diffusers_config(run)
    if run.precision.fp32_modules:
        _probe_fp32_modules(run)
    return run


CHECKPOINT_FILES = (
    "manifest.json",
    "model.safetensors",
    "optimizer.safetensors",
    "trainer.safetensors",
    "trainer.json",
)
"""What a checkpoint directory holds (sweep/run/checkpoint.py; tests/test_checkpoint.py holds the two to one list)."""
STEP_DIR = re.compile(r"step_\d+")
"""A checkpoint's own directory name: <run dir>/checkpoints/step_000010."""


def is_checkpoint_dir(path: Path) -> bool:
    """Whether a directory is meant as one checkpoint: named like a step directory, or holding a checkpoint's
    files. What is inside (a missing or damaged file) is the verifier's business: verdict `corrupt_checkpoint`."""
    return bool(STEP_DIR.fullmatch(path.name)) or any((path / name).exists() for name in CHECKPOINT_FILES)


def not_a_checkpoint(path: Path) -> str:
    """The sentence for a directory that is no checkpoint (a run directory, its checkpoints/ folder): it names the
    step directories found in it, the last few, newest last."""
    steps = sorted(
        (p for folder in (path, path / "checkpoints") if folder.is_dir() for p in folder.iterdir()),
        key=lambda p: p.name,
    )
    steps = [p for p in steps if p.is_dir() and STEP_DIR.fullmatch(p.name)]
    if not steps:
        return (
            f"{path} is not a checkpoint (none of {', '.join(CHECKPOINT_FILES[:2])}, ... in it, and no step "
            "directory): name a <run dir>/checkpoints/step_NNNNNN directory (checkpoint.every=N saves them)"
        )
    shown = ", ".join(str(p) for p in steps[-3:])
    more = f" ({len(steps)} in all)" if len(steps) > 3 else ""
    return f"{path} is not a checkpoint but holds step directories: name one of them: {shown}{more}"


def _check_resume_step(run: RunConfig, checkpoint: Path) -> None:
    """`steps` is the run's total, counted from step 0: a resume from a checkpoint saved at step N runs steps N to
    steps - 1, so steps <= N leaves nothing to run (before: each run ended `error` with a traceback). The step is
    the checkpoint's manifest.json `step` (sweep/run/checkpoint.py); a manifest that cannot be read is the
    checkpoint verifier's business (`corrupt_checkpoint`)."""
    import json

    try:
        saved_at = json.loads((checkpoint / "manifest.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    if not isinstance(saved_at, int) or isinstance(saved_at, bool):
        return
    require(
        run.steps > saved_at,
        "steps",
        f"steps={run.steps}, but checkpoint.resume_from {checkpoint} was saved at step {saved_at}: a resume runs "
        f"steps {saved_at} to steps - 1 (steps counts from step 0), so nothing is left to run; give steps > {saved_at}",
    )


REMOTE_LAUNCHERS = ("slurm", "ray")
"""Launchers whose jobs run on other machines (hydra.launcher._target_ holds one of these): the sweep's own
process (a login node) cannot tell whether the device a run asks for is there, so only the job checks it."""


def launches_here(config: Any) -> bool:
    """Whether the Hydra config's launcher runs jobs on this machine (basic, joblib, submitit_local, packed)."""
    target = str(OmegaConf.select(config, "hydra.launcher._target_", default="") or "").lower()
    return not any(name in target for name in REMOTE_LAUNCHERS) or "local" in target


LAUNCHER_COUNTS = {  # hydra.launcher key: (launchers it belongs to, its least value)
    "n_jobs": ("joblib", None),  # joblib: a nonzero count (-1: every core); 0 was joblib's ValueError
    "timeout_min": ("submitit", 1),  # 0 or less: every job killed at once, a traceback (UncompletedJobError)
    "tasks_per_node": ("submitit", 1),  # 0: submitit's AttributeError
    "nodes": ("submitit", 1),
    "cpus_per_task": ("submitit", 1),
    "array_parallelism": ("submitit", 1),
    "gpus_per_node": ("submitit", 0),
    "mem_gb": ("submitit", 1),
}
"""The launchers' counts a sweep checks before its first job (check_launcher): each one a traceback, or jobs that
could not run, after the sweep had started."""


def check_launcher(config: Any) -> None:
    """ConfigError for a joblib or submitit launcher count that cannot run a job (LAUNCHER_COUNTS); a null one is
    the launcher's own default."""
    target = str(OmegaConf.select(config, "hydra.launcher._target_", default="") or "").lower()
    for key, (launcher, least) in LAUNCHER_COUNTS.items():
        value = OmegaConf.select(config, f"hydra.launcher.{key}", default=None)
        if launcher not in target or value is None:
            continue
        ok = (
            isinstance(value, int) and not isinstance(value, bool) and (value != 0 if least is None else value >= least)
        )
        rule = "a whole number, not 0 (-1: every core)" if least is None else f"a whole number >= {least}"
        require(ok, f"hydra.launcher.{key}", f"must be {rule}, got {value!r}")


def check_no_chdir(config: Any) -> None:
    """ConfigError for hydra.job.chdir=true: a run reads its inputs (data.path, model.config, model.init_from,
    checkpoint.resume_from) relative to where the command ran, and a job Hydra moved into its own directory found
    none of them (a single run refused; a sweep stopped at its first job, after its up-front checks had passed)."""
    require(
        OmegaConf.select(config, "hydra.job.chdir", default=False) is not True,
        "hydra.job.chdir",
        "must stay false: runs read data.path, model.config and the checkpoints relative to where the command"
        " runs, and write their files into their own directory without it",
    )


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
    require(
        torch.cuda.is_available(),
        "device",
        f"{device} asked for, but torch sees no CUDA device on this machine ({built}); use device=auto or cpu",
    )
    try:
        index = torch.device(device).index
    except RuntimeError:
        raise ConfigError(f"device: must be auto, cpu, cuda or cuda:N, got {device!r}") from None
    count = torch.cuda.device_count()
    require(
        index is None or index < count,
        "device",
        f"{device} asked for, but torch sees {count} CUDA device(s) here (cuda:0..cuda:{count - 1})",
    )


_PROBED: dict[str, None] = {}
"""Custom-model factory calls already probed in this process (key: target, kwargs and config inputs)."""
_BUILT: dict[str, Any] = {}
"""The model each custom probe built (same keys), lent to the other probes of its run (the pure-precision contract,
precision.fp32_modules) so the check calls a factory once per distinct call; let go by release_checked_models."""


def _probe_once(key: str, probe: Callable[[], None]) -> None:
    """Run `probe` (it raises ConfigError for a model that cannot be built) once per distinct key in this process."""
    if key not in _PROBED:
        probe()
        _PROBED[key] = None


def _probe_custom(run: RunConfig) -> None:
    """Build the custom model once (per distinct call): a factory that raises or returns no nn.Module, a model
    over the 1,000M-parameter limit (counted as it is built, on the meta device past the limit), a forward that does
    not return a tensor of x's shape (on a batch of 2, and of the run's batch size), a model with nothing to train or
    a prediction with no grad_fn is one line and exit 2 before any run, not a crash in the middle of a sweep. Costs
    one model construction, one forward with autograd on a batch of 2 and one without on the run's batch; the model
    is kept (_BUILT) for the other probes of the check."""
    from models.custom import CustomModelError, CustomModelTooBig, probe_factory
    from sweep.run.sizes import PARAMS_LIMIT

    m, inputs = run.model, _probe_inputs(run)
    key = _custom_key(run)

    def probe() -> None:
        try:
            _BUILT[key] = probe_factory(m.target, m.kwargs, inputs, params_limit=PARAMS_LIMIT)
        except CustomModelTooBig as e:
            raise ConfigError(f"model.kwargs: {e}") from None
        except CustomModelError as e:
            raise ConfigError(f"model.target: {e}") from None

    _probe_once(key, probe)


def _probe_inputs(run: RunConfig) -> dict:
    """The config inputs of a custom factory, and what its probed forward must also work with: the run's batch
    size, and whether a finetune brings its own parameters."""
    return {**run.model_inputs, "batch_size": run.data.batch_size, "finetune": run.finetune.method.value}


def _custom_key(run: RunConfig) -> str:
    """One distinct call of a custom factory: its target, kwargs and config inputs (and what its probe checks)."""
    m = run.model
    return repr((m.target, sorted(m.kwargs.items()), sorted(_probe_inputs(run).items())))


def checked_model(run: RunConfig, copy: bool = True) -> Callable[[], Any]:
    """A builder of the run's model (sweep.run.model.build_run_model) that, for a custom model the check has built
    and still holds, wraps that build (a copy of it, unless `copy` is False) instead of calling the factory again."""
    from sweep.run.model import build_run_model

    def build() -> Any:
        built = _BUILT.get(_custom_key(run)) if run.model.arch is Arch.custom else None
        if built is None:
            return build_run_model(run)
        import copy as copying

        from models.custom import build_custom_model

        m = run.model
        return build_custom_model(
            m.target, m.kwargs, **run.model_inputs, module=copying.deepcopy(built) if copy else built
        )

    return build


def release_checked_models() -> None:
    """Let go of the models the custom probes built (the checks are done: the runs build their own)."""
    _BUILT.clear()


def _probe_pure_precision(run: RunConfig) -> None:
    """Under bf16_pure/fp16_pure, one forward of the custom model with its weights cast (once per model, dtype and
    fp32_modules in this process): where a float32 intermediate meets a low-precision weight, one warning line
    says which module and what to cast, and the runs of that precision are `skipped` with it as their reason
    (sweep/run/dtype_contract.py), instead of an `error` and a traceback each. Not a ConfigError: the grid's
    other cells run."""
    from sweep.run.dtype_contract import contract_problem

    contract_problem(run, build=checked_model(run))


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

    globs = list(run.precision.fp32_modules)
    build = checked_model(run, copy=False)  # a custom model: the check's own build, only named here

    def probe() -> None:
        import torch

        try:
            with torch.device("meta"):
                names = [n for n, _ in build().named_modules()]
        except Exception:  # noqa: BLE001  (a builder that needs real storage: build it for real, once)
            names = [n for n, _ in build().named_modules()]
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
    so a 300-character name would end in `OSError: File name too long`, and a file where a folder of the path
    must be in `FileExistsError` or `NotADirectoryError` (a traceback, or a run error)."""
    name_max, path_max = _path_limits(path)
    for part in Path(path).parts:
        size = len(os.fsencode(part))
        require(
            size <= name_max,
            key,
            f"a path component of {size} bytes is longer than the file system's limit of {name_max}: {part[:24]}...",
        )
    size = len(os.fsencode(os.path.abspath(path)))
    require(
        size + ROOM_INSIDE <= path_max,
        key,
        f"the path is {size} bytes; the file system allows {path_max} with the files a run writes inside",
    )
    blocked = _not_makeable(path)
    require(blocked is None, key, f"{blocked}; name a folder, or one that can be made")


def make_output_dir(path: str, key: str) -> None:
    """Make the run or sweep directory (Hydra would, a moment later) after its checks: a file system that makes no
    folders there (/proc, /sys: `No such file or directory` from mkdir) is a ConfigError naming `key`, where Hydra's
    own mkdir would be a traceback. A full, read-only or forbidden disk is raised as it is (sweep/__main__.py: one
    line, status 1)."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise
        raise ConfigError(
            f"{key}: cannot make the folder {exc.filename} ({exc.strerror}); name one on a file system that makes"
            " folders"
        ) from exc


def _not_makeable(path: str) -> str | None:
    """Why `path` cannot be made a folder: a file (or a broken link) where the path or one of its parents must be a
    folder; None otherwise. (A folder it may not write in, or a read-only one, is the disk's refusal: sweep/__main__.py
    says so in one line, status 1.)"""
    probe = os.path.abspath(path)
    while not os.path.isdir(probe):  # os.path: False, never a raise (a name too long, a loop of links)
        if os.path.lexists(probe):
            what = "a broken symbolic link" if os.path.islink(probe) and not os.path.exists(probe) else "a file"
            return f"{probe} is {what}, not a folder"
        probe = os.path.dirname(probe)
    return None


def _path_limits(path: str) -> tuple[int, int]:
    """(NAME_MAX, PATH_MAX) of the file system the path would be created on (its nearest existing parent)."""
    probe = Path(os.path.abspath(path))
    while not os.path.exists(probe) and probe != probe.parent:  # os.path: False, not a raise, on a too-long name
        probe = probe.parent
    try:
        return os.pathconf(probe, "PC_NAME_MAX"), os.pathconf(probe, "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):  # no pathconf (Windows) or no answer: the common limits
        return 255, 4096


def written_subdir(cfg: Any) -> str:
    """hydra.sweep.subdir as the user wrote it (`lr${optim.lr}`), for a message."""
    return str(OmegaConf.to_container(cfg.hydra.sweep, resolve=False).get("subdir", ""))


def check_job_dir(cfg: Any, job_num: int) -> Path:
    """A sweep job's directory, <sweep dir>/<subdir>, for the composed Hydra config of its cell: one the file system
    can create (a subdir such as ${hydra.job.override_dirname} grows with the overrides) and inside the sweep dir
    (elsewhere its summary, report and resume never look). hydra.job.num is set only at launch, so a copy gets one
    (the number the launcher will give it). Returns the directory; ConfigError naming hydra.sweep.subdir."""
    import copy

    from omegaconf import open_dict, read_write

    cfg = copy.deepcopy(cfg)  # the launcher gets the composed cell (the grid's ComposedOnce): leave it as it was
    with read_write(cfg), open_dict(cfg):
        cfg.hydra.job.num = job_num
    subdir = OmegaConf.select(cfg, "hydra.sweep.subdir", default="", throw_on_resolution_failure=False)
    sweep_dir = Path(str(cfg.hydra.sweep.dir))
    job_dir = sweep_dir / str(subdir or "")
    check_output_dir(str(job_dir), "hydra.sweep.subdir")
    inside, root = os.path.abspath(job_dir), os.path.abspath(sweep_dir)
    require(
        os.path.commonpath([inside, root]) == root,
        "hydra.sweep.subdir",
        f"the job directory {inside} is outside the sweep directory {sweep_dir}, where its summary, report and resume"
        " never look; give a subdir relative to it, without ..: e.g. ${hydra.job.num}",
    )
    return job_dir
