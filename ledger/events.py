"""Typed events: what engines report (normalized over the three wire dialects) and what the ledger decides.

Every event is a frozen, tagged ``msgspec.Struct``; the tag is the snake_case name stored in the log's
``kind`` column for ledger-made events (DESIGN §5). Engine events keep the type name *as received*
(``stored``, ``BlockStored``…) in :attr:`EngineEvent.type_name`, so statistics can report them per dialect.

Shapes follow reference/WIRE.md §A (TensorRT-LLM LLM-API dicts) and §B (vLLM / TensorRT-LLM native /
Dynamo maps and arrays). Decoding the wire is the consumer's job (``consumer/wire.py``); this module
only defines the normalized result.
"""

from __future__ import annotations

import msgspec

from ledger.types import BlockHash, DeadLetterReason, GenerationReason


def _snake(name: str) -> str:
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i:
            out.append("_")
        out.append(ch.lower())
    return "".join(out)


class _Event(msgspec.Struct, frozen=True, tag_field="kind", tag=_snake, gc=False):
    pass


# ---------------------------------------------------------------------------------------------
# Engine events (normalized). Hash fields are canonical: int in [0, 2**64) or 32 bytes.
# ---------------------------------------------------------------------------------------------


class StoredBlock(msgspec.Struct, frozen=True, gc=False):
    """One block of a ``stored`` event. Blocks of one event form a chain (block i's parent is i-1)."""

    block_hash: BlockHash
    num_tokens: int
    """Tokens in the block (the last block of a TensorRT-LLM event may be partial)."""
    tokens_digest: int
    """xxh3_64 over the little-endian int64 token ids (and extra ids), for audits; not a reuse key."""
    cache_level: int | None = None
    """0 GPU, 1 host, … (TensorRT-LLM); vLLM ``medium`` mapped by ``cache_level_from_medium``."""
    priority: int | None = None
    cache_salt: str | None = None
    """Cache salt as reported (TensorRT-LLM newer ``cache_salt``; vLLM ``extra_keys`` of the first block)."""


class EngineCreated(_Event, frozen=True):
    """TensorRT-LLM ``created``: a KV-cache manager was constructed (engine start)."""

    num_blocks_per_cache_level: list[int] = []


class BlockStored(_Event, frozen=True):
    parent_hash: BlockHash | None
    blocks: list[StoredBlock]
    lora_id: int | None = None
    lora_name: str | None = None
    """The LoRA adapter's name as vLLM reports it (``lora_name``); kept for audits: the ledger
    keys blocks by ``lora_id``."""


class BlockRemoved(_Event, frozen=True):
    block_hashes: list[BlockHash]
    cache_level: int | None = None


class LevelDiff(msgspec.Struct, frozen=True, gc=False):
    old_value: int
    new_value: int


class BlockUpdated(_Event, frozen=True):
    block_hash: BlockHash
    cache_level: LevelDiff | None = None
    priority: LevelDiff | None = None


class AllBlocksCleared(_Event, frozen=True):
    pass


EngineEventBody = EngineCreated | BlockStored | BlockRemoved | BlockUpdated | AllBlocksCleared


class EngineEvent(msgspec.Struct, frozen=True, gc=False):
    """One decoded engine event plus where it sits in its stream.

    ``raw`` is the event's original msgpack bytes (a slice of the batch payload), logged verbatim.
    ``event_id`` is TensorRT-LLM's per-manager counter; ``None`` for dialects without one.
    """

    body: EngineEventBody
    type_name: str
    raw: bytes
    event_id: int | None = None
    window_size: int = 0
    attention_dp_rank: int = 0
    batch_index: int | None = None
    """Position in the batch payload's event list (dead-lettered events keep theirs, so the
    idempotency key (source, seq, index) never collides); None = position in ``events``."""


class ReceivedBatch(msgspec.Struct, frozen=True, gc=False):
    """One ZMQ message ``[topic, seq, payload]`` from a source, decoded.

    ``digest`` is xxh3_64 of the payload bytes; it tells a duplicate batch (same seq, same bytes)
    from an engine restart (seq went backwards, new bytes).
    """

    source_id: str
    engine_id: str
    seq: int
    ts: float
    digest: int
    events: list[EngineEvent]
    attention_dp_rank: int | None = None
    received_at: float = 0.0
    dead_letters: list["DeadLetter"] = []
    """Events of this batch (or the whole payload) that failed validation; logged in the same
    transaction. The batch still advances the source position: replay would only resend them."""
    late: bool = False
    """The consumer proved by replay that the engine did not restart since the last batch it
    passed on, so this batch, whose seq is at or below that one's, is an old batch of the current
    run arriving late (reordered after its gap was declared lost). The ledger logs it once and
    never applies it (a late Stored(A) must not resurrect A after Removed(A)), and neither bumps
    the generation nor moves the source position for it."""
    new_run: bool = False
    """The consumer proved by replay that the engine restarted (another payload at a seq it had
    passed on): this is the first batch it passes on of the new run, whatever its seq. The ledger
    starts a new source epoch, bumps the generation and logs a gap for the new run's seqs below
    this one (``[0, seq)``: the engine's replay buffer no longer held them)."""
    block_key_scheme: str | None = None
    """The source's configured :class:`~ledger.types.BlockKeyScheme`, carried by the first batch a
    consumer process passes on from the source: the ledger logs it (``engine_described``)."""
    restart_logged: bool = False
    """With ``new_run``: the consumer already reported this restart (a :class:`GapReport` with
    reason ``seq_reset``, sent when an idle probe proved the restart before the new run had
    published anything), so the ledger opens the new epoch without a second bump, provided the
    engine applied no event since its generation was bumped (still ``resyncing``); otherwise it
    bumps as for any new run (fail closed)."""


class DeadLetter(msgspec.Struct, frozen=True, gc=False):
    """Input that could not be accepted; logged with its raw bytes and reason (DESIGN §2 rule 10)."""

    source_id: str
    engine_id: str
    reason: DeadLetterReason
    detail: str
    raw: bytes
    seq: int | None = None
    batch_index: int | None = None
    received_at: float = 0.0


class GapReport(msgspec.Struct, frozen=True, gc=False):
    """The consumer could not recover batches ``[from_seq, to_seq)`` of a source (replay failed or
    did not cover them), or started without proof of continuity (``from_seq == to_seq``).

    Reason ``seq_reset`` (``from_seq`` = the last seq passed on + 1, ``to_seq`` = 0): an idle probe
    proved by replay that the engine restarted and its new run has published nothing yet (the
    engine's replay buffer holds no batch at or after the last seq, whose batch it held before);
    the ledger bumps the generation now, and the new run's first batch comes ``new_run`` with
    ``restart_logged`` (:class:`ReceivedBatch`)."""

    source_id: str
    engine_id: str
    from_seq: int
    to_seq: int
    reason: GenerationReason


# ---------------------------------------------------------------------------------------------
# Ledger-made facts (the log's kinds besides raw engine events)
# ---------------------------------------------------------------------------------------------


class BatchReceived(_Event, frozen=True):
    """Accepted ZMQ message header; advances the source position."""

    source_id: str
    engine_id: str
    source_epoch: int
    seq: int
    ts: float
    digest: int
    num_events: int
    attention_dp_rank: int | None = None


class EngineRegistered(_Event, frozen=True):
    engine_id: str
    generation: int


class GapDetected(_Event, frozen=True):
    engine_id: str
    source_id: str | None
    reason: GenerationReason
    expected: int
    got: int
    attention_dp_rank: int | None = None
    window_size: int | None = None


class GenerationBumped(_Event, frozen=True):
    """The engine's generation moved to ``generation``; its live blocks and donors are quarantined."""

    engine_id: str
    generation: int
    reason: GenerationReason


class EngineDescribed(_Event, frozen=True):
    """What the consumer's settings say of an engine: its block-key scheme
    (:class:`~ledger.types.BlockKeyScheme` value). Logged when a consumer process passes on the
    engine's first batch; the newest one counts (placement advice reads it). No projection."""

    engine_id: str
    block_key_scheme: str


class EventDeadLettered(_Event, frozen=True):
    source_id: str
    engine_id: str
    reason: DeadLetterReason
    detail: str
    seq: int | None = None
    batch_index: int | None = None


class DonorRegistered(_Event, frozen=True):
    """A finished request's reusable span, registered by the connector (DESIGN §3 donor).

    ``content_keys[i]`` is the chained content key of block i (covers namespace, all earlier tokens
    and block i's tokens); ``block_hashes[i]`` the engine's hash of the same block (for freshness
    policy ``engine``). Only whole blocks: ``num_tokens == len(content_keys) * tokens_per_block``.
    """

    donor_id: str
    namespace: str
    engine_id: str
    generation: int
    content_keys: list[bytes]
    block_hashes: list[BlockHash]
    num_tokens: int
    tokens_per_block: int
    provider_generation: int = 0
    expires_at: float | None = None
    attention_dp_rank: int = 0
    window_size: int = 0


class DonorSaved(_Event, frozen=True):
    donor_id: str
    store_ref: str
    checksum: str
    size_bytes: int


class DonorEvicted(_Event, frozen=True):
    donor_id: str
    reason: str


class LeaseTaken(_Event, frozen=True):
    lease_id: str
    donor_id: str
    request_id: str
    holder: str
    expires_at: float


class LeaseReleased(_Event, frozen=True):
    lease_id: str
    reason: str


class OperatorReset(_Event, frozen=True):
    engine_id: str
    note: str = ""


LedgerFact = (
    BatchReceived
    | EngineRegistered
    | GapDetected
    | GenerationBumped
    | EngineDescribed
    | EventDeadLettered
    | DonorRegistered
    | DonorSaved
    | DonorEvicted
    | LeaseTaken
    | LeaseReleased
    | OperatorReset
)

AnyBody = EngineEventBody | LedgerFact

BODY_ENCODER = msgspec.msgpack.Encoder()
BODY_DECODER = msgspec.msgpack.Decoder(AnyBody)


def kind_of(body: AnyBody) -> str:
    """The snake_case tag of an event body, e.g. ``block_stored``, ``generation_bumped``."""
    return body.__struct_config__.tag  # type: ignore[return-value]
