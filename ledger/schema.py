"""SQLAlchemy models: the append-only log and the projections derived from it (DESIGN §5).

One ``DeclarativeBase`` with a naming convention (so Alembic can drop constraints by name, on
SQLite especially) and a type map. Hashes are stored as two columns, ``*_hash`` (signed BIGINT
holding the unsigned 64-bit pattern) and ``*_hash_ext`` (the full wide hash, ``b""`` for 64-bit
hashes); see :mod:`ledger.types` for why this is lossless on both SQLite and PostgreSQL.

Only :mod:`ledger.recorder` (live) and :mod:`ledger.replay` (scratch) write these tables, and
log rows are only ever inserted.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, InstrumentedAttribute, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-assigns INTEGER PRIMARY KEY (the rowid); PostgreSQL gets a real BIGINT.
SeqType = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        int: BigInteger(),
        float: Float(),
        str: String(),
        bytes: LargeBinary(),
        bool: Boolean(),
    }


class LogRow(Base):
    """One row per thing received or decided, in commit order. ``seq`` is the global sequence.

    Engine events keep their original msgpack bytes in ``payload`` and their normalized form
    (:mod:`ledger.events`, msgpack) in ``body``; ledger facts have only ``body``.
    ``type_name`` is the engine's type name as received (``stored``, ``BlockStored``) or the
    fact's tag. ``applied`` is False for events recorded but not applied (older ``event_id``).
    """

    __tablename__ = "log"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=False)
    committed_at: Mapped[float]
    kind: Mapped[str] = mapped_column(String(40))
    type_name: Mapped[str] = mapped_column(String(64))
    engine_id: Mapped[str | None] = mapped_column(String(200))
    source_id: Mapped[str | None] = mapped_column(String(400))
    source_epoch: Mapped[int | None] = mapped_column(Integer)
    zmq_seq: Mapped[int | None]
    batch_index: Mapped[int | None] = mapped_column(Integer)
    event_id: Mapped[int | None]
    attention_dp_rank: Mapped[int | None] = mapped_column(Integer)
    window_size: Mapped[int | None] = mapped_column(Integer)
    applied: Mapped[bool] = mapped_column(default=True)
    body: Mapped[bytes]
    payload: Mapped[bytes | None]

    __table_args__ = (
        # Idempotency (DESIGN §5): a replayed or duplicated batch can never enter twice.
        UniqueConstraint("source_id", "source_epoch", "zmq_seq", "batch_index"),
        Index("ix_log_engine_seq", "engine_id", "seq"),
        Index("ix_log_kind_seq", "kind", "seq"),  # removal rows since a seq (the connector's donor view)
    )


class EngineRow(Base):
    __tablename__ = "engines"

    engine_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    generation: Mapped[int]
    status: Mapped[str] = mapped_column(String(20))
    registered_seq: Mapped[int]
    generation_seq: Mapped[int]
    """Log seq of the fact that set the current generation."""
    last_seq: Mapped[int]
    """Log seq of the last event applied for this engine."""


class StreamRow(Base):
    """(engine_id, attention_dp_rank, window_size): the unit whose ``event_id``s are ordered."""

    __tablename__ = "streams"

    engine_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    attention_dp_rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    window_size: Mapped[int] = mapped_column(Integer, primary_key=True)
    last_event_id: Mapped[int | None]
    resync: Mapped[bool]
    """True after a generation bump: the next event is the new baseline."""


class SourceRow(Base):
    __tablename__ = "sources"

    source_id: Mapped[str] = mapped_column(String(400), primary_key=True)
    engine_id: Mapped[str] = mapped_column(String(200))
    epoch: Mapped[int] = mapped_column(Integer)
    """Increments when the source's ZMQ seq restarts (engine restart)."""
    last_seq: Mapped[int]
    last_ts: Mapped[float]
    """Engine timestamp of the last accepted batch (seconds since the epoch)."""


class BlockRow(Base):
    __tablename__ = "blocks"

    engine_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    attention_dp_rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    window_size: Mapped[int] = mapped_column(Integer, primary_key=True)
    block_hash: Mapped[int] = mapped_column(primary_key=True)
    block_hash_ext: Mapped[bytes] = mapped_column(primary_key=True)
    parent_hash: Mapped[int | None]
    parent_hash_ext: Mapped[bytes | None]
    num_tokens: Mapped[int] = mapped_column(Integer)
    tokens_digest: Mapped[int]
    cache_level: Mapped[int | None] = mapped_column(Integer)
    priority: Mapped[int | None] = mapped_column(Integer)
    cache_salt: Mapped[str | None] = mapped_column(String(400))
    lora_id: Mapped[int | None]
    state: Mapped[str] = mapped_column(String(16))
    generation: Mapped[int]
    store_count: Mapped[int] = mapped_column(Integer)
    """Stored events seen while live (a recomputed block or a re-report); see ledger.evolve."""
    stored_seq: Mapped[int]
    updated_seq: Mapped[int]

    # One B-tree per block on SQLite (the row lives in its primary key) and no secondary index: the
    # steady state inserts and deletes a row per block event, and every reader (the recorder, the
    # connector) finds blocks by primary key; an engine's quarantine scans its key prefix (live and
    # quarantined rows only: removed blocks have no row). Migration 0003; tools/results/consume-2026-11-30-steady.md.
    __table_args__ = {"sqlite_with_rowid": False}


class DonorRow(Base):
    __tablename__ = "donors"

    donor_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    namespace: Mapped[str] = mapped_column(String(128))
    engine_id: Mapped[str] = mapped_column(String(200))
    attention_dp_rank: Mapped[int] = mapped_column(Integer)
    window_size: Mapped[int] = mapped_column(Integer)
    generation: Mapped[int]
    num_tokens: Mapped[int]
    num_blocks: Mapped[int] = mapped_column(Integer)
    tokens_per_block: Mapped[int] = mapped_column(Integer)
    provider_generation: Mapped[int]
    expires_at: Mapped[float | None]
    state: Mapped[str] = mapped_column(String(16))
    store_ref: Mapped[str | None] = mapped_column(String(1000))
    checksum: Mapped[str | None] = mapped_column(String(128))
    size_bytes: Mapped[int | None]
    registered_seq: Mapped[int]
    updated_seq: Mapped[int]

    __table_args__ = (Index("ix_donors_engine_state", "engine_id", "state"),
                      Index("ix_donors_updated_seq", "updated_seq"))  # what changed since a seq


class DonorBlockRow(Base):
    """Block ``position`` of a donor span: its chained content key and the engine's hash."""

    __tablename__ = "donor_blocks"

    donor_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    content_key: Mapped[bytes]
    block_hash: Mapped[int]
    block_hash_ext: Mapped[bytes]

    __table_args__ = (Index("ix_donor_blocks_content_key", "content_key"),)


class LeaseRow(Base):
    __tablename__ = "leases"

    lease_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    donor_id: Mapped[str] = mapped_column(String(200))
    request_id: Mapped[str] = mapped_column(String(200))
    holder: Mapped[str] = mapped_column(String(200))
    expires_at: Mapped[float]
    state: Mapped[str] = mapped_column(String(16))
    release_reason: Mapped[str | None] = mapped_column(String(64))
    taken_seq: Mapped[int]
    released_seq: Mapped[int | None]

    __table_args__ = (Index("ix_leases_donor_state", "donor_id", "state"),)


class DeadLetterRow(Base):
    __tablename__ = "dead_letters"

    log_seq: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    source_id: Mapped[str] = mapped_column(String(400))
    engine_id: Mapped[str] = mapped_column(String(200))
    reason: Mapped[str] = mapped_column(String(40))
    detail: Mapped[str] = mapped_column(String(2000))
    zmq_seq: Mapped[int | None]
    batch_index: Mapped[int | None] = mapped_column(Integer)


class CounterRow(Base):
    """Monotonic counts derived from the log, per engine (``engine_id = ""`` for fleet-wide)."""

    __tablename__ = "counters"

    engine_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    name: Mapped[str] = mapped_column(String(80), primary_key=True)
    value: Mapped[int]



class ProjectionSnapshotRow(Base):
    """A projection snapshot (:mod:`ledger.snapshot`): the fold's rows after log row ``seq``, made by
    schema ``revision``'s fold, msgpack in ``body``. Not a projection (replay neither writes nor
    compares it); written by ``semkv-ledger snapshot`` only."""

    __tablename__ = "projection_snapshots"

    seq: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    revision: Mapped[str] = mapped_column(String(32), primary_key=True)
    taken_at: Mapped[float]
    body: Mapped[bytes]

class BlockIndexRow(Base):
    """The block index (:mod:`ledger.block_index`): one row per (block hash, log seq of a block event
    naming it), keyed by ``bucket`` = ``seq >> BUCKET_BITS`` first. ``block_hash`` is the storage
    column (:func:`ledger.types.storage_hashes`; a wide hash's first 8 bytes), so a reader keeps only
    the rows whose body names the full hash.

    Why the bucket first: a follower's window then fills the B-tree's newest bucket only, a few MB of
    pages, instead of a random page of the whole tree per row (keyed by hash first, each 10,000-seq
    window rewrote ~160 MB of pages into the WAL: 14k log rows/s on 2.7M rows,
    tools/results/inspect-index-2026-12-05.md); a lookup probes each bucket (42 on 2.7M rows).

    Derived data, kept BEHIND the log by a follower, never by the writer's transaction (one more
    row per block event there halved the writer: tools/results/ledger-replay-2026-12-05.md §4).
    Rows exist only up to the :class:`IndexWatermarkRow` ``block_index``; not a projection (replay
    neither writes nor compares it)."""

    __tablename__ = "block_index"

    bucket: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    block_hash: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    seq: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)

    # One B-tree on SQLite (the row is its key): a bucket's rows of one hash are one range of it.
    __table_args__ = {"sqlite_with_rowid": False}


BUCKET_BITS = 16
"""``block_index.bucket`` = ``seq >> BUCKET_BITS``: 65,536 log seqs per bucket (migration 0006)."""


class IndexWatermarkRow(Base):
    """How far a follower-kept index has read the log: every log row with ``seq`` at or below
    ``seq`` is indexed (``name`` ``block_index``: :class:`BlockIndexRow`). Written in the same
    transaction as the index rows it covers."""

    __tablename__ = "index_watermarks"

    name: Mapped[str] = mapped_column(String(40), primary_key=True)
    seq: Mapped[int]


PROJECTION_TABLES = (
    EngineRow.__table__,
    StreamRow.__table__,
    SourceRow.__table__,
    BlockRow.__table__,
    DonorRow.__table__,
    DonorBlockRow.__table__,
    LeaseRow.__table__,
    DeadLetterRow.__table__,
    CounterRow.__table__,
)


# --------------------------------------------------------------------------------------------
# What fits: the one place that says which engine-reported values the columns can hold
# --------------------------------------------------------------------------------------------

INT32_RANGE = (-(2**31), 2**31 - 1)
INT64_RANGE = (-(2**63), 2**63 - 1)

STORED_FIELDS: dict[str, tuple[InstrumentedAttribute, ...]] = {
    "event_id": (LogRow.event_id, StreamRow.last_event_id),
    "window_size": (LogRow.window_size, StreamRow.window_size, BlockRow.window_size, DonorRow.window_size),
    "attention_dp_rank": (LogRow.attention_dp_rank, StreamRow.attention_dp_rank, BlockRow.attention_dp_rank,
                          DonorRow.attention_dp_rank),
    "num_tokens": (BlockRow.num_tokens,),
    "cache_level": (BlockRow.cache_level,),
    "priority": (BlockRow.priority,),
    "lora_id": (BlockRow.lora_id,),
    "cache_salt": (BlockRow.cache_salt,),
}
"""Each field of a normalized engine event (:mod:`ledger.events`) that lands in a column, and the
columns it lands in (:mod:`ledger.apply` writes them). The wire decoder bounds these fields with
:func:`integer_range` and :func:`max_length`, so a value no column can hold is a dead letter at
decode instead of a refused transaction (which would take its batch's good siblings with it)."""


def integer_range(field: str) -> tuple[int, int]:
    """The integers every column of ``field`` holds on both backends, inclusive: ``INTEGER`` is
    int32 (PostgreSQL enforces it; SQLite would store 64 bits, but a ledger must survive a move to
    PostgreSQL), ``BIGINT`` int64 (a Python int above it raises ``OverflowError`` in pysqlite and
    "out of int64 range" in asyncpg).

    Raises:
        KeyError: ``field`` is not in :data:`STORED_FIELDS`.
        TypeError: one of its columns is not an integer column.
    """
    low, high = INT64_RANGE
    for attribute in STORED_FIELDS[field]:
        column_type = attribute.property.columns[0].type
        if not isinstance(column_type, Integer):
            raise TypeError(f"{attribute} is not an integer column")
        bounds = INT64_RANGE if isinstance(column_type, BigInteger) else INT32_RANGE
        low, high = max(low, bounds[0]), min(high, bounds[1])
    return low, high


def max_length(field: str) -> int:
    """The longest string (characters) every column of ``field`` holds (PostgreSQL enforces
    ``VARCHAR(n)``; SQLite does not).

    Raises:
        KeyError: ``field`` is not in :data:`STORED_FIELDS`.
        TypeError: one of its columns is not a bounded string column.
    """
    lengths = [getattr(attribute.property.columns[0].type, "length", None) for attribute in STORED_FIELDS[field]]
    if None in lengths:
        raise TypeError(f"{field} has a column that is not a bounded string")
    return min(lengths)  # type: ignore[type-var]
