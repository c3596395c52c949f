"""Command lines for `python -m sweep`, drawn by hypothesis from the config schema, and the path they take.

The property (tests/test_cli_property.py, bench/fuzz_cli.py): whatever the overrides, the command
either runs (exit 0, a verdict in result.json) or refuses with one line and exit status 2, never a
traceback. `outcome` follows the command's own path up to the first step without starting a process:
the password check (`literal_password_arg`), Hydra's compose, `to_run_config` (schema and `validate`),
`check_inputs` and `swept_params`, with a failure read the way `python -m sweep` reads it
(`config_error_line`). `run_job_in_process` then runs a valid draw as Hydra runs the job.

Overrides come from walking the `RunConfig` dataclasses: every leaf gets values of its own type, near
its edges (0, negatives, huge integers, nan/inf, tiny floats), of other types, odd unicode and empty
strings; nodes get scalars; unknown keys and unknown config-group options are mixed in.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import enum
import functools
import math
import shutil
import tempfile
import typing
from pathlib import Path

from hypothesis import strategies as st

from sweep.config import RunConfig

from .conftest import CONF_DIR, FAST

GROUPS = {
    p.name: sorted(f.stem for f in p.glob("*.yaml"))
    for p in Path(CONF_DIR).iterdir()
    if p.is_dir() and p.name not in ("hydra", "experiment")
}
# Config groups whose options build quickly and need no optional package or data (a real run of a
# valid draw uses only these).
RUNNABLE_GROUPS = {
    "precision": ["fp32", "bf16_amp", "fp16_amp", "fp16_amp_noscale", "bf16_pure"],
    "attention": ["math", "eager", "flash"],
    "modulate": ["eager", "fused"],
    "model": ["video_dit_tiny", "dit_tiny"],
}
# Leaves a fuzzed value must not reach for real: a module name imported by the custom-model probe.
SAFE_STRINGS = {"model.target": "fuzz_no_such_module_"}


def leaves(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, typing.Any]]:
    """(dotted key, annotated type) of every leaf of the schema, nodes included as (key, dataclass)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        key, t = prefix + f.name, hints[f.name]
        out.append((key, t))
        if dataclasses.is_dataclass(t):
            out += leaves(t, key + ".")
    return out


LEAVES = leaves()

_ODD_TEXT = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]),
    max_size=12,
)
_ODD = st.one_of(
    st.sampled_from(["", "''", '""', "null", "~", "[]", "{}", "true", "nan", "-inf", "1e400", "0x10", "1_000"]),
    st.sampled_from(["é", "日本", "\u200b", "a\\nb", "'a\nb'", "${oc.env:NOPE}", "${steps}", "${nope}", "%", "\\"]),
    _ODD_TEXT.map(lambda s: "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"),  # quoted: any text reaches us
    _ODD_TEXT,  # raw: Hydra's grammar may refuse it (that too must be one line)
)
_INTS = st.one_of(
    st.integers(-3, 70),
    st.sampled_from([0, -1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**30]),
    st.integers(),
).map(str)
_FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-45, 1e-320, 1e308, -1e308, 0.5, 1.0, 2.0, 1e-4, 1e-2]),
).map(lambda x: "nan" if math.isnan(x) else ("inf" if x == math.inf else "-inf" if x == -math.inf else repr(x)))


PATH_KEYS = ("data.path", "model.init_from", "checkpoint.resume_from", "ledger.storage")


@functools.cache
def existing_paths() -> list[str]:
    """Paths that exist, of the wrong kind for most keys: an empty folder, a folder of junk, junk files."""
    root = Path(tempfile.mkdtemp(prefix="cli_fuzz_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # the test process's, not left in /tmp after it
    (root / "empty").mkdir()
    (root / "junk").mkdir()
    for name in ("model.safetensors", "manifest.json", "a.npy", "b.mp4", "c.pt"):
        (root / "junk" / name).write_bytes(b"\x00not what it says\n")
    (root / "weights.safetensors").write_bytes(b"")
    (root / "notes.txt").write_text("hello")
    return [str(root / p) for p in ("empty", "junk", "junk/model.safetensors", "weights.safetensors", "notes.txt")]


def _optional(t) -> tuple[typing.Any, bool]:
    if typing.get_origin(t) is typing.Union and type(None) in typing.get_args(t):
        (inner,) = [a for a in typing.get_args(t) if a is not type(None)]
        return inner, True
    return t, False


def values_for(key: str, t) -> st.SearchStrategy[str]:
    """Override values for one schema leaf: mostly of its own type, some of any other."""
    t, optional = _optional(t)
    own: list[st.SearchStrategy[str]] = []
    origin = typing.get_origin(t)
    if dataclasses.is_dataclass(t):
        own.append(st.sampled_from(["{}", "null", "3", "[]", "{bogus: 1}"]))
    elif t is bool:
        own.append(st.sampled_from(["true", "false", "True", "0", "1", "yes"]))
    elif t is int:
        own.append(_INTS)
    elif t is float:
        own += [_FLOATS, _INTS]
    elif isinstance(t, type) and issubclass(t, enum.Enum):
        own.append(st.sampled_from([m.name for m in t] + [m.name.upper() for m in t] + ["bogus"]))
    elif origin in (list, typing.List):
        items = st.lists(st.one_of(_FLOATS, _INTS, st.sampled_from(["a", "null"])), max_size=4)
        own.append(items.map(lambda xs: "[" + ",".join(xs) + "]"))
    elif origin in (dict, typing.Dict):
        own.append(st.sampled_from(["{}", "{a: 1}", "{steps: nan}", "{'': 1}", "{a: {b: [1, 2]}}"]))
    elif t is str and key in PATH_KEYS:
        own.append(st.sampled_from(existing_paths()).map(lambda p: f"'{p}'"))
    elif t is str:
        prefix = SAFE_STRINGS.get(key)
        own.append(_ODD_TEXT.map(lambda s: prefix + "".join(c for c in s if c.isalnum())) if prefix else _ODD)
    if optional:
        own.append(st.just("null"))
    other = _ODD if key not in SAFE_STRINGS else st.sampled_from(["", "null", "3"])
    return st.one_of(*own, other) if own else other


def _override(key_and_type) -> st.SearchStrategy[str]:
    key, t = key_and_type
    prefix = st.sampled_from(["", "", "", "", "+", "++", "~"])
    return st.tuples(prefix, values_for(key, t)).map(
        lambda pv: f"{pv[0]}{key}" if pv[0] == "~" else f"{pv[0]}{key}={pv[1]}"
    )


def _group_override() -> st.SearchStrategy[str]:
    return st.sampled_from(sorted(GROUPS)).flatmap(
        lambda g: st.sampled_from([*GROUPS[g], "bogus", "", "null"]).map(lambda o: f"{g}={o}")
    )


_UNKNOWN = st.one_of(
    st.sampled_from(["bogus=1", "data.bogus=1", "+data.bogus=1", "optim.lr.x=1", "precision.scaler.nope=2"]),
    st.sampled_from(["=1", "steps", "steps=", "steps==2", "-m", "--bogus", "steps=1,2", "steps=range(3)"]),
    _ODD_TEXT.map(lambda s: f"{s}=1"),
)

OVERRIDE = st.one_of(st.sampled_from(LEAVES).flatmap(_override), _group_override(), _UNKNOWN)
# One real option of a group (each distinct set of options costs one full compose, ~0.1-0.3 s).
_VALID_GROUP = st.sampled_from(
    [f"{g}={o}" for g, opts in RUNNABLE_GROUPS.items() for o in opts] + [f"data={o}" for o in GROUPS["data"]]
)
_LEAF = st.sampled_from(LEAVES).flatmap(_override)
COMMAND = st.one_of(
    st.lists(OVERRIDE, min_size=1, max_size=4),  # anything
    st.tuples(st.lists(_VALID_GROUP, max_size=1), st.lists(_LEAF, min_size=1, max_size=3)).map(
        lambda gl: gl[0] + gl[1]
    ),  # real options, then values: reaches validation and check_inputs past the group choice
)


@st.composite
def runnable_command(draw) -> list[str]:
    """Overrides a quick real run accepts: runnable group options and in-range numbers."""
    out = [f"{g}={draw(st.sampled_from(opts))}" for g, opts in RUNNABLE_GROUPS.items() if draw(st.booleans())]
    if "model=dit_tiny" in out:  # an image model: image data
        out += ["data=synthetic_image", "data.frames=1"]
    out.append(f"optim.lr={draw(st.sampled_from(['1e-5', '1e-3', '0.1', '10.0']))}")
    out.append(f"seed={draw(st.integers(0, 2**31))}")
    if draw(st.booleans()):
        out.append(f"optim.grad_clip={draw(st.sampled_from(['0.0', '1.0']))}")
    if draw(st.booleans()):
        out.append(f"optim.warmup_steps={draw(st.integers(0, 3))}")
    return out


# ---- the path a command takes ------------------------------------------------------------------


class Composer:
    """Hydra's compose, with the config of each set of config-group choices composed once and key
    overrides applied the way compose applies them (ConfigLoaderImpl._apply_overrides_to_config):
    the full compose costs ~0.1-0.3 s, too much for hundreds of draws."""

    def __init__(self) -> None:
        self._bases: dict[tuple, typing.Any] = {}

    def __enter__(self) -> "Composer":
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        GlobalHydra.instance().clear()
        self._init = initialize_config_dir(config_dir=CONF_DIR, version_base="1.3")  # initializes here
        self._init.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._init.__exit__(*exc)

    def compose(self, overrides: list[str]):
        """(config, config-group choices), or raises what Hydra's compose raises."""
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import open_dict

        parsed = OverridesParser.create().parse_overrides(overrides)  # a grammar error, as compose raises it
        groups = [o.input_line for o in parsed if o.key_or_group in GROUPS]
        keys = [o for o in parsed if o.key_or_group not in GROUPS]
        if any(o.key_or_group.startswith("hydra") for o in keys):
            return self._full(overrides)
        if tuple(groups) not in self._bases:
            try:
                cfg, choices = self._full(groups)
                with open_dict(cfg):
                    cfg.pop("hydra")  # the job's config has none; copied for every draw, it is most of the cost
                self._bases[tuple(groups)] = (cfg, choices)
            except Exception as e:  # noqa: BLE001  (the same options fail the same way: raised again below)
                self._bases[tuple(groups)] = e
        base = self._bases[tuple(groups)]
        if isinstance(base, Exception):
            raise base
        cfg = copy.deepcopy(base[0])
        ConfigLoaderImpl._apply_overrides_to_config(keys, cfg)
        return cfg, base[1]

    def _full(self, overrides: list[str]):
        from hydra import compose

        cfg = compose(config_name="config", overrides=FAST + overrides, return_hydra_config=True)
        return cfg, dict(cfg.hydra.runtime.choices)


def outcome(composer: Composer, overrides: list[str]) -> tuple[str, str]:
    """("ok", "") when `python -m sweep` would start the run, ("exit2", the line) when it would refuse
    it, ("traceback", the error) when it would crash."""
    from sweep.__main__ import literal_password_arg
    from sweep.config import check_inputs, to_run_config
    from sweep.errors import config_error_line
    from sweep.job import swept_params

    try:
        if literal_password_arg(overrides) is not None:
            return "exit2", "password on the command line"
        cfg, choices = composer.compose(overrides)
        check_inputs(to_run_config(cfg))
        swept_params(cfg, overrides, choices)
    except Exception as exc:  # noqa: BLE001  (what the property is about)
        line = config_error_line(exc)
        if line is None:
            return "traceback", f"{type(exc).__name__}: {exc}"
        return "exit2", printed(line)
    return "ok", ""


def printed(line: str) -> str:
    """What `python -m sweep` prints for a config error line (sweep.errors.exit_config_error), as printed."""
    import contextlib
    import io

    from sweep.errors import exit_config_error

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        exit_config_error(line)
    return err.getvalue()


def run_job_in_process(run_dir: Path, overrides: list[str]) -> int:
    """`python -m sweep OVERRIDES` in this process, into run_dir: its exit status (0 or SystemExit's code)."""
    from hydra.core.global_hydra import GlobalHydra

    from sweep.job import run_job

    GlobalHydra.instance().clear()
    from hydra import initialize_config_dir

    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            GlobalHydra.instance().hydra.run(
                config_name="config",
                task_function=run_job,
                overrides=[*FAST, "threads=1", "ledger.enabled=false", f"hydra.run.dir={run_dir}", *overrides],
                with_log_configuration=False,
            )
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        GlobalHydra.instance().clear()
    return 0
