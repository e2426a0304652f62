"""Database URLs and engines for both backends (DESIGN §5 "Backends").

* SQLite (default, embedded): a file; WAL, ``synchronous=NORMAL``, ``busy_timeout``; created
  with mode 0600. Writers open transactions with ``BEGIN IMMEDIATE`` so that the write lock is
  taken up front (pysqlite's deferred BEGIN would otherwise fail with SQLITE_BUSY on upgrade;
  SQLAlchemy docs, dialects/sqlite.html "Serializable isolation / Savepoints / Transactional DDL").
* PostgreSQL: async writes through asyncpg, sync reads through psycopg 3.

Accepted ``--db`` values: a file path (``ledger.db``), ``sqlite:///path``, ``postgresql://…``
(driver suffixes are replaced by the right one for sync/async use).
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from ledger.errors import LedgerError

DEFAULT_DB = "sqlite:///semkv-ledger.db"
SQLITE_BUSY_TIMEOUT_MS = 30_000


def normalize_url(db: str) -> URL:
    """Turn a ``--db`` value into a SQLAlchemy URL without a driver suffix.

    Raises:
        LedgerError: an unsupported backend.
    """
    if "://" not in db:
        db = f"sqlite:///{db}"
    url = make_url(db)
    backend = url.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise LedgerError(f"unsupported ledger database {backend!r}: use a SQLite file or postgresql://")
    return url.set(drivername=backend)


def is_sqlite(url: URL) -> bool:
    return url.get_backend_name() == "sqlite"


def _ensure_sqlite_file(url: URL, create: bool) -> None:
    path = url.database
    if not path or path == ":memory:":
        raise LedgerError("the ledger needs a SQLite file, not an in-memory database")
    file = Path(path)
    if not file.exists():
        if not create:
            raise LedgerError(f"no ledger at {path}: run `semkv-ledger migrate --db {path}` first")
        file.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(file, os.O_CREAT | os.O_WRONLY, 0o600))


def _sqlite_listeners(sync_engine: Engine, *, writer: bool) -> None:
    begin = "BEGIN IMMEDIATE" if writer else "BEGIN"

    @event.listens_for(sync_engine, "connect")
    def _connect(dbapi_connection, _record) -> None:  # noqa: ANN001
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(sync_engine, "begin")
    def _begin(conn) -> None:  # noqa: ANN001
        conn.exec_driver_sql(begin)


def sync_engine(db: str, *, writer: bool = False, create: bool | None = None, pool_size: int = 5) -> Engine:
    """A synchronous engine (connector hot path, migrations, replay).

    Args:
        writer: on SQLite, open transactions with ``BEGIN IMMEDIATE``.
        create: create a missing SQLite file (mode 0600); defaults to ``writer``.

    Raises:
        LedgerError: unsupported URL, or a missing SQLite file when not creating.
    """
    url = normalize_url(db)
    if is_sqlite(url):
        _ensure_sqlite_file(url, writer if create is None else create)
        engine = create_engine(url.set(drivername="sqlite+pysqlite"))
        _sqlite_listeners(engine, writer=writer)
        return engine
    return create_engine(url.set(drivername="postgresql+psycopg"), pool_size=pool_size, pool_pre_ping=True)


def async_engine(db: str) -> AsyncEngine:
    """An asyncio engine for the consumer's writer (aiosqlite or asyncpg)."""
    url = normalize_url(db)
    if is_sqlite(url):
        _ensure_sqlite_file(url, create=True)
        engine = create_async_engine(url.set(drivername="sqlite+aiosqlite"))
        _sqlite_listeners(engine.sync_engine, writer=True)
        return engine
    return create_async_engine(url.set(drivername="postgresql+asyncpg"), pool_pre_ping=True)
