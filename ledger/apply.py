"""Projection state and ``apply``: the one function that turns log entries into projection rows.

Both the live writer (:mod:`ledger.recorder`) and ``semkv-ledger replay`` (:mod:`ledger.replay`)
call :func:`apply` on the same :class:`Projection` type, so live projections and a replay of the
log can only differ if the log or a projection was changed behind the ledger's back — which is
what replay's diff exists to catch.

``apply(proj, entry)`` is a fold: the next state from the current one and one entry, no I/O. A
:class:`Projection` holds typed rows (:mod:`ledger.rows`) keyed like the tables' primary keys,
plus the counters. What a fold step changed is reported to the projection's :class:`Changes`: the
rows to write, the blocks dropped, each quarantine. Replay ignores it and writes the whole
projection; the live writer (:mod:`ledger.recorder`), which loads only the rows a transaction
touches, uses it to write what changed and to quarantine in SQL the rows it did not load
(:data:`QUARANTINE`, the one statement of what a quarantine does, for both).

A removed block leaves the ``blocks`` projection (its history stays in the log): the projection
holds what the engines' caches hold now, live or quarantined blocks, so its size is bounded by the
fleet's KV capacity instead of growing with every block ever seen, and the ledger's steady state
(new blocks stored, evicted ones removed) is an INSERT and a DELETE per block instead of an update
of an ever larger table (2.3x: tools/results/consume-2026-11-30-steady.md). DESIGN §3's
``removed`` state is that absence; ``semkv-ledger inspect block HASH`` shows the removal from the
log. A generation bump quarantines the engine's live blocks and drops those an earlier bump
quarantined (an engine that restarted never removes them), so quarantined rows describe the latest
loss of continuity and the table holds at most two caches' worth of blocks per engine.

Duplicate stores and double removals (vLLM re-stores a recomputed block into a second physical
block, and ``kv_cache_report_mode="full"`` re-reports cache hits; fixtures/README.md): a
``stored`` of a live block increments ``store_count`` and keeps it live; a ``removed`` makes the
block leave the projection at once, whatever ``store_count`` says; a second ``removed`` finds no
block and is counted (``removed_unknown``, as is the removal of a block stored before the consumer
joined); a ``removed`` of a quarantined block removes it and is counted ``removed_not_live``.
Likewise an ``updated`` of a removed block is ``updated_unknown``, of a quarantined one
``updated_not_live``. This errs only toward *not live* — a missed reuse, never a promise on evicted
KV (DESIGN §2 rules 3 and 9).

A late batch (logged stale by ``ledger.decide``) changes nothing but counters: its events are
logged with ``applied`` False, and its ``batch_received`` row, at or below the source's last seq in
the same epoch, leaves the source position where it is (counted ``batches_stale``); only the
source's ``last_ts`` moves, to the newest engine ``ts`` heard.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from typing import Any

from ledger import events as ev
from ledger.rows import Block, DeadLetter, Donor, DonorBlock, Engine, Lease, Source, Stream
from ledger.types import (
    I64_MAX,
    TWO_64,
    BlockKey,
    BlockState,
    DonorState,
    EngineStatus,
    LeaseState,
    StreamKey,
    split_hash,
    split_hashes,
)

GLOBAL = ""  # counters' engine_id for fleet-wide counts
EVENTS_OF_TYPE = "events_type:"
"""Counter name prefix: ``events_type:<type_name>`` counts an engine's events logged with that type
name as received (``stored``, ``BlockStored``…); ``ledger.stats`` reports them as events by type."""
TABLES = ("engines", "streams", "sources", "blocks", "donors", "leases")
"""The projections of rows keyed by primary key (``Projection`` attributes of those names)."""


@dataclasses.dataclass(slots=True)
class LogEntry:
    """One log row to be written, with its decoded body. ``seq`` is assigned by the recorder."""

    seq: int
    committed_at: float
    body: ev.AnyBody
    type_name: str
    engine_id: str | None = None
    source_id: str | None = None
    source_epoch: int | None = None
    zmq_seq: int | None = None
    batch_index: int | None = None
    event_id: int | None = None
    attention_dp_rank: int | None = None
    window_size: int | None = None
    applied: bool = True
    payload: bytes | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Transition:
    """Rows of one engine in ``table`` whose ``state`` is in ``from_states`` move to ``to_state``
    (``None``: they leave the projection), stamped ``updated_seq``."""

    table: str
    from_states: tuple[str, ...]
    to_state: str | None


QUARANTINE = (
    # Blocks quarantined by the previous loss of continuity leave the projection (an engine that
    # restarted never removes them, so they would pile up at every restart); the live ones are
    # quarantined. The table stays bounded by two caches' worth of blocks per engine.
    Transition("blocks", (BlockState.QUARANTINED,), None),
    Transition("blocks", (BlockState.LIVE,), BlockState.QUARANTINED),
    Transition("donors", (DonorState.REGISTERED, DonorState.LIVE), DonorState.QUARANTINED),
)
"""What a generation bump does to the engine's rows, in this order; its streams also get
``resync``. :func:`_on_generation_bumped` runs it on the rows in memory, the recorder in SQL on
the rows it did not load."""


class Changes:
    """What fold steps changed since the rows were loaded: written by :func:`apply`, read by the
    writer of a partial projection (:class:`ledger.recorder.Pending`). A plain ``Changes`` records
    and is never read (replay writes every row)."""

    __slots__ = ("dirty", "dropped_blocks", "quarantines")

    def __init__(self) -> None:
        self.dirty: dict[str, set[Any]] = {t: set() for t in TABLES}
        """Per table, the keys of rows added or changed."""
        self.dropped_blocks: set[BlockKey] = set()
        """Keys of blocks that left the projection (not in ``Projection.blocks``)."""
        self.quarantines: list[tuple[str, int]] = []
        """(engine_id, seq) of each :data:`QUARANTINE`, in log order."""

    def clear(self) -> None:
        """Forget what was recorded (a whole fold, which writes every row, clears it as it goes so
        that its memory does not grow with every block the log ever named)."""
        for keys in self.dirty.values():
            keys.clear()
        self.dropped_blocks.clear()
        self.quarantines.clear()

    def removal_of_unseen_block(self, key: BlockKey) -> bool:
        """A removal found no row for ``key``. True when the writer accounts for it (a row it did
        not load); False counts it ``removed_unknown``."""
        return False


@dataclasses.dataclass
class Projection:
    """Projection rows in memory: the state :func:`apply` folds entries into."""

    engines: dict[str, Engine] = dataclasses.field(default_factory=dict)
    streams: dict[StreamKey, Stream] = dataclasses.field(default_factory=dict)
    sources: dict[str, Source] = dataclasses.field(default_factory=dict)
    blocks: dict[BlockKey, Block] = dataclasses.field(default_factory=dict)
    donors: dict[str, Donor] = dataclasses.field(default_factory=dict)
    donor_blocks: list[DonorBlock] = dataclasses.field(default_factory=list)
    """Rows appended (donor registrations are the only writer; never changed)."""
    leases: dict[str, Lease] = dataclasses.field(default_factory=dict)
    dead_letters: list[DeadLetter] = dataclasses.field(default_factory=list)
    counters: Counter[tuple[str, str]] = dataclasses.field(default_factory=Counter)
    """Counts since the rows were loaded (from zero: a replay's are the totals)."""
    live_blocks: dict[str, set[BlockKey]] = dataclasses.field(default_factory=dict)
    """engine_id -> keys of live blocks held (so a quarantine need not scan every block)."""
    quarantined_blocks: dict[str, set[BlockKey]] = dataclasses.field(default_factory=dict)
    """engine_id -> keys of quarantined blocks held (the next quarantine drops them)."""
    changes: Changes = dataclasses.field(default_factory=Changes)

    def put(self, table: str, key: Any, row: Any) -> None:
        getattr(self, table)[key] = row
        self.changes.dirty[table].add(key)

    def touch(self, table: str, key: Any) -> None:
        self.changes.dirty[table].add(key)

    def count(self, engine_id: str | None, name: str, n: int = 1) -> None:
        self.counters[(engine_id or GLOBAL, name)] += n

    def hold_blocks(self, rows: Iterable[Block]) -> list[BlockKey]:
        """Hold loaded block rows (indexed by state); returns their keys."""
        blocks, live_blocks, keys = self.blocks, self.live_blocks, []
        for row in rows:
            key = _new(BlockKey, (row.engine_id, row.attention_dp_rank, row.window_size, row.block_hash,
                                  row.block_hash_ext))
            blocks[key] = row
            keys.append(key)
            by_state = live_blocks if row.state == _LIVE else self.quarantined_blocks
            held = by_state.get(row.engine_id)
            if held is None:
                held = by_state[row.engine_id] = set()
            held.add(key)
        return keys


# --------------------------------------------------------------------------------------------
# apply
# --------------------------------------------------------------------------------------------


def apply(proj: Projection, entry: LogEntry) -> None:
    """Apply one log entry to the projection (mutates ``proj``). Deterministic; no I/O.

    Raises:
        KeyError: an entry refers to an engine that was never registered (a corrupt log).
    """
    body = entry.body
    body_type = type(body)
    engine_id = entry.engine_id
    if engine_id is not None and body_type in _ENGINE_BODY_TYPES:
        counters = proj.counters
        counters[(engine_id, "events_logged")] += 1
        counters[(engine_id, EVENTS_OF_TYPE + entry.type_name)] += 1  # stats' events by type, without a scan of the log
        if not entry.applied:
            counters[(engine_id, "events_stale")] += 1
            return
        _advance_stream(proj, entry)
        counters[(engine_id, "events_applied")] += 1
    handler = _HANDLERS.get(body_type)
    if handler is not None:
        handler(proj, entry, body)


LogRowColumns = tuple[int, bytes, str, "str | None", "int | None", "int | None", "int | None", "bool | int"]
"""A log row as read for a fold: (seq, body as msgpack bytes, type_name, engine_id, event_id,
attention_dp_rank, window_size, applied) — the :class:`LogEntry` fields :func:`apply` reads."""


def fold_rows(proj: Projection, rows: Iterable[LogRowColumns]) -> None:
    """Apply log rows in seq order, as ``apply(proj, LogEntry(...))`` of each row with its body
    decoded would, without recording changes for the block events (``proj.changes`` is left incomplete).

    For a whole fold that writes every row at the end (replay, snapshots, migrations), never for
    the live writer, which writes what ``proj.changes`` says. Stored and removed blocks, ~all of a
    log, are folded here by the same functions as :func:`apply`'s (``_store_blocks``,
    ``_remove_blocks``) with the engine-event bookkeeping of :func:`apply` and
    :func:`_advance_stream` inlined; every other row goes through :func:`apply` (its entry without
    the columns apply never reads: committed_at, the source columns; reading them from the log
    cost a sixth of the fold). ``tests/property/test_fold_rows.py`` holds the two equal. Why: the
    per-row calls and the change tracking were over half of replay's fold (profile in
    tools/results/ledger-replay-2026-12-05.md).

    A run of rows of one stream looks its stream and engine up once (apply may replace the engine's
    row, so a row it folds ends the run). A block stored into no row is kept apart, per engine
    (:data:`HeldBlocks`), until a row folded by :func:`apply` (its handlers read ``proj.blocks``
    and the live index) or the end of ``rows``, then added to ``proj.blocks`` and the live index
    in bulk; a removal in between only drops it, so a block stored and evicted between two such
    rows (in a log, within one batch: each batch's ``batch_received`` row goes through apply)
    never enters either (tools/results/ledger-replay-2026-12-05-1203.md).

    Raises:
        KeyError: an entry refers to an engine that was never registered (a corrupt log).
        msgspec.ValidationError, msgspec.DecodeError: a body that does not decode as a log body.
    """
    decode = ev.BODY_DECODER.decode
    engines, streams, counters = proj.engines, proj.streams, proj.counters
    stored_type, removed_type, active = ev.BlockStored, ev.BlockRemoved, EngineStatus.ACTIVE
    tally: dict[tuple[str, str, bool], int] = {}  # (engine_id, type_name, applied) -> events, added to counters at the end
    stream_key: StreamKey | None = None  # the stream of the previous block event folded here (None: none or stale)
    stream = engine = None
    held: HeldBlocks = {}
    engine_held: dict[BlockKey, Block] = {}
    try:
        for seq, raw, type_name, engine_id, event_id, dp_rank, window, applied in rows:
            body = decode(raw)
            body_type = type(body)
            if (body_type is not stored_type and body_type is not removed_type) or engine_id is None:
                _add_held(proj, held)
                apply(proj, LogEntry(seq, 0.0, body, type_name, engine_id, event_id=event_id,
                                     attention_dp_rank=dp_rank, window_size=window, applied=bool(applied)))
                stream_key = None  # apply may have replaced the engine's row (a registration)
                continue
            applied = bool(applied)
            tally_key = (engine_id, type_name, applied)
            tally[tally_key] = tally.get(tally_key, 0) + 1
            if not applied:
                continue
            dp_rank, window = dp_rank or 0, window or 0
            if stream_key is None or stream_key[0] != engine_id or stream_key[1] != dp_rank or stream_key[2] != window:
                stream_key = _new(StreamKey, (engine_id, dp_rank, window))
                stream = streams.get(stream_key)
                if stream is None:
                    stream = streams[stream_key] = Stream(engine_id, dp_rank, window, None, False)
                engine = engines[engine_id]
                engine_held = held.get(engine_id)
                if engine_held is None:
                    engine_held = held[engine_id] = {}
            if event_id is not None:
                stream.last_event_id = event_id
                stream.resync = False
            engine.last_seq = seq
            engine.status = active
            if body_type is stored_type:
                _store_blocks(proj, engine_id, dp_rank, window, seq, body, None, engine_held)
            else:
                _remove_blocks(proj, engine_id, dp_rank, window, body, None, engine_held)
    finally:
        _add_held(proj, held)
    for (engine_id, type_name, applied), n in tally.items():  # counters are only ever added to: order is free
        counters[(engine_id, "events_logged")] += n
        counters[(engine_id, EVENTS_OF_TYPE + type_name)] += n
        counters[(engine_id, "events_applied" if applied else "events_stale")] += n


HeldBlocks = dict[str, dict[BlockKey, Block]]
"""A whole fold's blocks stored into no row and not yet in ``proj.blocks`` nor the live index:
engine_id -> key -> row (always live)."""


def _add_held(proj: Projection, held: HeldBlocks) -> None:
    """Add the held blocks to ``proj.blocks`` and the live index, and forget them."""
    for engine_id, rows in held.items():
        if rows:
            proj.blocks.update(rows)
            live = proj.live_blocks.get(engine_id)
            if live is None:
                live = proj.live_blocks[engine_id] = set()
            live.update(rows)
            rows.clear()


def _advance_stream(proj: Projection, entry: LogEntry) -> None:
    engine_id = entry.engine_id
    key = _new(StreamKey, (engine_id, entry.attention_dp_rank or 0, entry.window_size or 0))
    row = proj.streams.get(key)
    if row is None:
        row = proj.streams[key] = Stream(engine_id, key[1], key[2], None, False)
    if entry.event_id is not None:
        # Only an event that carries an event_id can become the new baseline after a bump.
        row.last_event_id = entry.event_id
        row.resync = False
    dirty = proj.changes.dirty
    dirty["streams"].add(key)
    engine = proj.engines[engine_id]
    engine.last_seq = entry.seq
    engine.status = EngineStatus.ACTIVE
    dirty["engines"].add(engine_id)


def _block_key(entry: LogEntry, block_hash: ev.BlockHash) -> BlockKey:
    h, ext = split_hash(block_hash)
    return BlockKey(entry.engine_id, entry.attention_dp_rank or 0, entry.window_size or 0, h, ext)  # type: ignore[arg-type]


def _drop_block(proj: Projection, key: BlockKey) -> None:
    """Remove a block from the projection."""
    del proj.blocks[key]
    changes = proj.changes
    changes.dirty["blocks"].discard(key)
    changes.dropped_blocks.add(key)


# The two handlers below run once per block on the ingest path and in replay; they inline
# ledger.types.u64_to_i64 (its constants) and build keys with tuple.__new__: a NamedTuple's own
# constructor costs ~0.6 µs, and converting an event's hashes with one call (split_hashes) made
# replay's fold 10-15 % slower than this loop (A/B of apply alone, 2026-12-03). tests/unit/
# test_apply_hashes.py holds the keys they build equal to split_hash's.


def _on_stored(proj: Projection, entry: LogEntry, body: ev.BlockStored) -> None:
    _store_blocks(proj, entry.engine_id, entry.attention_dp_rank or 0, entry.window_size or 0, entry.seq, body,
                  proj.changes, None)


def _store_blocks(proj: Projection, engine_id: str, dp_rank: int, window: int, seq: int, body: ev.BlockStored,
                  changes: Changes | None, held: dict[BlockKey, Block] | None) -> None:
    """``_on_stored``'s work; ``changes`` None: nothing recorded, and ``held`` given: a block in no
    row is held there (a whole fold, :func:`fold_rows`)."""
    generation = proj.engines[engine_id].generation
    blocks = proj.blocks
    tracked = changes is not None
    if tracked:
        dirty, dropped = changes.dirty["blocks"], changes.dropped_blocks
    live = proj.live_blocks.get(engine_id)
    if live is None:  # (not setdefault: its default set would be built on every call)
        live = proj.live_blocks[engine_id] = set()
    p_hash, p_ext = split_hash(body.parent_hash) if body.parent_hash is not None else (None, None)
    lora_id = body.lora_id
    again = 0
    stored = body.blocks
    for block in stored:
        block_hash = block.block_hash
        if type(block_hash) is int:
            h, ext = (block_hash - TWO_64 if block_hash > I64_MAX else block_hash), b""
        else:
            h, ext = split_hash(block_hash)
        digest = block.tokens_digest
        if digest > I64_MAX:
            digest -= TWO_64
        key = _new(BlockKey, (engine_id, dp_rank, window, h, ext))
        row = blocks.get(key)
        held_row = None
        if row is None and held is not None:
            row = held_row = held.get(key)
            if row is None:
                held[key] = Block(engine_id, dp_rank, window, h, ext, p_hash, p_ext, block.num_tokens, digest,
                                  block.cache_level, block.priority, block.cache_salt, lora_id, _LIVE, generation,
                                  1, seq, seq)
                p_hash, p_ext = h, ext
                continue
        if row is not None and row.state == _LIVE:
            row.store_count += 1
            again += 1
            row.parent_hash = p_hash
            row.parent_hash_ext = p_ext
            row.num_tokens = block.num_tokens
            row.tokens_digest = digest
            row.cache_level = block.cache_level
            row.priority = block.priority
            row.cache_salt = block.cache_salt
            row.lora_id = lora_id
            row.generation = generation
            row.updated_seq = seq
        else:
            blocks[key] = Block(engine_id, dp_rank, window, h, ext, p_hash, p_ext, block.num_tokens, digest,
                                block.cache_level, block.priority, block.cache_salt, lora_id, _LIVE, generation, 1,
                                seq, seq)
            if tracked:
                dropped.discard(key)
            if row is not None:  # it was quarantined
                proj.quarantined_blocks.get(engine_id, set()).discard(key)
        if held_row is None:  # (a held row joins the live index when the fold adds it)
            live.add(key)
        if tracked:
            dirty.add(key)
        p_hash, p_ext = h, ext
    counters = proj.counters
    counters[(engine_id, "blocks_stored")] += len(stored)
    if again:
        counters[(engine_id, "stored_while_live")] += again


def _on_removed(proj: Projection, entry: LogEntry, body: ev.BlockRemoved) -> None:
    _remove_blocks(proj, entry.engine_id, entry.attention_dp_rank or 0, entry.window_size or 0, body, proj.changes, None)


def _remove_blocks(proj: Projection, engine_id: str, dp_rank: int, window: int, body: ev.BlockRemoved,
                   changes: Changes | None, held: dict[BlockKey, Block] | None) -> None:
    """``_on_removed``'s work; ``changes`` None: nothing recorded, and ``held`` given: the fold's
    blocks in no row yet (a whole fold, :func:`fold_rows`)."""
    blocks = proj.blocks
    tracked = changes is not None
    if tracked:
        dirty, dropped = changes.dirty["blocks"], changes.dropped_blocks
    live = proj.live_blocks.get(engine_id)
    if live is None:  # (not setdefault: its default set would be built on every call)
        live = proj.live_blocks[engine_id] = set()
    removed = unknown = not_live = 0
    for block_hash in body.block_hashes:
        if type(block_hash) is int:
            h, ext = (block_hash - TWO_64 if block_hash > I64_MAX else block_hash), b""
        else:
            h, ext = split_hash(block_hash)
        key = _new(BlockKey, (engine_id, dp_rank, window, h, ext))
        if held is not None and held.pop(key, None) is not None:  # live, in neither blocks nor the live index
            removed += 1
            continue
        row = blocks.pop(key, None)
        if row is None:
            if not tracked or not changes.removal_of_unseen_block(key):
                unknown += 1
            continue
        if row.state == _LIVE:
            removed += 1
            live.discard(key)
        else:
            not_live += 1
            proj.quarantined_blocks.get(engine_id, set()).discard(key)
        if tracked:
            dirty.discard(key)
            dropped.add(key)
    counters = proj.counters
    for name, n in (("blocks_removed", removed), ("removed_unknown", unknown), ("removed_not_live", not_live)):
        if n:
            counters[(engine_id, name)] += n


def _on_updated(proj: Projection, entry: LogEntry, body: ev.BlockUpdated) -> None:
    key = _block_key(entry, body.block_hash)
    row = proj.blocks.get(key)
    if row is None:
        proj.count(entry.engine_id, "updated_unknown")
        return
    if row.state != BlockState.LIVE:
        proj.count(entry.engine_id, "updated_not_live")
        return
    if body.cache_level is not None:
        row.cache_level = body.cache_level.new_value
    if body.priority is not None:
        row.priority = body.priority.new_value
    row.updated_seq = entry.seq
    proj.touch("blocks", key)
    proj.count(entry.engine_id, "blocks_updated")


def _on_batch(proj: Projection, entry: LogEntry, body: ev.BatchReceived) -> None:
    source = proj.sources.get(body.source_id)
    if source is not None and source.epoch == body.source_epoch and body.seq <= source.last_seq:
        # A late batch, logged stale in the current epoch (ledger.decide.Decider._place): the
        # source position stays where the run is, or its next batches would look like a gap and
        # batches already logged past this seq would be logged again.
        proj.count(body.engine_id, "batches")
        proj.count(body.engine_id, "batches_stale")
        if body.ts > source.last_ts:  # the newest engine ts heard, late batches included (decide's case 4)
            source.last_ts = body.ts
            proj.touch("sources", body.source_id)
        return
    proj.put("sources", body.source_id, Source(body.source_id, body.engine_id, body.source_epoch, body.seq, body.ts))
    proj.count(body.engine_id, "batches")


def _on_engine_registered(proj: Projection, entry: LogEntry, body: ev.EngineRegistered) -> None:
    proj.put("engines", body.engine_id,
             Engine(body.engine_id, body.generation, EngineStatus.ACTIVE, entry.seq, entry.seq, entry.seq))


def _on_gap(proj: Projection, entry: LogEntry, body: ev.GapDetected) -> None:
    proj.count(body.engine_id, f"gaps.{body.reason}")


def _on_generation_bumped(proj: Projection, entry: LogEntry, body: ev.GenerationBumped) -> None:
    engine_id, seq = body.engine_id, entry.seq
    engine = proj.engines[engine_id]
    engine.generation, engine.generation_seq, engine.status = body.generation, seq, EngineStatus.RESYNCING
    proj.touch("engines", engine_id)
    proj.count(engine_id, f"generation_bumps.{body.reason}")
    for transition in QUARANTINE:
        _TRANSITIONS[transition.table](proj, engine_id, transition, seq)
    for key, stream in proj.streams.items():
        if key.engine_id == engine_id:
            stream.resync = True
            proj.touch("streams", key)
    proj.changes.quarantines.append((engine_id, seq))


def _transition_blocks(proj: Projection, engine_id: str, transition: Transition, seq: int) -> None:
    """Blocks are indexed by state (``live_blocks``, ``quarantined_blocks``): no scan."""
    index = {BlockState.LIVE: proj.live_blocks, BlockState.QUARANTINED: proj.quarantined_blocks}
    keys = set().union(*(index[state].pop(engine_id, set()) for state in transition.from_states))
    if transition.to_state is None:
        for key in keys:
            _drop_block(proj, key)
        return
    index[transition.to_state].setdefault(engine_id, set()).update(keys)
    dirty = proj.changes.dirty["blocks"]
    for key in keys:
        row = proj.blocks[key]
        row.state, row.updated_seq = transition.to_state, seq
        dirty.add(key)


def _transition_donors(proj: Projection, engine_id: str, transition: Transition, seq: int) -> None:
    assert transition.to_state is not None, "donors leave the projection only by eviction"
    for donor_id, donor in proj.donors.items():
        if donor.engine_id == engine_id and donor.state in transition.from_states:
            donor.state, donor.updated_seq = transition.to_state, seq
            proj.touch("donors", donor_id)


_TRANSITIONS = {"blocks": _transition_blocks, "donors": _transition_donors}


def _on_dead_letter(proj: Projection, entry: LogEntry, body: ev.EventDeadLettered) -> None:
    proj.dead_letters.append(DeadLetter(entry.seq, body.source_id, body.engine_id, str(body.reason),
                                        body.detail[:2000], body.seq, body.batch_index))
    proj.count(body.engine_id, f"dead_letters.{body.reason}")


def _on_donor_registered(proj: Projection, entry: LogEntry, body: ev.DonorRegistered) -> None:
    proj.put("donors", body.donor_id, Donor(
        body.donor_id, body.namespace, body.engine_id, body.attention_dp_rank, body.window_size, body.generation,
        body.num_tokens, len(body.content_keys), body.tokens_per_block, body.provider_generation, body.expires_at,
        DonorState.REGISTERED, None, None, None, entry.seq, entry.seq))
    hashes = split_hashes(body.block_hashes)
    for position, (content_key, (h, ext)) in enumerate(zip(body.content_keys, hashes, strict=True)):
        proj.donor_blocks.append(DonorBlock(body.donor_id, position, content_key, h, ext))
    proj.count(body.engine_id, "donors_registered")


def _on_donor_saved(proj: Projection, entry: LogEntry, body: ev.DonorSaved) -> None:
    donor = proj.donors[body.donor_id]
    if donor.state == DonorState.REGISTERED:
        donor.state = DonorState.LIVE
    donor.store_ref, donor.checksum, donor.size_bytes = body.store_ref, body.checksum, body.size_bytes
    donor.updated_seq = entry.seq
    proj.touch("donors", body.donor_id)
    proj.count(donor.engine_id, "donors_saved")


def _on_donor_evicted(proj: Projection, entry: LogEntry, body: ev.DonorEvicted) -> None:
    donor = proj.donors[body.donor_id]
    donor.state, donor.updated_seq = DonorState.EVICTED, entry.seq
    proj.touch("donors", body.donor_id)
    proj.count(donor.engine_id, "donors_evicted")


def _on_lease_taken(proj: Projection, entry: LogEntry, body: ev.LeaseTaken) -> None:
    proj.put("leases", body.lease_id, Lease(body.lease_id, body.donor_id, body.request_id, body.holder,
                                            body.expires_at, LeaseState.HELD, None, entry.seq, None))
    proj.count(GLOBAL, "leases_taken")


def _on_lease_released(proj: Projection, entry: LogEntry, body: ev.LeaseReleased) -> None:
    lease = proj.leases[body.lease_id]
    lease.state, lease.release_reason, lease.released_seq = LeaseState.RELEASED, body.reason, entry.seq
    proj.touch("leases", body.lease_id)
    proj.count(GLOBAL, "leases_released")


_LIVE = BlockState.LIVE
_ENGINE_BODIES = (ev.EngineCreated, ev.BlockStored, ev.BlockRemoved, ev.BlockUpdated, ev.AllBlocksCleared)
_ENGINE_BODY_TYPES = frozenset(_ENGINE_BODIES)  # msgspec Structs: exact types, no subclasses
_new = tuple.__new__  # _new(BlockKey, (...)): a NamedTuple without its slow Python-level __new__
_HANDLERS: dict[type, Any] = {
    ev.BlockStored: _on_stored,
    ev.BlockRemoved: _on_removed,
    ev.BlockUpdated: _on_updated,
    ev.BatchReceived: _on_batch,
    ev.EngineRegistered: _on_engine_registered,
    ev.GapDetected: _on_gap,
    ev.GenerationBumped: _on_generation_bumped,
    ev.EventDeadLettered: _on_dead_letter,
    ev.DonorRegistered: _on_donor_registered,
    ev.DonorSaved: _on_donor_saved,
    ev.DonorEvicted: _on_donor_evicted,
    ev.LeaseTaken: _on_lease_taken,
    ev.LeaseReleased: _on_lease_released,
}
