"""Schema migrations (Alembic, ``migrations/`` at the repository root) and the schema-version gate.

Every command that opens a ledger calls :func:`check_schema`, which refuses a database that is
not at the head revision with :class:`~ledger.errors.SchemaOutOfDate` naming ``semkv-ledger migrate``.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection

from ledger.db import sync_engine
from ledger.errors import LedgerError, SchemaOutOfDate

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config() -> Config:
    """An Alembic config pointing at the repository's ``migrations/`` folder.

    Raises:
        LedgerError: the folder is missing (a non-editable install without the migrations).
    """
    if not (MIGRATIONS_DIR / "env.py").exists():
        raise LedgerError(f"migrations not found at {MIGRATIONS_DIR}; install semkv-ledger from its repository (pip install -e .)")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


@cache
def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "migrations/ has no revision"
    return head


def current_revision(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def upgrade(db: str, revision: str = "head") -> tuple[str | None, str]:
    """Upgrade the ledger at ``db`` to ``revision``; returns (revision before, revision after)."""
    engine = sync_engine(db, writer=True)
    try:
        with engine.connect() as conn:
            before = current_revision(conn)
        config = alembic_config()
        with engine.begin() as conn:
            config.attributes["connection"] = conn
            command.upgrade(config, revision)
        with engine.connect() as conn:
            return before, current_revision(conn) or ""
    finally:
        engine.dispose()


def check_schema(conn: Connection, db: str) -> None:
    """Raise :class:`SchemaOutOfDate` unless the database is at the head revision."""
    current = current_revision(conn)
    if current != head_revision():
        raise SchemaOutOfDate(db, current, head_revision())
