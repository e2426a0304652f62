"""The consumer's ledger writer: an asyncio front to the synchronous recorder (DESIGN §5).

One writer per database per process: on SQLite it is the only writer the consumer has (WAL lets
readers run beside it); on PostgreSQL several consumer processes may each run one, serialised by
the recorder's table lock. Each :meth:`LedgerWriter.append` is one transaction (DESIGN §5).

Backends:

* SQLite: ONE dedicated thread (a single-worker executor) owns ONE pysqlite connection from
  :func:`ledger.db.sync_engine` (``writer=True``: WAL, ``BEGIN IMMEDIATE``, 64 MiB page cache) and
  runs each whole transaction (:func:`ledger.recorder.append`) there: one thread hop per
  transaction. aiosqlite, used before, hops to its own thread once per statement (~12 per
  transaction) and was 1.2–2.8x slower at 1–1024 events per transaction
  (tools/results/ledger-2026-11-29.md). Calls run in submission order; a transaction whose
  awaiting task is cancelled still commits or rolls back as a whole on the thread, and
  :meth:`close` waits for it. :meth:`source_positions` (the daemon's health read) runs on a
  second, reading connection in a worker thread, so it is not queued behind a transaction that
  waits for the write lock (WAL: readers never wait for the writer), as with aiosqlite's pool.
* PostgreSQL: SQLAlchemy's AsyncEngine on asyncpg, the recorder under ``run_sync``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, TypeVar

from sqlalchemy import Connection, Engine, select
from sqlalchemy.exc import SQLAlchemyError

from ledger import recorder
from ledger.db import async_engine, is_sqlite, normalize_url, sync_engine
from ledger.decide import AppendResult
from ledger.errors import PersistenceError
from ledger.migrate import check_schema
from ledger.schema import SourceRow

T = TypeVar("T")
_SOURCES = SourceRow.__table__
_POSITIONS = select(_SOURCES.c.source_id, _SOURCES.c.engine_id, _SOURCES.c.epoch, _SOURCES.c.last_seq)


class SourcePosition(NamedTuple):
    """Where a source stands in the ledger: its epoch and last accepted ZMQ seq."""

    engine_id: str
    epoch: int
    last_seq: int


def _persistence_error(exc: SQLAlchemyError) -> PersistenceError:
    return PersistenceError(str(getattr(exc, "orig", exc)))


class LedgerWriter:
    """Appends consumer inputs (received batches, dead letters, gap reports) to the ledger."""

    def __init__(self, db: str) -> None:
        self.db = db
        self._closed = False
        if is_sqlite(normalize_url(db)):
            self._sqlite: _SQLiteThread | None = _SQLiteThread(db)
            self._engine = None
        else:
            self._sqlite = None
            self._engine = async_engine(db)

    @classmethod
    async def open(cls, db: str) -> LedgerWriter:
        """Open and check the schema.

        Raises:
            SchemaOutOfDate: the database is not migrated (run ``semkv-ledger migrate``).
            PersistenceError: the database cannot be reached.
        """
        writer = cls(db)
        try:
            if writer._sqlite is not None:
                await writer._sqlite.call(writer._sqlite.check_schema)
            else:
                async with writer._engine.connect() as conn:
                    await conn.run_sync(check_schema, db)
        except SQLAlchemyError as exc:
            await writer.close()
            raise _persistence_error(exc) from exc
        except Exception:
            await writer.close()
            raise
        return writer

    async def append(self, items: Sequence[recorder.Input], *, now: float | None = None) -> AppendResult:
        """Record ``items`` and apply them to the projections in ONE transaction.

        Raises:
            PersistenceError: the transaction failed; nothing of ``items`` was recorded.
        """
        try:
            if self._sqlite is not None:
                return await self._sqlite.call(self._sqlite.append, items, now)
            async with self._engine.begin() as conn:
                return await conn.run_sync(lambda sync_conn: recorder.append(sync_conn, items, now=now))
        except SQLAlchemyError as exc:
            raise _persistence_error(exc) from exc

    async def source_positions(self) -> dict[str, SourcePosition]:
        """Every known source's position (the consumer resumes from these after a restart)."""
        if self._sqlite is not None:
            rows = await asyncio.to_thread(self._sqlite.read, _POSITIONS)
        else:
            async with self._engine.connect() as conn:
                rows = (await conn.execute(_POSITIONS)).all()
        return {r.source_id: SourcePosition(r.engine_id, r.epoch, r.last_seq) for r in rows}

    async def close(self) -> None:
        """Wait for the transaction in flight, if any, then release the connections (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._sqlite is not None:
            await self._sqlite.close()
        else:
            await self._engine.dispose()


class _SQLiteThread:
    """One pysqlite writer connection, used only on one dedicated thread.

    ``conn`` is touched only on the executor's thread; a connection SQLAlchemy invalidated (a
    disconnect error) is replaced before the next transaction.
    """

    def __init__(self, db: str) -> None:
        self.db = db
        self.engine: Engine = sync_engine(db, writer=True, pool_size=1)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="semkv-ledger-writer")
        self.conn: Connection | None = None
        self._reader: Engine | None = None
        self._reader_lock = threading.Lock()
        self._closed = False

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # -- on the writer thread ---------------------------------------------------------------

    def _connection(self) -> Connection:
        conn = self.conn
        if conn is None or conn.invalidated or conn.closed:
            if conn is not None:
                conn.close()
            conn = self.conn = self.engine.connect()
        return conn

    def check_schema(self) -> None:
        conn = self._connection()
        try:
            check_schema(conn, self.db)
        finally:
            conn.rollback()  # end Alembic's read; the writer's transactions begin on their own

    def append(self, items: Sequence[recorder.Input], now: float | None) -> AppendResult:
        conn = self._connection()
        with conn.begin():  # BEGIN IMMEDIATE (ledger.db); COMMIT, or ROLLBACK on any error
            return recorder.append(conn, items, now=now)

    def _close_connection(self) -> None:
        conn, self.conn = self.conn, None
        try:
            if conn is not None:
                conn.close()
        finally:
            self.engine.dispose()

    # -- reads (any thread) ------------------------------------------------------------------

    def read(self, query) -> list:  # noqa: ANN001 - a Core select
        with self._reader_lock:
            if self._closed:
                raise PersistenceError("the ledger writer is closed")
            if self._reader is None:
                self._reader = sync_engine(self.db, pool_size=1)
            reader = self._reader
        with reader.connect() as conn:
            return conn.execute(query).all()

    async def close(self) -> None:
        try:
            await self.call(self._close_connection)  # queued after the transaction in flight
        except BaseException:
            self.executor.shutdown(wait=False)  # cancelled while a transaction runs: don't block the loop
            raise
        else:
            self.executor.shutdown(wait=True)  # idle: the thread exits at once
        finally:
            with self._reader_lock:
                reader, self._reader, self._closed = self._reader, None, True
            if reader is not None:
                reader.dispose()
