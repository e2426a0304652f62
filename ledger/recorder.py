"""The recorder: one transaction = load rows → decide/apply → write log rows and projections.

The contract (STYLE §1, eventsourcing's ``ProcessRecorder``): the raw log rows, the projection
updates and the "applied through" mark (``engines.last_seq``) are written in ONE transaction, so a
batch is recorded exactly once or not at all. The same code serves both backends; what differs
(locking, upsert dialect, bulk statement shape) is the connection's backend's
(:mod:`ledger.backends`): rows become visible in ``seq`` order because every writer first takes
the backend's log lock (:meth:`~ledger.backends.base.Backend.lock_log`).

Speed (DESIGN §7, ≥ 100k block events/s; measured by tools/bench_ledger.py): every statement is a
:class:`~ledger.prepared.Prepared` Core statement, compiled once per dialect and run on the DBAPI
cursor under the caller's transaction, so no SQLAlchemy expression is built or compiled per
transaction, and rows are typed (:mod:`ledger.rows`) and bound as tuples in column order. Before
this, building the IN-list loads and the per-row bind tuples cost more than the inserts (py-spy,
tools/results/consume-2026-11-29.md: 12 % SQLAlchemy, 16 % row building).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from msgspec.structs import astuple
from sqlalchemy import Connection, Table, bindparam, delete, func, literal_column, or_, select, update
from sqlalchemy.exc import SQLAlchemyError

from ledger import events as ev
from ledger import rows as typed
from ledger.apply import GLOBAL, QUARANTINE, TABLES, Changes, LogEntry, Projection
from ledger.backends import KeysDelete, RowsWrite
from ledger.db import Sql
from ledger.decide import BATCH_ROW_INDEX, EARLIER_EPOCHS_CHECKED, AppendResult, Decider
from ledger.errors import PersistenceError, persistence_error
from ledger.prepared import Prepared
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
from ledger.types import I64_MAX, TWO_64, BlockKey, BlockState, StreamKey, split_hash, storage_hashes

Input = ev.ReceivedBatch | ev.DeadLetter | ev.GapReport
_new = tuple.__new__  # a NamedTuple key without its constructor (ledger.apply builds keys alike)
T = TypeVar("T")

_TABLES: dict[str, Table] = {
    "engines": EngineRow.__table__,
    "streams": StreamRow.__table__,
    "sources": SourceRow.__table__,
    "blocks": BlockRow.__table__,
    "donors": DonorRow.__table__,
    "leases": LeaseRow.__table__,
}
_ROW_TYPES = {"engines": typed.Engine, "streams": typed.Stream, "sources": typed.Source, "blocks": typed.Block,
              "donors": typed.Donor, "leases": typed.Lease}
_LOG = LogRow.__table__


class Pending(Changes):
    """The live writer's bookkeeping of a partial projection: what :func:`apply` changed
    (:class:`~ledger.apply.Changes`), plus which block rows were loaded and which were left
    unloaded because the transaction only removes them."""

    __slots__ = ("loaded_blocks", "unloaded", "blind_removals")

    def __init__(self) -> None:
        super().__init__()
        self.loaded_blocks: set[BlockKey] = set()
        """Keys of the block rows read from the database: a dirty key NOT in here is a new row (a
        plain INSERT), a dropped one in here a row to DELETE."""
        self.unloaded: set[BlockKey] = set()
        """Keys of blocks NOT loaded because the transaction only removes them: their rows are
        deleted in SQL without being read. (Whole keys, so that :func:`ledger.apply.apply` asks
        with the key it already built: a per-block tuple less on the steady state's removals.)"""
        self.blind_removals: list[tuple[BlockKey, int]] = []
        """Removals of :attr:`unloaded` blocks in event order, each with the number of quarantines
        before it (so the writer deletes before or after a quarantine in the same order as
        replay); their counters are added from the rows each DELETE matched."""

    def removal_of_unseen_block(self, key: BlockKey) -> bool:
        if key in self.unloaded:
            self.blind_removals.append((key, len(self.quarantines)))
            return True
        return False


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
        started = time.perf_counter()
        locks = sql.backend.lock_log(sql)
        waited = time.perf_counter() - started
        proj = Projection(changes=Pending())
        _load_engines(sql, proj, engine_ids)
        _load_by_id(sql, proj, "donors", donor_ids)
        _load_by_id(sql, proj, "leases", lease_ids)
        decider = Decider(proj, _next_seq(sql), time.time() if now is None else now, _digest_lookup(sql),
                          _earlier_digests(sql))
        if locks:
            decider.result.log_lock_wait_s = waited
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
        _pending(proj).unloaded = removal_only
        for item in items:
            decider.handle(item)
        return decider.result

    return transact(sql, run, now=now, engine_ids=engine_ids)


def _pending(proj: Projection) -> Pending:
    changes = proj.changes
    assert isinstance(changes, Pending), "the recorder's projections track Pending changes"
    return changes


# --------------------------------------------------------------------------------------------
# loading (prepared statements; see the module docstring)
# --------------------------------------------------------------------------------------------

_ENGINES, _STREAMS, _BLOCKS = EngineRow.__table__, StreamRow.__table__, BlockRow.__table__
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


def _next_seq(sql: Sql) -> int:
    return (sql.one(_NEXT_SEQ, {})[0] or 0) + 1


def _load_engines(sql: Sql, proj: Projection, engine_ids: Iterable[str]) -> None:
    for engine_id in sorted(set(engine_ids)):
        row = sql.one(_ENGINE_BY_ID, {"id": engine_id})
        if row is None:
            continue
        proj.engines[engine_id] = typed.Engine(*row)
        for columns in sql.all(_STREAMS_OF, {"id": engine_id}):
            stream = typed.Stream(*columns)
            proj.streams[StreamKey(engine_id, stream.attention_dp_rank, stream.window_size)] = stream


def _load_by_id(sql: Sql, proj: Projection, name: str, ids: Iterable[str]) -> None:
    target, row_type = getattr(proj, name), _ROW_TYPES[name]
    for ident in sorted(set(ids)):
        row = sql.one(_BY_ID[name], {"id": ident})
        if row is not None:
            target[ident] = row_type(*row)


def _touched_hashes(items: Sequence[Input]) -> tuple[dict[StreamKey, set[int]], set[BlockKey]]:
    """Per stream, the storage hashes (signed 64-bit) of the batch's stored or updated blocks; and
    the keys of the blocks it only removes (whose signed hash is none of those). Rows of the first
    are loaded (by signed hash: every ``block_hash_ext``); the second are deleted without being
    read (``Pending.unloaded``): a removal needs no row, only the count of rows it deleted."""
    needed: dict[StreamKey, set[int]] = defaultdict(set)
    removed: dict[StreamKey, list[BlockKey]] = defaultdict(list)
    for item in items:
        if not isinstance(item, ev.ReceivedBatch):
            continue
        for event in item.events:
            body = event.body
            body_type = type(body)
            stream = _new(StreamKey, (item.engine_id, event.attention_dp_rank, event.window_size))
            if body_type is ev.BlockRemoved:
                # the keys apply's _remove_blocks builds, as plain tuples (equal to BlockKeys), with
                # split_hash inlined for 64-bit hashes as there: one tuple per removed block
                keys, (engine_id, rank, window) = removed[stream], stream
                for h in body.block_hashes:
                    if type(h) is int:
                        keys.append((engine_id, rank, window, h - TWO_64 if h > I64_MAX else h, b""))
                    else:
                        keys.append((engine_id, rank, window, *split_hash(h)))
                continue
            if body_type is ev.BlockStored:
                raw = [b.block_hash for b in body.blocks]
            elif body_type is ev.BlockUpdated:
                raw = [body.block_hash]
            else:
                continue
            needed[stream].update(storage_hashes(raw))
    only_removed: set[BlockKey] = set()
    for stream, keys in removed.items():
        loaded = needed.get(stream)
        only_removed.update([k for k in keys if k[3] not in loaded] if loaded else keys)
    return needed, only_removed


def _load_blocks(sql: Sql, proj: Projection, touched: dict[StreamKey, set[int]]) -> None:
    """Load the touched blocks through the primary key's prefix (engine, dp rank, window, hash)."""
    loaded = _pending(proj).loaded_blocks
    for stream, hashes in touched.items():
        if hashes:
            where = {"engine_id": stream.engine_id, "attention_dp_rank": stream.attention_dp_rank,
                     "window_size": stream.window_size}
            rows = sql.backend.blocks_by_hashes(sql, where, hashes)
            loaded.update(proj.hold_blocks([typed.Block(*row) for row in rows]))


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


def log_row(entry: LogEntry) -> tuple:
    """The ``log`` table row for an entry, in column order."""
    return (entry.seq, entry.committed_at, ev.kind_of(entry.body), entry.type_name, entry.engine_id,
            entry.source_id, entry.source_epoch, entry.zmq_seq, entry.batch_index, entry.event_id,
            entry.attention_dp_rank, entry.window_size, entry.applied, ev.BODY_ENCODER.encode(entry.body),
            entry.payload)


class _Rows(RowsWrite):
    """Rows written into one table in the backend's bulk shape (:class:`~ledger.backends.RowsWrite`)."""

    def write(self, sql: Sql, rows: Sequence[tuple]) -> None:
        sql.backend.write_rows(sql, self, rows)


class _DeleteByKey(KeysDelete):
    """Deletes rows by primary key (:class:`~ledger.backends.KeysDelete`); ``write`` takes key
    tuples in primary-key column order (a :class:`~ledger.types.BlockKey`) and returns the number
    of rows deleted."""

    def __init__(self, table: Table, *where: Any) -> None:
        super().__init__(table, where)

    def write(self, sql: Sql, keys: Sequence[tuple]) -> int:
        deleted = sql.backend.delete_keys(sql, self, keys)
        if deleted < 0:  # the counters of unloaded removals are these numbers: never guess them
            raise PersistenceError(f"the database driver did not report how many {self.table.name} rows it deleted")
        return deleted


_UPSERT = {name: _Rows(table, "update") for name, table in _TABLES.items()}
_DELETE_BLOCKS = _DeleteByKey(_BLOCKS)
_DELETE_LIVE_BLOCKS = _DeleteByKey(_BLOCKS, _BLOCKS.c.state == literal_column(f"'{BlockState.LIVE}'"))
_INSERT_LOG = _Rows(_LOG, None)
_INSERT_BLOCKS = _Rows(_BLOCKS, None)
_INSERT_DONOR_BLOCKS = _Rows(DonorBlockRow.__table__, None)
_INSERT_DEAD_LETTERS = _Rows(DeadLetterRow.__table__, None)
_ADD_COUNTERS = _Rows(CounterRow.__table__, "add")


def _quarantine_statements() -> tuple[Prepared, ...]:
    """:data:`ledger.apply.QUARANTINE` in SQL, for the rows a transaction did not load (the
    engine is ``id``, the bump's seq ``seq``), then the engine's streams' ``resync``."""
    statements = []
    for transition in QUARANTINE:
        table = _TABLES[transition.table]
        rows = (table.c.engine_id == bindparam("id"), or_(*[table.c.state == str(s) for s in transition.from_states]))
        if transition.to_state is None:
            statements.append(Prepared(delete(table).where(*rows)))
        else:
            statements.append(Prepared(update(table).where(*rows).values(state=str(transition.to_state),
                                                                         updated_seq=bindparam("seq"))))
    statements.append(Prepared(update(_STREAMS).where(_STREAMS.c.engine_id == bindparam("id")).values(resync=True)))
    return tuple(statements)


_QUARANTINE = _quarantine_statements()


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
    """Write what a transaction changed: insert log rows, run each quarantine in SQL (deleting
    unloaded removed blocks before or after each, in event order), delete loaded blocks that left
    the projection, then write every dirty row (new blocks as plain inserts), the appended donor
    blocks and dead letters, and add the counters. (A key is never both dropped and dirty:
    :mod:`ledger.apply` discards it from one when adding it to the other.)"""
    sql = conn if isinstance(conn, Sql) else Sql.of(conn)
    pending = _pending(proj)
    if entries:
        _INSERT_LOG.write(sql, [log_row(e) for e in entries])
    for index, (engine_id, seq) in enumerate(pending.quarantines):
        _delete_unloaded(sql, proj, [key for key, before in pending.blind_removals if before == index])
        for statement in _QUARANTINE:
            sql.run(statement, {"id": engine_id, "seq": seq})
    last = len(pending.quarantines)
    _delete_unloaded(sql, proj, [key for key, before in pending.blind_removals if before == last])
    loaded = pending.loaded_blocks
    _DELETE_BLOCKS.write(sql, sorted(key for key in pending.dropped_blocks if key in loaded))
    for name, keys in pending.dirty.items():
        if not keys:
            continue
        rows = getattr(proj, name)
        if name == "blocks":
            # New rows need no ON CONFLICT (PostgreSQL: speculative insertion costs ~25 % more).
            ordered = sorted(keys)  # B-tree order: consecutive rows share pages
            _INSERT_BLOCKS.write(sql, [astuple(rows[k]) for k in ordered if k not in loaded])
            _UPSERT[name].write(sql, [astuple(rows[k]) for k in ordered if k in loaded])
        else:
            _UPSERT[name].write(sql, [astuple(rows[k]) for k in keys])
    _write_appended(sql, proj)


def write_projection(conn: Connection | Sql, proj: Projection) -> None:
    """Write a whole projection into empty projection tables (replay's rebuild)."""
    sql = conn if isinstance(conn, Sql) else Sql.of(conn)
    for name in TABLES:
        rows = getattr(proj, name)
        _UPSERT[name].write(sql, [astuple(rows[k]) for k in sorted(rows)])
    _write_appended(sql, proj)


def _write_appended(sql: Sql, proj: Projection) -> None:
    _INSERT_DONOR_BLOCKS.write(sql, [astuple(row) for row in proj.donor_blocks])
    _INSERT_DEAD_LETTERS.write(sql, [astuple(row) for row in proj.dead_letters])
    if proj.counters:
        _ADD_COUNTERS.write(sql, [(e or GLOBAL, n, v) for (e, n), v in sorted(proj.counters.items())])
