"""Projection state and ``apply``: the one function that turns log entries into projection rows.

Both the live writer (:mod:`ledger.recorder`) and ``semkv-ledger replay`` (:mod:`ledger.replay`)
call :func:`apply` on the same :class:`Projection` type, so live projections and a replay of the
log can only differ if the log or a projection was changed behind the ledger's back — which is
what replay's diff exists to catch.

A :class:`Projection` holds projection rows as plain dicts keyed like the tables' primary keys.
The live writer loads only the rows a transaction touches (``partial=True``); bulk changes
(quarantining an engine's blocks) are applied to the loaded rows and remembered in
:attr:`Projection.bulk_ops` so the writer can run them as SQL against the rows it did not load.
Replay loads nothing and sees everything (``partial=False``).

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
from ledger.types import (
    BlockKey,
    BlockState,
    DonorState,
    EngineStatus,
    LeaseState,
    StreamKey,
    split_hash,
)

Row = dict[str, Any]
GLOBAL = ""  # counters' engine_id for fleet-wide counts


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


@dataclasses.dataclass(slots=True)
class BulkOp:
    """A change to rows the live writer may not have loaded: ``quarantine`` an engine's live blocks
    and donors, or mark its streams ``resync``. Executed as SQL before dirty rows are written."""

    op: str
    engine_id: str
    seq: int


@dataclasses.dataclass
class Projection:
    """Projection rows in memory, plus what changed since they were loaded."""

    partial: bool = False
    engines: dict[str, Row] = dataclasses.field(default_factory=dict)
    streams: dict[StreamKey, Row] = dataclasses.field(default_factory=dict)
    sources: dict[str, Row] = dataclasses.field(default_factory=dict)
    blocks: dict[BlockKey, Row] = dataclasses.field(default_factory=dict)
    donors: dict[str, Row] = dataclasses.field(default_factory=dict)
    donor_blocks: list[Row] = dataclasses.field(default_factory=list)
    leases: dict[str, Row] = dataclasses.field(default_factory=dict)
    dead_letters: list[Row] = dataclasses.field(default_factory=list)
    counters: Counter[tuple[str, str]] = dataclasses.field(default_factory=Counter)
    """Deltas when partial; absolute values when not."""
    live_blocks: dict[str, set[BlockKey]] = dataclasses.field(default_factory=dict)
    """engine_id -> keys of loaded live blocks (so a quarantine need not scan every block)."""
    quarantined_blocks: dict[str, set[BlockKey]] = dataclasses.field(default_factory=dict)
    """engine_id -> keys of loaded quarantined blocks (the next quarantine deletes them)."""
    loaded_blocks: set[BlockKey] = dataclasses.field(default_factory=set)
    """Keys of the block rows read from the database. The live writer loads every block a
    transaction touches first, so a dirty key NOT in here is a new row (a plain INSERT)."""
    removed_blocks: set[BlockKey] = dataclasses.field(default_factory=set)
    """Keys of blocks removed since loading (no longer in :attr:`blocks`): the rows to DELETE
    (those that are also in :attr:`loaded_blocks`; the others were never written)."""
    unloaded: set[tuple[str, int, int, int]] = dataclasses.field(default_factory=set)
    """(engine_id, dp rank, window, signed hash) that the live writer did NOT load because the
    transaction only removes them: their rows are deleted in SQL without being read."""
    blind_removals: list[tuple[BlockKey, int]] = dataclasses.field(default_factory=list)
    """Removals of :attr:`unloaded` blocks in event order, each with ``len(bulk_ops)`` at that point
    (so the writer deletes before or after a quarantine in the same order as replay); their
    counters are added by the writer from the rows each DELETE matched."""
    dirty: dict[str, set[Any]] = dataclasses.field(
        default_factory=lambda: {t: set() for t in ("engines", "streams", "sources", "blocks", "donors", "leases")}
    )
    bulk_ops: list[BulkOp] = dataclasses.field(default_factory=list)

    def put(self, table: str, key: Any, row: Row) -> None:
        getattr(self, table)[key] = row
        self.dirty[table].add(key)

    def touch(self, table: str, key: Any) -> None:
        self.dirty[table].add(key)

    def count(self, engine_id: str | None, name: str, n: int = 1) -> None:
        self.counters[(engine_id or GLOBAL, name)] += n

    def load_blocks(self, rows: Iterable[Row]) -> None:
        blocks, live_blocks, loaded = self.blocks, self.live_blocks, self.loaded_blocks
        for row in rows:
            key = _new(BlockKey, (row["engine_id"], row["attention_dp_rank"], row["window_size"], row["block_hash"],
                                  row["block_hash_ext"]))
            blocks[key] = row
            loaded.add(key)
            by_state = live_blocks if row["state"] == _LIVE else self.quarantined_blocks
            keys = by_state.get(row["engine_id"])
            if keys is None:
                keys = by_state[row["engine_id"]] = set()
            keys.add(key)


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
        if not entry.applied:
            counters[(engine_id, "events_stale")] += 1
            return
        _advance_stream(proj, entry)
        counters[(engine_id, "events_applied")] += 1
    handler = _HANDLERS.get(body_type)
    if handler is not None:
        handler(proj, entry, body)


def _advance_stream(proj: Projection, entry: LogEntry) -> None:
    engine_id = entry.engine_id
    key = _new(StreamKey, (engine_id, entry.attention_dp_rank or 0, entry.window_size or 0))
    row = proj.streams.get(key)
    if row is None:
        row = {"engine_id": engine_id, "attention_dp_rank": key[1], "window_size": key[2], "last_event_id": None,
               "resync": False}
    if entry.event_id is not None:
        # Only an event that carries an event_id can become the new baseline after a bump.
        row["last_event_id"] = entry.event_id
        row["resync"] = False
    proj.streams[key] = row
    proj.dirty["streams"].add(key)
    engine = proj.engines[engine_id]
    engine["last_seq"] = entry.seq
    engine["status"] = EngineStatus.ACTIVE
    proj.dirty["engines"].add(engine_id)


def _block_key(entry: LogEntry, block_hash: ev.BlockHash) -> BlockKey:
    h, ext = split_hash(block_hash)
    return BlockKey(entry.engine_id, entry.attention_dp_rank or 0, entry.window_size or 0, h, ext)  # type: ignore[arg-type]


def _drop_block(proj: Projection, key: BlockKey) -> None:
    """Remove a block from the projection (its row is deleted if it was loaded)."""
    del proj.blocks[key]
    proj.dirty["blocks"].discard(key)
    if key in proj.loaded_blocks:
        proj.removed_blocks.add(key)


# The two handlers below run once per block on the ingest path; they inline what
# _block_key/split_hash/u64_to_i64 do and build keys with tuple.__new__ (a
# NamedTuple's own constructor costs ~0.6 µs, split_hash ~0.2 µs; tools/bench_ledger.py).


def _on_stored(proj: Projection, entry: LogEntry, body: ev.BlockStored) -> None:
    engine_id, seq = entry.engine_id, entry.seq
    dp_rank, window = entry.attention_dp_rank or 0, entry.window_size or 0
    generation = proj.engines[engine_id]["generation"]
    blocks, dirty, removed = proj.blocks, proj.dirty["blocks"], proj.removed_blocks
    live = proj.live_blocks.setdefault(engine_id, set())
    p_hash, p_ext = split_hash(body.parent_hash) if body.parent_hash is not None else (None, None)
    lora_id = body.lora_id
    again = 0
    for block in body.blocks:
        block_hash = block.block_hash
        if type(block_hash) is int:
            h, ext = (block_hash - _TWO_64 if block_hash > _I64_MAX else block_hash), b""
        else:
            h, ext = split_hash(block_hash)
        digest = block.tokens_digest
        if digest > _I64_MAX:
            digest -= _TWO_64
        key = _new(BlockKey, (engine_id, dp_rank, window, h, ext))
        row = blocks.get(key)
        if row is not None and row["state"] == _LIVE:
            row["store_count"] += 1
            again += 1
            row["parent_hash"] = p_hash
            row["parent_hash_ext"] = p_ext
            row["num_tokens"] = block.num_tokens
            row["tokens_digest"] = digest
            row["cache_level"] = block.cache_level
            row["priority"] = block.priority
            row["cache_salt"] = block.cache_salt
            row["lora_id"] = lora_id
            row["generation"] = generation
            row["updated_seq"] = seq
        else:
            blocks[key] = {"engine_id": engine_id, "attention_dp_rank": dp_rank, "window_size": window,
                           "block_hash": h, "block_hash_ext": ext, "store_count": 1, "stored_seq": seq,
                           "parent_hash": p_hash, "parent_hash_ext": p_ext, "num_tokens": block.num_tokens,
                           "tokens_digest": digest, "cache_level": block.cache_level, "priority": block.priority,
                           "cache_salt": block.cache_salt, "lora_id": lora_id, "generation": generation,
                           "state": _LIVE, "updated_seq": seq}
            removed.discard(key)
            if row is not None:  # it was quarantined
                proj.quarantined_blocks.get(engine_id, set()).discard(key)
        live.add(key)
        dirty.add(key)
        p_hash, p_ext = h, ext
    counters = proj.counters
    counters[(engine_id, "blocks_stored")] += len(body.blocks)
    if again:
        counters[(engine_id, "stored_while_live")] += again


def _on_removed(proj: Projection, entry: LogEntry, body: ev.BlockRemoved) -> None:
    engine_id = entry.engine_id
    dp_rank, window = entry.attention_dp_rank or 0, entry.window_size or 0
    blocks, dirty, gone, unloaded = proj.blocks, proj.dirty["blocks"], proj.removed_blocks, proj.unloaded
    loaded = proj.loaded_blocks
    live = proj.live_blocks.setdefault(engine_id, set())
    removed = unknown = not_live = 0
    for block_hash in body.block_hashes:
        if type(block_hash) is int:
            h, ext = (block_hash - _TWO_64 if block_hash > _I64_MAX else block_hash), b""
        else:
            h, ext = split_hash(block_hash)
        key = _new(BlockKey, (engine_id, dp_rank, window, h, ext))
        row = blocks.pop(key, None)
        if row is None:
            if unloaded and (engine_id, dp_rank, window, h) in unloaded:
                proj.blind_removals.append((key, len(proj.bulk_ops)))
            else:
                unknown += 1
            continue
        if row["state"] == _LIVE:
            removed += 1
            live.discard(key)
        else:
            not_live += 1
            proj.quarantined_blocks.get(engine_id, set()).discard(key)
        dirty.discard(key)
        if key in loaded:  # else it never reached the table (stored earlier in this transaction)
            gone.add(key)
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
    if row["state"] != BlockState.LIVE:
        proj.count(entry.engine_id, "updated_not_live")
        return
    if body.cache_level is not None:
        row["cache_level"] = body.cache_level.new_value
    if body.priority is not None:
        row["priority"] = body.priority.new_value
    row["updated_seq"] = entry.seq
    proj.put("blocks", key, row)
    proj.count(entry.engine_id, "blocks_updated")


def _on_batch(proj: Projection, entry: LogEntry, body: ev.BatchReceived) -> None:
    source = proj.sources.get(body.source_id)
    if source is not None and source["epoch"] == body.source_epoch and body.seq <= source["last_seq"]:
        # A late batch, logged stale in the current epoch (ledger.decide.Decider._place): the
        # source position stays where the run is, or its next batches would look like a gap and
        # batches already logged past this seq would be logged again.
        proj.count(body.engine_id, "batches")
        proj.count(body.engine_id, "batches_stale")
        if body.ts > source["last_ts"]:  # the newest engine ts heard, late batches included (decide's case 4)
            proj.put("sources", body.source_id, {**source, "last_ts": body.ts})
        return
    proj.put("sources", body.source_id, {
        "source_id": body.source_id, "engine_id": body.engine_id, "epoch": body.source_epoch,
        "last_seq": body.seq, "last_ts": body.ts,
    })
    proj.count(body.engine_id, "batches")


def _on_engine_registered(proj: Projection, entry: LogEntry, body: ev.EngineRegistered) -> None:
    proj.put("engines", body.engine_id, {
        "engine_id": body.engine_id, "generation": body.generation, "status": EngineStatus.ACTIVE,
        "registered_seq": entry.seq, "generation_seq": entry.seq, "last_seq": entry.seq,
    })


def _on_gap(proj: Projection, entry: LogEntry, body: ev.GapDetected) -> None:
    proj.count(body.engine_id, f"gaps.{body.reason}")


def _on_generation_bumped(proj: Projection, entry: LogEntry, body: ev.GenerationBumped) -> None:
    engine = proj.engines[body.engine_id]
    engine.update(generation=body.generation, generation_seq=entry.seq, status=EngineStatus.RESYNCING)
    proj.touch("engines", body.engine_id)
    proj.count(body.engine_id, f"generation_bumps.{body.reason}")
    # Blocks quarantined by the previous loss of continuity leave the projection (an engine that
    # restarted never removes them, so they would pile up at every restart); the live ones are
    # quarantined. The table stays bounded by two caches' worth of blocks per engine.
    for key in proj.quarantined_blocks.pop(body.engine_id, ()):
        _drop_block(proj, key)
    quarantined = proj.quarantined_blocks[body.engine_id] = proj.live_blocks.pop(body.engine_id, set())
    for key in quarantined:
        row = proj.blocks[key]
        row["state"] = BlockState.QUARANTINED
        row["updated_seq"] = entry.seq
        proj.dirty["blocks"].add(key)
    for donor_id, donor in proj.donors.items():
        if donor["engine_id"] == body.engine_id and donor["state"] in _LIVE_DONOR_STATES:
            donor.update(state=DonorState.QUARANTINED, updated_seq=entry.seq)
            proj.touch("donors", donor_id)
    for key, stream in proj.streams.items():
        if key.engine_id == body.engine_id:
            stream["resync"] = True
            proj.touch("streams", key)
    if proj.partial:
        proj.bulk_ops.append(BulkOp("quarantine", body.engine_id, entry.seq))


def _on_dead_letter(proj: Projection, entry: LogEntry, body: ev.EventDeadLettered) -> None:
    proj.dead_letters.append({
        "log_seq": entry.seq, "source_id": body.source_id, "engine_id": body.engine_id,
        "reason": str(body.reason), "detail": body.detail[:2000], "zmq_seq": body.seq,
        "batch_index": body.batch_index,
    })
    proj.count(body.engine_id, f"dead_letters.{body.reason}")


def _on_donor_registered(proj: Projection, entry: LogEntry, body: ev.DonorRegistered) -> None:
    proj.put("donors", body.donor_id, {
        "donor_id": body.donor_id, "namespace": body.namespace, "engine_id": body.engine_id,
        "attention_dp_rank": body.attention_dp_rank, "window_size": body.window_size,
        "generation": body.generation, "num_tokens": body.num_tokens,
        "num_blocks": len(body.content_keys), "tokens_per_block": body.tokens_per_block,
        "provider_generation": body.provider_generation, "expires_at": body.expires_at,
        "state": DonorState.REGISTERED, "store_ref": None, "checksum": None, "size_bytes": None,
        "registered_seq": entry.seq, "updated_seq": entry.seq,
    })
    for position, (content_key, block_hash) in enumerate(zip(body.content_keys, body.block_hashes, strict=True)):
        h, ext = split_hash(block_hash)
        proj.donor_blocks.append({"donor_id": body.donor_id, "position": position,
                                  "content_key": content_key, "block_hash": h, "block_hash_ext": ext})
    proj.count(body.engine_id, "donors_registered")


def _on_donor_saved(proj: Projection, entry: LogEntry, body: ev.DonorSaved) -> None:
    donor = proj.donors[body.donor_id]
    if donor["state"] == DonorState.REGISTERED:
        donor["state"] = DonorState.LIVE
    donor.update(store_ref=body.store_ref, checksum=body.checksum, size_bytes=body.size_bytes,
                 updated_seq=entry.seq)
    proj.touch("donors", body.donor_id)
    proj.count(donor["engine_id"], "donors_saved")


def _on_donor_evicted(proj: Projection, entry: LogEntry, body: ev.DonorEvicted) -> None:
    donor = proj.donors[body.donor_id]
    donor.update(state=DonorState.EVICTED, updated_seq=entry.seq)
    proj.touch("donors", body.donor_id)
    proj.count(donor["engine_id"], "donors_evicted")


def _on_lease_taken(proj: Projection, entry: LogEntry, body: ev.LeaseTaken) -> None:
    proj.put("leases", body.lease_id, {
        "lease_id": body.lease_id, "donor_id": body.donor_id, "request_id": body.request_id,
        "holder": body.holder, "expires_at": body.expires_at, "state": LeaseState.HELD,
        "release_reason": None, "taken_seq": entry.seq, "released_seq": None,
    })
    proj.count(GLOBAL, "leases_taken")


def _on_lease_released(proj: Projection, entry: LogEntry, body: ev.LeaseReleased) -> None:
    lease = proj.leases[body.lease_id]
    lease.update(state=LeaseState.RELEASED, release_reason=body.reason, released_seq=entry.seq)
    proj.touch("leases", body.lease_id)
    proj.count(GLOBAL, "leases_released")


_LIVE = BlockState.LIVE
_LIVE_DONOR_STATES = (DonorState.REGISTERED, DonorState.LIVE)
_ENGINE_BODIES = (ev.EngineCreated, ev.BlockStored, ev.BlockRemoved, ev.BlockUpdated, ev.AllBlocksCleared)
_ENGINE_BODY_TYPES = frozenset(_ENGINE_BODIES)  # msgspec Structs: exact types, no subclasses
_new = tuple.__new__  # _new(BlockKey, (...)): a NamedTuple without its slow Python-level __new__
_TWO_64, _I64_MAX = 2**64, 2**63 - 1
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
