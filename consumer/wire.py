"""Sans-IO decoder: one ZMQ multipart message -> :class:`ReceivedBatch` or :class:`DeadLetter`.

No sockets here (DESIGN §6, STYLE §4 "sans-IO"): ``source.py`` receives, ``bridge.py``
publishes; both share the framing helpers below.

Frames (vLLM ``vllm/distributed/kv_events.py`` ``ZmqEventPublisher``, TensorRT-LLM native,
Dynamo)::

    [topic: bytes, seq: 8 bytes big-endian, payload: msgpack [ts, events, data_parallel_rank?]]

``seq`` is read as signed int64 (identical to vLLM's unsigned encoding below 2**63) so that the
replay end marker ``ff×8`` reads as -1. ``ts`` is engine wall time in seconds.

Event dialects, detected per event (reference/WIRE.md §A, §B):

(a) TensorRT-LLM LLM-API dicts (``tensorrt_llm/_utils.py`` ``KVCacheEventSerializer``):
    ``{"event_id", "data": {"type": created|stored|updated|removed, ...}, "window_size",
    "attention_dp_rank"?, "layer_group_id"?, "hash_algo"?}``. Hashes are unsigned 64-bit ints,
    or 64-char hex strings under ``hash_algo="v2_sha256"``. A stored event's blocks are full but
    for the last, which may be partial; none is empty.
(b) maps tagged ``"type": BlockStored|BlockRemoved|AllBlocksCleared`` (current vLLM, recorded
    from 0.32 in shared/fixtures; TensorRT-LLM native; Dynamo). Hashes int64/uint64 or 32-byte
    ``bin``. ``token_ids`` holds all blocks' tokens, ``block_size`` per block: full blocks only.
(c) older vLLM's positional tagged arrays (``array_like=True`` Structs): ``["BlockStored",
    block_hashes, parent_block_hash, token_ids, block_size, lora_id?, medium?, lora_name?,
    extra_keys?, group_idx?, ...]``,
    ``["BlockRemoved", block_hashes, medium?, group_idx?]``, ``["AllBlocksCleared"]``.
    Trailing fields may be omitted (they default) or added by newer engines (ignored).

Errors are values, never exceptions (STYLE "Errors"): a bad frame set is a :class:`DeadLetter`; a
bad payload is a :class:`ReceivedBatch` with no events and one dead letter (so the source position
still advances); a bad event is a dead letter with ``batch_index`` beside its good siblings.

Bounds: every value the ledger stores is bounded by its columns (``ledger.schema.STORED_FIELDS``),
so no transaction is refused for a value (which would take the batch's good siblings with it and,
handed back by the engine's replay buffer, crash-loop the daemon). One message may hold at most
:class:`WireLimits`' events, blocks and token ids: a large event is counted from its lists'
headers before it is decoded, so memory and the transaction's size stay bounded. An event nested
deeper than msgspec recurses is found by walking the payload (:mod:`consumer.wire_scan`).

Raw bytes kept for audits and exact replay:

* events: ``EngineEvent.raw`` / per-event ``DeadLetter.raw`` = the event's own msgpack bytes,
  sliced from the payload with ``msgspec.Raw`` (never re-encoded);
* payload-level dead letters: the payload bytes;
* frame-level dead letters: :func:`pack_frames` (a msgpack array of ``bin``, inverted by
  :func:`unpack_frames`); a frame above ``max_frame_bytes`` is cut to its first
  ``oversized_keep_bytes`` bytes, and the detail names its full length and xxh3_64.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Annotated, Any, Final, Union

import msgspec
import xxhash

from consumer.wire_scan import ScanError, array_header, skip_object
from ledger.events import (
    AllBlocksCleared, BlockRemoved, BlockStored, BlockUpdated, DeadLetter, EngineCreated,
    EngineEvent, LevelDiff, ReceivedBatch, StoredBlock,
)
from ledger.schema import integer_range, max_length
from ledger.types import BlockHash, DeadLetterReason, cache_level_from_medium, normalize_hash

__all__ = [
    "SEQ_END_MARKER", "UPSTREAM_NAMES", "WireLimits", "decode_message", "encode_frames",
    "event_indices", "is_end_marker", "pack_frames", "pack_seq", "tokens_digest", "unpack_frames",
    "unpack_seq",
]

# --- Upstream names: the ONE place where they meet ours (STYLE "Names") ------------------------
# our field -> (TensorRT-LLM LLM-API key, vLLM / TRT-LLM native / Dynamo key); None: no such field.
# Plain renames feed the Structs below (``rename=``); entries with a note are converted in code.
UPSTREAM_NAMES: Final[dict[str, tuple[str | None, str | None]]] = {
    "body": ("data", None),
    "type_name": ("data.type tag", "type tag; (c): element 0 of the array"),
    "parent_hash": ("parent_hash", "parent_block_hash"),
    "tokens_per_block": (None, "block_size"),
    "num_tokens": ("len(tokens)", "len(token_ids) split by block_size"),
    "tokens_digest": ("tokens[].token_id, .token_extra_id", "token_ids split by block_size"),
    "cache_level": ("cache_level", "medium via cache_level_from_medium"),
    "cache_salt": ("cache_salt", "first str of extra_keys[0], see _salt"),
    "attention_dp_rank": ("attention_dp_rank", "data_parallel_rank of the batch"),
}
_TRT_RENAME = {ours: up for ours, (up, _) in UPSTREAM_NAMES.items()
               if up and up.isidentifier() and up != ours}
_VLLM_RENAME = {ours: up for ours, (_, up) in UPSTREAM_NAMES.items()
                if up and up.isidentifier() and up != ours}

SEQ_END_MARKER: Final = (-1).to_bytes(8, "big", signed=True)
_U64: Final = 2**64 - 1
_Why = DeadLetterReason

# --- Framing helpers, shared with bridge.py (publisher) and the replay client. -------------------


@dataclass(frozen=True, slots=True)
class WireLimits:
    """Bounds on what one message may cost before it is decoded."""

    max_frame_bytes: int = 16 * 2**20
    """A frame above this is a dead letter ``OVERSIZED_FRAME`` (the payload is never decoded)."""
    oversized_keep_bytes: int = 4096
    """How much of an oversized frame (or of a message over a limit) the dead letter keeps (the DB
    must not hold 16 MiB rows)."""
    max_events_per_message: int = 65_536
    """Events in one message; beyond it the whole message is a dead letter ``MESSAGE_OVER_LIMIT``."""
    max_blocks_per_message: int = 65_536
    """Blocks in one message (stored, removed and updated ones together); beyond it, as above."""
    max_tokens_per_message: int = 4 * 2**20
    """Token ids in one message's stored blocks; beyond it, as above."""


def pack_seq(seq: int) -> bytes:
    """``seq`` -> 8 bytes big-endian. -1 gives :data:`SEQ_END_MARKER`; raises ValueError outside
    ``[-1, 2**63)``."""
    if not -1 <= seq < 2**63:
        raise ValueError(f"seq {seq} outside [-1, 2**63)")
    return seq.to_bytes(8, "big", signed=True)


def unpack_seq(frame: bytes) -> int:
    """8 bytes big-endian -> signed int (the end marker reads -1).

    Raises:
        ValueError: the frame is not 8 bytes.
    """
    if len(frame) != 8:
        raise ValueError(f"seq frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def encode_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The multipart message ``[topic, seq8, payload]`` that :func:`decode_message` accepts."""
    return [topic, pack_seq(seq), payload]


def is_end_marker(frames: Sequence[bytes]) -> bool:
    """True for a replay end marker (``[b"", ff×8, b""]``; the seq is always second to last)."""
    return len(frames) >= 2 and bytes(frames[-2]) == SEQ_END_MARKER


def pack_frames(frames: Sequence[bytes]) -> bytes:
    """Frames -> one msgpack array of ``bin``: how frame-level dead letters keep their raw bytes."""
    return msgspec.msgpack.encode([bytes(f) for f in frames])


def unpack_frames(raw: bytes) -> list[bytes]:
    """Inverse of :func:`pack_frames`."""
    return msgspec.msgpack.decode(raw, type=list[bytes])


def event_indices(batch: ReceivedBatch) -> list[int]:
    """Position in the payload of each of ``batch.events`` (the log's idempotency key is
    (source, seq, index in batch); dead letters carry theirs in ``batch_index``)."""
    return [i if e.batch_index is None else e.batch_index for i, e in enumerate(batch.events)]


def tokens_digest(token_ids: Sequence[int], extra_ids: Sequence[int] | None = None) -> int:
    """xxh3_64 over the token ids as little-endian int64, followed by the extra ids (same encoding)
    only when one of them is non-zero, so a text-only block digests alike in every dialect.

    Raises:
        OverflowError: an id outside int64.
    """
    data = _pack_i64(token_ids)
    if extra_ids and any(extra_ids):
        data += _pack_i64(extra_ids)
    return xxhash.xxh3_64_intdigest(data)


def _pack_i64(ids: Sequence[int]) -> bytes:
    """Little-endian int64s; struct.pack is 2x faster than array('q') and fixes the byte order."""
    try:
        return struct.pack(f"<{len(ids)}q", *ids)
    except struct.error as exc:
        raise OverflowError(f"token id outside int64: {exc}") from None


# --- Typed wire schemas ------------------------------------------------------------------------
# msgspec checks types and ranges in C (a range failure is classified VALUE_OUT_OF_RANGE by
# _range_failure); hashes and token ids are checked in the converters. Unknown keys are ignored:
# engines add fields. A field the ledger stores is bounded by its columns (ledger.schema
# STORED_FIELDS), so a value no column can hold never reaches a transaction.


def _stored(field: str, *, low: int = 0) -> Any:
    """``int`` in what every column of ``field`` holds, and at least ``low`` (engines report these as
    ids, counts and levels: never negative)."""
    column_low, column_high = integer_range(field)
    return Annotated[int, msgspec.Meta(ge=max(low, column_low), le=column_high)]


_EventId = _stored("event_id")
_WindowSize = _stored("window_size")
_DpRank = _stored("attention_dp_rank")
_CacheLevel = _stored("cache_level")
_Priority = _stored("priority")
_LevelOrPriority = Annotated[int, msgspec.Meta(ge=0, le=min(integer_range("cache_level")[1],
                                                             integer_range("priority")[1]))]
_LoraId = _stored("lora_id")
_BlockSize = _stored("num_tokens", low=1)
_Count = Annotated[int, msgspec.Meta(ge=0)]  # not stored in a column
_SALT_CHARS: Final = max_length("cache_salt")
_Salt = Annotated[str, msgspec.Meta(max_length=_SALT_CHARS)]


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float  # msgspec accepts msgpack ints here too
    events: list[msgspec.Raw]  # sliced, decoded one by one so that one bad event stays alone
    data_parallel_rank: _DpRank | None = None


_BATCH = msgspec.msgpack.Decoder(_Batch)
_ANY = msgspec.msgpack.Decoder()


# (a) TensorRT-LLM LLM-API ----------------------------------------------------------------------
# A lone tagged Struct checks "type" when present and accepts it absent (real streams omit the
# token's), 1.5x faster than a Literal field: tokens are most of dialect (a)'s decode time.
class _Token(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="unique_token"):
    token_id: int
    token_extra_id: int = 0


class _MmKey(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="mm_key"):
    hash: str  # 64 hex chars or a user uuid; validated, not kept: the block hash covers it
    start_offset: _Count


class _Diff(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="event_diff"):
    new_value: _LevelOrPriority
    old_value: _LevelOrPriority


class _TrtBlock(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="stored_block"):
    block_hash: int | str
    tokens: list[_Token]
    cache_level: _CacheLevel | None = None
    priority: _Priority | None = None
    cache_salt: _Salt | None = None
    lora_id: _LoraId | None = None  # not serialized by 1.2.x; read if a later version sends it
    mm_keys: list[_MmKey] = []


class _TrtData(msgspec.Struct, frozen=True, gc=False, tag_field="type"):
    pass


class _TrtCreated(_TrtData, tag="created"):
    num_blocks_per_cache_level: list[_Count] = []


class _TrtStored(_TrtData, tag="stored", rename=_TRT_RENAME):
    parent_hash: int | str | None
    blocks: list[_TrtBlock]


class _TrtRemoved(_TrtData, tag="removed"):
    block_hashes: list[int | str]


class _TrtUpdated(_TrtData, tag="updated"):
    block_hash: int | str
    cache_level: _Diff | None = None
    priority: _Diff | None = None


class _TrtEvent(msgspec.Struct, frozen=True, gc=False, rename=_TRT_RENAME):
    event_id: _EventId
    body: _TrtCreated | _TrtStored | _TrtRemoved | _TrtUpdated
    window_size: _WindowSize = 0
    attention_dp_rank: _DpRank | None = None
    layer_group_id: _Count | None = None
    hash_algo: str | None = None


# (b)/(c) vLLM / TensorRT-LLM native / Dynamo: one field list, as a map or positionally ----------
class _VStored(msgspec.Struct, frozen=True, gc=False, rename=_VLLM_RENAME):
    block_hashes: list[int | bytes]
    parent_hash: int | bytes | None
    token_ids: list[int]
    tokens_per_block: _BlockSize
    lora_id: _LoraId | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: _Count | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: _Count | None = None


class _VRemoved(msgspec.Struct, frozen=True, gc=False):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: _Count | None = None


class _VCleared(msgspec.Struct, frozen=True, gc=False):
    pass


# The same fields as a map tagged by "type" (b) and as an array tagged by element 0 (c).
_VLLM_BODIES = (
    (_VStored, "BlockStored"), (_VRemoved, "BlockRemoved"), (_VCleared, "AllBlocksCleared"),
)
_MAPS = tuple(msgspec.defstruct(f"Map{tag}", [], bases=(base,), tag_field="type", tag=tag)
              for base, tag in _VLLM_BODIES)
_ARRAYS = tuple(msgspec.defstruct(f"Array{tag}", [], bases=(base,), array_like=True, tag=tag)
                for base, tag in _VLLM_BODIES)
_TRT_BODIES = (_TrtCreated, _TrtStored, _TrtRemoved, _TrtUpdated)
_DECODERS: Final = {
    "a": msgspec.msgpack.Decoder(_TrtEvent),
    "b": msgspec.msgpack.Decoder(Union[_MAPS]),  # type: ignore[valid-type]
    "c": msgspec.msgpack.Decoder(Union[_ARRAYS]),  # type: ignore[valid-type]
}
_KNOWN_TYPES: Final = {
    "a": frozenset(c.__struct_config__.tag for c in _TRT_BODIES),
    "b": frozenset(tag for _, tag in _VLLM_BODIES),
    "c": frozenset(tag for _, tag in _VLLM_BODIES),
}
_xxh3 = xxhash.xxh3_64_intdigest
_LEVELS: Final = {m: cache_level_from_medium(m) for m in (None, "GPU", "CPU", "CPU_PINNED", "DISK")}
_TOKEN_ID, _EXTRA_ID = attrgetter("token_id"), attrgetter("token_extra_id")  # C-speed map()


# --- Decoding ------------------------------------------------------------------------------------


class _Reject(Exception):
    """Internal: one event cannot be accepted. Never leaves this module."""

    def __init__(self, reason: DeadLetterReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class _OverLimit(Exception):
    """Internal: the message went over one of :class:`WireLimits`' per-message limits."""


_RANGE_MESSAGE: Final = re.compile(r"Expected `(int|str)`( of length)? [<>]=")
_PRECHECK_BYTES: Final = 64 * 1024
"""An event this large is counted from its list headers before it is decoded: decoded, a list
costs ~8–40 bytes an element, so a 16 MiB event could take 600 MB before its count is known.
A smaller one decodes within a few MB, and is counted after."""
_SCAN_BUDGET: Final = 4_000_000
"""Objects :func:`_batch_by_scan` walks per element (~0.3 µs each: ~1.2 s at most)."""
_RAW_MAP = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_RAW_LIST = msgspec.msgpack.Decoder(list[msgspec.Raw])
_RAW_MAPS = msgspec.msgpack.Decoder(list[dict[str, msgspec.Raw]])
_NUM_TOKENS = attrgetter("num_tokens")


class _Budget:
    """What is left of one message's block and token limits (:class:`WireLimits`)."""

    __slots__ = ("blocks", "limits", "tokens")

    def __init__(self, limits: WireLimits) -> None:
        self.limits = limits
        self.blocks = limits.max_blocks_per_message
        self.tokens = limits.max_tokens_per_message

    def spend(self, body: Any) -> None:
        """Count a decoded event's blocks and tokens. Raises _OverLimit past a limit."""
        kind = type(body)
        if kind is BlockStored:
            self.blocks -= len(body.blocks)
            self.tokens -= sum(map(_NUM_TOKENS, body.blocks))
        elif kind is BlockRemoved:
            self.blocks -= len(body.block_hashes)
        elif kind is BlockUpdated:
            self.blocks -= 1
        self._check(0, 0)

    def precheck(self, raw: bytes, dialect: str) -> None:
        """Count a large event from its list headers, before it is decoded. Raises _OverLimit."""
        try:
            blocks, tokens = _shape(raw, dialect, self.blocks)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, ScanError, TypeError):
            return  # not shaped as expected: the real decode says why
        self._check(blocks, tokens)

    def _check(self, blocks: int, tokens: int) -> None:
        limits = self.limits
        if blocks > self.blocks:
            raise _OverLimit(f"more than max_blocks_per_message {limits.max_blocks_per_message} blocks")
        if tokens > self.tokens:
            raise _OverLimit(f"more than max_tokens_per_message {limits.max_tokens_per_message} tokens")


def _shape(raw: bytes, dialect: str, blocks_left: int) -> tuple[int, int]:
    """(blocks, token ids) of an undecoded event, from its lists' headers (``msgspec.Raw`` fields
    skip the elements without building them). Dialect (a)'s tokens sit in each block: they are
    counted only if the blocks fit ``blocks_left``."""
    if dialect == "c":
        fields = _RAW_LIST.decode(raw)
        return _length_of(fields[1] if len(fields) > 1 else None), _length_of(fields[3] if len(fields) > 3 else None)
    fields = _RAW_MAP.decode(raw)
    if dialect == "b":
        return _length_of(fields.get("block_hashes")), _length_of(fields.get("token_ids"))
    data = _RAW_MAP.decode(fields["data"])
    if "blocks" not in data:
        return _length_of(data.get("block_hashes")), 0
    blocks = _length_of(data["blocks"])
    if blocks > blocks_left:
        return blocks, 0
    return blocks, sum(_length_of(block.get("tokens")) for block in _RAW_MAPS.decode(data["blocks"]))


def _length_of(raw: msgspec.Raw | None) -> int:
    header = None if raw is None else array_header(memoryview(raw))
    return 0 if header is None else header[0]


def decode_message(
    frames: Sequence[bytes],
    *,
    source_id: str,
    engine_id: str,
    received_at: float,
    limits: WireLimits = WireLimits(),
) -> ReceivedBatch | DeadLetter:
    """Decode one received ZMQ message. Never raises on bad input.

    Args:
        frames: ``[topic, seq8, payload]``, any bytes-like objects.
        source_id, engine_id: copied into the result.
        received_at: local receive time (seconds since the epoch).
        limits: size bounds.

    Returns:
        :class:`DeadLetter` for a wrong frame set (WRONG_FRAME_COUNT, BAD_SEQ_FRAME incl. a replay
        end marker or a negative seq, OVERSIZED_FRAME); otherwise :class:`ReceivedBatch` whose
        ``dead_letters`` hold a payload-level failure (MALFORMED_MSGPACK, BAD_BATCH_SHAPE,
        VALUE_OUT_OF_RANGE for a NaN, infinite or negative ``ts`` or an out-of-range
        ``data_parallel_rank``, MESSAGE_OVER_LIMIT past one of ``limits``' per-message counts, which
        keeps only the payload's first ``oversized_keep_bytes``; then ``events == []`` and
        ``ts == 0.0``) or per-event failures (``batch_index`` = position): among them
        VALUE_OUT_OF_RANGE for any value its ledger column cannot hold (ledger.schema
        ``STORED_FIELDS``), and MALFORMED_MSGPACK for an event nested too deeply to decode (found
        by walking the payload, so its siblings are kept). ``digest`` is xxh3_64 of the payload bytes.
    """
    meta = (source_id, engine_id, received_at)
    bad = _check_frames(frames, limits)
    if bad is not None:
        reason, detail, seq = bad
        return DeadLetter(source_id, engine_id, reason, detail, _frames_raw(frames, limits), seq,
                          None, received_at)
    seq = unpack_seq(bytes(frames[1]))
    payload = frames[2]
    digest = xxhash.xxh3_64_intdigest(payload)
    try:
        batch = _decode_batch(payload, limits)
    except _Reject as rej:
        kept = payload if rej.reason != _Why.MESSAGE_OVER_LIMIT else memoryview(payload)[:limits.oversized_keep_bytes]
        return _payload_failure(meta, seq, digest, kept, rej.reason, rej.detail)
    ts = batch.ts
    if not (math.isfinite(ts) and ts >= 0.0):  # NaN/inf/negative must never reach the ledger
        return _payload_failure(meta, seq, digest, payload, _Why.VALUE_OUT_OF_RANGE,
                                f"batch ts {ts!r} is not a finite time >= 0")
    rank = batch.data_parallel_rank
    events: list[EngineEvent] = []
    dead: list[DeadLetter] = []
    budget = _Budget(limits)
    for index, item in enumerate(batch.events):
        raw = bytes(item)
        try:
            event = _decode_event(raw, rank or 0, budget)
        except _Reject as rej:
            dead.append(DeadLetter(source_id, engine_id, rej.reason, rej.detail, raw, seq, index,
                                   received_at))
            continue
        except _OverLimit as over:
            return _payload_failure(meta, seq, digest, memoryview(payload)[:limits.oversized_keep_bytes],
                                    _Why.MESSAGE_OVER_LIMIT, f"{over}; payload is {len(payload)} bytes, "
                                    f"kept first {limits.oversized_keep_bytes}")
        events.append(event)
    if dead:  # keep each event's payload position: (source, seq, index) is the log's idempotency key
        refused = {d.batch_index for d in dead}
        kept = [i for i in range(len(batch.events)) if i not in refused]
        events = [msgspec.structs.replace(e, batch_index=i) for e, i in zip(events, kept)]
    return ReceivedBatch(source_id, engine_id, seq, batch.ts, digest, events, rank, received_at,
                         dead)


def _check_frames(
    frames: Sequence[bytes], limits: WireLimits
) -> tuple[DeadLetterReason, str, int | None] | None:
    if len(frames) != 3:
        detail = f"expected [topic, seq, payload], got {len(frames)} frames"
        return _Why.WRONG_FRAME_COUNT, detail, None
    if len(frames[1]) != 8:
        return _Why.BAD_SEQ_FRAME, f"seq frame is {len(frames[1])} bytes, expected 8", None
    seq = unpack_seq(bytes(frames[1]))
    if seq < 0:  # -1 is the replay end marker: the replay client must consume it, not us
        what = "replay end marker" if seq == -1 else "seq >= 2**63"
        return _Why.BAD_SEQ_FRAME, f"{what} on the data path", None
    for i, frame in enumerate(frames):
        if len(frame) > limits.max_frame_bytes:
            detail = (f"frame {i} is {len(frame)} bytes > {limits.max_frame_bytes}; kept first "
                      f"{limits.oversized_keep_bytes}, xxh3_64={xxhash.xxh3_64_intdigest(frame)}")
            return _Why.OVERSIZED_FRAME, detail, seq
    return None


def _frames_raw(frames: Sequence[bytes], limits: WireLimits) -> bytes:
    limit, keep = limits.max_frame_bytes, limits.oversized_keep_bytes
    return pack_frames([f if len(f) <= limit else memoryview(f)[:keep] for f in frames])


def _decode_batch(payload: bytes, limits: WireLimits) -> _Batch:
    """The batch with its events as raw slices; an event count over the limit is refused before
    any event is sliced (one ``Raw`` per event would already cost memory).

    Raises:
        _Reject: BAD_BATCH_SHAPE, MALFORMED_MSGPACK, VALUE_OUT_OF_RANGE, MESSAGE_OVER_LIMIT.
    """
    count = _event_count(payload)
    if count is not None and count > limits.max_events_per_message:
        raise _Reject(_Why.MESSAGE_OVER_LIMIT, f"{count} events > max_events_per_message "
                      f"{limits.max_events_per_message}; payload is {len(payload)} bytes, kept first "
                      f"{limits.oversized_keep_bytes}")
    try:
        return _BATCH.decode(payload)
    except msgspec.ValidationError as exc:
        raise _range_failure(exc) or _Reject(_Why.BAD_BATCH_SHAPE, str(exc)) from None
    except RecursionError:  # an event nested deeper than msgspec recurses: isolate it
        return _batch_by_scan(payload)
    except msgspec.DecodeError as exc:
        raise _Reject(_Why.MALFORMED_MSGPACK, str(exc)) from None


def _event_count(payload: bytes) -> int | None:
    """The length of the payload's events array, read from its header (None if the payload is
    not shaped ``[ts, [events…], …]``: the decoder then says why)."""
    try:
        outer = array_header(payload)
        if outer is None or outer[0] < 2:
            return None
        events = array_header(payload, skip_object(payload, outer[1], 1))
    except ScanError:
        return None
    return None if events is None else events[0]


def _batch_by_scan(payload: bytes) -> _Batch:
    """Slice the events with :func:`consumer.wire_scan.skip_object` (no recursion), so an event
    nested too deeply for msgspec is a dead letter alone (``_decode_event`` meets the
    RecursionError) and its siblings are applied.

    Raises:
        _Reject: MALFORMED_MSGPACK (not msgpack, or more than :data:`_SCAN_BUDGET` objects),
            BAD_BATCH_SHAPE, VALUE_OUT_OF_RANGE.
    """
    try:
        outer = array_header(payload)
        if outer is None or not 2 <= outer[0] <= 3:
            raise _Reject(_Why.BAD_BATCH_SHAPE, "payload is not [ts, events, data_parallel_rank?]")
        ts_end = skip_object(payload, outer[1], _SCAN_BUDGET)
        events = array_header(payload, ts_end)
        if events is None:
            raise _Reject(_Why.BAD_BATCH_SHAPE, "payload element 1 (events) is not an array")
        spans, pos = [], events[1]
        for _ in range(events[0]):
            end = skip_object(payload, pos, _SCAN_BUDGET)
            spans.append(msgspec.Raw(payload[pos:end]))
            pos = end
        rest = [skip_object(payload, pos, _SCAN_BUDGET)] if outer[0] == 3 else []
    except ScanError as exc:
        raise _Reject(_Why.MALFORMED_MSGPACK, f"nested too deeply to decode and not walkable: {exc}") from None
    if (rest[0] if rest else pos) != len(payload):
        raise _Reject(_Why.MALFORMED_MSGPACK, "trailing bytes after the payload")
    # The header elements alone, re-framed: [ts, [], rank?] (validated as a whole payload is).
    header = bytes([0x90 | outer[0]]) + payload[outer[1]:ts_end] + b"\x90" + payload[pos:]
    try:
        shell = _BATCH.decode(header)
    except msgspec.ValidationError as exc:
        raise _range_failure(exc) or _Reject(_Why.BAD_BATCH_SHAPE, str(exc)) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _Reject(_Why.MALFORMED_MSGPACK, str(exc)) from None
    return _Batch(shell.ts, spans, shell.data_parallel_rank)


def _payload_failure(
    meta: tuple[str, str, float], seq: int, digest: int, payload: bytes,
    reason: DeadLetterReason, detail: str,
) -> ReceivedBatch:
    source_id, engine_id, received_at = meta
    letter = DeadLetter(source_id, engine_id, reason, detail, bytes(payload), seq, None,
                        received_at)
    return ReceivedBatch(source_id, engine_id, seq, 0.0, digest, [], None, received_at, [letter])


def _decode_event(raw: bytes, batch_rank: int, budget: _Budget) -> EngineEvent:
    """One event, within what is left of the message's limits.

    Raises:
        _Reject: the event alone is a dead letter.
        _OverLimit: the message went over a limit (the whole message is a dead letter).
    """
    dialect = _sniff(raw)
    if len(raw) > _PRECHECK_BYTES:  # count before decoding: a large list costs ~40 bytes an element
        budget.precheck(raw, dialect)
    try:
        wire = _DECODERS[dialect].decode(raw)
    except msgspec.ValidationError as exc:
        raise _classify(raw, dialect, exc) from None
    except (msgspec.DecodeError, RecursionError) as exc:  # bad UTF-8 is not seen when slicing
        raise _Reject(_Why.MALFORMED_MSGPACK, str(exc)) from None
    event = _CONVERTERS[type(wire)](wire, raw, batch_rank)
    budget.spend(event.body)
    return event


def _sniff(raw: bytes) -> str:
    """Dialect from the first bytes; producers put ``event_id`` (a) or ``type`` (b) first, so a
    generic decode is only needed for other key orders."""
    head = raw[0]
    if 0x90 <= head <= 0x9F or head in (0xDC, 0xDD):
        return "c"
    if raw.startswith(b"\xa8event_id", 1):
        return "a"
    if raw.startswith(b"\xa4type", 1):
        return "b"
    obj = _generic(raw)
    if isinstance(obj, dict):
        if "data" in obj:
            return "a"
        if "type" in obj:
            return "b"
        raise _Reject(_Why.SCHEMA_MISMATCH, "map event has neither 'data' nor 'type'")
    raise _Reject(_Why.SCHEMA_MISMATCH, f"event is a {type(obj).__name__}, not a map or array")


def _generic(raw: bytes) -> Any:
    try:
        return _ANY.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, TypeError,
            ValueError) as exc:
        raise _Reject(_Why.MALFORMED_MSGPACK, str(exc)) from None


def _range_failure(exc: msgspec.ValidationError) -> _Reject | None:
    """A bound of :func:`_stored` / ``_Count`` / ``_Salt`` failed (msgspec says "Expected `int` <= …",
    "Expected `str` of length <= …"): VALUE_OUT_OF_RANGE; None for any other validation error."""
    text = str(exc)
    if _RANGE_MESSAGE.match(text):
        return _Reject(_Why.VALUE_OUT_OF_RANGE, text)
    return None


def _classify(raw: bytes, dialect: str, exc: msgspec.ValidationError) -> _Reject:
    """Error path only: a bound that failed and an unknown type tag get their own reasons,
    anything else is a schema error."""
    out_of_range = _range_failure(exc)
    if out_of_range is not None:
        return out_of_range
    obj = _generic(raw)
    tag: Any = None
    if dialect == "a" and isinstance(obj, dict) and isinstance(obj.get("data"), dict):
        tag = obj["data"].get("type")
    elif dialect == "b" and isinstance(obj, dict):
        tag = obj.get("type")
    elif dialect == "c" and isinstance(obj, list) and obj:
        tag = obj[0]
    if isinstance(tag, str) and tag not in _KNOWN_TYPES[dialect]:
        return _Reject(_Why.UNKNOWN_EVENT_TYPE, f"unknown event type {tag!r} (dialect {dialect})")
    return _Reject(_Why.SCHEMA_MISMATCH, f"dialect {dialect}: {exc}")


# --- Range checks and hashes ---------------------------------------------------------------------


def _trt_hash(value: int | str, algo: str | None) -> BlockHash:
    """Dialect (a): C++ size_t (reject negatives) or, under v2_sha256, 64 hex chars."""
    if type(value) is int:
        if algo == "v2_sha256":
            raise _Reject(_Why.SCHEMA_MISMATCH, "int block hash under hash_algo v2_sha256")
        if value < 0:
            raise _Reject(_Why.HASH_OUT_OF_RANGE, f"block hash {value} < 0 (unsigned in dialect a)")
        return value
    if algo not in (None, "v2_sha256"):
        raise _Reject(_Why.SCHEMA_MISMATCH, f"hex block hash under hash_algo {algo!r}")
    if len(value) != 64:
        raise _Reject(_Why.HASH_OUT_OF_RANGE, f"hex block hash has {len(value)} chars, expected 64")
    return _normalize(value)


def _vllm_hash(value: int | bytes) -> BlockHash:
    """Dialects (b)/(c): int64 or uint64 (msgpack cannot carry more) or 32-byte bin."""
    if type(value) is int:
        return value & _U64  # two's-complement pattern of an int64 = ledger's canonical u64
    return _normalize(value)


def _level(medium: str | None) -> int | None:
    return _LEVELS[medium] if medium in _LEVELS else cache_level_from_medium(medium)


def _normalize(value: int | bytes | str) -> BlockHash:
    try:
        return normalize_hash(value)
    except ValueError as exc:
        raise _Reject(_Why.HASH_OUT_OF_RANGE, str(exc)) from None


def _checked(pack: Any, *args: Any) -> Any:
    try:
        return pack(*args)
    except OverflowError:
        raise _Reject(_Why.VALUE_OUT_OF_RANGE, "token id outside int64") from None


# --- Converters: wire struct -> ledger EngineEvent -----------------------------------------------


def _from_trt(ev: _TrtEvent, raw: bytes, batch_rank: int) -> EngineEvent:
    # Absent outside attention DP: then the publishing rank is the emitting rank.
    rank = ev.attention_dp_rank
    data = ev.body
    algo = ev.hash_algo
    if type(data) is _TrtStored:
        body: Any = _trt_stored(data, algo)
    elif type(data) is _TrtRemoved:
        body = BlockRemoved(block_hashes=[_trt_hash(h, algo) for h in data.block_hashes])
    elif type(data) is _TrtUpdated:
        body = BlockUpdated(block_hash=_trt_hash(data.block_hash, algo),
                            cache_level=_diff(data.cache_level), priority=_diff(data.priority))
    else:
        body = EngineCreated(num_blocks_per_cache_level=data.num_blocks_per_cache_level)
    return EngineEvent(body, data.__struct_config__.tag, raw, ev.event_id, ev.window_size,
                       batch_rank if rank is None else rank)


def _trt_stored(data: _TrtStored, algo: str | None) -> BlockStored:
    _check_trt_block_sizes(data.blocks)
    blocks = []
    lora_id = None
    for b in data.blocks:
        tokens = b.tokens
        blocks.append(StoredBlock(
            _trt_hash(b.block_hash, algo),
            len(tokens),
            _checked(tokens_digest, list(map(_TOKEN_ID, tokens)), list(map(_EXTRA_ID, tokens))),
            b.cache_level,
            b.priority,
            b.cache_salt,
        ))
        if lora_id is None:
            lora_id = b.lora_id
    parent = None if data.parent_hash is None else _trt_hash(data.parent_hash, algo)
    return BlockStored(parent_hash=parent, blocks=blocks, lora_id=lora_id)


def _check_trt_block_sizes(blocks: list[_TrtBlock]) -> None:
    """Dialect (a)'s rule (reference/WIRE.md §A): the blocks of one event are one chain of full
    blocks whose last may be partial, so every block but the last holds the same number of tokens
    and the last at most that many; none is empty. (The event does not say ``tokens_per_block``.)"""
    if not blocks:
        return
    full = len(blocks[0].tokens)
    for position, block in enumerate(blocks):
        count = len(block.tokens)
        last = position == len(blocks) - 1
        if count == 0 or count > full or (count != full and not last):
            raise _Reject(_Why.SCHEMA_MISMATCH, f"block {position} of {len(blocks)} holds {count} tokens; "
                          f"blocks before the last hold {full} (only the last may be partial, none empty)")


def _diff(diff: _Diff | None) -> LevelDiff | None:
    return None if diff is None else LevelDiff(old_value=diff.old_value, new_value=diff.new_value)


def _from_vllm_stored(ev: _VStored, raw: bytes, rank: int) -> EngineEvent:
    n, size, num_tokens = len(ev.block_hashes), ev.tokens_per_block, len(ev.token_ids)
    # Dialects (b)/(c) publish full blocks only (reference/WIRE.md §B: vLLM caches full blocks;
    # TensorRT-LLM's native publisher and Dynamo say so): block_size is bounded by the schema.
    if num_tokens != n * size:
        raise _Reject(_Why.SCHEMA_MISMATCH,
                      f"{num_tokens} token_ids are not {n} full blocks of block_size {size}")
    if ev.extra_keys is not None and len(ev.extra_keys) != n:
        raise _Reject(_Why.SCHEMA_MISMATCH, f"{len(ev.extra_keys)} extra_keys for {n} blocks")
    tokens = memoryview(_checked(_pack_i64, ev.token_ids))
    level = _level(ev.medium)
    salt = _salt(ev)
    blocks = []
    lo, step = 0, size * 8
    for h in ev.block_hashes:  # hot loop: hash normalization inlined
        chunk = tokens[lo:lo + step]
        blocks.append(StoredBlock(h & _U64 if type(h) is int else _normalize(h), size,  # full blocks (checked above)
                                  _xxh3(chunk), level, None, salt))
        salt = None  # the salt belongs to the first block only
        lo += step
    parent = None if ev.parent_hash is None else _vllm_hash(ev.parent_hash)
    body = BlockStored(parent_hash=parent, blocks=blocks, lora_id=ev.lora_id, lora_name=ev.lora_name)
    return EngineEvent(body, "BlockStored", raw, None, 0, rank)


def _salt(ev: _VStored) -> str | None:
    """The cache salt among vLLM extra keys (``generate_block_hash_extra_keys`` in
    ``vllm/v1/core/kv_cache_utils.py``): keys are ``lora_name + mm keys (tuples) + [cache_salt] +
    prompt-embeds digests (bytes)``, the salt only on the request's first block (parent None).
    So: the first ``str`` in block 0's keys that is not the LoRA name and not repeated in block 1
    (the LoRA name repeats on every block). Current vLLM sends mm keys as (identifier, offset)
    arrays; a producer sending bare-string mm identifiers on a root block would be misread."""
    keys = ev.extra_keys
    if not keys or keys[0] is None or ev.parent_hash is not None:
        return None
    following = (keys[1] or ()) if len(keys) > 1 else ()
    for key in keys[0]:
        if type(key) is str and key != ev.lora_name and key not in following:
            if len(key) > _SALT_CHARS:
                raise _Reject(_Why.VALUE_OUT_OF_RANGE, f"cache salt of {len(key)} characters > {_SALT_CHARS}")
            return key
    return None


def _from_vllm_removed(ev: _VRemoved, raw: bytes, rank: int) -> EngineEvent:
    body = BlockRemoved(block_hashes=[h & _U64 if type(h) is int else _normalize(h)
                                      for h in ev.block_hashes], cache_level=_level(ev.medium))
    return EngineEvent(body, "BlockRemoved", raw, None, 0, rank)


def _from_vllm_cleared(ev: _VCleared, raw: bytes, rank: int) -> EngineEvent:
    return EngineEvent(AllBlocksCleared(), "AllBlocksCleared", raw, None, 0, rank)


_CONVERTERS: Final[dict[type, Any]] = {_TrtEvent: _from_trt} | {
    cls: convert for group in (_MAPS, _ARRAYS)
    for cls, convert in zip(group, (_from_vllm_stored, _from_vllm_removed, _from_vllm_cleared))
}
