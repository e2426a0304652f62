"""WAL checkpoints of the SQLite ledger on their own thread and connection, off the writer's path.

Why: with SQLite's default ``wal_autocheckpoint`` (1000 pages), the COMMIT that crosses the
threshold copies the WAL back into the database file and fsyncs it on the writer's own thread;
at 1024 engine events per transaction that was ~7 % of the writer's time (append-only, 256,000
block events: 2.28–2.37 s with autocheckpoint, 2.10–2.16 s without; tools/results/consume-2026-11-30.md).
A PASSIVE checkpoint run from another connection copies the same pages while the writer goes on
appending to the WAL (sqlite.org/wal.html "Checkpointing", sqlite.org/c3ref/wal_checkpoint_v2.html):
SQLite releases the GIL while it works, so it runs on the second core.

The writer connection keeps ``wal_autocheckpoint`` at :data:`BACKSTOP_PAGES` (not 0). SQLite
restarts the WAL from its start only when a writer begins after every frame was copied back and
no reader uses them; under steady load the writer is always ahead of this thread, so the WAL grows
until the backstop's inline checkpoint, which then finds almost everything copied already (cheap),
and the next transaction restarts the log: the WAL file stays near the backstop's size. If this
thread stalls or dies, the backstop alone bounds it, as the default autocheckpoint did (a reader
that holds an old snapshot for long defeats both, as before). A checkpoint that cannot finish is
retried on the next round; nothing here is needed for correctness, only for speed.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable

import structlog

from ledger.backends.sqlite import sqlite_open_uri
from ledger.errors import LedgerUnwritable

BACKSTOP_PAGES = 4096
"""``wal_autocheckpoint`` of the writer connection (pages; 16 MiB at the default 4 KiB page)."""
MIN_INTERVAL_S = 0.2
"""At most one checkpoint per this many seconds (each fsyncs the database file): about what the
default 1000-page autocheckpoint does at 100k block events/s, far fewer when commits are small."""

_log = structlog.get_logger("ledger.checkpoint")


class WalCheckpointer:
    """Runs ``PRAGMA wal_checkpoint(PASSIVE)`` on ``path`` after commits, on a daemon thread.

    Call :meth:`committed` after each commit (cheap: sets an event) and :meth:`close` at the end.
    Errors are logged and retried on the next commit; they never reach the writer.
    """

    def __init__(self, path: str, *, min_interval_s: float = MIN_INTERVAL_S,
                 same_file: Callable[[], None] = lambda: None) -> None:
        """``same_file`` raises :class:`~ledger.errors.LedgerUnwritable` when ``path`` (or its
        ``-wal``/``-shm``) no longer names the file the writer opened (``LedgerFiles.check_same``);
        it runs before and after this thread (re)connects, which it does by path: a connection to
        a file renamed over the ledger would checkpoint the writer's WAL, still at ``path``-wal,
        into it, and one opened after the WAL was deleted would start another WAL beside the
        writer's."""
        self.path = path
        self._same_file = same_file
        self.min_interval_s = min_interval_s
        self.checkpoints = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="semkv-ledger-checkpoint", daemon=True)
        self._thread.start()

    def committed(self) -> None:
        self._wake.set()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop after the checkpoint in flight, if any (idempotent)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _connect(self) -> sqlite3.Connection:
        self._same_file()
        conn = sqlite3.connect(sqlite_open_uri(self.path), uri=True, isolation_level=None, check_same_thread=False)
        try:
            self._same_file()  # so the file just opened is the one checked
        except BaseException:
            conn.close()
            raise
        return conn

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            while True:
                self._wake.wait()
                if self._stop.is_set():
                    return
                self._wake.clear()
                started = time.monotonic()
                try:
                    if conn is None:
                        conn = self._connect()
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    self.checkpoints += 1
                except LedgerUnwritable as exc:  # the writer's next transaction stops the daemon
                    _log.warning("ledger.checkpoint_skipped", error=str(exc), path=self.path)
                except sqlite3.Error as exc:
                    _log.warning("ledger.checkpoint_failed", error=str(exc), path=self.path)
                    if conn is not None:
                        conn.close()
                        conn = None
                self._stop.wait(self.min_interval_s - (time.monotonic() - started))
        finally:
            if conn is not None:
                conn.close()
