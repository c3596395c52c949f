"""URLs that may carry a password (a database, a tracking server): what may be printed or saved of them.

A password in a URL never reaches a log or a file: `mask_url` is what gets printed. The ledger
(sweep/search/ledger.py) and the trackers (sweep/run/mlflow_sink.py) both mask through here.
"""

from __future__ import annotations

import re

SECRET_QUERY_KEYS = ("password", "passwd", "pwd")
"""Query parameters that carry a password (postgresql://ann@db/sweeps?password=...): libpq and the
MySQL drivers accept one there as well as in the user info."""


def url_has_password(url: str) -> bool:
    """Whether a storage URL spells out a password, in its user info or as a query parameter."""
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
    except Exception:  # noqa: BLE001  (not an SQLAlchemy URL: user:secret@ anywhere after the scheme)
        return bool(re.search(r"://[^@]*:[^@]*@", url))
    return parsed.password is not None or any(k.lower() in SECRET_QUERY_KEYS for k in parsed.query)


def mask_url(url: str) -> str:
    """The storage URL with its password (user info or query) replaced by ***, for anything printed or saved."""
    if "://" not in url:
        return url
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
        parsed = parsed.update_query_dict({k: "***" for k in parsed.query if k.lower() in SECRET_QUERY_KEYS})
        return parsed.render_as_string(hide_password=True).replace("%2A%2A%2A", "***")
    except Exception:  # noqa: BLE001  (not an SQLAlchemy URL: hide everything between scheme and host, and any query)
        scheme, rest = url.split("://", 1)
        rest = rest.split("?", 1)[0] + ("?***" if "?" in rest else "")
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}" if "@" in rest else f"{scheme}://{rest}"
