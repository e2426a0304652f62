"""The block index: block hash → log seqs of the block events naming it, kept BEHIND the log.

Why behind: ``inspect block HASH`` must not search the log (35–46 s and 2.8 GB on a 2.7M-row
ledger, issue 23), but an index row written by the writer in the same transaction as its log row
halved the writer (137–178k → 67–94k block events/s of CPU; tools/results/ledger-replay-2026-12-05.md
§4). So the writer is untouched and a **follower** (:class:`BlockIndexFollower`) reads the log after
a watermark, decodes the block events' hashes and writes, in ONE transaction per window of log
seqs, the index rows of that window and the new watermark (``index_watermarks`` row
``block_index``: every log row at or below it is indexed). A follower killed at any point leaves
the index and watermark of its last commit and resumes from there; two followers at once cost work,
never a wrong index (the watermark moves by compare-and-set; rows are inserted with ON CONFLICT DO
NOTHING).

Readers (:func:`ledger.stats.block_history`) take the index up to the watermark and search only the
log rows after it (:func:`indexed_through`), so an empty, partial or complete index gives the same
answer; only the time differs. A watermark past the log's head cannot come from a follower (the log
is append-only, seqs gapless); readers then ignore the index and search the whole log, and
:class:`IndexAhead` tells an operator to rebuild it (``semkv-ledger index --rebuild``).

Visibility: a window never goes past the newest seq visible when the step began. On SQLite the
single writer makes every seq at or below it visible; on PostgreSQL the recorder's log lock
(:meth:`ledger.backends.postgresql.PostgreSQLBackend.lock_log`) makes rows visible in seq order, so
no row at or below a visible seq commits later. A design without that order (per-stream sequences)
would need the writers' own watermark here instead of ``max(seq)``.

Where it runs: ``semkv-ledger index`` (once, with a progress bar, or ``--follow``), and the consumer
daemon's follower task (``block_index_interval_s``). On SQLite a window's write transaction takes the
ledger's one write lock, so the decoding is done before the lock is taken, a window gives up after
waiting :data:`LOCK_WAIT_MS` for it, and a following follower indexes only while the log is quiet
or the index is more than :data:`MAX_LAG_SEQS` behind (:meth:`BlockIndexFollower.step_when_quiet`),
pausing as long as each window took; on PostgreSQL it takes no lock a writer waits on (the log is
only read).

Replay neither rebuilds nor compares the index (derived data, not a projection); tests hold it equal
to a derivation from the whole log.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence

import msgspec
from sqlalchemy import Connection, Engine, bindparam, delete, event, func, or_, select, update
from sqlalchemy.exc import SQLAlchemyError

from ledger.backends import RowsWrite, backend_named
from ledger.db import Sql, sync_engine
from ledger.errors import LedgerError, lock_timed_out, persistence_error
from ledger.prepared import Prepared
from ledger.schema import BUCKET_BITS, BlockIndexRow, IndexWatermarkRow, LogRow
from ledger.types import BlockHash, storage_hashes

BLOCK_KINDS = ("block_stored", "block_removed", "block_updated")
"""Log kinds of the engine events that name blocks (what the index covers)."""
WATERMARK = "block_index"
WINDOW_SEQS = 10_000
"""Log seqs per follower transaction: ~40k index rows of 4-block events
(tools/results/inspect-index-2026-12-05.md has the write lock's time per window)."""

_LOG = LogRow.__table__
_INDEX = BlockIndexRow.__table__
_MARKS = IndexWatermarkRow.__table__
_HEAD = Prepared(select(func.max(_LOG.c.seq)))
_MARK = Prepared(select(_MARKS.c.seq).where(_MARKS.c.name == WATERMARK))
_WINDOW = Prepared(select(_LOG.c.seq, _LOG.c.body)
                   .where(_LOG.c.seq > bindparam("after"), _LOG.c.seq <= bindparam("upto"),
                          or_(*(_LOG.c.kind == kind for kind in BLOCK_KINDS)))  # constants: no expanding IN
                   .order_by(_LOG.c.seq))
_MOVE = Prepared(update(_MARKS).where(_MARKS.c.name == WATERMARK, _MARKS.c.seq == bindparam("was"))
                 .values(seq=bindparam("now")))
LOCK_WAIT_MS = 1_000
"""How long a window's write transaction waits for the write lock before it gives the window up
for now (``CatchUp.lock_busy``) and tries again later: the follower yields to the writer, which
waits 30 s (SQLite's busy timeout, ledger.backends.sqlite)."""
MAX_LAG_SEQS = 100_000
"""How far behind the log a follower lets the index fall while the writer is busy
(:meth:`BlockIndexFollower.step_when_quiet`): ``inspect block`` searches at most this many log
seqs past the watermark (~0.1 s; the whole 2.7M-row log took 2–4 s,
tools/results/inspect-index-2026-12-05.md)."""
_ROWS = RowsWrite(_INDEX, conflict="ignore")
_MARK_ROW = RowsWrite(_MARKS, conflict="ignore")


class IndexAhead(LedgerError):
    """The watermark says the index covers log seqs the log does not have (a log restored from an
    older copy under a newer index, or a hand edit): the index cannot be trusted."""

    def __init__(self, watermark: int, head: int) -> None:
        super().__init__(f"the block index says it covers the log through seq {watermark:,}, but the log ends at "
                         f"seq {head:,}: it is not used; rebuild it with `semkv-ledger index --rebuild`")
        self.watermark, self.head = watermark, head


# -- decoding: only the hashes of a block event's body (ledger.events) ---------------------------


class _Block(msgspec.Struct, gc=False):
    block_hash: int | bytes


class _Stored(msgspec.Struct, tag_field="kind", tag="block_stored", gc=False):
    blocks: list[_Block]


class _Removed(msgspec.Struct, tag_field="kind", tag="block_removed", gc=False):
    block_hashes: list[int | bytes]


class _Updated(msgspec.Struct, tag_field="kind", tag="block_updated", gc=False):
    block_hash: int | bytes


_HASHES = msgspec.msgpack.Decoder(_Stored | _Removed | _Updated)
"""Decodes a block event's log body (ledger.events.BlockStored/Removed/Updated) into its hashes
only: the other fields are skipped, not built."""


def hashes_named(body: bytes) -> list[BlockHash]:
    """The canonical block hashes a block event's log ``body`` names (with repeats).

    Raises:
        msgspec.ValidationError: ``body`` is not a block event's body.
    """
    event = _HASHES.decode(body)
    if type(event) is _Stored:
        return [b.block_hash for b in event.blocks]
    if type(event) is _Removed:
        return event.block_hashes
    return [event.block_hash]


def index_rows(log_rows: Iterable[tuple[int, bytes]]) -> list[tuple[int, int, int]]:
    """``(bucket, block_hash storage column, seq)`` index rows of ``(seq, body)`` block-event log
    rows, one per distinct hash and row, sorted (the B-tree takes them in key order)."""
    rows: list[tuple[int, int, int]] = []
    for seq, body in log_rows:
        bucket = seq >> BUCKET_BITS
        rows.extend((bucket, h, seq) for h in set(storage_hashes(hashes_named(bytes(body)))))
    rows.sort()
    return rows


# -- reading the watermark ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class IndexState:
    """Where the index stands: ``watermark`` (log seqs at or below it are indexed; 0 none) and the
    log's ``head`` (newest seq), as one reader saw them."""

    watermark: int
    head: int

    @property
    def ahead(self) -> bool:
        return self.watermark > self.head

    @property
    def lag(self) -> int:
        """Log seqs not yet indexed (0 when the index is ahead: see :attr:`usable_through`)."""
        return max(0, self.head - self.watermark)

    @property
    def usable_through(self) -> int:
        """The seq a reader may take from the index: the watermark, or 0 (search the whole log)
        when it is ahead of the log."""
        return 0 if self.ahead else self.watermark


def index_state(conn: Connection) -> IndexState:
    """The watermark (read first) and the head (read second: on PostgreSQL's autocommit reads the
    head can only be newer, never older, than the watermark's view).

    Raises:
        sqlalchemy.exc.DBAPIError: the database failed.
    """
    sql = Sql.of(conn)
    try:
        mark = sql.one(_MARK, {})
        head = sql.one(_HEAD, {})
    except sql.errors as exc:
        raise sql.wrap(exc) from exc
    return IndexState(mark[0] if mark else 0, (head[0] if head else None) or 0)


# -- the follower ---------------------------------------------------------------------------------


@dataclasses.dataclass
class CatchUp:
    """What :meth:`BlockIndexFollower.catch_up` did: the watermark before and after, log rows
    read (block events), index rows written, windows committed, seconds, and the head it aimed at."""

    started_at: int = 0
    watermark: int = 0
    head: int = 0
    log_rows: int = 0
    index_rows: int = 0
    windows: int = 0
    seconds: float = 0.0
    lock_seconds: float = 0.0
    """Seconds inside the write transactions (on SQLite: holding the ledger's write lock)."""
    lock_wait_seconds: float = 0.0
    """Seconds waiting to begin them (on SQLite: for the write lock)."""
    lock_busy: int = 0
    """Windows given up for now because the write lock stayed taken for :data:`LOCK_WAIT_MS`."""


class BlockIndexFollower:
    """Keeps the block index behind the log (the module docstring says how and why).

    Opens two engines on ``db``: one to read the log (no write lock on SQLite) and one to write a
    window's rows and watermark (``BEGIN IMMEDIATE`` on SQLite). Not thread-safe: one thread per
    follower.

    Args:
        window_seqs: log seqs per transaction (:data:`WINDOW_SEQS`).
    """

    def __init__(self, db: str, *, window_seqs: int = WINDOW_SEQS) -> None:
        if window_seqs < 1:
            raise ValueError(f"window_seqs must be at least 1, not {window_seqs}")
        self.db = db
        self.window_seqs = window_seqs
        self._last_head = -1
        """The log's head at the previous :meth:`step_when_quiet`."""
        self._pending: tuple[int, int, list, list[tuple[int, int, int]]] | None = None
        """(watermark, upto, log rows, index rows) of a window given up because the lock was busy."""
        # never create: a follower reconnecting after the ledger file was deleted must not make a new one
        self._reader: Engine = sync_engine(db, pool_size=1)
        self._writer: Engine = sync_engine(db, writer=True, create=False, pool_size=1)
        wait, _ = backend_named(self._writer.dialect.name).lock_wait(LOCK_WAIT_MS)

        @event.listens_for(self._writer, "connect")
        def _yield_to_the_writer(dbapi_connection, _record) -> None:  # noqa: ANN001
            cursor = dbapi_connection.cursor()
            cursor.execute(wait)
            cursor.close()
            dbapi_connection.commit()  # psycopg: keep the session setting (SQLite: autocommit, a no-op)

    def close(self) -> None:
        self._reader.dispose()
        self._writer.dispose()

    def __enter__(self) -> BlockIndexFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_schema(self) -> None:
        """Raises: SchemaOutOfDate (not at the head revision: no index tables), PersistenceError."""
        from ledger.migrate import check_schema

        try:
            with self._reader.connect() as conn:
                check_schema(conn, self.db)
        except SQLAlchemyError as exc:
            raise persistence_error(exc) from exc

    def state(self) -> IndexState:
        """Raises: PersistenceError."""
        try:
            with self._reader.connect() as conn:
                return index_state(conn)
        except SQLAlchemyError as exc:
            raise persistence_error(exc) from exc

    def step(self, done: CatchUp | None = None) -> bool:
        """Index the next window of the log after the watermark, in one transaction; False when
        there was nothing to index (caught up), another follower moved the watermark first, or the
        write lock stayed taken for :data:`LOCK_WAIT_MS` (``done.lock_busy``).

        Raises:
            IndexAhead: the watermark is past the log's head.
            PersistenceError: the database failed (nothing of this window was committed).
        """
        done = done if done is not None else CatchUp()
        try:
            with self._reader.connect() as conn:
                state = index_state(conn)
                if state.ahead:
                    raise IndexAhead(state.watermark, state.head)
                if not state.lag:
                    return False
                pending, self._pending = self._pending, None
                if pending is not None and pending[0] == state.watermark:  # read and decoded, then the lock was busy
                    _, upto, window, rows = pending
                else:
                    upto = min(state.head, state.watermark + self.window_seqs)
                    sql = Sql.of(conn)
                    try:
                        window = sql.all(_WINDOW, {"after": state.watermark, "upto": upto}, binary=True)
                    except sql.errors as exc:
                        raise sql.wrap(exc) from exc
                    rows = index_rows(window)
                conn.rollback()  # end the read before the write lock is taken
            asked = time.perf_counter()
            with self._writer.begin() as conn:  # BEGIN IMMEDIATE on SQLite: waits for the write lock
                locked = time.perf_counter()
                done.lock_wait_seconds += locked - asked
                if not self._move(conn, state.watermark, upto, rows):
                    return False
            done.lock_seconds += time.perf_counter() - locked
        except SQLAlchemyError as exc:
            error = persistence_error(exc)
            if lock_timed_out(error):
                done.lock_busy += 1
                self._pending = (state.watermark, upto, window, rows)
                return False
            raise error from exc
        done.watermark, done.head = upto, state.head
        done.log_rows += len(window)
        done.index_rows += len(rows)
        done.windows += 1
        return True

    @staticmethod
    def _move(conn: Connection, was: int, now: int, rows: Sequence[tuple[int, int, int]]) -> bool:
        """In the write transaction: move the watermark from ``was`` to ``now`` (compare-and-set)
        and insert ``rows``; False (nothing written) when the watermark is no longer ``was``."""
        sql = Sql.of(conn)
        try:
            if was == 0:  # a ledger whose watermark row was deleted: start it again
                sql.backend.write_rows(sql, _MARK_ROW, [(WATERMARK, 0)])
            if sql.run(_MOVE, {"was": was, "now": now}) != 1:
                conn.rollback()
                return False
            sql.backend.write_rows(sql, _ROWS, rows)
        except sql.errors as exc:
            raise sql.wrap(exc) from exc
        return True

    def step_when_quiet(self, done: CatchUp | None = None, *, max_lag_seqs: int = MAX_LAG_SEQS) -> bool:
        """:meth:`step`, but only when the log did not grow since the previous call (the writer is
        quiet) or the index is more than ``max_lag_seqs`` behind; False otherwise (and as
        :meth:`step`). Called every interval by a follower (the consumer's, ``index --follow``):
        while a writer commits back to back the index waits, up to ``max_lag_seqs`` behind, which
        bounds what ``inspect block`` searches past the watermark.

        Raises:
            IndexAhead, PersistenceError: as :meth:`step`.
        """
        state = self.state()
        quiet, self._last_head = state.head == self._last_head, state.head
        if not quiet and state.lag <= max_lag_seqs:
            return False
        return self.step(done)

    def catch_up(self, *, progress: Callable[[int, int], None] | None = None,
                 max_windows: int | None = None) -> CatchUp:
        """Index windows until the watermark reaches the head seen when each window began (the log
        may grow meanwhile: a busy ledger is followed, not chased forever; call again), or
        ``max_windows`` were committed. ``progress(watermark, head)`` after each window.

        Raises:
            IndexAhead, PersistenceError: as :meth:`step`.
        """
        started = time.perf_counter()
        first = self.state()
        if first.ahead:
            raise IndexAhead(first.watermark, first.head)
        done = CatchUp(started_at=first.watermark, watermark=first.watermark, head=first.head)
        target = first.head
        while (max_windows is None or done.windows < max_windows) and done.watermark < target:
            if not self.step(done):
                now = self.state()
                if now.ahead:
                    raise IndexAhead(now.watermark, now.head)
                if now.watermark >= target:
                    done.watermark = now.watermark
                    break
                continue  # the lock was busy, or another follower moved it: go on from where it is
            if progress is not None:
                progress(done.watermark, max(target, done.head))
        done.seconds = time.perf_counter() - started
        return done

    def rebuild(self) -> None:
        """Delete every index row and set the watermark to 0, in one transaction (then
        :meth:`catch_up` fills it again).

        Raises:
            PersistenceError: the database failed.
        """
        try:
            with self._writer.begin() as conn:
                conn.execute(delete(_INDEX))
                conn.execute(delete(_MARKS).where(_MARKS.c.name == WATERMARK))
                conn.execute(_MARKS.insert().values(name=WATERMARK, seq=0))
        except SQLAlchemyError as exc:
            raise persistence_error(exc) from exc
