"""Optuna's schema check, with its migration scripts parsed once per process instead of at every use.

Opening an Optuna RDB storage checks the database's alembic revision against the head of the installed Optuna's
migration scripts (optuna/storages/_rdb/alembic/versions: ten Python files, each defining SQLAlchemy models).
Optuna 5.0 builds a new alembic `ScriptDirectory` for every question it asks of them, and each one executes every
script again: three times for a new SQLite ledger (the head for the stamp, the stamp, the check), once for each
later open. The scripts are the installed package's own files, fixed for the life of the process, and a
`ScriptDirectory` keeps only what it read from them, so one parse answers every storage the process opens, whatever
its URL (a `ScriptDirectory` never reads the config's `sqlalchemy.url`).

Measured (`python bench/ledger_open.py`, docs/overhead.md item 8): a new SQLite ledger opened in 53-72 ms against
155-205 ms, an existing one in ~12 ms against 46-48 ms. Each sweep process opens its ledger once
(sweep.search.ledger.open_storage); the gain is per process, and a test session opens hundreds.

Optuna's own storage code does everything else as before, `optuna storage upgrade` included (alembic's command
builds its own ScriptDirectory). Where a later Optuna has no `_VersionManager._create_alembic_script`, nothing is
changed and its storages open as Optuna opens them.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

_LOCK = threading.Lock()


def parse_migrations_once() -> bool:
    """Make this process's Optuna RDB storages share one parse of Optuna's migration scripts. Idempotent; False where
    this Optuna has no such step to share (nothing is changed then)."""
    try:
        from optuna.storages._rdb.storage import _VersionManager
    except ImportError:
        return False
    create = getattr(_VersionManager, "_create_alembic_script", None)
    if create is None:
        return False
    if getattr(create, "parsed_once", False):
        return True
    _VersionManager._create_alembic_script = _shared(create)
    return True


def _shared(create: Callable[[Any], Any]) -> Callable[[Any], Any]:
    kept: list = []

    def create_alembic_script(self: Any) -> Any:
        with _LOCK:
            if not kept:
                kept.append(create(self))
            return kept[0]

    create_alembic_script.parsed_once = True  # type: ignore[attr-defined]
    create_alembic_script.__doc__ = "Optuna's ScriptDirectory of its migration scripts, parsed once per process."
    return create_alembic_script
