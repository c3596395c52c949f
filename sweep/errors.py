"""How a user mistake reaches the terminal: one line, `sweep: config error: <key>: <what>`, exit status 2.

The one place that prints it. `python -m sweep` (sweep/__main__.py) turns what Hydra and OmegaConf
raise into that line (`config_error_line`); code Hydra calls, where a raised error would not reach
__main__ as it is, exits through `exiting_on_config_error`: the task function (Hydra prints its own
report first) and callbacks (Hydra turns their exceptions into a warning and goes on).
"""

from __future__ import annotations

import contextlib
import re
import sys
from typing import Iterator, NoReturn

from hydra.errors import HydraException, OverrideParseException
from omegaconf.errors import OmegaConfBaseException

from sweep.config import ConfigError

PREFIX = "sweep: config error: "


def config_error_line(exc: BaseException) -> str | None:
    """One line for a user mistake in the config or command line; None for anything else (a bug)."""
    if isinstance(exc, ConfigError):
        return str(exc)
    if isinstance(exc.__cause__, ConfigError):  # raised inside a plugin Hydra instantiates (the Optuna sweeper)
        return str(exc.__cause__)
    cause = exc.__cause__ if isinstance(exc.__cause__, OmegaConfBaseException) else None
    if isinstance(exc, OmegaConfBaseException) or cause is not None:
        err = cause or exc
        key = getattr(err, "full_key", None)
        msg = str(err).split("\n")[0].strip()
        return f"{key}: {msg}" if key else msg
    if isinstance(exc, OverrideParseException) and (words := _several_overrides(exc.override)):
        return (
            f"{exc.override!r}: one argument holding {len(words)} overrides (quoted together); give each key=value"
            f" as an argument of its own: {' '.join(words)} (or quote a value that holds spaces: key='a b')"
        )
    if isinstance(exc, HydraException) or _raised_reading_overrides(exc):
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        options = getattr(exc, "options", None)
        head = lines[0] if lines else type(exc).__name__
        if not isinstance(exc, HydraException):
            nulls = [a.split("=", 1)[0].lstrip("+~") for a in sys.argv[1:] if _is_null_override(a)]
            named = f"{', '.join(nulls)}: " if nulls and "NoneType" in head else ""
            head = f"{named}an override Hydra cannot use: {head}"
        return f"{head} (choose one of: {', '.join(options)})" if options else head
    return None


# Hydra modules that only read the command line's overrides, the defaults list they make and the config
# files they name: a plain ValueError/TypeError raised in them (or in what they call) is about the
# user's input (`precision=null`: "Config group override must be a string or a list. Got NoneType";
# a NUL byte in an option name: "embedded null byte" from os.path), not a bug.
_HYDRA_INPUT_MODULES = (
    "hydra/_internal/defaults_list.py",
    "hydra/core/override_parser/",
    "hydra/_internal/config_repository.py",
    "hydra/_internal/core_plugins/file_config_source.py",
)


def _raised_reading_overrides(exc: BaseException) -> bool:
    """Whether the innermost Hydra frame of the exception's traceback is one of _HYDRA_INPUT_MODULES."""
    if not isinstance(exc, (ValueError, TypeError)):
        return False
    innermost_hydra = None
    tb = exc.__traceback__
    while tb is not None:
        where = tb.tb_frame.f_code.co_filename.replace("\\", "/")
        if "/hydra/" in where:
            innermost_hydra = where
        tb = tb.tb_next
    return innermost_hydra is not None and any(m in innermost_hydra for m in _HYDRA_INPUT_MODULES)


_OVERRIDE_START = re.compile(r"^[+~]*[A-Za-z_][\w.@/-]*=")


def _several_overrides(arg: str) -> list[str]:
    """The overrides one command-line word holds when it is several joined by spaces (`"optim=adamw optim.lr=1"`,
    which Hydra's parser reports as "mismatched input '=' expecting <EOF>", naming no key); [] otherwise, so a
    quoted value with spaces in it stays Hydra's own message."""
    words = arg.split()
    return words if len(words) > 1 and all(_OVERRIDE_START.match(w) for w in words) else []


def _is_null_override(arg: str) -> bool:
    """`key=null` (or `key=~`) on the command line: a config group given no option (Hydra's message says
    "Got NoneType" and not which key)."""
    key, eq, value = arg.partition("=")
    return bool(eq) and not key.startswith("-") and value.strip().lower() in ("null", "~")


def exit_config_error(line: ConfigError | str) -> NoReturn:
    """Print the one line and exit with status 2."""
    print(f"{PREFIX}{one_line(str(line))}", file=sys.stderr)
    sys.exit(2)


def one_line(text: str) -> str:
    """`text` with its line breaks and other control characters escaped (`\\n`): a value quoted on the
    command line may hold any of them, and the message that names it must stay one line."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


@contextlib.contextmanager
def exiting_on_config_error() -> Iterator[None]:
    """A ConfigError raised inside is printed as the one line, and the process exits with status 2."""
    try:
        yield
    except ConfigError as e:
        exit_config_error(e)
