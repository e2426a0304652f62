"""SQLite, the embedded default: one file per ledger (DESIGN §5 "Backends").

* WAL, ``synchronous=NORMAL``, ``busy_timeout``, a 64 MiB page cache for writers; files created
  with mode 0600. No ``mmap``: in WAL mode every commit by another connection makes a reader drop
  its page cache and, with ``mmap``, unmap the file, so a lookup right after a lease write took
  0.8 ms instead of 0.15 ms for one indexed query (A/B on the 2-core reference machine).
* Writers open transactions with ``BEGIN IMMEDIATE`` so that the write lock is taken up front
  (pysqlite's deferred BEGIN would otherwise fail with SQLITE_BUSY on upgrade; SQLAlchemy docs,
  dialects/sqlite.html "Serializable isolation / Savepoints / Transactional DDL"). That lock also
  serialises writers of the log, so :meth:`SQLiteBackend.lock_log` has nothing to do.
* Connections open the file with ``mode=rw`` (sqlite.org/uri.html): a connection made after the
  ledger file was deleted fails instead of quietly starting an empty ledger at the path.
* Bulk statements: executemany of one statement (pysqlite steps a prepared statement per row,
  which is as fast as SQLite goes); block loads as ``IN (?, …)`` chunks.

Audits of a ledger this process cannot write (a read-only mount, a snapshot, another user's file:
:meth:`SQLiteBackend.audit_engine`). The usual open fails there: a WAL database needs its ``-shm``
and ``-wal`` files, and SQLite makes them beside the file (sqlite.org/wal.html, "Read-Only
Databases": a read-only WAL database can be read when the ``-shm`` and ``-wal`` already exist, when
the directory is writable so they can be created, or when it is opened ``immutable``). So:

* ``-shm`` and ``-wal`` exist: ``mode=ro``, SQLite's own protocol. A writer may be at work (the
  ledger of a running consumer seen through a read-only mount): SQLite (3.22+) does not trust a
  ``-shm`` it cannot write and checks it against the WAL, so every committed transaction is seen
  and none half (a transaction only in the WAL included: tests/integration/ledger/test_readonly_audit.py).
* no ``-wal`` with content and no ``-shm`` (a ledger its last connection closed, which checkpoints
  and deletes both): ``immutable=1``, which needs neither. SQLite then takes no lock and assumes
  the file never changes; that holds here because no connection has the database open (each keeps
  ``-shm`` until the last one closes) and every commit is in the file, and it is checked: when the
  reading ends the file must have the same identity, size, mtime and ctime as before it began
  (any write changes them, a checkpoint by a writer that came meanwhile included), else the audit
  fails as :class:`~ledger.errors.LedgerError`, to be run again. (Times are as fine as the kernel
  keeps them: Linux 6.13+ stamps a change made after a ``stat`` finely; older kernels round to
  their clock tick, ~4 ms, so there a write in the tick of the file's previous write shows only
  through the size.) ``mode=ro`` would not do here: it creates ``-wal`` and ``-shm`` where it can
  (a writable directory), owned by the auditor and left behind, after which the ledger's owner can
  no longer write it ("attempt to write a readonly database"; seen on SQLite 3.40, a 0644 ledger
  of uid 1000 read by ``nobody``).
* a ``-wal`` with content and no ``-shm`` (a copy without it, a crash): refused; transactions in
  that WAL can only be read through a ``-shm``, and none is created beside a ledger this process
  cannot write (above).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import quote

from sqlalchemy import ColumnElement, Engine, bindparam, create_engine, delete, event, func, select
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import URL

from ledger.backends.base import AuditOpen, Backend, KeysDelete, ReadOnlyOpen, RowsWrite
from ledger.errors import LedgerError
from ledger.prepared import Prepared
from ledger.schema import BlockRow

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from ledger.db import Sql

SQLITE_BUSY_TIMEOUT_MS = 30_000
SQLITE_WRITER_CACHE_KIB = 64 * 1024
IN_CHUNK = 512
"""Hashes per ``IN (...)`` list of a block load (a power of two: see :meth:`SQLiteBackend._blocks_in`)."""
_BLOCKS = BlockRow.__table__


def sqlite_open_uri(path: str, mode: str = "rw") -> str:
    """The SQLite URI that opens the file ``path`` and never creates it (sqlite.org/uri.html,
    ``mode=rw`` or ``ro``). Only :meth:`SQLiteBackend.sync_engine` told to create (``migrate``, a
    writer) makes the file."""
    return f"{_file_uri(path)}?mode={mode}"


def _file_uri(path: str) -> str:
    return f"file:{quote(os.path.abspath(path))}"


def _open_url(url: URL, driver: str, **params: str) -> URL:
    """``url`` opening :func:`sqlite_open_uri` (pysqlite and aiosqlite pass ``mode`` and the other
    SQLite URI parameters into the URI); ``params`` default to ``mode=rw``."""
    return url.set(drivername=driver, database=_file_uri(url.database or ""),
                   query={**(params or {"mode": "rw"}), "uri": "true"})


def write_refusal(path: Path) -> str | None:
    """Why this process cannot write the SQLite ledger ``path`` or create the ``-wal``/``-shm``
    files beside it, or None when it can. ``access(2)`` judges, for root too: read-only mounts and
    the immutable attribute (``chattr +i``) stop root, mode bits stop the others.

    Returns ``read-only file system``, or which file or directory this user may not write. A
    missing file is judged by its directory alone.
    """
    for target, what in ((path, "file"), (path.parent, "directory")):
        if target.exists() and not os.access(target, os.W_OK):
            if os.statvfs(target).f_flag & os.ST_RDONLY:
                return "read-only file system"
            return f"{what} {target} is not writable by this user"
    return None


class _FileState(NamedTuple):
    """What any write to a file changes: identity, size, mtime and ctime (ns)."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> _FileState:
        st = os.stat(path)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _in_existing_directory(url: URL, missing_directory: str) -> Path:
    """The ledger file's path, refusing an in-memory database and a path whose directory does not
    exist (a mistyped path: no ledger there, and none may quietly start there).

    Raises:
        LedgerError: either of the above; ``missing_directory`` begins the message.
    """
    path = url.database
    if not path or not path.strip():  # "   ": a file named by blanks is a slip of the shell, never a ledger
        raise LedgerError("no ledger file given (an empty or blank path): give the SQLite ledger file, e.g. --db ledger.db")
    if path == ":memory:":
        raise LedgerError("the ledger needs a SQLite file, not an in-memory database")
    file = Path(path)
    try:
        exists = file.exists()
    except PermissionError:  # a directory on the path this user may not enter
        raise LedgerError(f"cannot reach the ledger {path}: permission denied on a directory of its path "
                          "for this user") from None
    if not exists and not file.parent.is_dir():
        raise LedgerError(f"{missing_directory} {path}: directory {file.parent} does not exist")
    if file.is_dir():
        raise LedgerError(f"{path} is a directory, not a SQLite ledger file: give the file, e.g. {file / 'ledger.db'}")
    if exists and file.is_file() and not os.access(file, os.R_OK):  # SQLite would say "unable to open"
        raise LedgerError(f"cannot read the ledger {path}: permission denied for this user (mode "
                          f"{file.stat().st_mode & 0o777:04o}, owner uid {file.stat().st_uid}); ledgers are "
                          "created mode 0600: run as their owner or give this user read access")
    return file


def _ensure_file(url: URL, create: bool) -> Path:
    file = _in_existing_directory(url, "cannot create the ledger" if create else "no ledger at")
    if file.exists():
        return file
    if not create:
        raise LedgerError(f"no ledger at {file}: run `semkv-ledger migrate --db {file}` first")
    os.close(os.open(file, os.O_CREAT | os.O_WRONLY, 0o600))
    return file


def _listeners(sync_engine: Engine, *, writer: bool, read_only: bool = False) -> None:
    begin = "BEGIN IMMEDIATE" if writer else "BEGIN"

    @event.listens_for(sync_engine, "connect")
    def _connect(dbapi_connection, _record) -> None:  # noqa: ANN001
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves
        cursor = dbapi_connection.cursor()
        if not read_only:  # both are writes (the journal mode lives in the file's header)
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


class SQLiteBackend(Backend):
    name = "sqlite"
    interruptible = True
    write_begin = "BEGIN IMMEDIATE"
    lock_poll_ms = 1
    """SQLite's busy handler sleeps 1, 2, 5, … then 100 ms between tries (``sqliteDefaultBusyCallback``,
    sqlite.org/src/file/src/main.c), so a writer committing back to back (a busy consumer) holds the
    lock at nearly every try and a 5 s wait can fail; tries about every millisecond find its gaps
    between transactions (tests/integration/ledger/test_lock_wait.py: a 40 ms / 0.5 ms writer)."""
    snapshot_begin = "BEGIN"  # a deferred read transaction: one WAL snapshot for its statements
    change_counter = "PRAGMA data_version"
    """Changes when another connection commits, never for this connection's own commits
    (https://sqlite.org/pragma.html#pragma_data_version); ~3 µs."""

    def sync_engine(self, url: URL, *, writer: bool, create: bool, pool_size: int,
                    statement_timeout_s: float | None) -> Engine:
        _ensure_file(url, create)
        engine = create_engine(_open_url(url, "sqlite+pysqlite"))
        _listeners(engine, writer=writer)
        return engine

    def async_engine(self, url: URL) -> AsyncEngine:
        from sqlalchemy.ext.asyncio import create_async_engine  # (~60 ms of import: the writer's only)
        _ensure_file(url, create=True)
        engine = create_async_engine(_open_url(url, "sqlite+aiosqlite"))
        _listeners(engine.sync_engine, writer=True)
        return engine

    def ledger_exists(self, url: URL) -> bool:
        """Raises LedgerError for an in-memory URL or a path whose directory does not exist."""
        return _in_existing_directory(url, "no ledger at").exists()

    @contextlib.contextmanager
    def audit_engine(self, url: URL) -> Iterator[AuditOpen]:
        """The usual engine when this process can write the ledger and its directory; else one
        opened read-only as the module docstring says, with a :class:`ReadOnlyOpen` to tell the
        user (nothing is created beside a file this process cannot write).

        Raises:
            LedgerError: no ledger file (or its directory is missing); a ``-wal`` with content
                and no ``-shm`` in a place this process cannot write; or, on exit, a ledger read as
                a snapshot that changed meanwhile (what was read may be inconsistent: run again).
        """
        path = _ensure_file(url, create=False)
        refusal = write_refusal(path)
        if refusal is None:
            engine = create_engine(_open_url(url, "sqlite+pysqlite"))
            _listeners(engine, writer=False, read_only=True)  # an audit writes nothing: not even the journal mode
            try:
                yield engine, None
            finally:
                engine.dispose()
            return
        with _audit_read_only(url, path, refusal) as opened:
            yield opened

    def write_refusal(self, url: URL) -> str | None:
        """:func:`write_refusal` of the ledger file (refuses an in-memory URL or a missing
        directory as :meth:`ledger_exists` does)."""
        return write_refusal(_in_existing_directory(url, "cannot create the ledger"))

    def contains_bytes(self, column: ColumnElement[bytes], needle: bytes) -> ColumnElement[bool]:
        return func.instr(column, needle) > 0  # instr on BLOBs compares bytes (sqlite.org/lang_corefunc.html#instr)

    @contextlib.contextmanager
    def deadline(self, dbapi_connection: Any, past_deadline: Callable[[], bool]) -> Iterator[None]:
        # SQLite calls the handler every 64 virtual-machine steps; True interrupts the statement.
        dbapi_connection.set_progress_handler(past_deadline, 64)
        try:
            yield
        finally:
            dbapi_connection.set_progress_handler(None, 0)

    def lock_wait(self, ms: int) -> tuple[str, str]:
        return f"PRAGMA busy_timeout={ms}", f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}"

    def blocks_by_hashes(self, sql: Sql, stream: dict[str, Any], hashes: set[int]) -> list[tuple]:
        ordered, rows = sorted(hashes), []
        for start in range(0, len(ordered), IN_CHUNK):
            chunk = ordered[start:start + IN_CHUNK]
            prepared, params = self._blocks_in(1 << (len(chunk) - 1).bit_length())
            chunk += [chunk[-1]] * (len(params) - len(chunk))
            rows += sql.all(prepared, {**stream, **dict(zip(params, chunk))})
        return rows

    def _blocks_in(self, size: int) -> tuple[Prepared, list[str]]:
        """``block_hash IN (?, …)`` with ``size`` parameters. Chunks are padded to a power of two
        (repeating their last hash), so at most 10 statements exist and each compiles once."""
        def build() -> tuple[Prepared, list[str]]:
            names = [f"h{i}" for i in range(size)]
            stmt = select(_BLOCKS).where(_BLOCKS.c.engine_id == bindparam("engine_id"),
                                         _BLOCKS.c.attention_dp_rank == bindparam("attention_dp_rank"),
                                         _BLOCKS.c.window_size == bindparam("window_size"),
                                         _BLOCKS.c.block_hash.in_([bindparam(n) for n in names]))
            return Prepared(stmt), names

        return self._shape(("blocks_in", size), build)

    def write_rows(self, sql: Sql, spec: RowsWrite, rows: Sequence[tuple]) -> None:
        if rows:
            sql.many_positional(self._shape(spec, lambda: _insert(spec)), rows)

    def delete_keys(self, sql: Sql, spec: KeysDelete, keys: Sequence[tuple]) -> int:
        return sql.many_positional(self._shape(spec, lambda: _delete(spec)), keys) if keys else 0


@contextlib.contextmanager
def _audit_read_only(url: URL, path: Path, refusal: str) -> Iterator[AuditOpen]:
    """:meth:`SQLiteBackend.audit_engine` of a ledger this process cannot write (the module docstring
    says which open and why)."""
    wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
    if wal.exists() and shm.exists():
        with _read_only(url, ReadOnlyOpen(str(path), refusal, snapshot=False), mode="ro") as opened:
            yield opened
        return
    if wal.exists() and wal.stat().st_size > 0:
        raise LedgerError(f"cannot read the ledger {path} read-only ({refusal}): {wal.name} holds transactions "
                          f"and there is no {shm.name}, which SQLite needs to read them and which is not created "
                          f"beside a ledger this user cannot write; copy {path.name} with {wal.name} to a writable "
                          f"directory and read the copy")
    before = _FileState.of(path)
    try:
        with _read_only(url, ReadOnlyOpen(str(path), refusal, snapshot=True), mode="ro", immutable="1") as opened:
            yield opened
    finally:  # also when the reading failed: a write meanwhile explains a "malformed" page best
        if not _unchanged(path, before):
            raise LedgerError(f"the ledger {path} changed while it was read as an immutable snapshot (it cannot be "
                              f"written here, {refusal}, and had no -shm file): what was read may be inconsistent; "
                              f"run the command again")


def _unchanged(path: Path, before: _FileState) -> bool:
    try:
        return _FileState.of(path) == before
    except OSError:  # deleted or unreachable: changed as far as this reading knows
        return False


@contextlib.contextmanager
def _read_only(url: URL, how: ReadOnlyOpen, **params: str) -> Iterator[AuditOpen]:
    """A read-only engine on the ledger file with these SQLite URI ``params``, disposed on exit."""
    engine = create_engine(_open_url(url, "sqlite+pysqlite", **params))
    _listeners(engine, writer=False, read_only=True)
    try:
        yield engine, how
    finally:
        engine.dispose()


def _insert(spec: RowsWrite) -> Prepared:
    table = spec.table
    stmt = sqlite.insert(table)
    keys = [c.name for c in table.primary_key.columns]
    if spec.conflict == "update":
        stmt = stmt.on_conflict_do_update(index_elements=keys, set_={
            c.name: stmt.excluded[c.name] for c in table.columns if c.name not in keys})
    elif spec.conflict == "add":
        stmt = stmt.on_conflict_do_update(index_elements=keys, set_={"value": table.c.value + stmt.excluded.value})
    elif spec.conflict == "ignore":
        stmt = stmt.on_conflict_do_nothing(index_elements=keys)
    _binds_in_order(stmt, [c.name for c in table.columns])
    return Prepared(stmt)


def _binds_in_order(stmt: Any, names: list[str]) -> None:
    """Rows and keys are bound as tuples, as they are: the statement's parameters must be exactly
    ``names``, in order (a condition binding its own parameter would shift them)."""
    if list(stmt.compile(dialect=sqlite.dialect()).positiontup) != names:
        raise ValueError(f"statement parameters are not {names}: conditions must use literal_column")


def _delete(spec: KeysDelete) -> Prepared:
    table = spec.table
    names = [c.name for c in table.primary_key.columns]
    stmt = delete(table).where(*[table.c[n] == bindparam(n) for n in names], *spec.where)
    _binds_in_order(stmt, names)
    return Prepared(stmt)
