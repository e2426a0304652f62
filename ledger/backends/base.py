"""What a ledger backend provides: one object per database family, chosen once per URL or connection.

Everything that differs between SQLite and PostgreSQL lives behind :class:`Backend`: how an engine
is made and a file found, how a write transaction begins and serialises with other writers, how a
read keeps one snapshot, how a statement is interrupted or a lock wait bounded, how an audit reads
a ledger it cannot write (:meth:`Backend.audit_engine`), and the statement shapes of the recorder's
bulk reads and writes. The callers (``ledger.db``, ``ledger.recorder``,
``ledger.connections``, ``ledger.writer``, ``ledger.migrate``) hold no backend test of their own.
(eventsourcing does the same with one recorder module per backend.)

The bulk statements are described by :class:`RowsWrite` and :class:`KeysDelete`, declared once by
the recorder; each backend compiles its own shape for them on first use and caches it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, ColumnElement, Engine, Table
from sqlalchemy.engine import URL

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from ledger.db import Sql


@dataclasses.dataclass(frozen=True, eq=False)
class RowsWrite:
    """Rows written into ``table``: ``conflict`` ``None`` a plain insert, ``"update"`` an upsert of
    every non-key column (projections), ``"add"`` adds ``value`` to the existing row (counters),
    ``"ignore"`` keeps the existing row (the block index: two followers may write the same rows).
    Rows are tuples of every column in the table's column order."""

    table: Table
    conflict: str | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class KeysDelete:
    """Rows of ``table`` deleted by primary key, with extra ``where`` conditions that bind no
    parameter (``literal_column``). Keys are tuples in primary-key column order."""

    table: Table
    where: tuple[ColumnElement[bool], ...] = ()


@dataclasses.dataclass(frozen=True)
class ReadOnlyOpen:
    """How :meth:`Backend.audit_engine` opened a ledger this process cannot write."""

    path: str
    reason: str
    """Why it cannot be written: ``read-only file system``, or which file or directory this user
    may not write."""
    snapshot: bool
    """Read as an immutable snapshot, without locks, and checked unchanged when the reading ended
    (SQLite ``immutable=1``: :mod:`ledger.backends.sqlite` says when that is safe)."""

    def describe(self) -> str:
        """One line for people: ``ledger PATH opened read-only (cannot write: REASON)``, and for a
        snapshot ``; read as a snapshot, checked unchanged afterwards``."""
        line = f"ledger {self.path} opened read-only (cannot write: {self.reason})"
        return f"{line}; read as a snapshot, checked unchanged afterwards" if self.snapshot else line


AuditOpen = tuple[Engine, "ReadOnlyOpen | None"]
"""What :meth:`Backend.audit_engine` yields: the engine, and how it was opened read-only (None: as usual)."""


class Backend:
    """One database family. Subclasses: :class:`ledger.backends.sqlite.SQLiteBackend`,
    :class:`ledger.backends.postgresql.PostgreSQLBackend`."""

    name: str
    interruptible: bool = False
    """Whether :meth:`deadline` can interrupt a running statement."""
    write_begin: str = "BEGIN"
    """The driver SQL opening a write transaction on a connection that emits its own BEGIN."""
    lock_poll_ms: int | None = None
    """Where the backend's own wait for the write lock is not a queue, a bounded wait
    (:meth:`lock_wait`) is this short wait tried again and again until its deadline instead
    (:meth:`ledger.connections.Connections.lock_wait`); None: the backend's own wait."""
    snapshot_begin: str | None = None
    """The driver SQL opening a read transaction (one snapshot for several statements), or None
    when the connection's autocommit statements already see consistent data."""
    change_counter: str | None = None
    """Driver SQL answering one integer that differs from its previous answer on the same connection
    whenever ANOTHER connection (of any process) committed to the database in between, or None when
    the backend has no such cheap signal (:meth:`ledger.connections.Connections.change_token`)."""

    def __init__(self) -> None:
        self._shapes: dict[object, Any] = {}

    # -- engines -------------------------------------------------------------------------------

    def sync_engine(self, url: URL, *, writer: bool, create: bool, pool_size: int,
                    statement_timeout_s: float | None) -> Engine:
        raise NotImplementedError

    def async_engine(self, url: URL) -> AsyncEngine:
        raise NotImplementedError

    def ledger_exists(self, url: URL) -> bool:
        """False when the URL names a ledger that certainly does not exist (a SQLite path with no
        file); a server database's existence is the connection's to report."""
        return True

    @contextlib.contextmanager
    def audit_engine(self, url: URL) -> Iterator[AuditOpen]:
        """An engine for commands that only read a ledger (``stats``, ``inspect``, ``replay``),
        disposed on exit. Here: the usual one (a read-only server, such as a PostgreSQL hot
        standby, simply refuses writes, and these commands make none). SQLite opens a file this
        process cannot write read-only instead (:meth:`ledger.backends.sqlite.SQLiteBackend.audit_engine`).

        Raises:
            LedgerError: the ledger cannot be opened (a backend's own reasons).
        """
        engine = self.sync_engine(url, writer=False, create=False, pool_size=5, statement_timeout_s=None)
        try:
            yield engine, None
        finally:
            engine.dispose()

    def write_refusal(self, url: URL) -> str | None:
        """Why this process cannot write the ledger at ``url``, found without opening it, or None
        when nothing says so before a write is tried (a server is asked by writing)."""
        return None

    def contains_bytes(self, column: ColumnElement[bytes], needle: bytes) -> ColumnElement[bool]:
        """SQL: ``needle`` occurs in the binary ``column`` (a scan the database runs in C, for
        prefiltering rows before they are decoded in Python)."""
        raise NotImplementedError

    # -- connections ---------------------------------------------------------------------------

    def prepare_client_connection(self, dbapi_connection: Any) -> None:
        """Set up a connector connection kept open for reads and writes."""

    @contextlib.contextmanager
    def deadline(self, dbapi_connection: Any, past_deadline: Callable[[], bool]) -> Iterator[None]:
        """Interrupt this connection's statements once ``past_deadline()`` is True (where the
        backend is :attr:`interruptible`; a no-op otherwise)."""
        yield

    def lock_wait(self, ms: int) -> tuple[str, str]:
        """Driver SQL bounding this session's wait for the ledger's write lock to ``ms``, and the
        SQL restoring the default."""
        raise NotImplementedError

    def serialize_migrations(self, conn: Connection) -> None:
        """Make this transaction the only migration of the database until it ends, so that a
        second ``migrate`` started meanwhile waits and then finds the schema at the head. A no-op
        where a write transaction already excludes every other writer from its ``BEGIN``."""

    # -- the recorder's statement shapes -------------------------------------------------------

    def lock_log(self, sql: Sql) -> bool:
        """Serialise this write transaction with every other writer of the log (rows become
        visible in ``seq`` order). Returns whether a lock was taken here (False: the backend's
        transactions are already serialised when they begin)."""
        return False

    def blocks_by_hashes(self, sql: Sql, stream: dict[str, Any], hashes: set[int]) -> list[tuple]:
        """The ``blocks`` rows of one stream (``engine_id``, ``attention_dp_rank``,
        ``window_size``) whose signed ``block_hash`` is in ``hashes``, in table column order."""
        raise NotImplementedError

    def write_rows(self, sql: Sql, spec: RowsWrite, rows: Sequence[tuple]) -> None:
        """Write ``rows`` (tuples in the table's column order) as ``spec`` says."""
        raise NotImplementedError

    def delete_keys(self, sql: Sql, spec: KeysDelete, keys: Sequence[tuple]) -> int:
        """Delete by key; returns the rows deleted (the driver's count, which may be -1 if the
        driver does not know it)."""
        raise NotImplementedError

    def _shape(self, spec: object, build: Callable[[], Any]) -> Any:
        shape = self._shapes.get(spec)
        if shape is None:
            shape = self._shapes[spec] = build()
        return shape
