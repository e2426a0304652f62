"""The SQLite writer connection: one pysqlite connection that runs whole recorder transactions, and
its WAL checkpointer (:mod:`ledger.checkpoint`). Driven by :mod:`ledger.writer` on a thread of the
consumer's process, or by :mod:`ledger.writer_process` in a child process."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from ledger import recorder
from ledger.checkpoint import BACKSTOP_PAGES, WalCheckpointer
from ledger.db import normalize_url, sync_engine
from ledger.decide import AppendResult
from ledger.errors import PersistenceError
from ledger.migrate import check_schema
from ledger.recorder import persistence_error


def check_writable(db: str) -> None:
    """Refuse a ledger this user cannot write at start-up, not at its first transaction (SQLite
    opens a read-only file and fails only when it writes).

    Raises:
        PersistenceError: (permanent) the file, or its directory (WAL and shm files live beside
            it), is not writable.
    """
    path = Path(normalize_url(db).database or "")
    for target in (path, path.parent):
        if target.exists() and not os.access(target, os.W_OK):
            raise PersistenceError(f"the ledger {path} is not writable by this user ({target} is read-only)",
                                   transient=False)


class SQLiteWriterConnection:
    """One pysqlite writer connection and its WAL checkpointer; every method runs on ONE thread.

    ``conn`` is replaced before the next transaction when SQLAlchemy invalidated it (a disconnect
    error). Used by the in-process writer thread and by the writer process alike.
    """

    def __init__(self, db: str) -> None:
        self.db = db
        self.engine: Engine = sync_engine(db, writer=True, pool_size=1)
        self.conn: Connection | None = None
        self.checkpointer = WalCheckpointer(normalize_url(db).database or "")

    def connect(self) -> None:
        """Open the connection now (the writer process does, to report a bad database at start).

        Raises:
            PersistenceError: the database cannot be opened or written.
        """
        check_writable(self.db)
        try:
            self._connection()
        except (SQLAlchemyError, sqlite3.Error) as exc:
            raise _error(exc) from exc

    def _connection(self) -> Connection:
        conn = self.conn
        if conn is None or conn.invalidated or conn.closed:
            if conn is not None:
                conn.close()
            conn = self.conn = self.engine.connect()
            # checkpoints run on the checkpointer's thread; SQLite's own only as a backstop
            conn.connection.driver_connection.execute(f"PRAGMA wal_autocheckpoint={BACKSTOP_PAGES}")
        return conn

    def check_schema(self) -> None:
        check_writable(self.db)
        conn = self._connection()
        try:
            check_schema(conn, self.db)
        finally:
            conn.rollback()  # end Alembic's read; the writer's transactions begin on their own

    def append(self, items: Sequence[recorder.Input], now: float | None) -> AppendResult:
        """One transaction.

        Raises:
            PersistenceError: nothing of ``items`` was recorded; ``__cause__`` is the SQLAlchemy
                error (the daemon retries lock and connection errors, ``ledger.errors.is_transient``).
        """
        try:
            conn = self._connection()
            with conn.begin():  # BEGIN IMMEDIATE (ledger.db); COMMIT, or ROLLBACK on any error
                result = recorder.append(conn, items, now=now)
        except (SQLAlchemyError, sqlite3.Error) as exc:  # connect, BEGIN, COMMIT (the recorder translates its own)
            raise _error(exc) from exc
        self.checkpointer.committed()
        return result

    def close(self) -> None:
        conn, self.conn = self.conn, None
        try:
            if conn is not None:
                conn.close()
        finally:
            self.engine.dispose()
            self.checkpointer.close()


def _error(exc: SQLAlchemyError | sqlite3.Error) -> PersistenceError:
    if isinstance(exc, SQLAlchemyError):
        return persistence_error(exc)
    # the PRAGMA on the raw connection: raised ``from exc``, is_transient reads its result code
    return PersistenceError(f"{type(exc).__name__}: {exc}")
