"""Projection snapshots: the fold's state at a log seq, kept so that time travel starts from it.

Not :mod:`ledger.checkpoint` (SQLite's WAL checkpointer). A snapshot is every projection row the
fold (:func:`ledger.apply.apply`) had after the log row ``seq``, with its counters, encoded with
msgpack into one row of ``projection_snapshots``. It is made by the fold only — from the newest
earlier snapshot plus the log after it, or from the start — never copied from the live tables, so
it holds what the log says, whatever the live projections hold (the audit's point). It is tagged
with the schema revision whose fold made it: a later revision may fold differently (0004 added
counters), so only snapshots of the current revision are used.

``semkv-ledger snapshot`` takes one at the head of the log; ``semkv-ledger replay --until SEQ``
starts from the newest usable snapshot at or before ``SEQ`` and folds only the log after it, so
its time grows with the log after the snapshot, not with the ledger's age. The full audit
(``replay`` without ``--until``) still folds the whole log: a snapshot is a shortcut for looking
back, never evidence. ``tests/property/test_snapshot.py`` holds snapshot + tail equal to the fold of
the whole log on random engine histories.
"""

from __future__ import annotations

import time
from collections import Counter

import msgspec
from sqlalchemy import Connection, insert, select

from ledger.apply import Projection
from ledger.rows import Block, DeadLetter, Donor, DonorBlock, Engine, Lease, Source, Stream
from ledger.schema import ProjectionSnapshotRow
from ledger.types import StreamKey

__all__ = ["ProjectionSnapshot", "from_projection", "latest_snapshot", "save_snapshot", "to_projection"]

_SNAPSHOTS = ProjectionSnapshotRow.__table__


class ProjectionSnapshot(msgspec.Struct, array_like=True, gc=False):
    """Every projection row after log row ``seq``, each table's rows in primary-key order (so equal
    projections encode to equal bytes)."""

    seq: int
    engines: list[Engine]
    streams: list[Stream]
    sources: list[Source]
    blocks: list[Block]
    donors: list[Donor]
    donor_blocks: list[DonorBlock]
    leases: list[Lease]
    dead_letters: list[DeadLetter]
    counters: list[tuple[str, str, int]]
    """(engine_id, name, value); engine_id ``""`` for fleet-wide counts."""


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(ProjectionSnapshot)


def from_projection(proj: Projection, seq: int) -> ProjectionSnapshot:
    """The snapshot of ``proj``, the fold of the log up to and including ``seq`` (a whole fold: a
    live writer's partial projection is not one)."""
    def ordered(rows: dict) -> list:
        return [rows[key] for key in sorted(rows)]

    return ProjectionSnapshot(
        seq, ordered(proj.engines), ordered(proj.streams), ordered(proj.sources), ordered(proj.blocks),
        ordered(proj.donors), list(proj.donor_blocks), ordered(proj.leases), list(proj.dead_letters),
        sorted((engine_id, name, value) for (engine_id, name), value in proj.counters.items()))


def to_projection(snapshot: ProjectionSnapshot) -> Projection:
    """A projection to fold the log after ``snapshot.seq`` into (the rows and the fold's indexes of
    live and quarantined blocks)."""
    proj = Projection(
        engines={row.engine_id: row for row in snapshot.engines},
        streams={StreamKey(row.engine_id, row.attention_dp_rank, row.window_size): row for row in snapshot.streams},
        sources={row.source_id: row for row in snapshot.sources},
        donors={row.donor_id: row for row in snapshot.donors},
        donor_blocks=list(snapshot.donor_blocks),
        leases={row.lease_id: row for row in snapshot.leases},
        dead_letters=list(snapshot.dead_letters),
        counters=Counter({(engine_id, name): value for engine_id, name, value in snapshot.counters}))
    proj.hold_blocks(snapshot.blocks)
    return proj


def save_snapshot(conn: Connection, snapshot: ProjectionSnapshot, revision: str) -> int:
    """Store ``snapshot`` (made by the fold of schema ``revision``) in the caller's transaction;
    returns its size in bytes. A snapshot already stored at that seq and revision is replaced.

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database failed.
    """
    body = _ENCODER.encode(snapshot)
    conn.execute(_SNAPSHOTS.delete().where(_SNAPSHOTS.c.seq == snapshot.seq, _SNAPSHOTS.c.revision == revision))
    conn.execute(insert(_SNAPSHOTS).values(seq=snapshot.seq, revision=revision, taken_at=time.time(), body=body))
    return len(body)


def latest_snapshot(conn: Connection, revision: str, until: int | None = None) -> ProjectionSnapshot | None:
    """The newest snapshot of schema ``revision`` at or before log seq ``until`` (None: any), or None.

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database failed.
        msgspec.DecodeError: a stored snapshot is not one this version can read.
    """
    query = select(_SNAPSHOTS.c.body).where(_SNAPSHOTS.c.revision == revision)
    if until is not None:
        query = query.where(_SNAPSHOTS.c.seq <= until)
    body = conn.execute(query.order_by(_SNAPSHOTS.c.seq.desc()).limit(1)).scalar()
    return None if body is None else _DECODER.decode(body)
