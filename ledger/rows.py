"""Typed projection rows: the state :func:`ledger.apply.apply` folds the log into.

One struct per projection table (:mod:`ledger.schema`), its fields the table's columns in the
table's order (``tests/unit/test_rows.py`` holds them equal), so a row is bound to a statement
as ``msgspec.structs.astuple(row)`` in column order, and loaded as ``Row(*columns)``.

msgspec Structs: attribute access as fast as a dict's item access, construction faster than a
dict literal, no per-row ``__dict__`` (``gc=False``: rows hold no reference cycles). States are
the enums of :mod:`ledger.types` when apply sets them and their ``str`` values when loaded from
the database; both compare equal to the enum (``StrEnum``).
"""

from __future__ import annotations

import msgspec


class Engine(msgspec.Struct, gc=False):
    engine_id: str
    generation: int
    status: str
    registered_seq: int
    generation_seq: int
    last_seq: int


class Stream(msgspec.Struct, gc=False):
    engine_id: str
    attention_dp_rank: int
    window_size: int
    last_event_id: int | None
    resync: bool


class Source(msgspec.Struct, gc=False):
    source_id: str
    engine_id: str
    epoch: int
    last_seq: int
    last_ts: float


class Block(msgspec.Struct, gc=False):
    engine_id: str
    attention_dp_rank: int
    window_size: int
    block_hash: int
    """Signed 64-bit storage form (:func:`ledger.types.split_hash`)."""
    block_hash_ext: bytes
    parent_hash: int | None
    parent_hash_ext: bytes | None
    num_tokens: int
    tokens_digest: int
    cache_level: int | None
    priority: int | None
    cache_salt: str | None
    lora_id: int | None
    state: str
    generation: int
    store_count: int
    stored_seq: int
    updated_seq: int


class Donor(msgspec.Struct, gc=False):
    donor_id: str
    namespace: str
    engine_id: str
    attention_dp_rank: int
    window_size: int
    generation: int
    num_tokens: int
    num_blocks: int
    tokens_per_block: int
    provider_generation: int
    expires_at: float | None
    state: str
    store_ref: str | None
    checksum: str | None
    size_bytes: int | None
    registered_seq: int
    updated_seq: int


class DonorBlock(msgspec.Struct, gc=False):
    donor_id: str
    position: int
    content_key: bytes
    block_hash: int
    block_hash_ext: bytes


class Lease(msgspec.Struct, gc=False):
    lease_id: str
    donor_id: str
    request_id: str
    holder: str
    expires_at: float
    state: str
    release_reason: str | None
    taken_seq: int
    released_seq: int | None


class DeadLetter(msgspec.Struct, gc=False):
    log_seq: int
    source_id: str
    engine_id: str
    reason: str
    detail: str
    zmq_seq: int | None
    batch_index: int | None
