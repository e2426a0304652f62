"""The SQLite writer connection: one pysqlite connection that runs whole recorder transactions, and
its WAL checkpointer (:mod:`ledger.checkpoint`). Driven by :mod:`ledger.writer` on a thread of the
consumer's process, or by :mod:`ledger.writer_process` in a child process.

The ledger's files are watched (:class:`LedgerFiles`): after every COMMIT, before the transaction is
reported done, the writer checks that the path still names the file it writes (and its ``-wal`` and
``-shm`` files) and that they are still writable. SQLite writes through the descriptors it opened:
a ledger deleted or renamed over keeps taking commits into a file nobody can open again, and a
ledger made read-only (``chattr +i``) takes them into the WAL and then fails every checkpoint with
"disk I/O error", which a retry never cures. Either way the writer raises a permanent
:class:`~ledger.errors.LedgerUnwritable` naming the file and what happened to it, so the consumer
stops (exit 1) instead of acknowledging what it cannot keep or retrying forever. Other errors,
"disk I/O error" and disk full (``SQLITE_FULL``) included, keep their classification
(:func:`ledger.errors.is_transient`) when the files are fine.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import structlog
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from ledger import recorder
from ledger.checkpoint import BACKSTOP_PAGES, WalCheckpointer
from ledger.db import normalize_url, sync_engine
from ledger.decide import AppendResult
from ledger.errors import LedgerUnwritable, PersistenceError
from ledger.migrate import check_schema
from ledger.errors import persistence_error

_STOPPED = "stopping: nothing more is acknowledged (docs/troubleshooting.md)"
_log = structlog.get_logger("ledger.sqlite_writer")


class FileId(NamedTuple):
    """Which file a path names: ``(st_dev, st_ino)`` of ``os.stat``."""

    device: int
    inode: int

    @classmethod
    def of(cls, path: Path | str) -> FileId:
        """Raises: OSError (FileNotFoundError: nothing at ``path``)."""
        st = os.stat(path)
        return cls(st.st_dev, st.st_ino)

    def __str__(self) -> str:
        return f"{self.device}:{self.inode}"


def ledger_path(db: str) -> Path:
    """The SQLite file of a ledger URL or path."""
    return Path(normalize_url(db).database or "")


def check_writable(db: str) -> None:
    """Refuse a ledger this user cannot write at start-up, not at its first transaction (SQLite
    opens a read-only file and fails only when it writes).

    ``access(2)`` judges: the mode bits (which root bypasses), the immutable attribute
    (``chattr +i``, which stops root too) and read-only mounts.

    Raises:
        LedgerUnwritable: the file, or its directory (WAL and shm files live beside it), is not
            writable.
    """
    path = ledger_path(db)
    for target in (path, path.parent):
        if target.exists() and not os.access(target, os.W_OK):
            raise LedgerUnwritable(f"the ledger {path} is not writable by this user ({target} is read-only)")


class LedgerFiles:
    """The ledger file, its ``-wal`` and ``-shm`` files, as one writer connection opened them.

    :meth:`check` is 3 ``stat`` and 4 ``access`` system calls, run once per transaction: 16 µs
    on this 2-core VM, measured side by side with the transactions it guards (one writer
    connection, SQLite file): 3 % of a one-batch transaction of 3 events (0.5 ms), 0.04 % of a
    1024-event one (45 ms while the VM was loaded; ~9 ms idle, so ~0.2 %).

    Args:
        path: the ledger file.
        expected: the identity the ledger had when the writer opened it (the writer process gets
            its parent's); None: take it at the first :meth:`pin`.
    """

    def __init__(self, path: Path, expected: FileId | None = None) -> None:
        self.path = path
        self.expected = expected
        self._journal = (f"{path}-wal", f"{path}-shm")
        self._writable = (str(path), *self._journal, str(path.parent))
        self._pinned: list[tuple[str, FileId]] = []
        """(path, identity) of the ledger and its journal files once :meth:`pin` ran."""

    def check_ledger(self) -> None:
        """The path still names the ledger file first opened (run before SQLite opens it again: it
        would create a new empty file at a deleted path).

        Raises:
            LedgerUnwritable: deleted or replaced.
        """
        if self.expected is not None:
            self._same(str(self.path), self.expected)

    def pin(self) -> None:
        """After a connection opened the ledger (in WAL mode, so its ``-wal`` and ``-shm`` exist):
        remember what it opened.

        Raises:
            LedgerUnwritable: the ledger is not the file first opened, or a journal file is missing.
        """
        self.check_ledger()
        if self.expected is None:
            self.expected = FileId.of(self.path)
        pinned = [(str(self.path), self.expected)]
        for path in self._journal:
            try:
                pinned.append((path, FileId.of(path)))
            except FileNotFoundError as exc:
                raise _gone(f"the ledger's journal file {path} is missing") from exc
        self._pinned = pinned

    def check_same(self) -> None:
        """The ledger and its journal files are the ones pinned (before :meth:`pin`: the ledger).

        Raises:
            LedgerUnwritable: one was deleted or replaced (the ledger itself: then our journal
                files still at the path are removed, :meth:`_drop_journal`).
        """
        if not self._pinned:
            self.check_ledger()
            return
        try:
            self._same(*self._pinned[0])
        except LedgerUnwritable:
            self._drop_journal()
            raise
        for path, pinned in self._pinned[1:]:
            self._same(path, pinned)

    def check(self) -> None:
        """:meth:`check_same`, and all of them writable.

        Raises:
            LedgerUnwritable: one was deleted or replaced, or is read-only.
        """
        self.check_same()
        for path in self._writable:
            if not os.access(path, os.W_OK) and os.path.exists(path):
                raise _gone(f"the ledger {self.path} is no longer writable by this user ({path} is read-only)")

    def _drop_journal(self) -> None:
        """The ledger file is no longer at its path: remove the ``-wal`` and ``-shm`` still at the
        path that are ours. SQLite neither checkpoints nor deletes the WAL of a database file that
        moved when it closes, and a WAL left at the path would be read as the journal of whatever
        file is put there, corrupting it (sqlite.org/howtocorrupt.html, "Unlinking or renaming a
        database file while in use"). Our connection keeps its open descriptors."""
        for path, pinned in self._pinned[1:]:
            try:
                if FileId.of(path) == pinned:
                    os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as exc:  # best effort: the daemon stops anyway; say what is left behind
                _log.warning("ledger.stale_journal_left", path=path, error=str(exc))

    @staticmethod
    def _same(path: str, pinned: FileId) -> None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise _gone(f"the ledger file {path} was deleted while the consumer wrote it") from None
        except OSError as exc:
            raise _gone(f"the ledger file {path} cannot be checked: {exc}") from exc
        if (st.st_dev, st.st_ino) != pinned:
            raise _gone(f"the ledger file {path} was replaced while the consumer wrote it "
                        f"(device:inode {pinned} is now {st.st_dev}:{st.st_ino})")


def _gone(message: str) -> LedgerUnwritable:
    return LedgerUnwritable(f"{message}: {_STOPPED}")


class SQLiteWriterConnection:
    """One pysqlite writer connection and its WAL checkpointer; every method runs on ONE thread.

    ``conn`` is replaced before the next transaction when SQLAlchemy invalidated it (a disconnect
    error). Used by the in-process writer thread and by the writer process alike.

    Args:
        expected: the ledger file's identity when the consumer opened it (:class:`FileId`; the
            writer process is given its parent's); None: the file this connection first opens.

    Raises:
        LedgerUnwritable: ``expected`` is given and the path no longer names that file.
    """

    def __init__(self, db: str, *, expected: FileId | None = None) -> None:
        self.db = db
        self.files = LedgerFiles(ledger_path(db), expected)
        self.files.check_ledger()  # before sync_engine, which would create a new file at a deleted path
        self.engine: Engine = sync_engine(db, writer=True, pool_size=1)
        self.conn: Connection | None = None
        self.checkpointer = WalCheckpointer(str(self.files.path), same_file=self.files.check_same)

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
            self.conn = None
            self.files.check_ledger()
            conn = self.engine.connect()
            try:
                self.files.pin()
                # checkpoints run on the checkpointer's thread; SQLite's own only as a backstop
                conn.connection.driver_connection.execute(f"PRAGMA wal_autocheckpoint={BACKSTOP_PAGES}")
            except BaseException:
                conn.close()
                raise
            self.conn = conn
        return conn

    def check_schema(self) -> None:
        check_writable(self.db)
        conn = self._connection()
        try:
            check_schema(conn, self.db)
        finally:
            conn.rollback()  # end Alembic's read; the writer's transactions begin on their own

    def append(self, items: Sequence[recorder.Input], now: float | None) -> AppendResult:
        """One transaction; reported done only if the ledger's files are still the ones written
        (:class:`LedgerFiles`).

        Raises:
            PersistenceError: nothing of ``items`` was recorded in the ledger the path names;
                ``__cause__`` is the SQLAlchemy error (the daemon retries lock and connection
                errors, ``ledger.errors.is_transient``).
            LedgerUnwritable: the ledger's files were deleted, replaced or made read-only (a
                failed transaction is explained by them first: "disk I/O error" is what SQLite
                says of a file made immutable), whether or not this transaction committed.
        """
        try:
            conn = self._connection()
            with conn.begin():  # BEGIN IMMEDIATE (ledger.db); COMMIT, or ROLLBACK on any error
                result = recorder.append(conn, items, now=now)
        except (SQLAlchemyError, sqlite3.Error) as exc:  # connect, BEGIN, COMMIT (the recorder translates its own)
            self._explain(exc)
            raise _error(exc) from exc
        except PersistenceError as exc:
            if not isinstance(exc, LedgerUnwritable):  # the recorder's translated driver errors
                self._explain(exc)
            raise
        self.files.check()  # committed, but not acknowledged before this passes
        self.checkpointer.committed()
        return result

    def _explain(self, exc: BaseException) -> None:
        """Raise the watch's error when the ledger's files explain ``exc``."""
        try:
            self.files.check()
        except LedgerUnwritable as gone:
            raise gone from exc

    def close(self) -> None:
        conn, self.conn = self.conn, None
        try:
            if conn is not None:
                conn.close()
        finally:
            self.engine.dispose()
            self.checkpointer.close()


def _error(exc: SQLAlchemyError | sqlite3.Error) -> PersistenceError:
    return persistence_error(exc)  # a raw sqlite3 error: the PRAGMA on the raw connection
