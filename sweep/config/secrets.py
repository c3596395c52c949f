"""Secrets a config must not spell out, because Hydra writes them down: the command line into every run's
.hydra/overrides.yaml, multirun.yaml and its log; the composed config into every .hydra/config.yaml. A password,
token or key comes in through the environment instead (`ledger.storage: ${oc.env:SWEEP_LEDGER_URL}`), which
Hydra saves unresolved.

- `literal_password_arg(argv)`: the command line, checked by `python -m sweep` before Hydra starts;
- `check_no_literal_secrets(config)`: the composed config (a --config-dir experiment, a config file), checked
  before Hydra writes any file: at the start of a run or a sweep (sweep.callbacks.OutputDirCheck) and for each
  cell of a sweep, whose experiment may differ per cell (the grid and Optuna sweepers).
"""

from __future__ import annotations

import re
from typing import Any

from sweep.config.schema import ConfigError


def literal_password_arg(argv: list[str]) -> str | None:
    """The key of the first command-line override that spells out a storage password, if any.

    Hydra writes every override into .hydra/overrides.yaml, multirun.yaml and its log before any of
    our code runs, so a password must come in through the environment instead. Every URL in an
    override's value counts, however it is written (ledger.storage=URL, ledger={storage:URL}, a sweep
    of URLs), and a password counts wherever the URL carries it (user:secret@, ?password=, and any query key
    that names a secret: ?sslpassword=, ?token=, ?api_key=, sweep.run.urls.is_secret_key).
    """
    from sweep.run.urls import url_has_password

    for arg in argv:
        if "://" in arg and any(url_has_password(url) for url in urls_in_override(arg)):
            return arg.split("=", 1)[0].strip("'\"")
    return None


def urls_in_override(arg: str) -> list[str]:
    """The URL-looking strings in an override's value: parsed with Hydra's grammar, or, where that
    fails (an unquoted ?password=... is not valid grammar, yet still reaches Hydra's log), found in the text."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        (override,) = OverridesParser.create().parse_overrides([arg])
        return [s for s in _strings(override.value()) if "://" in s]
    except Exception:  # noqa: BLE001  (any parse failure: fall back to the raw text)
        return re.findall(r"[A-Za-z][\w+.-]*://[^\s'\"{}\[\],]*", arg)


def _strings(value) -> list[str]:
    """Every string inside a parsed override value (dicts, lists, a choice sweep's options)."""
    from hydra.core.override_parser.types import ChoiceSweep

    if isinstance(value, str):
        return [value]
    if isinstance(value, ChoiceSweep):
        value = value.list
    if isinstance(value, dict):
        value = list(value.values())
    return [s for v in value for s in _strings(v)] if isinstance(value, (list, tuple)) else []


_INTERPOLATION = re.compile(r"\$\{[^${}]*\}")


def without_interpolations(text: str) -> str:
    """`text` with every ${...} interpolation (nested ones too) taken out: what it spells out literally."""
    while True:
        stripped = _INTERPOLATION.sub("", text)
        if stripped == text:
            return text
        text = stripped


def spells_out_secret(value: str) -> bool:
    """Whether a URL as written (unresolved) holds a secret literally: a user-info password or a secret query
    value that is not an ${oc.env:...} (or other) interpolation (sweep.run.urls.written_secrets)."""
    from sweep.run.urls import written_secrets

    literal = without_interpolations(value)
    return "://" in literal and bool(written_secrets(literal))


def literal_secret_keys(config: Any) -> list[str]:
    """The dotted keys of a composed config (a DictConfig, with or without its `hydra` node) whose value spells out a
    secret: any URL with a password or a secret query key (ledger.storage, logger.mlflow.tracking_uri, a URL in
    model.kwargs, ...), a sweep of URLs in hydra.sweeper.params, and a secret-named variable of hydra.job.env_set
    (MLFLOW_TRACKING_PASSWORD) given a literal value. The command line's own overrides are literal_password_arg's."""
    from omegaconf import OmegaConf

    from sweep.run.urls import is_secret_key

    tree = OmegaConf.to_container(config, resolve=False, enum_to_str=True)
    hydra = tree.pop("hydra", None) or {}
    found: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else None
        if items is None:
            if isinstance(node, str) and spells_out_secret(node):
                found.append(prefix.rstrip("."))
            return
        for k, v in items:
            walk(v, f"{prefix}{k}.")

    walk(tree, "")
    params = (hydra.get("sweeper") or {}).get("params") or {}
    for key, value in params.items():
        if any(spells_out_secret(url) for url in urls_in_override(f"{key}={value}")):
            found.append(f"hydra.sweeper.params.{key}")
    for name, value in ((hydra.get("job") or {}).get("env_set") or {}).items():
        text = str(value)
        if spells_out_secret(text) or (is_secret_key(name) and without_interpolations(text)):
            found.append(f"hydra.job.env_set.{name}")
    return found


def check_no_literal_secrets(config: Any) -> None:
    """ConfigError (one line, no secret in it) naming the first key of the composed config that spells out a secret."""
    keys = literal_secret_keys(config)
    if not keys:
        return
    key = keys[0]
    how = {
        "ledger.storage": "write ledger.storage: ${oc.env:SWEEP_LEDGER_URL} and export SWEEP_LEDGER_URL",
        "logger.mlflow.tracking_uri": "write logger.mlflow.tracking_uri: ${oc.env:MY_URI} and export MY_URI, or leave"
        " it null and export MLFLOW_TRACKING_URI (or MLFLOW_TRACKING_PASSWORD)",
    }.get(key, "write it as ${oc.env:VAR} and export VAR")
    raise ConfigError(
        f"{key}: a config file spells out a password or other secret (a token, a key), and Hydra would copy it into"
        f" every run's .hydra/config.yaml; {how}"
    )
