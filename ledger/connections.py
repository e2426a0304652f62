"""Per-thread DBAPI connections to one ledger, and the read and write transactions run on them.

The connector reads inside TensorRT-LLM's scheduler and worker, so its reads are synchronous and
must not pay for SQLAlchemy per call: building and executing a SQLAlchemy expression cost
0.5–1.3 ms per query on the 2-core reference machine, against ~10–30 µs for a
:class:`~ledger.prepared.Prepared` statement on a kept DBAPI connection
(tools/results/connector-*.md). Each thread therefore keeps its own connection, opened on first
use. What differs per backend (a read snapshot, the write ``BEGIN``, interrupting a statement,
bounding a lock wait) is the backend's (:mod:`ledger.backends`); driver errors are translated
here, at the transaction boundary, into :class:`~ledger.errors.PersistenceError`.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from ledger.backends import backend_named
from ledger.db import Sql, sync_engine
from ledger.errors import DeadlineExceeded, LockTimeout, persistence_error
from ledger.migrate import check_schema

T = TypeVar("T")


class Connections:
    """One ledger's connections, one per thread (thread-safe).

    Args:
        db: ledger URL or SQLite path (see :mod:`ledger.db`).
        check: refuse a database not at the schema head (``SchemaOutOfDate``).
        statement_timeout_s: PostgreSQL: statements (lock waits included) and connecting give up
            after this long (see :func:`ledger.db.sync_engine`); None: no limit.

    Raises (constructor): SchemaOutOfDate (``check``), LedgerError for an unsupported URL or a
    missing SQLite file, PersistenceError when the database cannot be opened. :meth:`read` and
    :meth:`write` raise PersistenceError when the database fails (or a statement timed out).
    """

    def __init__(self, db: str, *, check: bool = True, statement_timeout_s: float | None = None) -> None:
        self._engine = sync_engine(db, statement_timeout_s=statement_timeout_s)
        self.backend = backend_named(self._engine.dialect.name)
        self._local = threading.local()
        self._open: list[Any] = []
        self._open_lock = threading.Lock()
        self._serials = itertools.count(1)
        if check:
            try:
                with self._engine.connect() as conn:
                    check_schema(conn, db)
            except SQLAlchemyError as exc:  # unreachable, refused, not a database
                self._engine.dispose()
                raise persistence_error(exc) from exc

    def close(self) -> None:
        with self._open_lock:
            connections, self._open = self._open, []
        for raw in connections:
            try:
                raw.close()
            except Exception:  # noqa: BLE001 - closing a broken connection at shutdown
                pass
        self._engine.dispose()

    def read(self, fn: Callable[[Sql], T], *, snapshot: bool = False) -> T:
        """Run ``fn`` on this thread's connection; ``snapshot``: in one read transaction where the
        backend needs one for its statements to see one snapshot (SQLite)."""
        sql = self._sql()
        begin = self.backend.snapshot_begin if snapshot else None
        try:
            if begin:
                sql.driver(begin)
            value = fn(sql)
            if begin:
                sql.driver("COMMIT")
            return value
        except sql.errors as exc:
            wrapped = sql.wrap(exc)
            if wrapped.connection_invalidated:
                self._drop()
            elif begin:
                self._rollback(sql)
            if getattr(self._local, "interrupted", False):
                raise DeadlineExceeded(f"ledger read interrupted at its deadline: {exc}") from wrapped
            raise persistence_error(wrapped) from wrapped
        except BaseException:
            if begin:
                self._rollback(sql)
            raise

    def write(self, fn: Callable[[Sql], T]) -> T:
        """Run ``fn`` in one write transaction on this thread's connection (committed when it
        returns, rolled back when it raises)."""
        sql = self._sql()
        self._local.writes += 1  # before it may commit: change_token must never miss this connection's own commit
        self._begin_write(sql)
        try:
            value = fn(sql)
            sql.driver("COMMIT")
            return value
        except sql.errors as exc:
            self._rollback(sql)
            wrapped = sql.wrap(exc)
            raise persistence_error(wrapped) from wrapped
        except BaseException:
            self._rollback(sql)
            raise

    def _begin_write(self, sql: Sql) -> None:
        """Open the write transaction; inside a polled :meth:`lock_wait`, try again after each
        short wait for the lock until the wait's deadline.

        Raises:
            PersistenceError: the database failed (:class:`~ledger.errors.LockTimeout`: the lock
                was not free in time).
        """
        while True:
            try:
                sql.driver(self.backend.write_begin)
                return
            except sql.errors as exc:
                wrapped = sql.wrap(exc)
                if wrapped.connection_invalidated:
                    self._drop()
                error = persistence_error(wrapped)
                deadline = getattr(self._local, "lock_deadline", None)
                if not (isinstance(error, LockTimeout) and deadline is not None and time.monotonic() < deadline
                        and getattr(self._local, "sql", None) is sql):
                    raise error from wrapped

    def change_token(self) -> tuple[int, int, int] | None:
        """A token of what this thread's connection has seen of the database: equal to an earlier
        token of this thread iff no transaction committed in between, by any connection, this one
        included. ``(connection serial, the backend's change counter, writes begun on it)``: SQLite's
        ``PRAGMA data_version`` does not move for a connection's own commits, hence the count; a new
        connection (after a driver error) is a new serial. None where the backend has no cheap
        change counter (PostgreSQL): the caller reads again instead.

        Read it BEFORE the reads it vouches for: a commit between the two makes the next token
        differ, so the answer is only ever re-read, never trusted too long.

        Raises:
            PersistenceError: the database failed.
        """
        counter = self.backend.change_counter
        if counter is None:
            return None
        sql = self._sql()
        try:
            sql.cursor.execute(counter)
            value = sql.cursor.fetchone()[0]
        except sql.errors as exc:
            wrapped = sql.wrap(exc)
            if wrapped.connection_invalidated:
                self._drop()
            raise persistence_error(wrapped) from wrapped
        return self._local.serial, int(value), self._local.writes

    @contextlib.contextmanager
    def deadline(self, seconds: float) -> Iterator[None]:
        """Interrupt this thread's statements once ``seconds`` have passed, where the backend can
        (:attr:`~ledger.backends.base.Backend.interruptible`): they raise
        :class:`~ledger.errors.DeadlineExceeded`. A no-op elsewhere."""
        sql = self._sql()
        limit = time.perf_counter() + seconds
        clock = time.perf_counter
        local = self._local

        def past_deadline() -> bool:
            if clock() > limit:
                local.interrupted = True
                return True
            return False

        local.interrupted = False
        try:
            with self.backend.deadline(sql.connection, past_deadline):
                yield
        finally:
            local.interrupted = False

    @contextlib.contextmanager
    def lock_wait(self, seconds: float) -> Iterator[None]:
        """Bound this thread's wait for the ledger's write lock (see
        :meth:`ledger.client.LedgerClient.lock_wait`)."""
        sql = self._sql()
        ms, poll = max(1, round(seconds * 1000)), self.backend.lock_poll_ms
        wait, restore = self.backend.lock_wait(min(ms, poll) if poll else ms)
        try:
            sql.driver(wait)
        except sql.errors as exc:
            self._drop()
            raise persistence_error(sql.wrap(exc)) from exc
        self._local.lock_deadline = time.monotonic() + seconds if poll and ms > poll else None
        try:
            yield
        finally:
            self._local.lock_deadline = None
            if getattr(self._local, "sql", None) is sql:  # not replaced by a reconnect meanwhile
                try:
                    sql.driver(restore)
                except sql.errors:  # a broken connection: the next use reconnects with the defaults
                    self._drop()

    def _sql(self) -> Sql:
        sql = getattr(self._local, "sql", None)
        if sql is None:
            dbapi_error = self._engine.dialect.loaded_dbapi.Error
            try:
                raw = self._engine.raw_connection()
            except SQLAlchemyError as exc:
                raise persistence_error(exc) from exc
            except dbapi_error as exc:  # the pool's connect is not wrapped (psycopg: "connection refused")
                wrapped = DBAPIError.instance(None, None, exc, dbapi_error, dialect=self._engine.dialect)
                raise persistence_error(wrapped) from exc
            sql = Sql(raw.dbapi_connection, self._engine.dialect)
            self.backend.prepare_client_connection(raw.dbapi_connection)
            self._local.sql, self._local.raw = sql, raw
            self._local.serial, self._local.writes = next(self._serials), 0
            with self._open_lock:
                self._open.append(raw)
        return sql

    def _drop(self) -> None:
        """Forget this thread's connection after a driver error (the next call opens a new one)."""
        raw, self._local.sql, self._local.raw = getattr(self._local, "raw", None), None, None
        if raw is None:
            return
        with self._open_lock:
            if raw in self._open:
                self._open.remove(raw)
        try:
            raw.invalidate()
        except Exception:  # noqa: BLE001 - the connection is already broken
            pass

    def _rollback(self, sql: Sql) -> None:
        try:
            sql.driver("ROLLBACK")
        except sql.errors:
            self._drop()
