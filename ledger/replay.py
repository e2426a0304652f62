"""``semkv-ledger replay``: rebuild every projection from the log in a scratch database and diff.

The rebuild reads the live log in ``seq`` order (streamed in pages, read-only), folds each page with
:func:`ledger.apply.fold_rows` (what :func:`ledger.apply.apply` does row by row, without recording
changes) into an in-memory :class:`~ledger.apply.Projection`, writes the result
into a scratch SQLite file (created from ``Base.metadata``; the live database is never written, nor is
any file that holds more than projection tables: :func:`refuse_foreign_scratch`),
then compares every projection table row by row with the live one. Any difference is a bug.

``until`` stops after that log seq (time travel); the diff is then skipped, since the live
projections are at the head of the log, and the rebuild starts from the newest projection snapshot
at or before ``until`` when there is one (:mod:`ledger.snapshot`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Table, bindparam, func, select

from ledger import events as ev
from ledger.apply import LogEntry, LogRowColumns, Projection, fold_rows
from ledger.backends.base import ReadOnlyOpen
from ledger.backends.sqlite import sqlite_open_uri
from ledger.db import Sql, audit_engine, sync_engine, write_refusal
from ledger.errors import LedgerError
from ledger.migrate import check_schema, current_revision
from ledger.prepared import Prepared
from ledger.recorder import write_projection
from ledger.schema import PROJECTION_TABLES, Base, LogRow
from ledger.snapshot import ProjectionSnapshot, from_projection, latest_snapshot, save_snapshot, to_projection

_LOG = LogRow.__table__
Progress = Callable[[int, int], None]


@dataclasses.dataclass
class TableDiff:
    table: str
    only_in_live: list[dict[str, Any]]
    only_in_replay: list[dict[str, Any]]
    changed: list[tuple[dict[str, Any], dict[str, Any]]]  # (live row, replayed row)
    totals: tuple[int, int, int] = (0, 0, 0)
    """(only in live, only in replay, changed) before sampling."""

    @property
    def count(self) -> int:
        return sum(self.totals)


@dataclasses.dataclass
class ReplayReport:
    events: int
    last_seq: int
    rebuild_seconds: float
    diffs: list[TableDiff]
    compared: bool
    scratch_path: str | None = None
    row_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    started_from: int = 0
    """The seq of the snapshot the rebuild started from (``--until`` only), 0: the start of the log."""

    @property
    def events_per_second(self) -> float:
        return self.events / self.rebuild_seconds if self.rebuild_seconds > 0 else float("inf")

    @property
    def equal(self) -> bool:
        return all(d.count == 0 for d in self.diffs)


_LOG_COLUMNS = ("seq", "committed_at", "body", "type_name", "engine_id", "source_id", "source_epoch", "zmq_seq",
                "batch_index", "event_id", "attention_dp_rank", "window_size", "applied")
"""Log columns in :class:`~ledger.apply.LogEntry`'s field order (``payload`` is not read)."""
_LOG_PAGE = Prepared(select(*(_LOG.c[name] for name in _LOG_COLUMNS))
                     .where(_LOG.c.seq > bindparam("after"), _LOG.c.seq <= bindparam("upto"))
                     .order_by(_LOG.c.seq))
_FOLD_COLUMNS = ("seq", "body", "type_name", "engine_id", "event_id", "attention_dp_rank", "window_size", "applied")
"""Log columns of :data:`ledger.apply.LogRowColumns`, what a fold reads."""
_FOLD_PAGE = Prepared(select(*(_LOG.c[name] for name in _FOLD_COLUMNS))
                      .where(_LOG.c.seq > bindparam("after"), _LOG.c.seq <= bindparam("upto"))
                      .order_by(_LOG.c.seq))
_HEAD = select(func.max(_LOG.c.seq))


def iter_log(conn: Connection, until: int | None = None, batch_rows: int = 20_000, *,
             after: int = 0) -> Iterator[LogEntry]:
    """Log rows in seq order as :class:`LogEntry` (bodies decoded), streamed in pages of
    ``batch_rows``, from after seq ``after`` up to ``until`` (a seq; None: the whole log).

    Raises:
        sqlalchemy.exc.DBAPIError: the database failed (as SQLAlchemy would have raised it).
    """
    decode = ev.BODY_DECODER.decode
    for rows in _pages(conn, _LOG_PAGE, until, batch_rows, after):
        for seq, committed_at, body, *rest, applied in rows:
            yield LogEntry(seq, committed_at, decode(body), *rest, bool(applied))


FOLD_PAGE_ROWS = 20_000


def iter_log_pages(conn: Connection, until: int | None = None, page_rows: int = FOLD_PAGE_ROWS, *,
                   after: int = 0) -> Iterator[list[LogRowColumns]]:
    """Pages of at most ``page_rows`` log rows in seq order, from after seq ``after`` up to ``until``
    (None: the whole log), each row the columns a fold reads, the body undecoded
    (:data:`ledger.apply.LogRowColumns`, for :func:`ledger.apply.fold_rows`). Memory holds one page.

    Raises:
        sqlalchemy.exc.DBAPIError: the database failed (as SQLAlchemy would have raised it).
    """
    return _pages(conn, _FOLD_PAGE, until, page_rows, after)


def _pages(conn: Connection, statement: Prepared, until: int | None, page_rows: int, after: int) -> Iterator[list]:
    """The log's rows after ``after`` up to ``until`` (None: the head when called), one window of
    ``page_rows`` seqs per statement.

    A window (``seq > a AND seq <= a + page_rows``), never an open range with a ``LIMIT``: PostgreSQL
    without statistics on the log (autovacuum off, a restored dump, a ledger just loaded) plans
    ``seq > a ORDER BY seq LIMIT n`` as a bitmap scan and a sort of every row after ``a``, so each page
    read the rest of the log: 500k rows took 5.0 s to read instead of 1.15 s, and the cost grows with
    the square of the log (tools/results/replay-2026-12-05-pg.md). Seqs are unique and gapless
    (:mod:`ledger.recorder`), so a window holds at most ``page_rows`` rows; a gap only shortens a page.
    Pages are read on the DBAPI cursor (:class:`~ledger.prepared.Prepared`): SQLAlchemy's result rows
    cost a third of the rebuild (tools/results/replay-2026-12-03.md).
    """
    sql = Sql.of(conn)
    try:
        head = conn.execute(_HEAD).scalar() or 0
        end = head if until is None else min(until, head)
        while after < end:
            upto = min(end, after + page_rows)
            rows = sql.all(statement, {"after": after, "upto": upto}, binary=True)
            if rows:
                yield rows
            after = upto
    except sql.errors as exc:
        raise sql.wrap(exc) from exc


def rebuild(conn: Connection, until: int | None = None, progress: Progress | None = None, *,
            start: ProjectionSnapshot | None = None) -> tuple[Projection, int, int]:
    """Fold the log up to ``until`` (None: all of it) into a fresh projection, or into ``start``'s
    rows and only the log after its seq. Returns (projection, log rows folded, last seq).
    ``progress(folded, to fold)`` after every page of the log read (:data:`FOLD_PAGE_ROWS` rows) and at the end.

    The rows are folded by :func:`ledger.apply.fold_rows` (the same result as :func:`ledger.apply.apply`
    row by row, without recording changes: every row is written at the end).
    """
    after = start.seq if start is not None else 0
    head = until if until is not None else conn.execute(select(func.max(_LOG.c.seq))).scalar() or 0
    total = max(0, head - after)  # seqs are gapless from 1 (ledger.recorder), so no count of the log
    proj = to_projection(start) if start is not None else Projection()
    count, last_seq = 0, after
    for rows in iter_log_pages(conn, until, FOLD_PAGE_ROWS, after=after):
        fold_rows(proj, rows)
        count += len(rows)
        last_seq = rows[-1][0]
        proj.changes.clear()  # what apply recorded for the other rows: nobody reads it here (bounded memory)
        if progress is not None:
            progress(count, total)
    if progress is not None:
        progress(count, total)
    return proj, count, last_seq


def _rows_by_key(conn: Connection, table: Table) -> dict[tuple, dict[str, Any]]:
    keys = [c.name for c in table.primary_key.columns]
    out = {}
    for row in conn.execute(select(table)):
        mapping = {k: _plain(v) for k, v in row._mapping.items()}
        out[tuple(mapping[k] for k in keys)] = mapping
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, str):
        return str(value)
    return value


def diff_tables(live: Connection, scratch: Connection, sample: int = 20) -> list[TableDiff]:
    """Compare every projection table of two databases; at most ``sample`` rows of each kind kept."""
    diffs = []
    for table in PROJECTION_TABLES:
        a, b = _rows_by_key(live, table), _rows_by_key(scratch, table)
        only_a = [a[k] for k in a.keys() - b.keys()]
        only_b = [b[k] for k in b.keys() - a.keys()]
        changed = [(a[k], b[k]) for k in a.keys() & b.keys() if a[k] != b[k]]
        diffs.append(TableDiff(table.name, only_a[:sample], only_b[:sample], changed[:sample],
                               (len(only_a), len(only_b), len(changed))))
    return diffs


def replay(db: str, *, until: int | None = None, scratch: str | Path | None = None,
           progress: Progress | None = None,
           on_read_only: Callable[[ReadOnlyOpen], None] | None = None) -> ReplayReport:
    """Rebuild projections from the log of ``db`` into a scratch SQLite file and diff them.

    The live ledger is only read (:func:`ledger.db.audit_engine`): a SQLite ledger this process
    cannot write (a read-only mount, a snapshot, another user's file) is opened read-only, and the
    scratch file is written elsewhere, so the audit works there too.

    Args:
        scratch: where to write the rebuilt projections; a temporary file (deleted) if None.
        progress: called with (log rows applied, log rows to apply) while rebuilding.
        on_read_only: called once, before anything is read, when the live ledger had to be opened
            read-only (to tell the user why and how).

    Raises:
        LedgerError: ``scratch`` is not a new file or an earlier replay's (see :func:`refuse_foreign_scratch`);
            no ledger at ``db``; a read-only ledger that cannot be read, or that changed while it was
            read as a snapshot (see :func:`ledger.db.audit_engine`).
        SchemaOutOfDate, PersistenceError (as SQLAlchemy errors from the caller's view).
    """
    kept = scratch is not None
    with contextlib.ExitStack() as cleanup:  # unwinds in reverse: connections, engines, the temporary directory
        if scratch is None:
            scratch = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="semkv-replay-"))) / "replay.db"
        else:
            refuse_foreign_scratch(Path(scratch))
            if not Path(scratch).exists():  # registered first, so it runs last: after the engines closed it
                cleanup.push(functools.partial(_remove_unfinished, Path(scratch)))
        live_engine, read_only = cleanup.enter_context(audit_engine(db))
        if read_only is not None and on_read_only is not None:
            on_read_only(read_only)
        scratch_engine = sync_engine(str(scratch), writer=True)
        cleanup.callback(scratch_engine.dispose)
        live = cleanup.enter_context(live_engine.connect())
        if live.dialect.name == "postgresql":
            # One snapshot for the log folded and the projections compared: under READ COMMITTED each
            # statement sees the newest commit, and a batch committed during the fold made a sound,
            # busy ledger "differ" (tests/integration/ledger/test_replay_live.py). SQLite's read
            # transaction already holds one snapshot.
            live.execution_options(isolation_level="REPEATABLE READ")
        check_schema(live, db, cannot_write=read_only.reason if read_only is not None else None)
        live_head = live.execute(select(func.max(_LOG.c.seq))).scalar() or 0
        compare = until is None or until >= live_head
        # a snapshot only for looking back: the audit of the live projections folds the whole log
        start = None if compare else latest_snapshot(live, current_revision(live) or "", until)
        started = time.perf_counter()
        proj, count, last_seq = rebuild(live, until, progress, start=start)
        seconds = time.perf_counter() - started
        Base.metadata.drop_all(scratch_engine, tables=list(PROJECTION_TABLES))
        Base.metadata.create_all(scratch_engine, tables=list(PROJECTION_TABLES))
        with scratch_engine.begin() as out:
            write_projection(out, proj)
        with scratch_engine.connect() as out:
            diffs = diff_tables(live, out) if compare else []
            counts = {t.name: out.execute(select(func.count()).select_from(t)).scalar_one()
                      for t in PROJECTION_TABLES}
        return ReplayReport(count, last_seq, seconds, diffs, compare, str(scratch) if kept else None, counts,
                            start.seq if start is not None else 0)


@dataclasses.dataclass(frozen=True)
class SnapshotTaken:
    seq: int
    """The log seq the snapshot is at (the head when it was taken)."""
    started_from: int
    """The seq of the snapshot it was folded from (0: the start of the log)."""
    folded: int
    """Log rows folded."""
    seconds: float
    size_bytes: int
    """Bytes of the snapshot written (0 when ``already_there``)."""
    already_there: bool = False
    """The newest snapshot was already at the head of the log: nothing was written."""


def snapshot_at_head(db: str, progress: Progress | None = None) -> SnapshotTaken:
    """Take a projection snapshot (:mod:`ledger.snapshot`) at the head of the log of ``db``: the
    newest snapshot of this revision plus the log after it, folded, stored in the ledger.

    Raises:
        LedgerError: no ledger at ``db`` (or it cannot be written).
        SchemaOutOfDate, PersistenceError (as SQLAlchemy errors from the caller's view).
    """
    engine = sync_engine(db, writer=True)
    try:
        with engine.connect() as conn:
            check_schema(conn, db)
            revision = current_revision(conn) or ""
            start = latest_snapshot(conn, revision)
            started = time.perf_counter()
            proj, folded, last_seq = rebuild(conn, None, progress, start=start)
            seconds = time.perf_counter() - started
            conn.rollback()  # end the read before the write transaction (SQLite: BEGIN IMMEDIATE)
        if start is not None and last_seq == start.seq:  # nothing logged since: keep the one there is
            return SnapshotTaken(last_seq, start.seq, 0, seconds, 0, already_there=True)
        with engine.begin() as conn:
            size = save_snapshot(conn, from_projection(proj, last_seq), revision)
        return SnapshotTaken(last_seq, start.seq if start is not None else 0, folded, seconds, size)
    finally:
        engine.dispose()


def _remove_unfinished(path: Path, exc_type: type[BaseException] | None, *_: object) -> bool:
    """ExitStack callback: a replay that did not finish (an error, Ctrl-C) removes the ``--out`` file it
    created, so no empty or half-written projection file is left to be read as a result."""
    if exc_type is not None:
        for leftover in (path, *(path.with_name(path.name + suffix) for suffix in ("-wal", "-shm", "-journal"))):
            leftover.unlink(missing_ok=True)
    return False  # the error goes on


def refuse_foreign_scratch(path: Path) -> None:
    """Refuse a scratch path replay must not write: replay drops and recreates the projection tables
    there, so it takes only a new file (in an existing directory), an empty one, or a file holding
    nothing but projection tables (an earlier ``--out``). A ledger (it has a log) is never one.

    Raises:
        LedgerError: naming ``--out`` and why.
    """
    if not path.exists():
        if not path.parent.is_dir():
            raise LedgerError(f"--out {path}: directory {path.parent} does not exist")
        try:  # the file replay will write: created (and removed) here, so that a refusal names --out
            path.touch(mode=0o600, exist_ok=False)
            path.unlink()
        except OSError as exc:
            raise LedgerError(f"--out {path}: cannot create the file: {exc.strerror or exc}") from None
        return
    if not path.is_file():
        raise LedgerError(f"--out {path}: not a regular file")
    refusal = write_refusal(str(path))  # before any open: a read-only mount, `chattr +i`, another user's file
    if refusal is not None:
        raise LedgerError(f"--out {path}: it cannot be written here ({refusal}); give a file replay can write")
    if path.stat().st_size == 0:
        return
    try:
        with contextlib.closing(sqlite3.connect(sqlite_open_uri(str(path), "ro"), uri=True)) as conn:
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as exc:
        raise LedgerError(f"--out {path}: not a SQLite file ({exc}); replay writes a new file or an earlier --out") from exc
    foreign = sorted(tables - {table.name for table in PROJECTION_TABLES})
    if foreign:
        raise LedgerError(f"--out {path} holds tables replay did not write ({', '.join(foreign[:4])}): it may be a "
                          f"ledger, which replay never overwrites; choose a new file")
