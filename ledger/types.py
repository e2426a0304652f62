"""Identifiers, enums and hash encodings shared by every part of semkv-ledger.

Pure module: no I/O, no imports from ``consumer`` or ``connector``.

Block hashes
------------
Engines report block hashes in three shapes (reference/WIRE.md §A, §B):

* unsigned 64-bit integers (TensorRT-LLM LLM-API events, vLLM ``int`` hashes; values ≥ 2**63 occur),
* signed int64 (TensorRT-LLM native ZMQ publisher, Dynamo),
* wide hashes: 32-byte binaries (vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) or 64-char hex
  strings (TensorRT-LLM ``hash_algo = "v2_sha256"``).

The canonical in-memory form is :data:`BlockHash` = ``int`` in ``[0, 2**64)`` (signed values are
reinterpreted as their unsigned 64-bit pattern, ``-1 -> 2**64-1``) or ``bytes`` (wide hashes; hex
strings are decoded to bytes). Storage splits a hash into two columns so that both SQLite and
PostgreSQL index it natively and losslessly:

* ``block_hash``  — signed BIGINT holding the 64-bit pattern (for wide hashes: the first 8 bytes,
  big-endian, which is exactly TensorRT-LLM's ``v2_sha256_64`` truncation);
* ``block_hash_ext`` — the full wide hash bytes, or ``b""`` for 64-bit hashes.

:func:`split_hash` and :func:`join_hash` convert between the two forms; round-trips are exact.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from typing import NamedTuple, NewType

EngineId = NewType("EngineId", str)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def checked_engine_id(value: str) -> str:
    """``value`` if it holds no control character (a newline in an id splits the log lines, tables
    and Prometheus labels that carry it).

    Raises:
        ValueError: it does.
    """
    if _CONTROL.search(value):
        raise ValueError(f"an engine id cannot hold control characters (a newline, a tab…): {value!r}")
    return value
SourceId = NewType("SourceId", str)
Generation = NewType("Generation", int)
Seq = NewType("Seq", int)
BlockHash = int | bytes

U64_MAX = 2**64 - 1
_I64_MIN = -(2**63)
TWO_64 = 2**64
I64_MAX = 2**63 - 1
"""The u64 → i64 storage conversion's constants (:func:`u64_to_i64`), for the loops that inline it."""
WIDE_HASH_BYTES = 32


class StreamKey(NamedTuple):
    """The unit whose TensorRT-LLM ``event_id``s are ordered (DESIGN §3)."""

    engine_id: str
    attention_dp_rank: int
    window_size: int


class BlockKey(NamedTuple):
    """Identity of one engine block in the projections: a stream plus the canonical hash."""

    engine_id: str
    attention_dp_rank: int
    window_size: int
    block_hash: int  # signed 64-bit storage form
    block_hash_ext: bytes  # b"" for 64-bit hashes


def normalize_hash(value: int | bytes | str) -> BlockHash:
    """Return the canonical form of an engine-reported block hash.

    Args:
        value: an int in ``[-2**63, 2**64)``, 32 bytes, or a 64-char hex string.

    Raises:
        ValueError: out-of-range integers, wrong-length bytes or non-hex strings.
    """
    if isinstance(value, bool):
        raise ValueError("block hash must not be a bool")
    if isinstance(value, int):
        if value < _I64_MIN or value > U64_MAX:
            raise ValueError(f"block hash {value} outside [-2**63, 2**64)")
        return value % TWO_64
    if isinstance(value, str):
        try:
            value = bytes.fromhex(value)
        except ValueError as exc:
            raise ValueError("block hash string is not hex") from exc
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if len(raw) != WIDE_HASH_BYTES:
            raise ValueError(f"wide block hash must be {WIDE_HASH_BYTES} bytes, got {len(raw)}")
        return raw
    raise ValueError(f"unsupported block hash type {type(value).__name__}")


def u64_to_i64(value: int) -> int:
    """Reinterpret an unsigned 64-bit value as signed int64 (the BIGINT storage form)."""
    return value - TWO_64 if value > I64_MAX else value


def i64_to_u64(value: int) -> int:
    """Inverse of :func:`u64_to_i64`."""
    return value + TWO_64 if value < 0 else value


def split_hash(block_hash: BlockHash) -> tuple[int, bytes]:
    """Canonical hash -> ``(block_hash BIGINT, block_hash_ext BLOB)`` storage columns."""
    if type(block_hash) is int:
        return (block_hash - TWO_64 if block_hash > I64_MAX else block_hash), b""
    return u64_to_i64(int.from_bytes(block_hash[:8], "big")), block_hash


def split_hashes(block_hashes: Iterable[BlockHash]) -> list[tuple[int, bytes]]:
    """:func:`split_hash` over many hashes (one call per event on the ingest path)."""
    return [((h - TWO_64 if h > I64_MAX else h), b"") if type(h) is int else split_hash(h) for h in block_hashes]


def storage_hashes(block_hashes: Iterable[BlockHash]) -> list[int]:
    """The ``block_hash`` BIGINT column of each hash (``split_hash(h)[0]``; no ``ext``)."""
    return [(h - TWO_64 if h > I64_MAX else h) if type(h) is int else split_hash(h)[0] for h in block_hashes]


def join_hash(stored: int, ext: bytes) -> BlockHash:
    """Storage columns -> canonical hash. Exact inverse of :func:`split_hash`."""
    return bytes(ext) if ext else i64_to_u64(stored)


def format_hash(block_hash: BlockHash) -> str:
    """Human form: decimal for 64-bit hashes, hex for wide ones."""
    return str(block_hash) if isinstance(block_hash, int) else block_hash.hex()


def parse_hash(text: str) -> BlockHash:
    """Parse :func:`format_hash` output (decimal, ``0x`` hex, negative int64, or 64 hex chars, with or
    without ``0x``).

    Raises:
        ValueError: text is none of those.
    """
    text = text.strip()
    # exactly the notations above (Python's int(text, 0) also took +5, 1_000, 0b101, -0x5 and
    # non-ASCII digits, and refused 0123)
    if text[:2].lower() == "0x" and len(text) == 2 + 2 * WIDE_HASH_BYTES:  # a wide hash written with 0x
        return normalize_hash(text[2:])
    if _HEX.fullmatch(text):  # a 64-bit hash in hex (too many digits: out of range, said so)
        return normalize_hash(int(text[2:], 16))
    if len(text) == 2 * WIDE_HASH_BYTES:
        return normalize_hash(text)
    if _DECIMAL.fullmatch(text):
        return normalize_hash(int(text, 10))
    raise ValueError(f"{text!r} is not a block hash: give a decimal or 0x-hex integer, or 64 hex characters")


_DECIMAL = re.compile(r"-?[0-9]+", re.ASCII)
_HEX = re.compile(r"0[xX][0-9a-fA-F]+", re.ASCII)


class BlockState(enum.StrEnum):
    """A block row's state. A removed block has no row (DESIGN §3's ``removed``; ledger.apply)."""

    LIVE = "live"
    QUARANTINED = "quarantined"


class BlockKeyScheme(enum.StrEnum):
    """How an engine computes the block hashes it publishes (its events' ``block_hash``), so that
    placement advice can compute a request's hashes the engine's way. A property of the engine's
    stream: set per source in the consumer's settings (``block_key_scheme``) and logged
    (``engine_described``), or inferred from the wire dialect (``ledger.placement_reads``)."""

    TRTLLM_V1 = "trtllm_v1"  # TensorRT-LLM v1_block_key (WIRE.md §A.1): connector.block_keys.block_hash_chain
    TRTLLM_V2 = "trtllm_v2"  # TensorRT-LLM v2_sha256 / v2_sha256_64: not computed here (caller's hashes only)
    VLLM = "vllm"  # vLLM's sha256 chain seeded per process (NONE_HASH): not computed here (caller's hashes only)
    DYNAMO = "dynamo"  # Dynamo's xxh3-64 seed 1337 chain: connector.block_keys.dynamo_block_hashes


class DonorState(enum.StrEnum):
    REGISTERED = "registered"  # known to the ledger, KV bytes not yet saved
    LIVE = "live"  # bytes saved and checksummed in the donor store
    EVICTED = "evicted"
    QUARANTINED = "quarantined"


class LeaseState(enum.StrEnum):
    HELD = "held"
    RELEASED = "released"


class EngineStatus(enum.StrEnum):
    ACTIVE = "active"
    RESYNCING = "resyncing"  # continuity lost; next event per stream is the new baseline


class GenerationReason(enum.StrEnum):
    """Why an engine's generation was bumped (DESIGN §3)."""

    CREATED = "created"  # a `created` event on a stream that had a baseline: engine restart
    SEQ_RESET = "seq_reset"  # ZMQ sequence went backwards with a new payload: engine restart
    SEQ_GAP = "seq_gap"  # batches lost and not recovered by replay
    EVENT_ID_GAP = "event_id_gap"  # TensorRT-LLM's bounded event buffer dropped events
    EVENT_ID_REGRESSION = "event_id_regression"  # an older event_id: a late event, or a restart whose created was lost
    ALL_BLOCKS_CLEARED = "all_blocks_cleared"
    ENGINE_STARTED = "engine_started"  # the engine's connector started (a new engine process)
    CONSUMER_RESUME = "consumer_resume"  # consumer (re)started without proof of continuity
    OPERATOR_RESET = "operator_reset"


class DeadLetterReason(enum.StrEnum):
    """Why input could not be accepted (DESIGN §6). Values are stable: they are stored."""

    WRONG_FRAME_COUNT = "wrong_frame_count"
    OVERSIZED_FRAME = "oversized_frame"
    BAD_SEQ_FRAME = "bad_seq_frame"
    MALFORMED_MSGPACK = "malformed_msgpack"
    BAD_BATCH_SHAPE = "bad_batch_shape"
    UNKNOWN_EVENT_TYPE = "unknown_event_type"
    SCHEMA_MISMATCH = "schema_mismatch"
    HASH_OUT_OF_RANGE = "hash_out_of_range"
    VALUE_OUT_OF_RANGE = "value_out_of_range"
    MESSAGE_OVER_LIMIT = "message_over_limit"  # too many events, blocks or tokens in one message
    REFUSED_BY_LEDGER = "refused_by_ledger"  # the database refused the event's batch (consumer/daemon.py)
    LATE_FROM_ANOTHER_RUN = "late_from_another_run"  # a late batch of an engine run the ledger moved past (ledger/decide.py)


class FreshnessPolicy(enum.StrEnum):
    """Which evidence proves a donor's KV bytes are still valid (DESIGN §5)."""

    ENGINE = "engine"  # every block of the donor span is live in the engine, current generation
    STORE = "store"  # the donor store holds checksummed bytes; engine blocks may be gone


class StaleReason(enum.StrEnum):
    """Why a donor is not fresh. ``None`` from a freshness check means fresh."""

    UNKNOWN_DONOR = "unknown_donor"
    NOT_SAVED = "not_saved"
    EVICTED = "evicted"
    QUARANTINED = "quarantined"
    GENERATION_MISMATCH = "generation_mismatch"
    ENGINE_UNKNOWN = "engine_unknown"
    ENGINE_RESYNCING = "engine_resyncing"  # the engine lost continuity; nothing trusted until a new baseline
    BLOCKS_NOT_LIVE = "blocks_not_live"
    NAMESPACE_MISMATCH = "namespace_mismatch"
    EXPIRED = "expired"
    LEASE_NOT_HELD = "lease_not_held"


def cache_level_from_medium(medium: str | None) -> int | None:
    """vLLM/Dynamo ``medium`` ("GPU", "CPU", "DISK") -> TensorRT-LLM ``cache_level`` (0 GPU, 1 host)."""
    if medium is None:
        return None
    return {"GPU": 0, "CPU": 1, "CPU_PINNED": 1, "DISK": 2}.get(medium.upper(), 3)
