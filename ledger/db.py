"""Database URLs, engines and the DBAPI statement runner of both backends (DESIGN §5 "Backends").

What differs between SQLite and PostgreSQL is each backend's module (:mod:`ledger.backends`);
this module chooses the backend from the URL and hands over. Hot paths (the recorder, the
connector's :class:`~ledger.client.LedgerClient`) run :class:`~ledger.prepared.Prepared`
statements through :class:`Sql` on DBAPI connections.

Accepted ``--db`` values: a file path (``ledger.db``), ``sqlite:///path``, ``postgresql://…``
(driver suffixes are replaced by the right one for sync/async use).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError

from ledger.backends import Backend, backend_for, backend_named
from ledger.backends.base import AuditOpen
from ledger.prepared import Prepared

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

DEFAULT_DB = "sqlite:///semkv-ledger.db"


def normalize_url(db: str) -> URL:
    """Turn a ``--db`` value into a SQLAlchemy URL without a driver suffix: a bare path is a SQLite
    file, ``postgres://`` is read as ``postgresql://``.

    Raises:
        LedgerError: an unsupported backend.
    """
    if "://" not in db:
        db = f"sqlite:///{db}"
    url = make_url(db)
    if url.get_backend_name() == "postgres":  # libpq's own URI scheme, which SQLAlchemy 1.4+ no longer takes
        url = url.set(drivername="postgresql")  # (https://www.postgresql.org/docs/current/libpq-connect.html, 34.1.1.2)
    backend = backend_for(url)
    return url.set(drivername=backend.name)


def backend_of(db: str) -> Backend:
    """The backend a ``--db`` value names (raises LedgerError for an unsupported one)."""
    return backend_for(normalize_url(db))


def sync_engine(db: str, *, writer: bool = False, create: bool | None = None, pool_size: int = 5,
                statement_timeout_s: float | None = None) -> Engine:
    """A synchronous engine (connector hot path, migrations, replay).

    Args:
        writer: on SQLite, open transactions with ``BEGIN IMMEDIATE``.
        create: create a missing SQLite file (mode 0600); defaults to ``writer``.
        statement_timeout_s: PostgreSQL only: statements, lock waits and connecting give up after
            this long, and so does a connection whose peer stops answering
            (:meth:`ledger.backends.postgresql.PostgreSQLBackend.sync_engine`). None: no limit.

    Raises:
        LedgerError: unsupported URL, or a missing SQLite file when not creating.
    """
    url = normalize_url(db)
    return backend_for(url).sync_engine(url, writer=writer, create=writer if create is None else create,
                                        pool_size=pool_size, statement_timeout_s=statement_timeout_s)


@contextlib.contextmanager
def audit_engine(db: str) -> Iterator[AuditOpen]:
    """An engine for the commands that only read a ledger (``stats``, ``inspect``, ``replay``):
    yields ``(engine, read_only)``, ``read_only`` None when the ledger was opened as usual, else a
    :class:`~ledger.backends.base.ReadOnlyOpen` saying why and how it was opened read-only (a SQLite
    file on a read-only mount or of another user; :meth:`ledger.backends.sqlite.SQLiteBackend.audit_engine`).
    The engine is disposed on exit.

    Raises:
        LedgerError: unsupported URL, no ledger file, a ledger that cannot be read read-only, or
            one read as a snapshot that changed while it was read (on exit).
    """
    url = normalize_url(db)
    with backend_for(url).audit_engine(url) as opened:
        yield opened


def write_refusal(db: str) -> str | None:
    """Why this process cannot write the ledger ``db`` (a SQLite file or its directory on a
    read-only mount or not this user's to write), or None when nothing says so before a write.

    Raises:
        LedgerError: unsupported URL, an in-memory SQLite URL or a path in a missing directory.
    """
    url = normalize_url(db)
    return backend_for(url).write_refusal(url)


def async_engine(db: str) -> AsyncEngine:
    """An asyncio engine: asyncpg for the consumer's writer on PostgreSQL. On SQLite (aiosqlite) the
    writer no longer uses it (it runs the sync recorder on one thread, ``ledger/writer.py``);
    tools/bench_ledger.py still does, to compare the two."""
    url = normalize_url(db)
    return backend_for(url).async_engine(url)


class Sql:
    """Runs :class:`Prepared` statements on one DBAPI connection; the caller owns the transaction.

    Driver errors surface as the driver's own exceptions (``self.errors``); callers translate
    them at their boundary together with SQLAlchemy's (``ledger.recorder``, ``ledger.connections``).
    """

    __slots__ = ("dialect", "backend", "connection", "cursor", "errors", "owner")

    def __init__(self, dbapi_connection, dialect, owner: Connection | None = None) -> None:  # noqa: ANN001
        self.dialect = dialect
        self.backend = backend_named(dialect.name)
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

    def one(self, prepared: Prepared, params: Mapping[str, Any]) -> Any:
        sql, bind = prepared.compiled(self.dialect)
        cursor = self.cursor
        cursor.execute(sql, bind(params))
        return cursor.fetchone()

    def all(self, prepared: Prepared, params: Mapping[str, Any], *, binary: bool = False) -> list:
        """Every row. ``binary``: on psycopg, results in PostgreSQL's binary format (the same Python
        values; ``bytea`` without hex text: ~45 % less client CPU and ~25 % less time reading the log,
        tools/results/ledger-replay-2026-12-05.md); other drivers ignore it."""
        sql, bind = prepared.compiled(self.dialect)
        cursor = self.cursor
        if binary and self.dialect.driver == "psycopg":
            cursor.execute(sql, bind(params), binary=True)
        else:
            cursor.execute(sql, bind(params))
        return cursor.fetchall()

    def run(self, prepared: Prepared, params: Mapping[str, Any]) -> int:
        """Execute; returns the rows it changed (``rowcount``)."""
        sql, bind = prepared.compiled(self.dialect)
        self.cursor.execute(sql, bind(params))
        return self.cursor.rowcount

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
