"""Database URLs and engines for both backends (DESIGN §5 "Backends").

* SQLite (default, embedded): a file; WAL, ``synchronous=NORMAL``, ``busy_timeout``, a 64 MiB
  page cache for writers; created with mode 0600. No ``mmap``: in WAL mode every commit by another
  connection makes a reader drop its page cache and, with ``mmap``, unmap the file, so a lookup
  right after a lease write took 0.8 ms instead of 0.15 ms for one indexed query (A/B on the
  2-core reference machine; a static database had suggested the opposite). Writers open
  transactions with ``BEGIN IMMEDIATE`` so that the write lock is taken up front (pysqlite's
  deferred BEGIN would otherwise fail with SQLITE_BUSY on upgrade; SQLAlchemy docs,
  dialects/sqlite.html "Serializable isolation / Savepoints / Transactional DDL").
* PostgreSQL: async writes through asyncpg, sync reads through psycopg 3.
* Hot paths (the recorder, the connector's :class:`~ledger.queries.LedgerClient`) run
  :class:`Prepared` statements through :class:`Sql` on DBAPI connections (see their docstrings).

Accepted ``--db`` values: a file path (``ledger.db``), ``sqlite:///path``, ``postgresql://…``
(driver suffixes are replaced by the right one for sync/async use).
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from ledger.errors import LedgerError

DEFAULT_DB = "sqlite:///semkv-ledger.db"
SQLITE_BUSY_TIMEOUT_MS = 30_000
PG_WRITER_PLAN_CACHE_MODE = "force_custom_plan"
"""The consumer's writer (asyncpg) plans every statement with its parameters. asyncpg keeps
server-side prepared statements per connection, and PostgreSQL switches one to a cached generic
plan after five executions; a generic plan made while ``blocks`` was small (a fresh ledger) stays
in use as it grows: the block load then used ``ix_blocks_engine_state`` and filtered every block
of the engine per hash (2.5 s for 256 hashes at 50k blocks). Writer at 64 events/txn: 1.3k block
events/s with cached plans, 7.4k with custom ones; no difference at 1024/txn (planning is
amortised over the batch). NOT for the connector's psycopg reads: planning its 3-table point
joins costs ~0.6 ms per query (a binary search makes ~10), against 0.1 ms with cached plans."""
SQLITE_WRITER_CACHE_KIB = 64 * 1024


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
        if not file.parent.is_dir():  # a mistyped path: no ledger there, and none may quietly start there
            what = "cannot create the ledger" if create else "no ledger at"
            raise LedgerError(f"{what} {path}: directory {file.parent} does not exist")
        if not create:
            raise LedgerError(f"no ledger at {path}: run `semkv-ledger migrate --db {path}` first")
        os.close(os.open(file, os.O_CREAT | os.O_WRONLY, 0o600))


def sqlite_open_uri(path: str, mode: str = "rw") -> str:
    """The SQLite URI that opens the file ``path`` and never creates it (sqlite.org/uri.html,
    ``mode=rw`` or ``ro``): a connection made after the ledger file was deleted fails with
    "unable to open database file" instead of quietly starting an empty ledger at the path.
    Only :func:`_ensure_sqlite_file` (``migrate``, a writer told to create) makes the file."""
    return f"{_sqlite_file(path)}?mode={mode}"


def _sqlite_file(path: str) -> str:
    return f"file:{quote(os.path.abspath(path))}"


def _sqlite_url(url: URL, driver: str) -> URL:
    """``url`` opening :func:`sqlite_open_uri` (pysqlite and aiosqlite pass ``mode`` into the URI)."""
    return url.set(drivername=driver, database=_sqlite_file(url.database or ""), query={"mode": "rw", "uri": "true"})


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
        if writer:
            # A transaction of 1024 engine events dirties ~1-3 MB of random blocks-index pages;
            # the default 2 MiB cache spilled them mid-transaction (tools/bench_ledger.py).
            cursor.execute(f"PRAGMA cache_size=-{SQLITE_WRITER_CACHE_KIB}")
        cursor.close()

    @event.listens_for(sync_engine, "begin")
    def _begin(conn) -> None:  # noqa: ANN001
        conn.exec_driver_sql(begin)


def sync_engine(db: str, *, writer: bool = False, create: bool | None = None, pool_size: int = 5,
                statement_timeout_s: float | None = None) -> Engine:
    """A synchronous engine (connector hot path, migrations, replay).

    Args:
        writer: on SQLite, open transactions with ``BEGIN IMMEDIATE``.
        create: create a missing SQLite file (mode 0600); defaults to ``writer``.
        statement_timeout_s: PostgreSQL only: the server cancels any statement running longer
            (``statement_timeout``, lock waits included); connecting gives up after as long
            (``connect_timeout``, at least 2 s: libpq's minimum); and the client drops a
            connection whose sent data goes unacknowledged that long (``tcp_user_timeout``) or
            whose idle peer stops answering keepalives (~11 s), so a network partition fails a
            call instead of hanging it. A peer that acknowledges but never answers (a frozen
            proxy) is not detected. None: no limit.

    Raises:
        LedgerError: unsupported URL, or a missing SQLite file when not creating.
    """
    url = normalize_url(db)
    if is_sqlite(url):
        _ensure_sqlite_file(url, writer if create is None else create)
        engine = create_engine(_sqlite_url(url, "sqlite+pysqlite"))
        _sqlite_listeners(engine, writer=writer)
        return engine
    connect_args = {}
    if statement_timeout_s is not None:
        ms = max(1, round(statement_timeout_s * 1000))
        connect_args = {"options": f"-c statement_timeout={ms}", "tcp_user_timeout": ms,
                        "connect_timeout": max(2, math.ceil(statement_timeout_s)),
                        "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3}
    return create_engine(url.set(drivername="postgresql+psycopg"), pool_size=pool_size, pool_pre_ping=True,
                         connect_args=connect_args)


def async_engine(db: str) -> AsyncEngine:
    """An asyncio engine: asyncpg for the consumer's writer on PostgreSQL. On SQLite (aiosqlite) the
    writer no longer uses it (it runs the sync recorder on one thread, ``ledger/writer.py``);
    tools/bench_ledger.py still does, to compare the two."""
    url = normalize_url(db)
    if is_sqlite(url):
        _ensure_sqlite_file(url, create=True)
        engine = create_async_engine(_sqlite_url(url, "sqlite+aiosqlite"))
        _sqlite_listeners(engine.sync_engine, writer=True)
        return engine
    return create_async_engine(url.set(drivername="postgresql+asyncpg"), pool_pre_ping=True,
                               connect_args={"server_settings": {"plan_cache_mode": PG_WRITER_PLAN_CACHE_MODE}})


# ------------------------------------------------------------------------------------------------
# prepared statements on DBAPI connections (the hot paths)
# ------------------------------------------------------------------------------------------------


class Prepared:
    """A Core statement compiled once per dialect into driver SQL plus a parameter binder.

    Why: building, compiling and executing a SQLAlchemy expression costs 0.5–1.3 ms per call on
    the 2-core reference machine (tools/results/connector-2026-11-29.md, before), against ~20 µs
    for the same SQL on a kept DBAPI connection. The statement is still written once, in Core;
    SQLAlchemy compiles it per dialect class and paramstyle (SQLite ``qmark``, psycopg
    ``pyformat`` with its bind casts, asyncpg ``numeric_dollar``), so the SQL lives in one place
    and stays correct on both backends. Constants bound at build time (``state == "live"``) keep
    their values; the binder from :meth:`compiled` fills in the rest by name.

    Values must already be driver-native (int, float, str, bytes, bool, None, or lists of them
    for PostgreSQL arrays): no SQLAlchemy type processing runs.
    """

    __slots__ = ("stmt", "_compiled")

    def __init__(self, stmt) -> None:  # noqa: ANN001 - any executable Core construct
        self.stmt = stmt
        self._compiled: dict[tuple[type, str], tuple[str, Any, Any]] = {}

    def compiled(self, dialect) -> tuple[str, Any, Any]:  # noqa: ANN001
        """``(sql, binder, row_getter)`` for ``dialect``.

        ``binder(params)`` fills constants in and returns what the cursor takes; ``row_getter(row)``
        is a C itemgetter for executemany over rows that hold every parameter.
        """
        key = (type(dialect), dialect.paramstyle)
        hit = self._compiled.get(key)
        if hit is None:
            hit = self._compiled[key] = _compile(self.stmt, dialect)
        return hit


def _compile(stmt, dialect) -> tuple[str, Any, Any]:  # noqa: ANN001
    compiled = stmt.compile(dialect=dialect)
    if "POSTCOMPILE" in compiled.string:
        raise ValueError("prepared statements cannot hold expanding IN lists")
    defaults = dict(compiled.params)
    if compiled.positiontup is None:
        def binder(params: Mapping[str, Any], defaults=defaults) -> dict:  # noqa: ANN001
            return {**defaults, **params}

        return compiled.string, binder, (lambda row: row)
    order = tuple(compiled.positiontup)

    def positional(params: Mapping[str, Any], order=order, defaults=defaults) -> tuple:  # noqa: ANN001
        return tuple(params[k] if k in params else defaults[k] for k in order)

    if len(order) > 1:
        getter = operator.itemgetter(*order)
    else:
        def getter(row: Mapping[str, Any], order=order) -> tuple:  # noqa: ANN001
            return tuple(row[k] for k in order)
    return compiled.string, positional, getter


class Sql:
    """Runs :class:`Prepared` statements on one DBAPI connection; the caller owns the transaction.

    Driver errors surface as the driver's own exceptions (``self.errors``); callers translate
    them at their boundary together with SQLAlchemy's (``ledger.recorder``, ``ledger.queries``).
    """

    __slots__ = ("dialect", "connection", "cursor", "errors", "owner")

    def __init__(self, dbapi_connection, dialect, owner: Connection | None = None) -> None:  # noqa: ANN001
        self.dialect = dialect
        self.connection = dbapi_connection
        self.cursor = dbapi_connection.cursor()
        self.errors: tuple[type[BaseException], ...] = (dialect.loaded_dbapi.Error,)
        self.owner = owner

    @classmethod
    def of(cls, conn: Connection) -> Sql:
        """The DBAPI connection under a SQLAlchemy ``Connection`` (inside its transaction).

        For aiosqlite/asyncpg this is SQLAlchemy's sync adapter, so it works under ``run_sync``.
        """
        return cls(conn.connection.dbapi_connection, conn.dialect, conn)

    def wrap(self, exc: BaseException) -> DBAPIError:
        """A driver error as SQLAlchemy would have raised it (``OperationalError`` for "database is
        locked", ``connection_invalidated`` on a lost connection), so callers that classify errors
        by SQLAlchemy type (the consumer's retry policy) see what they saw before. A lost
        connection also invalidates the owning SQLAlchemy connection."""
        try:
            lost = bool(self.dialect.is_disconnect(exc, self.connection, self.cursor))
        except Exception:  # noqa: BLE001 - classification only; an unknown error is not a disconnect
            lost = False
        wrapped = DBAPIError.instance(None, None, exc, self.dialect.loaded_dbapi.Error, connection_invalidated=lost,
                                      dialect=self.dialect)
        if lost and self.owner is not None:
            self.owner.invalidate(wrapped)
        return wrapped

    @property
    def is_sqlite(self) -> bool:
        return self.dialect.name == "sqlite"

    def one(self, prepared: Prepared, params: Mapping[str, Any]) -> Any:
        sql, bind, _ = prepared.compiled(self.dialect)
        cursor = self.cursor
        cursor.execute(sql, bind(params))
        return cursor.fetchone()

    def all(self, prepared: Prepared, params: Mapping[str, Any]) -> list:
        sql, bind, _ = prepared.compiled(self.dialect)
        cursor = self.cursor
        cursor.execute(sql, bind(params))
        return cursor.fetchall()

    def run(self, prepared: Prepared, params: Mapping[str, Any]) -> int:
        """Execute; returns the rows it changed (``rowcount``)."""
        sql, bind, _ = prepared.compiled(self.dialect)
        self.cursor.execute(sql, bind(params))
        return self.cursor.rowcount

    def many(self, prepared: Prepared, rows: Sequence[Mapping[str, Any]]) -> None:
        """executemany over rows holding every parameter of the statement."""
        if not rows:
            return
        sql, _, bind = prepared.compiled(self.dialect)
        if len(rows) == 1:
            self.cursor.execute(sql, bind(rows[0]))
        else:
            self.cursor.executemany(sql, list(map(bind, rows)))

    def many_positional(self, prepared: Prepared, rows: Sequence[Sequence[Any]]) -> int:
        """executemany over rows already in the statement's parameter order (SQLite's qmark);
        returns the rows changed, summed over ``rows``."""
        if not rows:
            return 0
        self.cursor.executemany(prepared.compiled(self.dialect)[0], rows)
        return self.cursor.rowcount

    def driver(self, sql: str, params: Any = None) -> None:
        """Plain driver SQL without parameters (``BEGIN IMMEDIATE``, ``LOCK TABLE``)."""
        if params is None:
            self.cursor.execute(sql)
        else:
            self.cursor.execute(sql, params)
