"""Read-only summaries of a ledger for ``semkv-ledger stats`` and ``inspect`` (one item's history).

Everything here is read from the projections (small: counters, engines, live blocks, donors) and,
for one item's history, from the log; nothing is written. The JSON shape of :func:`ledger_stats` is a stable interface for scripts and audits.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, bindparam, func, select

from ledger import events as ev
from ledger.apply import EVENTS_OF_TYPE
from ledger.backends import backend_named
from ledger.block_index import BLOCK_KINDS, index_state
from ledger.schema import (BUCKET_BITS, BlockIndexRow, BlockRow, CounterRow, DeadLetterRow, DonorRow, EngineRow, LeaseRow, LogRow,
                           SourceRow)
from ledger.types import BlockHash, format_hash, storage_hashes

_LOG = LogRow.__table__
_INDEX = BlockIndexRow.__table__


def ledger_stats(conn: Connection) -> dict[str, Any]:
    """One object: events_total, events_by_type, dead_letters, engines, blocks_by_state, donors_by_state,
    leases_by_state, sources, counters, block_index (``watermark``, ``head``: :mod:`ledger.block_index`). Engine event types are reported as received (``stored``,
    ``BlockStored``…); ledger facts by their tag."""
    engines = [dict(r._mapping) for r in conn.execute(select(EngineRow.__table__).order_by(EngineRow.__table__.c.engine_id))]
    events_by_type: dict[str, int] = {}
    per_engine: dict[str, dict[str, int]] = {}
    counters: dict[str, dict[str, int]] = {}
    for engine_id, name, value in conn.execute(select(CounterRow.__table__)):
        if name.startswith(EVENTS_OF_TYPE):  # counted by the fold, so no scan of the log here
            type_name = name[len(EVENTS_OF_TYPE):]
            events_by_type[type_name] = events_by_type.get(type_name, 0) + value
            per_engine.setdefault(engine_id, {})[type_name] = value
        else:
            counters.setdefault(engine_id or "*", {})[name] = value
    for engine in engines:
        engine["events_by_type"] = per_engine.get(engine["engine_id"], {})
        engine["counters"] = counters.get(engine["engine_id"], {})
    return {
        "events_total": sum(events_by_type.values()),
        # seq is gapless from 1 (the recorder takes max + 1 under the log lock; rows are never
        # deleted), so the newest seq is the row count without counting a multi-GB table
        "log_rows": conn.execute(select(func.max(_LOG.c.seq))).scalar() or 0,
        "events_by_type": events_by_type,
        "dead_letters": conn.execute(select(func.count()).select_from(DeadLetterRow.__table__)).scalar_one(),
        "dead_letters_by_reason": _group(conn, DeadLetterRow.__table__.c.reason),
        "engines": engines,
        "sources": [dict(r._mapping) for r in conn.execute(select(SourceRow.__table__).order_by(SourceRow.__table__.c.source_id))],
        "blocks_by_state": _group(conn, BlockRow.__table__.c.state),
        "donors_by_state": _group(conn, DonorRow.__table__.c.state),
        "leases_by_state": _group(conn, LeaseRow.__table__.c.state),
        "counters": counters,
        "block_index": dataclasses.asdict(index_state(conn)),  # how far `inspect block`'s index reached
    }


def _group(conn: Connection, column) -> dict[str, int]:
    return {str(k): v for k, v in conn.execute(select(column, func.count()).group_by(column))}


def history(conn: Connection, kind: str, ident: str, limit: int = 200) -> list[dict[str, Any]]:
    """Log rows about one item: ``engine`` (its events and decisions), ``donor`` (its lifecycle and
    leases), ``block`` (stored/removed/updated events naming the hash). Newest last."""
    if kind == "engine":
        query = select(_LOG).where(_LOG.c.engine_id == ident).order_by(_LOG.c.seq.desc()).limit(limit)
        return _decoded(reversed(conn.execute(query).all()))
    if kind == "donor":
        kinds = ("donor_registered", "donor_saved", "donor_evicted", "lease_taken", "lease_released")
        rows = conn.execute(select(_LOG).where(_LOG.c.kind.in_(kinds)).order_by(_LOG.c.seq)).all()
        return [r for r in _decoded(rows) if _mentions_donor(r["body"], ident, conn)][-limit:]
    if kind == "block":
        raise ValueError("use block_history for blocks")
    raise ValueError(f"unknown item kind {kind!r}: engine, donor or block")


_BLOCK_KINDS = BLOCK_KINDS
BLOCK_HISTORY_PAGE_ROWS = 5_000
BLOCK_HISTORY_WINDOW_SEQS = 100_000
"""The log after the index's watermark is searched this many seqs at a time, so that progress can
be shown between windows."""
BLOCK_INDEX_PAGE_SEQS = 256
"""Log rows read by seq per statement (newest first) until ``limit`` rows are found."""
BLOCK_INDEX_BUCKETS_PER_READ = 512
"""Index buckets (:data:`ledger.schema.BUCKET_BITS`) probed per statement."""


@dataclasses.dataclass
class BlockLookup:
    """One block's history (:func:`find_block`): ``rows`` oldest first, and how they were found:
    the index up to ``indexed_through`` (0: not used), the log searched after it
    (``searched_seqs`` seqs), and ``index_ahead`` when the index's watermark was past the log's
    head and so was not trusted."""

    rows: list[dict[str, Any]]
    indexed_through: int
    searched_seqs: int
    index_ahead: bool = False


def block_history(conn: Connection, block_hash: BlockHash, limit: int = 200,
                  progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """The rows of :func:`find_block`: engine events of every engine naming ``block_hash``, oldest
    first (the newest ``limit``)."""
    return find_block(conn, block_hash, limit, progress).rows


def find_block(conn: Connection, block_hash: BlockHash, limit: int = 200,
               progress: Callable[[int, int], None] | None = None) -> BlockLookup:
    """Engine events of every engine naming ``block_hash``, oldest first (the newest ``limit``).

    A removed block has no projection row left to say which engines knew it (ledger.apply), so the
    history comes from the log, found in two parts (:mod:`ledger.block_index`):

    * log rows after the index's watermark are searched: the database keeps only rows whose body
      holds the hash's msgpack bytes (a scan in C:
      :meth:`~ledger.backends.base.Backend.contains_bytes`), in windows of
      :data:`BLOCK_HISTORY_WINDOW_SEQS` seqs and pages of :data:`BLOCK_HISTORY_PAGE_ROWS` rows;
      ``progress(seq searched up to, newest seq)`` after each window. With a follower running this
      is the few seqs it has not reached; with an empty index, the whole log (seconds on millions
      of rows);
    * if fewer than ``limit`` rows were found there, the index gives the seqs at or below the
      watermark naming the hash's storage column (a probe per bucket of 65,536 seqs, newest
      first), and those log rows are read by seq, :data:`BLOCK_INDEX_PAGE_SEQS` at a time.

    Either way the rows are decoded and kept only when an event really names the hash (the bytes
    can also occur elsewhere in a body; a wide hash shares its index column with any other of the
    same first 8 bytes). A watermark past the log's head is not trusted: the whole log is searched.
    Memory holds one page and ``limit`` rows.

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database failed.
    """
    state = index_state(conn)
    through = state.usable_through
    kept = _search_log(conn, block_hash, limit, through, state.head, progress)
    if len(kept) < limit and through:
        older = _from_index(conn, block_hash, limit - len(kept), through)
        kept.extendleft(reversed(older))
    return BlockLookup(list(kept), through, state.head - through, state.ahead)


def _search_log(conn: Connection, block_hash: BlockHash, limit: int, after: int, head: int,
                progress: Callable[[int, int], None] | None) -> collections.deque[dict[str, Any]]:
    needle = ev.BODY_ENCODER.encode(block_hash)  # what the recorder wrote: msgspec encodes canonically
    contains = backend_named(conn.dialect.name).contains_bytes(_LOG.c.body, needle)
    query = (select(_LOG).where(_LOG.c.kind.in_(_BLOCK_KINDS), contains, _LOG.c.seq > bindparam("after"),
                                _LOG.c.seq <= bindparam("upto"))
             .order_by(_LOG.c.seq).limit(BLOCK_HISTORY_PAGE_ROWS))
    kept: collections.deque[dict[str, Any]] = collections.deque(maxlen=limit)
    for start in range(after, head, BLOCK_HISTORY_WINDOW_SEQS):
        params = {"after": start, "upto": min(start + BLOCK_HISTORY_WINDOW_SEQS, head)}
        while page := conn.execute(query, params).all():
            kept.extend(row for row in _decoded(page) if block_hash in _hashes_of(row["body"]))
            params["after"] = page[-1].seq
        if progress is not None:
            progress(params["upto"], head)
    return kept


def _from_index(conn: Connection, block_hash: BlockHash, wanted: int, through: int) -> list[dict[str, Any]]:
    """The newest ``wanted`` rows at or below seq ``through`` naming ``block_hash``, from the
    index (one probe of each bucket, newest buckets first, :data:`BLOCK_INDEX_BUCKETS_PER_READ`
    buckets per statement), oldest first."""
    stored = storage_hashes([block_hash])[0]
    seqs = (select(_INDEX.c.seq).where(_INDEX.c.bucket.in_(bindparam("buckets", expanding=True)),
                                       _INDEX.c.block_hash == stored, _INDEX.c.seq <= through)
            .order_by(_INDEX.c.seq.desc()))
    rows_at = select(_LOG).where(_LOG.c.seq.in_(bindparam("seqs", expanding=True))).order_by(_LOG.c.seq.desc())
    found: list[dict[str, Any]] = []
    newest = through >> BUCKET_BITS
    for top in range(newest, -1, -BLOCK_INDEX_BUCKETS_PER_READ):
        buckets = list(range(top, max(-1, top - BLOCK_INDEX_BUCKETS_PER_READ), -1))
        page = conn.execute(seqs, {"buckets": buckets}).scalars().all()
        for start in range(0, len(page), BLOCK_INDEX_PAGE_SEQS):
            chunk = page[start:start + BLOCK_INDEX_PAGE_SEQS]
            found += [row for row in _decoded(conn.execute(rows_at, {"seqs": chunk}).all())
                      if block_hash in _hashes_of(row["body"])][:wanted - len(found)]
            if len(found) >= wanted:
                return found[::-1]
    return found[::-1]


def _hashes_of(body: Any) -> set:
    if isinstance(body, ev.BlockStored):
        return {b.block_hash for b in body.blocks}
    if isinstance(body, ev.BlockRemoved):
        return set(body.block_hashes)
    if isinstance(body, ev.BlockUpdated):
        return {body.block_hash}
    return set()



def _mentions_donor(body: Any, donor_id: str, conn: Connection) -> bool:
    if isinstance(body, ev.LeaseReleased):
        row = conn.execute(select(LeaseRow.__table__.c.donor_id).where(LeaseRow.__table__.c.lease_id == body.lease_id)).first()
        return row is not None and row.donor_id == donor_id
    return getattr(body, "donor_id", None) == donor_id


def _decoded(rows) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        item = {k: v for k, v in row._mapping.items() if k not in ("payload",)}
        item["body"] = ev.BODY_DECODER.decode(item["body"])
        out.append(item)
    return out


def describe(body: Any) -> str:
    """One line for a decoded log body (hashes in decimal/hex)."""
    if isinstance(body, ev.BlockStored):
        return f"{len(body.blocks)} block(s) " + ", ".join(format_hash(b.block_hash) for b in body.blocks[:4]) + (
            " …" if len(body.blocks) > 4 else "")
    if isinstance(body, ev.BlockRemoved):
        return "removed " + ", ".join(format_hash(h) for h in body.block_hashes[:4]) + (" …" if len(body.block_hashes) > 4 else "")
    fields = {k: getattr(body, k) for k in body.__struct_fields__ if k not in ("content_keys", "block_hashes")}
    return ", ".join(f"{k}={v}" for k, v in fields.items())
