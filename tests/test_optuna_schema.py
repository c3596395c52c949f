"""sweep/search/optuna_schema.py: Optuna's migration scripts parsed once per process, and its schema check unchanged."""

from __future__ import annotations

import os
import sqlite3

import optuna
import pytest
from alembic.config import Config
from alembic.script import ScriptDirectory
from optuna.storages._rdb import storage as rdb

from sweep.search import ledger  # noqa: F401  (installs the shared parse, as every sweep process does)
from sweep.search.ledger import open_storage
from sweep.search.optuna_schema import parse_migrations_once


def optunas_own_scripts() -> ScriptDirectory:
    """Optuna's migration scripts read afresh with alembic's own API, not through the shared parse."""
    folder = os.path.join(os.path.dirname(rdb.__file__), "alembic")
    config = Config()
    config.set_main_option("script_location", folder)
    return ScriptDirectory.from_config(config)


def revision_of(db) -> str:
    with sqlite3.connect(db) as c:
        return c.execute("select version_num from alembic_version").fetchone()[0]


def test_new_and_reopened_ledgers_share_one_parse_of_the_scripts(tmp_path, monkeypatch):
    parses = []
    from_config = ScriptDirectory.from_config.__func__
    monkeypatch.setattr(
        ScriptDirectory, "from_config", classmethod(lambda cls, c: parses.append(1) or from_config(cls, c))
    )
    for i in range(3):
        open_storage(f"sqlite:///{tmp_path / f'{i}.db'}")  # new: a head for the stamp, the stamp, the check
        optuna.storages.RDBStorage(f"sqlite:///{tmp_path / f'{i}.db'}")  # reopened: the check
    assert len(parses) <= 1  # Optuna alone parses them 12 times here; none when this process parsed them already


def test_a_new_ledger_is_stamped_with_the_head_of_optunas_scripts(tmp_path):
    db = tmp_path / "ledger.db"
    open_storage(f"sqlite:///{db}")
    assert revision_of(db) == optunas_own_scripts().get_current_head()


def test_a_ledger_of_an_older_schema_is_still_refused_with_optunas_advice(tmp_path):
    db = tmp_path / "old.db"
    optuna.storages.RDBStorage(f"sqlite:///{db}")
    scripts = optunas_own_scripts()
    older = scripts.get_revision(scripts.get_current_head()).down_revision
    with sqlite3.connect(db) as c:
        c.execute("update alembic_version set version_num = ?", (older,))
    with pytest.raises(RuntimeError, match="no longer compatible.*optuna storage upgrade"):
        optuna.storages.RDBStorage(f"sqlite:///{db}")


def test_installing_it_again_changes_nothing():
    installed = rdb._VersionManager._create_alembic_script
    assert parse_migrations_once() and parse_migrations_once()
    assert rdb._VersionManager._create_alembic_script is installed and installed.parsed_once
