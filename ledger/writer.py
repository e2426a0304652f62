"""The consumer's ledger writer: an asyncio front to the synchronous recorder (DESIGN §5).

One writer per database per process: on SQLite it is the only writer the consumer has (WAL lets
readers run beside it); on PostgreSQL several consumer processes may each run one, serialised by
the recorder's table lock. Each :meth:`LedgerWriter.append` is one transaction (DESIGN §5).

Backends:

* SQLite: ONE pysqlite connection from :func:`ledger.db.sync_engine` (``writer=True``: WAL,
  ``BEGIN IMMEDIATE``, 64 MiB page cache) runs each whole transaction
  (:func:`ledger.recorder.append`), with WAL checkpoints on a thread of their own
  (:class:`ledger.sqlite_writer.SQLiteWriterConnection`). Where it runs:

  - ``process=True`` (the consumer daemon's default, ``writer_process``): in a child process
    (:mod:`ledger.writer_process`), fed by one dedicated thread here that sends a transaction and
    waits for its reply. The recorder and the daemon's receive/decode then run on two cores
    instead of taking turns on one GIL: 256,000 block events end to end in 2.15–2.24 s instead of
    2.88–3.02 s (4 interleaved rounds; tools/results/consume-2026-11-30.md).
  - ``process=False``: on ONE dedicated thread of this process (a single-worker executor): one
    thread hop per transaction. aiosqlite, used before, hops to its own thread once per statement
    (~12 per transaction) and was 1.2–2.8x slower at 1–1024 events per transaction
    (tools/results/ledger-2026-11-29.md).

  Either way calls run in submission order; a transaction whose awaiting task is cancelled still
  commits or rolls back as a whole, and :meth:`close` waits for it. :meth:`source_positions` (the
  daemon's health read) runs on a second, reading connection in a worker thread, so it is not
  queued behind a transaction that waits for the write lock (WAL: readers never wait for the
  writer), as with aiosqlite's pool.

  The ledger file is watched: a transaction is reported done only once its writer found the path
  still naming the file it opened (and its ``-wal``/``-shm``), all writable; otherwise
  :meth:`LedgerWriter.append` raises :class:`~ledger.errors.LedgerUnwritable`
  (:class:`ledger.sqlite_writer.LedgerFiles`).
* PostgreSQL: SQLAlchemy's AsyncEngine on asyncpg, the recorder under ``run_sync``. Not a file:
  nothing to watch (the server's own errors arrive as errors).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, TypeVar

import structlog
from sqlalchemy import Engine, and_, select
from sqlalchemy.exc import SQLAlchemyError

from ledger import recorder, writer_process
from ledger.db import async_engine, backend_of, sync_engine
from ledger import events as ev
from ledger.decide import BATCH_ROW_INDEX, AppendResult
from ledger.errors import LedgerError, PersistenceError, is_database_error, persistence_error, unreached_error
from ledger.migrate import check_schema
from ledger.schema import LogRow, SourceRow
from ledger.sqlite_writer import FileId, SQLiteWriterConnection, check_writable, ledger_path

T = TypeVar("T")
_log = structlog.get_logger("ledger.writer")
_SOURCES = SourceRow.__table__
_LOG = LogRow.__table__
_POSITIONS = select(_SOURCES.c.source_id, _SOURCES.c.engine_id, _SOURCES.c.epoch, _SOURCES.c.last_seq,
                    _LOG.c.body).select_from(_SOURCES.outerjoin(_LOG, and_(
                        _LOG.c.source_id == _SOURCES.c.source_id, _LOG.c.source_epoch == _SOURCES.c.epoch,
                        _LOG.c.zmq_seq == _SOURCES.c.last_seq, _LOG.c.batch_index == BATCH_ROW_INDEX)))
"""Each source row with the ``batch_received`` log row of its last seq (one probe of the log's
unique (source_id, source_epoch, zmq_seq, batch_index) index per source)."""


class SourcePosition(NamedTuple):
    """Where a source stands in the ledger: its epoch, last accepted ZMQ seq, and the payload
    digest (xxh3_64) of the batch logged at that seq, so that a resuming consumer can tell the run
    it knows from an engine restart it did not see (``consumer.source``); None if that batch's
    row cannot be found."""

    engine_id: str
    epoch: int
    last_seq: int
    last_digest: int | None = None


def _position(row) -> SourcePosition:  # noqa: ANN001 - a result row of _POSITIONS
    digest = None
    if row.body is not None:
        body = ev.BODY_DECODER.decode(bytes(row.body))
        digest = body.digest if isinstance(body, ev.BatchReceived) else None
    return SourcePosition(row.engine_id, row.epoch, row.last_seq, digest)


class LedgerWriter:
    """Appends consumer inputs (received batches, dead letters, gap reports) to the ledger.

    Where transactions run is the backend's (:data:`_RUNNERS`): SQLite's one writer connection on
    a thread or in a child process, PostgreSQL's async engine."""

    def __init__(self, db: str, *, process: bool = False) -> None:
        self.db = db
        self._closed = False
        self._runner = _RUNNERS[backend_of(db).name](db, process)

    @classmethod
    async def open(cls, db: str, *, process: bool = False) -> LedgerWriter:
        """Open and check the schema.

        Args:
            process: on SQLite, run the writer connection in a child process (a second core for
                the recorder; see :class:`_SQLiteProcess`); ignored on PostgreSQL, whose server
                already does the database work in other processes.

        Raises:
            SchemaOutOfDate: the database is not migrated (run ``semkv-ledger migrate``).
            PersistenceError: the database cannot be reached.
        """
        writer = cls(db, process=process)
        try:
            await writer._runner.check_schema()
        except SQLAlchemyError as exc:
            await writer.close()
            raise persistence_error(exc) from exc
        except Exception as exc:
            await writer.close()
            if isinstance(exc, LedgerError) or not is_database_error(exc):
                raise
            raise unreached_error(exc) from exc
        return writer

    async def append(self, items: Sequence[recorder.Input], *, now: float | None = None) -> AppendResult:
        """Record ``items`` and apply them to the projections in ONE transaction.

        Raises:
            PersistenceError: the transaction failed; nothing of ``items`` was recorded in the
                ledger the path names.
            LedgerUnwritable: (a permanent PersistenceError) the SQLite ledger file, its
                ``-wal``/``-shm`` or its directory was deleted, replaced or made read-only since it
                was opened: what this transaction committed, if anything, went to a file nobody
                will read or cannot be checkpointed, and must not be acknowledged.
        """
        try:
            return await self._runner.append(items, now)
        except SQLAlchemyError as exc:
            raise persistence_error(exc) from exc
        except Exception as exc:
            if isinstance(exc, LedgerError) or not is_database_error(exc):
                raise
            raise unreached_error(exc) from exc  # a server gone while the consumer runs: retried

    @property
    def mode(self) -> str:
        """Where transactions run: ``process`` or ``thread`` (SQLite), ``postgresql``."""
        return self._runner.mode

    async def source_positions(self) -> dict[str, SourcePosition]:
        """Every known source's position, with the digest of its last logged batch (the consumer
        resumes from these after a restart).

        Raises:
            PersistenceError: the ledger cannot be read.
        """
        try:
            rows = await self._runner.read(_POSITIONS)
        except SQLAlchemyError as exc:
            raise persistence_error(exc) from exc
        return {r.source_id: _position(r) for r in rows}

    async def close(self) -> None:
        """Wait for the transaction in flight, if any, then release the connections (idempotent)."""
        if self._closed:
            return
        self._closed = True
        await self._runner.close()


class _PostgreSQL:
    """SQLAlchemy's AsyncEngine on asyncpg, the recorder under ``run_sync``."""

    mode = "postgresql"

    def __init__(self, db: str) -> None:
        self.db = db
        self.engine = async_engine(db)

    async def check_schema(self) -> None:
        async with self.engine.connect() as conn:
            await conn.run_sync(check_schema, self.db)

    async def append(self, items: Sequence[recorder.Input], now: float | None) -> AppendResult:
        async with self.engine.begin() as conn:
            return await conn.run_sync(lambda sync_conn: recorder.append(sync_conn, items, now=now))

    async def read(self, query) -> list:  # noqa: ANN001 - a Core select
        async with self.engine.connect() as conn:
            return (await conn.execute(query)).all()

    async def close(self) -> None:
        await self.engine.dispose()


class _Reader:
    """Reads (the daemon's health check) on their own connection, from any thread. WAL: never
    queued behind a transaction that waits for the write lock."""

    def __init__(self, db: str) -> None:
        self.db = db
        self._engine: Engine | None = None
        self._lock = threading.Lock()
        self._closed = False

    def read(self, query) -> list:  # noqa: ANN001 - a Core select
        with self._lock:
            if self._closed:
                raise PersistenceError("the ledger writer is closed")
            if self._engine is None:
                self._engine = sync_engine(self.db, pool_size=1)
            engine = self._engine
        with engine.connect() as conn:
            return conn.execute(query).all()

    def close(self) -> None:
        with self._lock:
            engine, self._engine, self._closed = self._engine, None, True
        if engine is not None:
            engine.dispose()


class _OneThread:
    """A single-worker executor that runs the writer's blocking calls in submission order, and the
    health-read connection beside it."""

    def __init__(self, db: str) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="semkv-ledger-writer")
        self.reader = _Reader(db)

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def read(self, query) -> list:  # noqa: ANN001 - a Core select
        """On the reading connection, in a worker thread: not queued behind a transaction."""
        return await asyncio.to_thread(self.reader.read, query)

    async def _close_with(self, fn: Callable[[], None]) -> None:
        try:
            await self.call(fn)  # queued after the transaction in flight
        except BaseException:
            self.executor.shutdown(wait=False)  # cancelled while a transaction runs: don't block the loop
            raise
        else:
            self.executor.shutdown(wait=True)  # idle: the thread exits at once
        finally:
            self.reader.close()


class _SQLiteThread(_OneThread):
    """The writer connection on the dedicated thread of this process."""

    mode = "thread"

    def __init__(self, db: str) -> None:
        super().__init__(db)
        self.writer = SQLiteWriterConnection(db)

    async def check_schema(self) -> None:
        await self.call(self.writer.check_schema)

    async def append(self, items: Sequence[recorder.Input], now: float | None) -> AppendResult:
        return await self.call(self.writer.append, items, now)

    async def close(self) -> None:
        await self._close_with(self.writer.close)


class _SQLiteProcess(_OneThread):
    """The writer connection in a child process (:mod:`ledger.writer_process`), driven from the
    dedicated thread of this process, which sends each transaction and waits for its reply.

    Why: the recorder's Python work and the daemon's receive/decode otherwise share one GIL (see
    the module docstring for the figures). A child that dies fails the transaction in flight with
    a transient :class:`PersistenceError` and the next call starts a new one, unless
    :data:`~ledger.writer_process.MAX_CONSECUTIVE_DEATHS` children died in a row without a commit
    (then the error is permanent: a batch that crashes the writer must stop the daemon, not spin
    it). What a retry after a death records: :mod:`ledger.writer_process`.
    """

    mode = "process"

    def __init__(self, db: str) -> None:
        super().__init__(db)
        self.db = db
        self.child: writer_process.Child | None = None
        self.deaths_in_a_row = 0
        self.closed = False
        self.ledger_file: FileId | None = None
        """The file whose schema was checked: every child writes this one or refuses to start."""

    async def check_schema(self) -> None:
        def check() -> None:
            check_writable(self.db)
            engine = sync_engine(self.db, create=True)  # as the thread's writer engine does
            try:
                with engine.connect() as conn:
                    check_schema(conn, self.db)
                    self.ledger_file = FileId.of(ledger_path(self.db))  # while open: the file just checked
            finally:
                engine.dispose()
            self._child()  # start the child now: a daemon pays its start-up before the first message

        await self.call(check)

    def _child(self) -> writer_process.Child:
        if self.closed:
            raise PersistenceError("the ledger writer is closed")
        if self.child is None or not self.child.alive:
            if self.child is not None:
                self.child.close()
                self.deaths_in_a_row += 1
                if self.deaths_in_a_row >= writer_process.MAX_CONSECUTIVE_DEATHS:
                    raise PersistenceError(f"the ledger writer process died {self.deaths_in_a_row} times in a row "
                                           "without a commit", transient=False)
                _log.warning("ledger.writer_process_restarted", deaths_in_a_row=self.deaths_in_a_row)
            assert self.ledger_file is not None, "check_schema first"
            self.child = writer_process.Child.start(self.db, self.ledger_file)
        return self.child

    def _append(self, items: Sequence[recorder.Input], now: float | None) -> AppendResult:
        result = self._child().append(items, now)
        self.deaths_in_a_row = 0
        return result

    async def append(self, items: Sequence[recorder.Input], now: float | None) -> AppendResult:
        return await self.call(self._append, items, now)

    def _close_child(self) -> None:
        self.closed = True
        child, self.child = self.child, None
        if child is not None:
            child.close()

    async def close(self) -> None:
        try:
            await self._close_with(self._close_child)
        except BaseException:
            # Cancelled (the daemon's shutdown timed out): a transaction still in flight would keep
            # this process alive until the reply deadline; killing the child rolls it back and
            # ends the wait now. What it held was not committed; the engine's replay resends it.
            child = self.child
            if child is not None:
                child.process.kill()
            raise


_RUNNERS: dict[str, Callable[[str, bool], _SQLiteThread | _SQLiteProcess | _PostgreSQL]] = {
    "sqlite": lambda db, process: _SQLiteProcess(db) if process else _SQLiteThread(db),
    "postgresql": lambda db, process: _PostgreSQL(db),
}
"""Per backend (:mod:`ledger.backends`), how its writer runs transactions."""
