"""The SQLite ledger writer in a child process: the child's loop and the parent's handle on it.

Why a process (DESIGN §7, ≥ 100k block events/s into SQLite on 2 cores): the recorder is Python
and the consumer's receive/decode is Python; in one process they take turns on one GIL, and the
writer thread's transactions took 25–30 % longer beside a busy event loop than alone
(tools/results/consume-2026-11-30.md).

Protocol: one Unix socket pair framed by :class:`multiprocessing.connection.Connection`; the
parent sends one :class:`_Append` (msgspec msgpack: the same typed structs the consumer decoded,
validated again on decode) and waits for its :class:`_Reply` before sending the next, so
transactions commit in submission order. The child is ``python -P -m ledger.writer_process`` with
the parent's ``sys.path`` (a plain subprocess: no ``multiprocessing`` start method or exit hooks
to reason about).

Lifetime: the parent owns shutdown and closes the child after its last commit. The child runs
in its own process group (a terminal's Ctrl-C never reaches it, even while it starts) and
ignores SIGINT and SIGTERM (systemd signals every process of the service's cgroup). When the
socket closes (the parent closed it, exited, or was killed with SIGKILL) the child finishes the
transaction in flight, which commits or rolls back as a whole, and exits. A child that stops
answering is killed after :func:`reply_timeout_s`.

A child that dies fails the transaction in flight with a transient
:class:`~ledger.errors.PersistenceError` and the next call starts a new one; after
:data:`MAX_CONSECUTIVE_DEATHS` deaths without a committed transaction between them (a batch that
crashes the writer every time) the error is permanent. A child that dies after its COMMIT and
before its reply leaves the outcome unknown: the retry of a received batch is then exact (the
log's idempotency key, DESIGN §5), but a gap report or a dead letter sent on its own has no such
key and is recorded twice (a second generation bump: a needless quarantine, never a stale
promise). PostgreSQL has the same window when a connection drops during COMMIT.

The ledger file: the parent takes its identity (``st_dev``, ``st_ino``) when it checks the schema
and gives it to every child (argv), which refuses a path that names another file, or none, before
it opens anything (a restarted child would otherwise write a file renamed over the ledger, or
create an empty one where it was deleted); every transaction is then checked against it
(:class:`ledger.sqlite_writer.LedgerFiles`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from multiprocessing.connection import Connection

import msgspec
import structlog

import ledger.backends.sqlite
from ledger import events as ev
from ledger.decide import AppendResult
from ledger.errors import IntegrityFailure, LedgerUnwritable, LockTimeout, PersistenceError, ReadOnlyDatabase
from ledger.recorder import Input
from ledger.sqlite_writer import FileId, SQLiteWriterConnection

_KINDS = (ev.ReceivedBatch, ev.DeadLetter, ev.GapReport)
_CLOSE_TIMEOUT_S = 30.0
START_TIMEOUT_S = 60.0
"""The child must be ready (imports done, connection open) within this long."""
MAX_CONSECUTIVE_DEATHS = 3
"""Children that may die in a row, with no commit between them, before the error is permanent."""


class _Append(msgspec.Struct, array_like=True, gc=False):
    """One transaction's inputs, split by type (msgspec cannot tell these untagged structs apart in
    one list); ``order[i]`` is the index in ``_KINDS`` of the i-th input."""

    batches: list[ev.ReceivedBatch]
    dead_letters: list[ev.DeadLetter]
    gaps: list[ev.GapReport]
    order: bytes
    now: float | None


class _Reply(msgspec.Struct, array_like=True, gc=False):
    result: AppendResult | None = None
    error: str | None = None
    transient: bool = False
    kind: str = ""
    """The error's class among the ledger's persistence errors (:data:`_ERROR_KINDS`; types do not cross
    the socket, their names do)."""


_ENCODER = msgspec.msgpack.Encoder()
_APPEND = msgspec.msgpack.Decoder(_Append)
_REPLY = msgspec.msgpack.Decoder(_Reply)


def encode_append(items: Sequence[Input], now: float | None) -> bytes:
    """One transaction's request (msgpack; the inverse of :func:`decode_append`)."""
    lists: tuple[list, list, list] = ([], [], [])
    order = bytearray()
    for item in items:
        kind = _KINDS.index(type(item))
        lists[kind].append(item)
        order.append(kind)
    return _ENCODER.encode(_Append(*lists, bytes(order), now))


def decode_append(data: bytes) -> tuple[list[Input], float | None]:
    """``(items, now)`` in their original order.

    Raises:
        msgspec.ValidationError, msgspec.DecodeError: not a request of this protocol.
    """
    request = _APPEND.decode(data)
    sources = [iter(request.batches), iter(request.dead_letters), iter(request.gaps)]
    return [next(sources[kind]) for kind in request.order], request.now


def reply_timeout_s() -> float:
    """How long the parent waits for one transaction's reply before it kills the child: far above
    any transaction, which waits at most the busy timeout for the lock."""
    return max(120.0, 4 * ledger.backends.sqlite.SQLITE_BUSY_TIMEOUT_MS / 1000)


class Child:
    """The parent's handle on one writer process. Used from one thread at a time."""

    def __init__(self, process: subprocess.Popen, conn: Connection) -> None:
        self.process = process
        self._conn: Connection | None = conn

    @classmethod
    def start(cls, db: str, expected: FileId) -> Child:
        """Start a child writing the ledger file ``expected`` (the one the parent checked) and wait
        until it is ready.

        Raises:
            PersistenceError: (transient) the child could not be started, exited, or did not
                become ready within :data:`START_TIMEOUT_S`; or its connection could not be
                opened. Permanent when the path no longer names ``expected``, or the file is
                read-only (:class:`~ledger.sqlite_writer.LedgerFiles`).
        """
        parent_end, child_end = socket.socketpair()
        # -P: no working directory in front of sys.path; the parent's path, its "" made explicit
        path = os.pathsep.join(p or os.getcwd() for p in sys.path)
        try:
            process = subprocess.Popen(
                [sys.executable, "-P", "-m", "ledger.writer_process", str(child_end.fileno()), db,
                 str(ledger.backends.sqlite.SQLITE_BUSY_TIMEOUT_MS), str(expected.device), str(expected.inode)],
                pass_fds=(child_end.fileno(),), env={**os.environ, "PYTHONPATH": path},
                stdin=subprocess.DEVNULL, process_group=0)
        except OSError as exc:
            parent_end.close()
            raise PersistenceError(f"cannot start the ledger writer process: {exc}", transient=True) from exc
        finally:
            child_end.close()
        child = cls(process, Connection(parent_end.detach()))
        try:
            reply = child._reply(START_TIMEOUT_S)
        except PersistenceError:
            child.close(timeout_s=1.0)
            raise
        if reply.error is not None:
            child.close()
            raise _error(reply)
        return child

    @property
    def alive(self) -> bool:
        return self._conn is not None and self.process.poll() is None

    def append(self, items: Sequence[Input], now: float | None) -> AppendResult:
        """One transaction in the child.

        Raises:
            PersistenceError: the transaction failed (``transient`` as classified in the child),
                or the child exited or stopped answering (transient: a new child serves the retry).
        """
        if self._conn is None:
            raise PersistenceError("the ledger writer process is closed", transient=True)
        try:
            self._conn.send_bytes(encode_append(items, now))
        except OSError as exc:
            self._lost()
            raise PersistenceError(f"the ledger writer process exited (exit code {self.process.poll()})",
                                   transient=True) from exc
        reply = self._reply(reply_timeout_s())
        if reply.error is not None:
            raise _error(reply)
        assert reply.result is not None
        return reply.result

    def _reply(self, timeout_s: float) -> _Reply:
        conn = self._conn
        assert conn is not None
        try:
            if not conn.poll(timeout_s):
                self._lost(kill=True)
                raise PersistenceError(f"the ledger writer process did not answer within {timeout_s:.0f} s: killed",
                                       transient=True)
            return _REPLY.decode(conn.recv_bytes())
        except (EOFError, OSError) as exc:
            self._lost()
            raise PersistenceError(f"the ledger writer process exited (exit code {self.process.poll()})",
                                   transient=True) from exc

    def _lost(self, *, kill: bool = False) -> None:
        self._drop_conn()
        if kill:
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(1.0)  # reap it: the exit code goes into the error

    def close(self, timeout_s: float = _CLOSE_TIMEOUT_S) -> None:
        """Close the socket (the child exits after its transaction in flight) and wait for it."""
        self._drop_conn()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _drop_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


_ERROR_KINDS: dict[str, type[PersistenceError]] = {
    kind.__name__: kind for kind in (LedgerUnwritable, LockTimeout, ReadOnlyDatabase, IntegrityFailure)}


def _error(reply: _Reply) -> PersistenceError:
    assert reply.error is not None
    kind = _ERROR_KINDS.get(reply.kind)
    if kind is None:
        return PersistenceError(reply.error, transient=reply.transient)
    error = kind(reply.error)
    error.transient = reply.transient
    return error


def _failure(exc: Exception) -> _Reply:
    """The reply for an error in the child (its type reduced to what the parent needs)."""
    if isinstance(exc, PersistenceError):
        return _Reply(error=str(exc), transient=exc.transient, kind=type(exc).__name__)
    return _Reply(error=f"{type(exc).__name__}: {exc}", transient=False)


def serve(conn: Connection, db: str, expected: FileId | None = None) -> None:
    """The child's loop: one transaction per request until the socket closes."""
    try:
        writer = SQLiteWriterConnection(db, expected=expected)
        writer.connect()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the start
        _send(conn, _failure(exc))
        return
    _tune_gc()
    try:
        if not _send(conn, _Reply()):  # ready
            return
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                return
            if not _send(conn, _run(writer, data)):
                return
    finally:
        writer.close()


def _send(conn: Connection, reply: _Reply) -> bool:
    """False when the parent is gone (the transaction, if any, is committed or rolled back)."""
    try:
        conn.send_bytes(_ENCODER.encode(reply))
        return True
    except OSError:
        return False


GC_GEN0_THRESHOLD = 1_000_000
"""Net container allocations (allocations minus frees) that start a collection: above what one
transaction holds alive at once, so the collector runs only when garbage that refcounting cannot
free (reference cycles) accumulates, not several times inside every transaction."""


def _tune_gc() -> None:
    """Fewer, cheaper garbage collections in a process that only runs transactions.

    A transaction of 1024 engine events holds ~100k row dicts, keys and decoded structs at its peak,
    all freed by refcounting when it ends. At CPython's default gen-0 threshold (700) the collector
    ran ~25 times per transaction and walked everything start-up created (the modules,
    SQLAlchemy's metadata and the schema). ``gc.freeze()`` moves what exists after start-up out of
    every collection (docs.python.org/3/library/gc.html#gc.freeze); the gen-0 threshold
    (:data:`GC_GEN0_THRESHOLD`) keeps collections out of transactions; cycles are still collected.
    Append-only, 256,000 block events: median 2.30 s default, 1.95 s with a threshold of 10,000
    (tools/results/consume-2026-11-30.md); steady state of a 65,536-block cache, one writer:
    96–98k block events/s at 10,000, 103–107k at 200,000, 108k at 1,000,000 (≈ collector off;
    tools/results/consume-2026-11-30-steady.md, "Steps").
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 10, 10)


def _run(writer: SQLiteWriterConnection, data: bytes) -> _Reply:
    try:
        items, now = decode_append(data)
        return _Reply(result=writer.append(items, now))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the transaction
        return _failure(exc)


def main() -> None:
    structlog.configure(processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"),
                                    structlog.processors.JSONRenderer()],
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fd, db, busy_timeout_ms = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    expected = FileId(int(sys.argv[4]), int(sys.argv[5]))
    ledger.backends.sqlite.SQLITE_BUSY_TIMEOUT_MS = busy_timeout_ms  # the parent's, so both wait on a lock alike
    serve(Connection(fd), db, expected)


if __name__ == "__main__":
    main()
