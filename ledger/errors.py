"""Error family of the ledger. Driver errors are translated once, where a transaction or connection
ends (:func:`persistence_error`), into :class:`PersistenceError` or the kind it is
(:class:`LockTimeout`, :class:`ReadOnlyDatabase`, :class:`IntegrityFailure`), with whether a retry
may succeed; nothing outside ``ledger/`` catches a driver or SQLAlchemy exception. For a person,
:func:`database_error_line` turns any of them into the one ``error:`` line every command prints."""

from __future__ import annotations

import errno
import os
import socket


class LedgerError(Exception):
    """Root of every error the ledger raises on purpose."""


class PersistenceError(LedgerError):
    """A database error translated from the driver (:func:`persistence_error`): a connection lost
    or refused, a disk or server failure, or one of the kinds below.

    ``transient``: whether retrying may succeed (a lock, a lost connection, a full disk), judged
    where the error was translated.
    """

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class LockTimeout(PersistenceError):
    """A write gave up waiting for the ledger's write lock (SQLite ``SQLITE_BUSY``, PostgreSQL
    ``lock_not_available``, SQLSTATE 55P03). Always transient."""

    def __init__(self, message: str) -> None:
        super().__init__(message, transient=True)


class ReadOnlyDatabase(PersistenceError):
    """The database refused a write as read-only (SQLite ``SQLITE_READONLY``, PostgreSQL
    ``read_only_sql_transaction``, SQLSTATE 25006). Permanent."""


class IntegrityFailure(PersistenceError):
    """A constraint refused the write (SQLite ``SQLITE_CONSTRAINT``, PostgreSQL class 23): the
    ledger was changed behind its writer's back, or a bug. Permanent."""


class LedgerUnwritable(PersistenceError):
    """The ledger as a whole can no longer be written (its SQLite file, ``-wal`` or ``-shm``
    deleted, replaced or made read-only, or its directory made read-only;
    ``ledger.sqlite_writer.LedgerFiles``): no transaction of any input can succeed, so this is
    never a verdict on the inputs of the transaction that met it. Always permanent."""

    def __init__(self, message: str) -> None:
        super().__init__(message, transient=False)


class DeadlineExceeded(PersistenceError):
    """A read was interrupted because the caller's deadline passed (see ``LedgerClient.deadline``)."""


class SchemaOutOfDate(LedgerError):
    """The ledger database is not at the schema head; run ``semkv-ledger migrate``."""

    def __init__(self, url: str, current: str | None, head: str, *, unknown: bool = False,
                 cannot_write: str | None = None) -> None:
        self.current, self.head, self.unknown = current, head, unknown
        if unknown:  # a newer semkv-ledger migrated it (or a rolled-back upgrade): migrate cannot go back
            advice = ("it is newer than this semkv-ledger knows (or another application's schema): run the "
                      "semkv-ledger version that migrated it")
        elif cannot_write is not None:  # a read-only snapshot or mount: migrate would be refused too
            advice = (f"it cannot be migrated here ({cannot_write}): copy it, with its -wal file if there is one, to "
                      f"a writable directory, run `semkv-ledger migrate --db COPY` and audit the copy")
        else:
            advice = f"run `semkv-ledger migrate --db {url_for_humans(url)}` first"
        super().__init__(
            f"ledger schema at {url_for_humans(url)} is {current or 'not created'}, expected {head}: {advice}")


class ConfigurationError(LedgerError):
    """A setting, or a source it configures, that cannot work: a key file missing or unusable, a
    source bound to another engine in the ledger. Nothing was started; the command exits 2."""


class EventRejected(LedgerError):
    """A fact could not be applied (e.g. a donor registered twice, a lease on an unknown donor)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


_SQLITE_BUSY = 5
_SQLITE_READONLY = 8
_SQLITE_CONSTRAINT = 19
_SQLITE_NOTADB = 26
_SQLITE_TRANSIENT = {_SQLITE_BUSY, 6, 10, 13, 15}
"""Primary SQLite result codes worth a retry: BUSY, LOCKED, IOERR, FULL, PROTOCOL
(sqlite.org/rescode.html). Not READONLY (8), ERROR (1: "no such table", SQL errors), CORRUPT (11),
CONSTRAINT (19), NOTADB (26): a retry meets them again."""


def is_transient(exc: PersistenceError) -> bool:
    """A database error worth retrying (see :func:`persistence_error`)."""
    return exc.transient


def lock_timed_out(exc: PersistenceError) -> bool:
    """Did a write give up waiting for the ledger's write lock?"""
    return isinstance(exc, LockTimeout)


def sqlite_result_code(exc: BaseException | None) -> int | None:
    """The primary result code of an error raised by Python's sqlite3 (3.11+), else None."""
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def persistence_error(exc: BaseException) -> PersistenceError:
    """The ledger's error for a SQLAlchemy error, a :meth:`~ledger.db.Sql.wrap`-ped driver error or
    a raw ``sqlite3`` one: the one translation of driver errors. Raise it ``from exc``.

    Classified by the driver's code where it has one (a SQLite result code: SQLite reports
    "database is locked" and "attempt to write a readonly database" with the same exception type;
    a PostgreSQL SQLSTATE), else by SQLAlchemy's type: lock waits, lost connections, pool
    timeouts and SQLite's BUSY, LOCKED, IOERR, FULL and PROTOCOL are transient.
    """
    from sqlalchemy.exc import DBAPIError, DisconnectionError, IntegrityError, InterfaceError, OperationalError
    from sqlalchemy.exc import TimeoutError as PoolTimeoutError

    original = exc.orig if isinstance(exc, DBAPIError) else exc
    message = f"{type(original).__name__}: {original}".strip()
    code, sqlstate = sqlite_result_code(original), getattr(original, "sqlstate", None) or ""
    if code == _SQLITE_BUSY or sqlstate == "55P03":
        return LockTimeout(message)
    if code == _SQLITE_READONLY or sqlstate == "25006":
        return ReadOnlyDatabase(message)
    if code == _SQLITE_CONSTRAINT or sqlstate.startswith("23") or isinstance(exc, IntegrityError):
        return IntegrityFailure(message)
    if code is not None:
        return PersistenceError(message, transient=code in _SQLITE_TRANSIENT)
    transient = (isinstance(exc, (OperationalError, InterfaceError, DisconnectionError, PoolTimeoutError))
                 or bool(getattr(exc, "connection_invalidated", False)) or sqlstate.startswith(_PG_TRANSIENT))
    return PersistenceError(message, transient=transient)


_PG_TRANSIENT = ("08", "53", "57P01", "57P02", "57P03", "40001", "40P01", "55000")
"""PostgreSQL SQLSTATEs worth a retry (postgresql.org/docs/current/errcodes-appendix.html): class 08
(connection exception), class 53 (insufficient resources: too many connections, disk full), the
server shutting down or starting (57P01–57P03), serialization failure and deadlock (40001, 40P01),
and 55000, which a server answers a new connection with while the database does not accept
connections (``ALTER DATABASE … ALLOW_CONNECTIONS false``)."""


def unreached_error(exc: BaseException) -> PersistenceError:
    """The ledger's error for one a driver raised untranslated while connecting (asyncpg raises
    its own errors and ``ConnectionRefusedError`` outside SQLAlchemy's wrapping, see
    :func:`is_database_error`): transient when the server could not be reached or refused the
    connection for now (network errors, the SQLSTATEs of :data:`_PG_TRANSIENT`). Raise it ``from exc``."""
    sqlstate = getattr(exc, "sqlstate", None) or ""
    transient = (isinstance(exc, (ConnectionError, TimeoutError)) or sqlstate.startswith(_PG_TRANSIENT)
                 or (isinstance(exc, OSError) and exc.errno in _NETWORK_ERRNOS))
    return PersistenceError(f"{type(exc).__name__}: {one_line(str(exc))}", transient=transient)


_DRIVER_MODULES = ("sqlite3", "psycopg", "asyncpg", "aiosqlite")


def is_database_error(exc: BaseException) -> bool:
    """An error met while reaching or reading a database: SQLAlchemy's, a driver's own (sqlite3,
    psycopg, asyncpg: asyncpg raises its errors and ``ConnectionRefusedError`` untranslated when it
    connects), a :class:`PersistenceError`, or a network error (refused, unreachable, timed out)."""
    from sqlalchemy.exc import SQLAlchemyError

    if isinstance(exc, (SQLAlchemyError, PersistenceError, ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _NETWORK_ERRNOS:
        return True
    return any(cls.__module__.split(".")[0] in _DRIVER_MODULES for cls in type(exc).__mro__)


def database_error_line(exc: BaseException, db: str, *, setting: str = "--db") -> str:
    """What went wrong opening the ledger ``db``, as ONE line for ``error: …``: the setting that
    named it, the database (password hidden), and the driver's reason with its lines joined.

    ``exc`` is any error :func:`is_database_error` accepts (a :class:`SchemaOutOfDate`, or another
    :class:`LedgerError` that already names its path, is printed as it is). Every command that opens
    a ledger (``migrate``, ``stats``, ``consume``, ``connector-check``, ``serve``…) prints this
    line and exits 2, so one message shape covers unreachable servers, missing databases and
    files that are not SQLite databases.
    """
    if isinstance(exc, LedgerError) and not isinstance(exc, PersistenceError):
        return one_line(str(exc))
    return f"{setting} {url_for_humans(db)}: cannot open the ledger database: {_database_reason(exc)}"


def one_line(text: str) -> str:
    """``text`` with its lines and runs of blanks joined by single spaces (driver messages span lines)."""
    return " ".join(text.split())


_NETWORK_ERRNOS = frozenset({
    errno.ETIMEDOUT, errno.ECONNREFUSED, errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ENETUNREACH,
    errno.EADDRNOTAVAIL, socket.EAI_NONAME, socket.EAI_AGAIN, socket.EAI_NODATA,
})
"""Errors reaching a server: refused, unreachable, timed out, and getaddrinfo's (an unknown host name)."""


def _database_reason(exc: BaseException) -> str:
    cause = exc.__cause__ if isinstance(exc, PersistenceError) and exc.__cause__ is not None else exc
    original = getattr(cause, "orig", None) or cause
    text = one_line(str(original)) or type(original).__name__
    if isinstance(original, OSError) and original.errno and original.errno > 0:  # asyncpg: "Connect call failed (…)"
        return f"{os.strerror(original.errno).lower()} ({text})"
    if sqlite_result_code(original) == _SQLITE_NOTADB or "file is not a database" in text:
        return f"not a SQLite ledger ({text})"
    return text


def url_for_humans(url: str) -> str:
    """Hide a password in a database URL before printing it."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - a URL we cannot parse is printed as given, never raised on
        return url
