"""Every config composes and validates; user mistakes fail at composition with one line naming the key."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from sweep.config import ConfigError, RunConfig

from .conftest import CONF_DIR, FAST, REPO, make_run, run_cli_refusals

GROUPS = ["precision", "attention", "modulate", "model", "data", "optim", "objective", "monitor", "logger"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_and_validates(group, option):
    extra = ["model=dit_tiny"] if option == "synthetic_image" else []
    extra += ["data=synthetic_image"] if option.startswith(("dit_", "diffusers_dit_", "pixart_", "sana_")) else []
    extra += [f"data.path={REPO}"] if option.endswith("_folder") else []  # any existing directory validates
    extra += ["model.target=examples.my_dit:build"] if option == "custom" else []  # model=custom needs its factory
    if option == "diffusers_config":  # needs its file (validate() reads it; the size budget is check_inputs')
        extra += [f"model.config={REPO}/tests/data/diffusers_configs/cogvideox_2b.json"]
    run = make_run(f"{group}={option}", *extra, fast=False)
    assert isinstance(run, RunConfig)


def test_precision_files_spell_out_every_knob():
    """Each precision file names every knob itself rather than inheriting silently."""
    import yaml  # PyYAML comes with omegaconf

    for option in options("precision"):
        spec = yaml.safe_load((Path(CONF_DIR) / "precision" / f"{option}.yaml").read_text())
        assert spec["name"] == option
        assert {"param_dtype", "autocast_dtype", "tf32", "scaler"} <= set(spec)


def test_precision_policies_mean_what_they_say():
    assert make_run("precision=fp16_amp").precision.scaler.enabled
    assert not make_run("precision=fp16_amp_noscale").precision.scaler.enabled
    assert make_run("precision=bf16_pure").precision.param_dtype.value == "bfloat16"
    assert make_run("precision=fp16_pure").precision.autocast_dtype is None
    assert make_run("precision=bf16_amp").precision.param_dtype.value == "float32"


@pytest.mark.parametrize(
    "override,key",
    [
        ("optim.lr=-1e-3", "optim.lr"),
        ("optim.lr=0", "optim.lr"),
        ("steps=0", "steps"),
        ("model.size=XL", "model.size"),
        ("data.faults=[{index:999,kind:nan}]", "data.faults[0].index"),
        ("data.faults=[{index:3,kind:zero}]", "data.faults[0].kind"),
        ("precision.scaler.backoff_factor=2", "precision.scaler.backoff_factor"),
        ("threads=100000", "threads"),  # torch.set_num_threads(100000) segfaulted
        ("seed=100000000000000000000000000", "seed"),  # 10**26 overflowed the ledger and lost the trial
        ("seed=-1", "seed"),
        ("data.seed=4294967296", "data.seed"),
    ],
)
def test_bad_values_are_rejected_naming_the_key(override, key):
    with pytest.raises(ConfigError, match="^" + re.escape(key) + ": "):
        make_run(override)


@pytest.mark.parametrize(
    "override,key",
    [
        ("optim.lr=inf", "optim.lr"),
        ("optim.weight_decay=inf", "optim.weight_decay"),
        ("optim.eps=nan", "optim.eps"),
        ("optim.betas=[0.9,nan]", "optim.betas[1]"),
        ("monitor.spike_factor=inf", "monitor.spike_factor"),
        ("precision.scaler.init_scale=inf", "precision.scaler.init_scale"),
        ("data.range_limit=inf", "data.range_limit"),
        ("model.qk_gain=inf", "model.qk_gain"),
        ("objective.flow_shift=-inf", "objective.flow_shift"),
        ("ledger.pruner.upper=inf", "ledger.pruner.upper"),
        ("+tag=inf", "tag"),  # a key outside the schema too
    ],
)
def test_every_float_key_must_be_finite(override, key):
    """Hydra reads inf/nan as floats; no float key may take one (the check walks the config, not a key list)."""
    with pytest.raises(ConfigError, match="^" + re.escape(key) + ": must be a finite number, got "):
        make_run(override)


def test_fault_kinds_parse_from_the_command_line():
    """Hydra reads a bare nan/inf as a float; the fault kind still comes out as the word."""
    run = make_run("data.faults=[{index:3,kind:nan},{index:4,kind:inf},{index:5,kind:range}]")
    assert [(f.index, f.kind) for f in run.data.faults] == [(3, "nan"), (4, "inf"), (5, "range")]


MISTAKES = [
    (["optim.lrr=1e-3"], "optim.lrr"),  # typo'd key
    (["optim.lr=fast"], "optim.lr"),  # wrong type
    (["precision=fp8"], "precision"),  # unknown option
    (["optim.lr=-1"], "optim.lr"),  # bad value
    (["-m", "optim.lr=1e-3,-1", "steps=1"], "optim.lr"),  # bad value in one cell of a grid
    (["threads=100000"], "threads"),  # segfaulted torch (rc 139)
    (["optim.lr=inf"], "optim.lr"),  # not finite
    (["-m", "optim.lr=1e-3,inf", "steps=1"], "optim.lr"),  # not finite, in one cell of a grid
    (["precision=null"], "precision: "),  # Hydra's own message names no key
    (
        ["-m", "steps=1", "optim.lr=1e-3,1e-2", "hydra/launcher=joblib", "hydra.launcher.n_jobs=0"],
        "hydra.launcher.n_jobs",
    ),
    (["hydra.job.chdir=true"], "hydra.job.chdir"),  # a relative data.path was "no such directory" in the job dir
    (["-m", "steps=1", "optim.lr=1e-3,1e-2", "hydra.job.chdir=true"], "hydra.job.chdir"),  # at the first job
    # two overrides in one shell word: Hydra's "mismatched input '=' expecting <EOF>" named no key
    (["optim=adamw optim.lr=1"], "'optim=adamw optim.lr=1': one argument holding 2 overrides (quoted together)"),
]
WRONG_INIT_FROM = [
    ["model.init_from=nope.safetensors"],
    ["-m", "steps=1", "optim.lr=1e-3,1e-2", "model.init_from=notes.txt"],
]
TOO_LONG = [
    (["hydra.run.dir=RUN/" + "a" * 300], "hydra.run.dir"),
    (
        [
            "-m",
            "steps=1",
            "optim.lr=1e-3,1e-2",
            "hydra.sweep.dir=SWEEP",
            "hydra.sweep.subdir=${hydra.job.num}_" + "a" * 300,
        ],
        "hydra.sweep.subdir",
    ),
]
NOT_A_FOLDER = [  # NOTES: the case's notes.txt, a file (Hydra's mkdir raised FileExistsError/NotADirectoryError)
    (["hydra.run.dir=NOTES"], "hydra.run.dir"),
    (["hydra.run.dir=NOTES/run"], "hydra.run.dir"),
    (["-m", "steps=1", "optim.lr=1e-3,1e-2", "hydra.sweep.dir=NOTES"], "hydra.sweep.dir"),
]
NO_FOLDERS = [  # /proc makes no folders: Hydra's mkdir raised FileNotFoundError, a traceback
    (["hydra.run.dir=/proc/no_such_pid/run"], "hydra.run.dir"),
    (["-m", "steps=1", "optim.lr=1e-3,1e-2", "hydra.sweep.dir=/proc/no_such_pid/sweep"], "hydra.sweep.dir"),
]
NO_FOLDERS = NO_FOLDERS if os.path.isdir("/proc/self") else []  # Linux's procfs
ABSURD_SIZE = ["data.channels=2147483648", "hydra.run.dir=RUN"]
CUDA_WITHOUT_CUDA = ["device=cuda", "steps=2", *FAST, "hydra.run.dir=RUN"]
OUTPUT_DIRS = ["hydra.run.dir=RUN", "hydra.sweep.dir=SWEEP"]
REFUSED = [
    *([*args, *OUTPUT_DIRS] for args, _ in MISTAKES),
    *([*args, *OUTPUT_DIRS] for args in WRONG_INIT_FROM),
    *(args for args, _ in TOO_LONG),
    *(args for args, _ in NOT_A_FOLDER),
    *(args for args, _ in NO_FOLDERS),
    ABSURD_SIZE,
    *([] if __import__("torch").cuda.is_available() else [CUDA_WITHOUT_CUDA]),
]
"""The command lines below that `python -m sweep` refuses before any run; RUN, SWEEP and NOTES stand for the case's
own directory's run/, sweep/ and notes.txt."""


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, tuple]:
    """Each of REFUSED run from a directory of its own (holding notes.txt, not weights), each in a fork of one
    warmed interpreter (conftest.run_cli_refusals: no interpreter start-up each): by " ".join(args), its
    CompletedProcess and its directory."""
    dirs = [tmp_path_factory.mktemp("refused") for _ in REFUSED]
    for d in dirs:
        (d / "notes.txt").write_text("not weights")
    argvs = [
        [
            *(
                a.replace("RUN", f"{d}/run").replace("SWEEP", f"{d}/sweep").replace("NOTES", f"{d}/notes.txt")
                for a in args
            )
        ]
        for args, d in zip(REFUSED, dirs)
    ]
    procs = run_cli_refusals(*zip(argvs, dirs))
    return {" ".join(args): (proc, d) for args, proc, d in zip(REFUSED, procs, dirs)}


@pytest.mark.xdist_group("refusals")  # the module's `refused` batch, run once: on one worker
@pytest.mark.parametrize("args,key", MISTAKES)
def test_user_mistake_is_one_line_without_traceback(args, key, refused):
    proc, tmp_path = refused[" ".join([*args, *OUTPUT_DIRS])]
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("sweep: config error:") and key in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.rglob("result.json")), "no run may start when the config is wrong"


def test_files_a_run_loads_are_checked_before_it_starts(tmp_path):
    from sweep.config import check_inputs

    (tmp_path / "notes.txt").write_text("not weights")
    (tmp_path / "w.safetensors").write_bytes(b"")
    for override, message in [
        (
            f"model.init_from={tmp_path}/nope.safetensors",
            f"model.init_from: no such file or directory: {tmp_path}/nope",
        ),
        (
            f"model.init_from={tmp_path}/notes.txt",
            f"model.init_from: {tmp_path}/notes.txt is not a checkpoint directory",
        ),
        (
            f"checkpoint.resume_from={tmp_path}/nope",
            f"checkpoint.resume_from: no such checkpoint directory: {tmp_path}/nope",
        ),
    ]:
        with pytest.raises(ConfigError, match="^" + re.escape(message)):
            check_inputs(make_run(override))
    # what is inside is the checkpoint verifier's business (verdict corrupt_checkpoint), not a config error
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "manifest.json").write_text("{}")
    check_inputs(make_run(f"model.init_from={tmp_path}/w.safetensors", f"checkpoint.resume_from={tmp_path}/ckpt"))


@pytest.mark.xdist_group("refusals")  # the module's `refused` batch, run once: on one worker
@pytest.mark.parametrize("args", WRONG_INIT_FROM)
def test_a_missing_or_wrong_init_from_is_one_line_before_any_run(args, refused):
    proc, tmp_path = refused[" ".join([*args, *OUTPUT_DIRS])]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("sweep: config error: model.init_from: "), lines[0]
    assert not list(tmp_path.rglob("result.json")), "no run may start when an input file is missing"


def test_an_output_dir_the_file_system_cannot_create_is_a_config_error(tmp_path):
    from sweep.config import check_output_dir

    check_output_dir(str(tmp_path / ("a" * 200) / "0"), "hydra.run.dir")
    with pytest.raises(ConfigError, match=r"^hydra.run.dir: a path component of 300 bytes is longer than .* 255"):
        check_output_dir(str(tmp_path / ("a" * 300)), "hydra.run.dir")
    with pytest.raises(ConfigError, match=r"^hydra.sweep.dir: the path is \d+ bytes"):
        check_output_dir(str(tmp_path.joinpath(*["b" * 250] * 17)), "hydra.sweep.dir")


@pytest.mark.parametrize(
    "launcher,key,value,ok",
    [
        ("hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs", 0, False),  # ValueError
        ("hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs", -1, True),  # every core
        ("hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher", "timeout_min", 0, False),  # killed
        ("hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher", "tasks_per_node", 0, False),
        ("hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher", "gpus_per_node", 0, True),
        ("hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher", "cpus_per_task", None, True),
        ("hydra_plugins.dit_sweep.packed_launcher.PackedLauncher", "n_jobs", 0, True),  # not the packed launcher's
    ],
)
def test_a_launcher_count_that_cannot_run_a_job_is_a_config_error(launcher, key, value, ok):
    from omegaconf import OmegaConf

    from sweep.config import check_launcher

    config = OmegaConf.create({"hydra": {"launcher": {"_target_": launcher, key: value}}})
    if ok:
        check_launcher(config)
    else:
        with pytest.raises(ConfigError, match=f"^hydra.launcher.{key}: must be a whole number"):
            check_launcher(config)


def test_an_output_dir_blocked_by_a_file_is_a_config_error(tmp_path):
    from sweep.config import check_output_dir

    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    check_output_dir(str(tmp_path / "new" / "run"), "hydra.run.dir")  # made by Hydra, parents too
    check_output_dir(str(tmp_path), "hydra.run.dir")  # a folder that exists
    for path, what in [("notes.txt", "a file"), ("notes.txt/run", "a file"), ("gone/run", "a broken symbolic link")]:
        at = tmp_path / path.split("/")[0]
        with pytest.raises(ConfigError, match=f"^hydra.sweep.dir: {re.escape(str(at))} is {what}, not a folder; "):
            check_output_dir(str(tmp_path / path), "hydra.sweep.dir")


@pytest.mark.xdist_group("refusals")  # the module's `refused` batch, run once: on one worker
@pytest.mark.parametrize(
    "args,key,why",
    [
        *((args, key, "a path component of 30") for args, key in TOO_LONG),
        *((args, key, "NOTES is a file, not a folder") for args, key in NOT_A_FOLDER),
        *(
            (args, key, "cannot make the folder /proc/no_such_pid (No such file or directory)")
            for args, key in NO_FOLDERS
        ),
    ],
)
def test_an_output_dir_the_file_system_cannot_make_is_one_line_before_any_run(args, key, why, refused):
    proc, tmp_path = refused[" ".join(args)]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"sweep: config error: {key}: {why.replace('NOTES', f'{tmp_path}/notes.txt')}"), lines[0]
    assert (tmp_path / "notes.txt").read_text() == "not weights" and not list(tmp_path.rglob("result.json"))


@pytest.mark.parametrize(
    "override,key,limit",
    [
        ("data.channels=2147483648", "data.channels", "1.0 GiB"),  # asked for 64 TiB and died out of memory
        ("data.frames=100000", "data.frames", "1.0 GiB"),
        ("data.batch_size=100000000", "data.batch_size", "1.0 GiB"),
        ("data.height=1048576", "data.height", "1.0 GiB"),  # the evaluation batch (16 clips) is over first
        ("data.num_samples=100000000", "data.num_samples", "4.0 GiB"),  # synthetic data is rendered whole
        ("model.width=1048576", "model.width", "1,000M"),
        ("model.depth=1000000000", "model.depth", "1,000M"),  # counted at two depths, not built a billion times
    ],
)
def test_absurd_sizes_are_refused_with_the_estimate_and_the_limit(override, key, limit):
    with pytest.raises(ConfigError) as e:
        make_run(override)
    message = str(e.value)
    assert message.startswith(("data: ", "model: ")), message
    assert f"over the {limit} limit" in message and key in message.split("limit: ")[1], message
    assert re.search(r"[\d.]+[kMGT] (values|parameters)", message), message


def test_the_size_limits_leave_real_configs_alone():
    """The largest sizes the configs use (video_dit_s, size B, a 64x64 latent clip) stay under the limits."""
    make_run("model=video_dit_s")
    make_run("model.size=B")
    make_run("data.height=64", "data.width=64", "data.channels=4", "data.frames=16", "data.batch_size=16")


@pytest.mark.xdist_group("refusals")  # the module's `refused` batch, run once: on one worker
def test_an_absurd_size_is_one_line_before_any_run(refused):
    proc, tmp_path = refused[" ".join(ABSURD_SIZE)]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("sweep: config error: data: one training batch is 4 x 2147483648 x 8 x 16 x 16"), lines[
        0
    ]
    assert not list(tmp_path.rglob("result.json"))


def test_a_checkpoint_of_another_shape_or_dtype_is_refused_before_any_run(tmp_path):
    """Before, the run ended `error` with torch's "size mismatch for x_embedder.proj.weight" (or a dtype
    error) after building everything; the run that saved the checkpoint says what it was."""
    from omegaconf import OmegaConf

    from sweep.config import check_inputs

    from .conftest import compose_cfg

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    (run_dir / ".hydra").mkdir()
    OmegaConf.save(compose_cfg(["data.frames=4", "data.height=8", "data.width=8"]), run_dir / ".hydra" / "config.yaml")
    ckpt = f"checkpoint.resume_from={run_dir}/checkpoints/step_000002"
    check_inputs(make_run(ckpt, "precision=bf16_amp"))  # autocast saves the same fp32 weights: fine
    with pytest.raises(ConfigError, match=r"^checkpoint.resume_from: .* model.width=null there, 64 here$"):
        check_inputs(make_run(ckpt, "model.width=64"))
    with pytest.raises(ConfigError, match=r"precision.param_dtype=float32 there, float16 here"):
        check_inputs(make_run(ckpt, "precision=fp16_pure"))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.xdist_group("refusals")  # the module's `refused` batch, run once: on one worker
def test_device_cuda_without_cuda_is_one_line_before_any_run(refused):
    """issue 33: device=cuda on a machine without CUDA was a run ending `error` with a traceback, exit 0."""
    proc, tmp_path = refused[" ".join(CUDA_WITHOUT_CUDA)]
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("sweep: config error: device: cuda asked for, but torch sees no CUDA device")
    assert not (tmp_path / "run" / "result.json").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_in_a_grid_cell_is_refused_before_the_first_run(tmp_path):
    from .conftest import multirun_in_process

    with pytest.raises(ConfigError, match=r"^device: cuda:1 asked for.* \(in the sweep cell"):
        multirun_in_process(tmp_path / "s", "device=cpu,cuda:1", "steps=2", "ledger.enabled=false")
    assert not list((tmp_path / "s").glob("*/result.json"))


def test_a_remote_launcher_leaves_the_device_to_the_job():
    from omegaconf import OmegaConf

    from sweep.config import launches_here

    def cfg(target):
        return OmegaConf.create({"hydra": {"launcher": {"_target_": target}}})

    assert not launches_here(cfg("hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"))
    assert launches_here(cfg("hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"))
    assert launches_here(cfg("hydra._internal.core_plugins.basic_launcher.BasicLauncher"))


@pytest.mark.parametrize("folder", ["/tmp/elsewhere", "../..", "tb/../../up", "'~/tb'"])
def test_a_tensorboard_dir_outside_the_run_dir_is_refused(folder):
    """issue 45: logger.tensorboard.dir=/abs or ../.. wrote event files outside the run directory, against the
    schema's "inside the run directory" (and a sweep's runs would all write into one folder)."""
    with pytest.raises(ConfigError, match=r"^logger.tensorboard.dir: .*inside the run directory"):
        make_run(f"logger.tensorboard.dir={folder}")


@pytest.mark.parametrize("folder", ["tensorboard", "tb/events", "a/../b"])
def test_a_tensorboard_dir_inside_the_run_dir_is_fine(folder):
    assert make_run(f"logger.tensorboard.dir={folder}").logger.tensorboard.dir == folder


def test_only_words_that_are_all_overrides_are_read_as_several():
    """A value with spaces in it is Hydra's to judge (`+tag=a b` is a tag); words that each start `key=` are
    overrides joined by quoting."""
    from sweep.errors import _several_overrides

    assert _several_overrides("optim=adamw optim.lr=1") == ["optim=adamw", "optim.lr=1"]
    assert _several_overrides("+tag=a ~b.c=1") == ["+tag=a", "~b.c=1"]
    assert _several_overrides("+tag=a b") == [] and _several_overrides("optim.lr=1") == []
