"""The recorder: one transaction = load rows → decide/apply → write log rows and projections.

The contract (STYLE §1, eventsourcing's ``ProcessRecorder``): the raw log rows, the projection
updates and the "applied through" mark (``engines.last_seq``) are written in ONE transaction, so a
batch is recorded exactly once or not at all. The same code serves both backends; what differs
(locking, upsert dialect, bulk statement shape) is looked up from the connection's dialect.

Rows become visible in ``seq`` order: on SQLite the writer holds the database write lock from
``BEGIN IMMEDIATE``; on PostgreSQL ``LOCK TABLE log IN SHARE ROW EXCLUSIVE MODE`` serialises
writers (several consumers for different engines) so that a reader tailing the log never skips a
seq that commits later (eventsourcing ``postgres.py`` ``_lock_table`` does the same).

Speed (DESIGN §7, ≥ 100k block events/s; measured by tools/bench_ledger.py): every statement is a
:class:`~ledger.db.Prepared` Core statement, compiled once per dialect and run on the DBAPI
cursor under the caller's transaction, so no SQLAlchemy expression is built or compiled per
transaction. Before this, building the IN-list loads and the per-row bind tuples cost more than
the inserts (py-spy, tools/results/consume-2026-11-29.md: 12 % SQLAlchemy, 16 % row building).
On PostgreSQL each table is written with ONE statement per transaction (``INSERT … SELECT FROM
unnest(array, …)``): asyncpg's and psycopg's executemany send one statement per row (pipelined,
but planned and executed row by row), which held the writer at 1.6–4k block events/s.
"""

from __future__ import annotations

import operator
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from sqlalchemy import (
    BigInteger,
    Connection,
    Float,
    Table,
    bindparam,
    delete,
    func,
    literal_column,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import SQLAlchemyError

from ledger import events as ev
from ledger.apply import GLOBAL, LogEntry, Projection
from ledger.db import Prepared, Sql
from ledger.decide import BATCH_ROW_INDEX, EARLIER_EPOCHS_CHECKED, AppendResult, Decider
from ledger.errors import PersistenceError, persistence_error
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
from ledger.types import BlockKey, BlockState, DonorState, StreamKey, split_hash

Input = ev.ReceivedBatch | ev.DeadLetter | ev.GapReport
T = TypeVar("T")
_TWO_64, _I64_MAX = 2**64, 2**63 - 1
_IN_CHUNK = 512  # hashes per IN (...) list on SQLite (a power of two: see _blocks_in)

_TABLES: dict[str, Table] = {
    "engines": EngineRow.__table__,
    "streams": StreamRow.__table__,
    "sources": SourceRow.__table__,
    "blocks": BlockRow.__table__,
    "donors": DonorRow.__table__,
    "leases": LeaseRow.__table__,
}
_LOG = LogRow.__table__


def transact(conn: Connection | Sql, fn: Callable[[Decider], T], *, now: float | None = None,
             engine_ids: Iterable[str] = (), donor_ids: Iterable[str] = (), lease_ids: Iterable[str] = ()) -> T:
    """Run ``fn`` with a :class:`Decider` over freshly loaded rows, then write what it emitted.

    Must be called inside a transaction on ``conn`` (a SQLAlchemy connection, or a
    :class:`~ledger.db.Sql` on a DBAPI connection whose transaction the caller opened). ``fn`` may
    read more rows through the decider's projection only if they were named in
    ``engine_ids``/``donor_ids``/``lease_ids``.

    Raises:
        PersistenceError: any driver error (translated here, the one boundary).
    """
    sql = conn if isinstance(conn, Sql) else Sql.of(conn)
    try:
        _lock_log(sql)
        proj = Projection(partial=True)
        _load_engines(sql, proj, engine_ids)
        _load_by_id(sql, proj, "donors", donor_ids)
        _load_by_id(sql, proj, "leases", lease_ids)
        decider = Decider(proj, _next_seq(sql), time.time() if now is None else now, _digest_lookup(sql),
                          _earlier_digests(sql))
        value = fn(decider)
        write(sql, proj, decider.entries)
        return value
    except SQLAlchemyError as exc:
        raise persistence_error(exc) from exc
    except sql.errors as exc:
        wrapped = sql.wrap(exc)
        raise persistence_error(wrapped) from wrapped


def append(conn: Connection | Sql, items: Sequence[Input], *, now: float | None = None) -> AppendResult:
    """Append a batch of consumer inputs and apply them, in the caller's transaction."""
    sql = conn if isinstance(conn, Sql) else Sql.of(conn)
    engine_ids = {item.engine_id for item in items}

    def run(decider: Decider) -> AppendResult:
        proj = decider.proj
        _load_by_id(sql, proj, "sources", {i.source_id for i in items if isinstance(i, ev.ReceivedBatch)})
        needed, removal_only = _touched_hashes(items)
        _load_blocks(sql, proj, needed)
        proj.unloaded = {(*stream, h) for stream, hashes in removal_only.items() for h in hashes}
        for item in items:
            decider.handle(item)
        return decider.result

    return transact(sql, run, now=now, engine_ids=engine_ids)


# --------------------------------------------------------------------------------------------
# loading (prepared statements; see the module docstring)
# --------------------------------------------------------------------------------------------

_ENGINES, _STREAMS, _BLOCKS = EngineRow.__table__, StreamRow.__table__, BlockRow.__table__
_NAMES = {table.name: [c.name for c in table.columns] for table in (*_TABLES.values(), _LOG)}
_NEXT_SEQ = Prepared(select(func.max(_LOG.c.seq)))
_ENGINE_BY_ID = Prepared(select(_ENGINES).where(_ENGINES.c.engine_id == bindparam("id")))
_STREAMS_OF = Prepared(select(_STREAMS).where(_STREAMS.c.engine_id == bindparam("id")))
_BY_ID = {name: Prepared(select(_TABLES[name]).where(_TABLES[name].primary_key.columns[0] == bindparam("id")))
          for name in ("sources", "donors", "leases")}
_LOGGED_DIGEST = Prepared(select(_LOG.c.body).where(
    _LOG.c.source_id == bindparam("source_id"), _LOG.c.source_epoch == bindparam("epoch"),
    _LOG.c.zmq_seq == bindparam("seq"), _LOG.c.batch_index == BATCH_ROW_INDEX))
_EPOCH_PARAMS = [f"e{i}" for i in range(EARLIER_EPOCHS_CHECKED)]
_EARLIER_DIGESTS = Prepared(select(_LOG.c.body).where(
    _LOG.c.source_id == bindparam("source_id"), _LOG.c.source_epoch.in_([bindparam(n) for n in _EPOCH_PARAMS]),
    _LOG.c.zmq_seq == bindparam("seq"), _LOG.c.batch_index == BATCH_ROW_INDEX))
"""The batches logged at one seq in the epochs just before the current one: one probe of the
log's unique (source_id, source_epoch, zmq_seq, batch_index) index per epoch. (A range over the
epochs would scan every row of those epochs: the index cannot skip to the seq.)"""
_STREAM_BLOCKS = (_BLOCKS.c.engine_id == bindparam("engine_id"),
                  _BLOCKS.c.attention_dp_rank == bindparam("attention_dp_rank"),
                  _BLOCKS.c.window_size == bindparam("window_size"))
_HASHES = func.unnest(bindparam("hashes", type_=postgresql.ARRAY(BigInteger()))).table_valued("h").render_derived()
_PER_HASH = select(_BLOCKS).where(*_STREAM_BLOCKS, _BLOCKS.c.block_hash == _HASHES.c.h).offset(0).lateral()
_BLOCKS_BY_HASHES = Prepared(select(_PER_HASH).select_from(_HASHES).join(_PER_HASH, true()))
"""PostgreSQL: one primary-key probe per hash, whatever the planner's statistics say. The plainer
``block_hash = ANY($4)`` got a generic plan that used only the (engine, rank, window) prefix of the
key and filtered every block of the engine (308 ms per 1000 hashes on a fresh, un-ANALYZEd
ledger; 2 ms with this form). ``OFFSET 0`` keeps the subquery from being flattened into a join."""
_BLOCKS_IN: dict[int, tuple[Prepared, list[str]]] = {}


def _blocks_in(size: int) -> tuple[Prepared, list[str]]:
    """SQLite: ``block_hash IN (?, …)`` with ``size`` parameters. Chunks are padded to a power of
    two (repeating their last hash), so at most 10 statements exist and each compiles once."""
    hit = _BLOCKS_IN.get(size)
    if hit is None:
        names = [f"h{i}" for i in range(size)]
        stmt = select(_BLOCKS).where(*_STREAM_BLOCKS, _BLOCKS.c.block_hash.in_([bindparam(n) for n in names]))
        hit = _BLOCKS_IN[size] = (Prepared(stmt), names)
    return hit


def _lock_log(sql: Sql) -> None:
    if not sql.is_sqlite:
        sql.driver("LOCK TABLE log IN SHARE ROW EXCLUSIVE MODE")


def _next_seq(sql: Sql) -> int:
    return (sql.one(_NEXT_SEQ, {})[0] or 0) + 1


def _load_engines(sql: Sql, proj: Projection, engine_ids: Iterable[str]) -> None:
    engine_names, stream_names = _NAMES["engines"], _NAMES["streams"]
    for engine_id in sorted(set(engine_ids)):
        row = sql.one(_ENGINE_BY_ID, {"id": engine_id})
        if row is None:
            continue
        proj.engines[engine_id] = dict(zip(engine_names, row))
        for stream in sql.all(_STREAMS_OF, {"id": engine_id}):
            stream = dict(zip(stream_names, stream))
            proj.streams[StreamKey(engine_id, stream["attention_dp_rank"], stream["window_size"])] = stream


def _load_by_id(sql: Sql, proj: Projection, name: str, ids: Iterable[str]) -> None:
    target, names, key = getattr(proj, name), _NAMES[name], _TABLES[name].primary_key.columns[0].name
    for ident in sorted(set(ids)):
        row = sql.one(_BY_ID[name], {"id": ident})
        if row is not None:
            row = dict(zip(names, row))
            target[row[key]] = row


def _touched_hashes(items: Sequence[Input]) -> tuple[dict[StreamKey, set[int]], dict[StreamKey, set[int]]]:
    """Per stream, the storage hashes (signed 64-bit) of the batch's events: (stored or updated,
    only removed). Rows of the first are loaded; the second are deleted without being read
    (``Projection.unloaded``): a removal needs no row, only the count of rows it deleted."""
    needed: dict[StreamKey, set[int]] = defaultdict(set)
    removed: dict[StreamKey, set[int]] = defaultdict(set)
    for item in items:
        if not isinstance(item, ev.ReceivedBatch):
            continue
        for event in item.events:
            body = event.body
            if type(body) is ev.BlockStored:
                raw, target = [b.block_hash for b in body.blocks], needed
            elif type(body) is ev.BlockRemoved:
                raw, target = body.block_hashes, removed
            elif type(body) is ev.BlockUpdated:
                raw, target = [body.block_hash], needed
            else:
                continue
            hashes = target[StreamKey(item.engine_id, event.attention_dp_rank, event.window_size)]
            for h in raw:  # split_hash(h)[0], inlined: this runs once per block event
                if type(h) is int:
                    hashes.add(h - _TWO_64 if h > _I64_MAX else h)
                else:
                    hashes.add(split_hash(h)[0])
    return needed, {stream: hashes - needed.get(stream, set()) for stream, hashes in removed.items()}


def _load_blocks(sql: Sql, proj: Projection, touched: dict[StreamKey, set[int]]) -> None:
    """Load the touched blocks through the primary key's prefix (engine, dp rank, window, hash):
    one statement per stream on PostgreSQL (``_BLOCKS_BY_HASHES``), IN-list chunks on SQLite."""
    names = _NAMES["blocks"]
    for stream, hashes in touched.items():
        if not hashes:
            continue
        where = {"engine_id": stream.engine_id, "attention_dp_rank": stream.attention_dp_rank,
                 "window_size": stream.window_size}
        if not sql.is_sqlite:
            rows = sql.all(_BLOCKS_BY_HASHES, {**where, "hashes": list(hashes)})
            proj.load_blocks([dict(zip(names, row)) for row in rows])
            continue
        ordered = sorted(hashes)
        for start in range(0, len(ordered), _IN_CHUNK):
            chunk = ordered[start:start + _IN_CHUNK]
            prepared, params = _blocks_in(1 << (len(chunk) - 1).bit_length())
            chunk += [chunk[-1]] * (len(params) - len(chunk))
            rows = sql.all(prepared, {**where, **dict(zip(params, chunk))})
            proj.load_blocks([dict(zip(names, row)) for row in rows])


def _digest_lookup(sql: Sql) -> Callable[[str, int, int], int | None]:
    def lookup(source_id: str, epoch: int, seq: int) -> int | None:
        row = sql.one(_LOGGED_DIGEST, {"source_id": source_id, "epoch": epoch, "seq": seq})
        return None if row is None else ev.BODY_DECODER.decode(row[0]).digest

    return lookup


def _earlier_digests(sql: Sql) -> Callable[[str, int, int], list[int]]:
    def lookup(source_id: str, epoch: int, seq: int) -> list[int]:
        first = max(1, epoch - EARLIER_EPOCHS_CHECKED)
        epochs = list(range(first, epoch)) or [0]  # epochs start at 1: 0 pads, never matches
        params = dict(zip(_EPOCH_PARAMS, epochs + [epochs[-1]] * (len(_EPOCH_PARAMS) - len(epochs))))
        rows = sql.all(_EARLIER_DIGESTS, {"source_id": source_id, "seq": seq, **params})
        return [ev.BODY_DECODER.decode(row[0]).digest for row in rows]

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


class _Rows:
    """Writes rows into one table: executemany on SQLite, one ``unnest`` statement on PostgreSQL.

    ``conflict``: ``None`` plain insert, ``"update"`` upsert every non-key column (projections),
    ``"add"`` add ``value`` to the existing row (counters).
    """

    def __init__(self, table: Table, conflict: str | None) -> None:
        self.names = [c.name for c in table.columns]
        self.getter = operator.itemgetter(*self.names)
        # psycopg refuses arrays mixing int and float (``now=1000`` in tests): floats are made float
        self.floats = {c.name for c in table.columns if isinstance(c.type, Float)}
        keys = [c.name for c in table.primary_key.columns]
        lite = sqlite.insert(table)
        arrays = [bindparam(c.name, type_=postgresql.ARRAY(c.type)) for c in table.columns]
        source = func.unnest(*arrays).table_valued(*self.names).render_derived()
        pg = postgresql.insert(table).from_select(self.names, select(*[source.c[n] for n in self.names]))
        if conflict == "update":
            lite = lite.on_conflict_do_update(index_elements=keys, set_={
                n: lite.excluded[n] for n in self.names if n not in keys})
            pg = pg.on_conflict_do_update(index_elements=keys, set_={
                n: pg.excluded[n] for n in self.names if n not in keys})
        elif conflict == "add":
            lite = lite.on_conflict_do_update(index_elements=keys, set_={"value": table.c.value + lite.excluded.value})
            pg = pg.on_conflict_do_update(index_elements=keys, set_={"value": table.c.value + pg.excluded.value})
        self.sqlite, self.postgresql = Prepared(lite), Prepared(pg)

    def write(self, sql: Sql, rows: Sequence[dict[str, Any]]) -> None:
        if not rows:
            return
        if sql.is_sqlite:
            sql.many(self.sqlite, rows)
            return
        arrays = dict(zip(self.names, map(list, zip(*map(self.getter, rows)))))
        for name in self.floats:
            arrays[name] = [None if v is None else float(v) for v in arrays[name]]
        sql.run(self.postgresql, arrays)


class _DeleteByKey:
    """Deletes rows by primary key: executemany on SQLite, one ``DELETE … USING unnest`` on PostgreSQL.
    ``write`` takes key tuples in primary-key column order (a :class:`~ledger.types.BlockKey`) and
    returns the number of rows deleted; ``where``: more conditions on the row."""

    def __init__(self, table: Table, *where: Any) -> None:
        self.table, self.names = table.name, [c.name for c in table.primary_key.columns]
        lite = delete(table).where(*[table.c[n] == bindparam(n) for n in self.names], *where)
        arrays = [bindparam(n, type_=postgresql.ARRAY(table.c[n].type)) for n in self.names]
        keys = func.unnest(*arrays).table_valued(*self.names).render_derived()
        pg = delete(table).where(*[table.c[n] == keys.c[n] for n in self.names], *where)
        self.sqlite, self.postgresql = Prepared(lite), Prepared(pg)
        if lite.compile(dialect=sqlite.dialect()).positiontup != self.names:  # write() binds key tuples as-is
            raise ValueError("_DeleteByKey conditions must not bind parameters: use literal_column")

    def write(self, sql: Sql, keys: Sequence[tuple]) -> int:
        if not keys:
            return 0
        if sql.is_sqlite:
            deleted = sql.many_positional(self.sqlite, keys)
        else:
            deleted = sql.run(self.postgresql, dict(zip(self.names, map(list, zip(*keys)))))
        if deleted < 0:  # the counters of unloaded removals are these numbers: never guess them
            raise PersistenceError(f"the database driver did not report how many {self.table} rows it deleted")
        return deleted


_UPSERT = {name: _Rows(table, "update") for name, table in _TABLES.items()}
_DELETE_BLOCKS = _DeleteByKey(_BLOCKS)
_DELETE_LIVE_BLOCKS = _DeleteByKey(_BLOCKS, _BLOCKS.c.state == literal_column(f"'{BlockState.LIVE}'"))
_INSERT_LOG = _Rows(_LOG, None)
_INSERT_BLOCKS = _Rows(_BLOCKS, None)
_INSERT_DONOR_BLOCKS = _Rows(DonorBlockRow.__table__, None)
_INSERT_DEAD_LETTERS = _Rows(DeadLetterRow.__table__, None)
_ADD_COUNTERS = _Rows(CounterRow.__table__, "add")
_DONORS = DonorRow.__table__
_QUARANTINE = (  # ledger.apply._on_generation_bumped, for the rows the transaction did not load
    Prepared(delete(_BLOCKS).where(_BLOCKS.c.engine_id == bindparam("id"),
                                   _BLOCKS.c.state == str(BlockState.QUARANTINED))),
    Prepared(update(_BLOCKS).where(_BLOCKS.c.engine_id == bindparam("id"), _BLOCKS.c.state == str(BlockState.LIVE))
             .values(state=str(BlockState.QUARANTINED), updated_seq=bindparam("seq"))),
    Prepared(update(_DONORS).where(_DONORS.c.engine_id == bindparam("id"),
                                   or_(_DONORS.c.state == str(DonorState.REGISTERED),
                                       _DONORS.c.state == str(DonorState.LIVE)))
             .values(state=str(DonorState.QUARANTINED), updated_seq=bindparam("seq"))),
    Prepared(update(_STREAMS).where(_STREAMS.c.engine_id == bindparam("id")).values(resync=True)),
)


def _delete_unloaded(sql: Sql, proj: Projection, keys: list[BlockKey]) -> None:
    """Delete the rows of removed blocks the transaction did not load, and count them as
    ``apply`` counts a removal: a live row ``blocks_removed``, a quarantined one
    ``removed_not_live``, no row ``removed_unknown`` (per engine; a key twice deletes once)."""
    by_engine: dict[str, list[BlockKey]] = defaultdict(list)
    for key in keys:
        by_engine[key.engine_id].append(key)
    for engine_id, group in by_engine.items():
        group.sort()
        live = _DELETE_LIVE_BLOCKS.write(sql, group)
        not_live = _DELETE_BLOCKS.write(sql, group) if live < len(group) else 0
        for name, n in (("blocks_removed", live), ("removed_not_live", not_live),
                        ("removed_unknown", len(group) - live - not_live)):
            if n:
                proj.counters[(engine_id, name)] += n


def write(conn: Connection | Sql, proj: Projection, entries: Sequence[LogEntry]) -> None:
    """Insert log rows, run bulk ops (deleting unloaded removed blocks before or after each, in event
    order), delete loaded removed blocks, then upsert every dirty projection row.
    (A key is never both removed and dirty: ledger.apply discards it from one when adding it to
    the other.)"""
    sql = conn if isinstance(conn, Sql) else Sql.of(conn)
    if entries:
        _INSERT_LOG.write(sql, [log_row(e) for e in entries])
    for index, op in enumerate(proj.bulk_ops):
        _delete_unloaded(sql, proj, [key for key, before in proj.blind_removals if before == index])
        for statement in _QUARANTINE:
            sql.run(statement, {"id": op.engine_id, "seq": op.seq})
    last = len(proj.bulk_ops)
    _delete_unloaded(sql, proj, [key for key, before in proj.blind_removals if before == last])
    _DELETE_BLOCKS.write(sql, sorted(key for key in proj.removed_blocks if key in proj.loaded_blocks))
    for name, keys in proj.dirty.items():
        if not keys:
            continue
        rows = getattr(proj, name)
        if name == "blocks" and proj.partial:
            # New rows need no ON CONFLICT (PostgreSQL: speculative insertion costs ~25 % more).
            loaded = proj.loaded_blocks
            ordered = sorted(keys)  # B-tree order: consecutive rows share pages
            _INSERT_BLOCKS.write(sql, [rows[k] for k in ordered if k not in loaded])
            _UPSERT[name].write(sql, [rows[k] for k in ordered if k in loaded])
        else:
            _UPSERT[name].write(sql, [rows[k] for k in keys])
    _INSERT_DONOR_BLOCKS.write(sql, proj.donor_blocks)
    _INSERT_DEAD_LETTERS.write(sql, proj.dead_letters)
    if proj.counters:
        _ADD_COUNTERS.write(sql, [{"engine_id": e or GLOBAL, "name": n, "value": v}
                                  for (e, n), v in sorted(proj.counters.items())])
