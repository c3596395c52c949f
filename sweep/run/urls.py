"""URLs that may carry a secret (a database, a tracking server): what may be printed or saved of them.

A secret in a URL never reaches a log or a file: `mask_url` is what gets printed. The ledger
(sweep/search/ledger.py) and the trackers (sweep/run/mlflow_sink.py) both mask through here, and
`python -m sweep` refuses a URL with one on the command line (`url_has_password`), before Hydra saves it.
What other libraries log (urllib3's "Retrying ... /?token=..." when a tracking server is down) is scrubbed by
`SecretFilter`, which `install_secret_filter` puts on every handler of the logging tree (Hydra's console and
__main__.log, ours): a user-info password and the value of every secret query key, in any message.
"""

from __future__ import annotations

import logging
import os
import re
from urllib.parse import parse_qsl

SECRET_QUERY_KEYS = (
    "password",
    "passwd",
    "pwd",
    "token",
    "secret",
    "api_key",
    "apikey",
    "api-key",
    "access_key",
    "accesskey",
    "auth",
    "credential",
    "private",
    "signature",
    "passphrase",
)
"""Parts of a query parameter's name that mark it as carrying a secret, matched case-insensitively as
substrings: libpq's `password` and `sslpassword`, SQLAlchemy's and the MySQL drivers' `passwd`/`pwd`, a
tracking server's `token`/`access_token`/`api_key`, a cloud store's `secret_access_key`/`sas` `signature`,
`authSource`-like keys too (masking a non-secret costs nothing; saving a secret does). A key is also
secret when it is exactly `sig`, `key` (signed URLs) or `pass` (a substring would catch `passive`)."""
_SECRET_EXACT = ("sig", "key", "pass")


def is_secret_key(key: str) -> bool:
    """Whether a URL query parameter of this name carries a secret (SECRET_QUERY_KEYS)."""
    k = str(key).strip().lower()
    return k in _SECRET_EXACT or any(part in k for part in SECRET_QUERY_KEYS)


def _query_keys(url: str) -> list[str]:
    """Every query parameter name of the URL, parsed leniently (any scheme, blank values kept)."""
    query = url.split("?", 1)[1] if "?" in url else ""
    return [k for k, _ in parse_qsl(query.split("#", 1)[0], keep_blank_values=True)] or (
        re.findall(r"[?&;]([^=&;#]+)=", "?" + query) if query else []
    )


def url_has_password(url: str) -> bool:
    """Whether a URL spells out a secret: a password in its user info, or a query parameter whose name
    marks a secret (is_secret_key)."""
    if any(is_secret_key(k) for k in _query_keys(url)):
        return True
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
    except Exception:  # noqa: BLE001  (not an SQLAlchemy URL: user:secret@ anywhere after the scheme)
        return bool(re.search(r"://[^@/?#]*:[^@]*@", url))
    return parsed.password is not None or any(is_secret_key(k) for k in parsed.query)


def mask_url(url: str) -> str:
    """The URL with its secrets (user info password, secret query parameters) replaced by ***, for
    anything printed or saved."""
    if "://" not in url:
        return url
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
        parsed = parsed.update_query_dict({k: "***" for k in parsed.query if is_secret_key(k)})
        return parsed.render_as_string(hide_password=True).replace("%2A%2A%2A", "***")
    except Exception:  # noqa: BLE001  (not an SQLAlchemy URL: hide everything between scheme and host, and any query)
        scheme, rest = url.split("://", 1)
        rest = rest.split("?", 1)[0] + ("?***" if "?" in rest else "")
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}" if "@" in rest else f"{scheme}://{rest}"


def written_secrets(url: str) -> list[str]:
    """The secret values a URL spells out, as written: its user-info password and its secret query parameters'
    values (is_secret_key), blank ones left out."""
    found = (
        [v for k, v in parse_qsl(url.split("?", 1)[1], keep_blank_values=True) if is_secret_key(k)]
        if "?" in url
        else []
    )
    userinfo = re.match(r"[^:/?#]+://([^@/?#]*(?:/[^@?#]*)?)@", url)
    if userinfo and ":" in userinfo.group(1):
        found.append(userinfo.group(1).split(":", 1)[1])
    return [v for v in found if v]


def url_secrets(url: str) -> list[str]:
    """The secret values a URL spells out (written_secrets), as written and percent-decoded, longest first: what
    must not appear in a message about it."""
    from urllib.parse import unquote

    values = {s for v in written_secrets(url) for s in (v, unquote(v))}
    return sorted((v for v in values if len(v) >= 3), key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """`text` (an error message about `url`) with the URL masked and each of its secrets replaced by ***,
    however the message spells the URL (a path appended to it, a query re-quoted, no scheme)."""
    if not url:
        return text
    text = text.replace(url, mask_url(url))
    for secret in url_secrets(url):
        text = text.replace(secret, "***")
    return text


_USERINFO = re.compile(r"([A-Za-z][\w+.-]*://[^\s/@:'\"<>]*):([^\s'\"<>@]+)@")
_QUERY_PARAM = re.compile(r"([?&;])([^=&;#\s'\"<>?]+)=([^&;#\s'\"<>]*)")
_KNOWN: set[str] = set()
"""Secret values of the URLs this process was given (install_secret_filter): scrubbed wherever they appear."""
SECRET_ENV_URLS = ("MLFLOW_TRACKING_URI", "SWEEP_LEDGER_URL")
"""Variables whose value is a URL that may hold a secret a library could log."""
SECRET_ENV = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
"""Variables whose value is a secret."""


def scrub_secrets(text: str) -> str:
    """`text` with every user-info password (scheme://user:***@) and every secret query value (?token=***) masked,
    whatever URL it belongs to, and every secret this process was given (install_secret_filter) replaced by ***."""
    text = _USERINFO.sub(lambda m: f"{m[1]}:***@", text)
    text = _QUERY_PARAM.sub(lambda m: f"{m[1]}{m[2]}=***" if m[3] and is_secret_key(m[2]) else m[0], text)
    for secret in sorted(_KNOWN, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


class SecretFilter(logging.Filter):
    """A handler filter that scrubs every record it passes (scrub_secrets): its message, its traceback, its stack."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001  (a record that cannot be formatted: the handler reports it as it would)
            return True
        clean = scrub_secrets(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub_secrets(record.exc_text)
        if record.stack_info:
            record.stack_info = scrub_secrets(record.stack_info)
        return True


_FILTER = SecretFilter()


def install_secret_filter(*urls: str | None) -> None:
    """Put SecretFilter on every handler of the logging tree (the root's, Hydra's job logging's, any library's),
    once each, and remember the secrets of `urls`, of SECRET_ENV_URLS' and SECRET_ENV's values. Called where
    handlers are (re)made: each time Hydra configures logging (a run's start, each job's), after a tracker opens."""
    for url in (*urls, *(os.environ.get(name) for name in SECRET_ENV_URLS)):
        if url and "://" in url:
            _KNOWN.update(url_secrets(url))
    _KNOWN.update(v for v in (os.environ.get(name) for name in SECRET_ENV) if v and len(v) >= 3)
    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if _FILTER not in handler.filters:
                handler.addFilter(_FILTER)
