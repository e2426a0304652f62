"""The recorder: one transaction = load rows → decide/apply → write log rows and projections.

The contract (STYLE §1, eventsourcing's ``ProcessRecorder``): the raw log rows, the projection
updates and the "applied through" mark (``engines.last_seq``) are written in ONE transaction, so a
batch is recorded exactly once or not at all. The same code serves both backends; what differs
(locking, upsert dialect) is looked up from the connection's dialect.

Rows become visible in ``seq`` order: on SQLite the writer holds the database write lock from
``BEGIN IMMEDIATE``; on PostgreSQL ``LOCK TABLE log IN SHARE ROW EXCLUSIVE MODE`` serialises
writers (several consumers for different engines) so that a reader tailing the log never skips a
seq that commits later (eventsourcing ``postgres.py`` ``_lock_table`` does the same).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection, Table, and_, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from ledger import events as ev
from ledger.apply import GLOBAL, LogEntry, Projection
from ledger.decide import BATCH_ROW_INDEX, AppendResult, Decider
from ledger.errors import PersistenceError
from ledger.schema import (
    BlockRow,
    CounterRow,
    DeadLetterRow,
    DonorBlockRow,
    DonorRow,
    EngineRow,
    LeaseRow,
    LogRow,
    SourceRow,
    StreamRow,
)
from ledger.types import BlockState, DonorState, StreamKey, split_hash

Input = ev.ReceivedBatch | ev.DeadLetter | ev.GapReport
T = TypeVar("T")
_IN_CHUNK = 500  # bound parameters per IN (...) list

_TABLES: dict[str, Table] = {
    "engines": EngineRow.__table__,
    "streams": StreamRow.__table__,
    "sources": SourceRow.__table__,
    "blocks": BlockRow.__table__,
    "donors": DonorRow.__table__,
    "leases": LeaseRow.__table__,
}
_LOG = LogRow.__table__


def transact(conn: Connection, fn: Callable[[Decider], T], *, now: float | None = None,
             engine_ids: Iterable[str] = (), donor_ids: Iterable[str] = (), lease_ids: Iterable[str] = ()) -> T:
    """Run ``fn`` with a :class:`Decider` over freshly loaded rows, then write what it emitted.

    Must be called inside a transaction on ``conn``. ``fn`` may read more rows through the
    decider's projection only if they were named in ``engine_ids``/``donor_ids``/``lease_ids``.

    Raises:
        PersistenceError: any driver error (translated here, the one boundary).
    """
    try:
        _lock_log(conn)
        proj = Projection(partial=True)
        _load_engines(conn, proj, set(engine_ids))
        _load_by_id(conn, proj, "donors", DonorRow.__table__.c.donor_id, set(donor_ids))
        _load_by_id(conn, proj, "leases", LeaseRow.__table__.c.lease_id, set(lease_ids))
        decider = Decider(proj, _next_seq(conn), time.time() if now is None else now, _digest_lookup(conn))
        value = fn(decider)
        write(conn, proj, decider.entries)
        return value
    except SQLAlchemyError as exc:
        raise _translate(exc) from exc


def append(conn: Connection, items: Sequence[Input], *, now: float | None = None) -> AppendResult:
    """Append a batch of consumer inputs and apply them, in the caller's transaction."""
    engine_ids = {item.engine_id for item in items}

    def run(decider: Decider) -> AppendResult:
        _load_sources(conn, decider.proj, {i.source_id for i in items if isinstance(i, ev.ReceivedBatch)})
        _load_blocks(conn, decider.proj, _touched_hashes(items))
        for item in items:
            decider.handle(item)
        return decider.result

    return transact(conn, run, now=now, engine_ids=engine_ids)


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------


def _lock_log(conn: Connection) -> None:
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql("LOCK TABLE log IN SHARE ROW EXCLUSIVE MODE")


def _next_seq(conn: Connection) -> int:
    return (conn.execute(select(func.max(_LOG.c.seq))).scalar() or 0) + 1


def _chunks(values: Sequence[T]) -> Iterable[Sequence[T]]:
    for start in range(0, len(values), _IN_CHUNK):
        yield values[start:start + _IN_CHUNK]


def _load_engines(conn: Connection, proj: Projection, engine_ids: set[str]) -> None:
    if not engine_ids:
        return
    for row in conn.execute(select(EngineRow.__table__).where(EngineRow.__table__.c.engine_id.in_(engine_ids))):
        proj.engines[row.engine_id] = row._asdict()
    stream_table = StreamRow.__table__
    for row in conn.execute(select(stream_table).where(stream_table.c.engine_id.in_(engine_ids))):
        proj.streams[StreamKey(row.engine_id, row.attention_dp_rank, row.window_size)] = row._asdict()


def _load_sources(conn: Connection, proj: Projection, source_ids: set[str]) -> None:
    _load_by_id(conn, proj, "sources", SourceRow.__table__.c.source_id, source_ids)


def _load_by_id(conn: Connection, proj: Projection, name: str, column, ids: set[str]) -> None:
    target = getattr(proj, name)
    for chunk in _chunks(sorted(ids)):
        for row in conn.execute(select(column.table).where(column.in_(chunk))):
            target[row._mapping[column.name]] = row._asdict()


def _touched_hashes(items: Sequence[Input]) -> dict[StreamKey, set[int]]:
    """stream -> storage hashes (signed 64-bit) that the batch's events refer to."""
    touched: dict[StreamKey, set[int]] = defaultdict(set)
    for item in items:
        if not isinstance(item, ev.ReceivedBatch):
            continue
        for event in item.events:
            hashes = touched[StreamKey(item.engine_id, event.attention_dp_rank, event.window_size)]
            body = event.body
            if isinstance(body, ev.BlockStored):
                hashes.update(split_hash(b.block_hash)[0] for b in body.blocks)
            elif isinstance(body, ev.BlockRemoved):
                hashes.update(split_hash(h)[0] for h in body.block_hashes)
            elif isinstance(body, ev.BlockUpdated):
                hashes.add(split_hash(body.block_hash)[0])
    return touched


def _load_blocks(conn: Connection, proj: Projection, touched: dict[StreamKey, set[int]]) -> None:
    """Load the touched blocks through the primary key's prefix (engine, dp rank, window, hash)."""
    table = BlockRow.__table__
    names = [c.name for c in table.columns]
    for stream, hashes in touched.items():
        if not hashes:
            continue
        for chunk in _chunks(sorted(hashes)):
            query = select(table).where(and_(table.c.engine_id == stream.engine_id,
                                             table.c.attention_dp_rank == stream.attention_dp_rank,
                                             table.c.window_size == stream.window_size,
                                             table.c.block_hash.in_(chunk)))
            compiled = query.compile(dialect=conn.dialect, compile_kwargs={"render_postcompile": True})
            params = compiled.params if compiled.positiontup is None else tuple(compiled.params[k] for k in compiled.positiontup)
            rows = conn.exec_driver_sql(compiled.string, params).fetchall()
            proj.load_blocks(dict(zip(names, row)) for row in rows)


def _digest_lookup(conn: Connection) -> Callable[[str, int, int], int | None]:
    def lookup(source_id: str, epoch: int, seq: int) -> int | None:
        body = conn.execute(select(_LOG.c.body).where(
            _LOG.c.source_id == source_id, _LOG.c.source_epoch == epoch, _LOG.c.zmq_seq == seq,
            _LOG.c.batch_index == BATCH_ROW_INDEX)).scalar()
        return None if body is None else ev.BODY_DECODER.decode(body).digest

    return lookup


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------


def log_row(entry: LogEntry) -> dict[str, Any]:
    """The ``log`` table row for an entry."""
    return {
        "seq": entry.seq, "committed_at": entry.committed_at, "kind": ev.kind_of(entry.body),
        "type_name": entry.type_name, "engine_id": entry.engine_id, "source_id": entry.source_id,
        "source_epoch": entry.source_epoch, "zmq_seq": entry.zmq_seq, "batch_index": entry.batch_index,
        "event_id": entry.event_id, "attention_dp_rank": entry.attention_dp_rank,
        "window_size": entry.window_size, "applied": entry.applied,
        "body": ev.BODY_ENCODER.encode(entry.body), "payload": entry.payload,
    }


def write(conn: Connection, proj: Projection, entries: Sequence[LogEntry]) -> None:
    """Insert log rows, run bulk ops, then upsert every dirty projection row."""
    if entries:
        insert(conn, _LOG, [log_row(e) for e in entries])
    for op in proj.bulk_ops:
        _run_bulk(conn, op.engine_id, op.seq)
    for name, keys in proj.dirty.items():
        if keys:
            rows = getattr(proj, name)
            upsert(conn, _TABLES[name], [rows[k] for k in keys])
    if proj.donor_blocks:
        insert(conn, DonorBlockRow.__table__, proj.donor_blocks)
    if proj.dead_letters:
        insert(conn, DeadLetterRow.__table__, proj.dead_letters)
    if proj.counters:
        _add_counters(conn, proj.counters)


def _run_bulk(conn: Connection, engine_id: str, seq: int) -> None:
    blocks, donors, streams = BlockRow.__table__, DonorRow.__table__, StreamRow.__table__
    conn.execute(update(blocks).where(blocks.c.engine_id == engine_id, blocks.c.state == BlockState.LIVE)
                 .values(state=BlockState.QUARANTINED, updated_seq=seq))
    conn.execute(update(donors).where(donors.c.engine_id == engine_id,
                                      donors.c.state.in_([DonorState.REGISTERED, DonorState.LIVE]))
                 .values(state=DonorState.QUARANTINED, updated_seq=seq))
    conn.execute(update(streams).where(streams.c.engine_id == engine_id).values(resync=True))


def _insert_for(conn: Connection):
    return postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert


def executemany(conn: Connection, stmt, rows: Sequence[dict[str, Any]]) -> None:
    """Execute a Core statement for many rows through the DBAPI's ``executemany``.

    The statement is compiled once per dialect and cached; rows go to the driver as plain tuples
    (or dicts for named paramstyles). This skips SQLAlchemy's per-row bind processing, which
    cost more than the inserts themselves on the ingest path (tools/bench_ledger.py). Values must
    already be driver-native: int, float, str, bytes, bool, None.
    """
    if not rows:
        return
    compiled = _compiled(conn.dialect, stmt)
    if compiled.positiontup is not None:
        order = compiled.positiontup
        params = [tuple(row[k] for k in order) for row in rows]
    else:
        params = list(rows)
    conn.exec_driver_sql(compiled.string, params)


_COMPILED: dict[tuple[type, str, int], Any] = {}


def _compiled(dialect, stmt):
    # Keyed by dialect class and paramstyle: asyncpg ($1) and psycopg (%(name)s) are both "postgresql".
    key = (type(dialect), dialect.paramstyle, id(stmt))
    hit = _COMPILED.get(key)
    if hit is None:
        hit = _COMPILED[key] = (stmt, stmt.compile(dialect=dialect))
    return hit[1]


def _upsert_stmt(conn: Connection, table: Table):
    key = (conn.dialect.name, "upsert", table.name)
    stmt = _STATEMENTS.get(key)
    if stmt is None:
        stmt = _insert_for(conn)(table)
        keys = [c.name for c in table.primary_key.columns]
        stmt = _STATEMENTS[key] = stmt.on_conflict_do_update(
            index_elements=keys, set_={c.name: stmt.excluded[c.name] for c in table.columns if c.name not in keys})
    return stmt


_STATEMENTS: dict[tuple[str, str, str], Any] = {}


def _insert_stmt(conn: Connection, table: Table):
    key = (conn.dialect.name, "insert", table.name)
    stmt = _STATEMENTS.get(key)
    if stmt is None:
        stmt = _STATEMENTS[key] = table.insert()
    return stmt


def upsert(conn: Connection, table: Table, rows: list[dict[str, Any]]) -> None:
    """INSERT … ON CONFLICT (primary key) DO UPDATE every other column (both dialects)."""
    executemany(conn, _upsert_stmt(conn, table), rows)


def insert(conn: Connection, table: Table, rows: Sequence[dict[str, Any]]) -> None:
    executemany(conn, _insert_stmt(conn, table), rows)


def _add_counters(conn: Connection, deltas) -> None:
    key = (conn.dialect.name, "add", "counters")
    stmt = _STATEMENTS.get(key)
    if stmt is None:
        table = CounterRow.__table__
        stmt = _insert_for(conn)(table)
        stmt = _STATEMENTS[key] = stmt.on_conflict_do_update(
            index_elements=["engine_id", "name"], set_={"value": table.c.value + stmt.excluded.value})
    executemany(conn, stmt, [{"engine_id": e or GLOBAL, "name": n, "value": v} for (e, n), v in sorted(deltas.items())])


def _translate(exc: SQLAlchemyError) -> PersistenceError:
    original = exc.orig if isinstance(exc, DBAPIError) else exc
    return PersistenceError(f"{type(original).__name__}: {original}".strip())
