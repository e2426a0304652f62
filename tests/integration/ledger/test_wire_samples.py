"""The TensorRT-LLM event samples of reference/WIRE.md §A (values from TensorRT-LLM's own tests)
decode and apply to a real ledger without error, and replay agrees.

The samples come from different TensorRT-LLM tests, so their event_ids are renumbered to be
consecutive per stream (engine, attention_dp_rank, window_size); otherwise the ledger would rightly
read the jumps as lost events."""

from __future__ import annotations

import asyncio

import msgspec

from consumer.wire import decode_message, encode_frames
from ledger.events import ReceivedBatch
from ledger.writer import LedgerWriter
from tests.integration.ledger.suite import assert_replay_equal, blocks, counter

TOKEN = {"type": "unique_token", "token_id": 1, "token_extra_id": 0}
SAMPLES = [
    {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [2231, 0]}},
    {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": [{
        "type": "stored_block", "block_hash": 9622824665191806685,
        "tokens": [TOKEN, {"type": "unique_token", "token_id": 2860, "token_extra_id": 0},
                   {"type": "unique_token", "token_id": 278, "token_extra_id": 0}]}]}},
    {"event_id": 2, "data": {"type": "stored", "parent_hash": 9622824665191806685, "blocks": [{
        "type": "stored_block", "block_hash": 10, "tokens": [{"token_id": 5, "token_extra_id": 0}]}]}},
    {"event_id": 0, "attention_dp_rank": 2, "data": {"type": "removed", "block_hashes": [1]}},
    {"event_id": 3, "data": {"type": "updated", "block_hash": 10}},
    {"event_id": 4, "data": {"type": "removed", "block_hashes": [10385249491213107555, 12379813738877118345]}},
    {"event_id": 0, "attention_dp_rank": 0, "layer_group_id": 0, "window_size": 128, "hash_algo": "v1_block_key",
     "data": {"type": "stored", "parent_hash": None, "blocks": [{
         "type": "stored_block", "block_hash": 104, "tokens": [{"type": "unique_token", "token_id": 1001,
                                                                 "token_extra_id": 0}],
         "cache_salt": None, "cache_level": 0, "priority": 0, "mm_keys": []}]}},
    {"event_id": 5, "data": {"type": "updated", "block_hash": 9622824665191806685,
                             "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0}, "priority": None}},
]


def test_wire_section_a_samples_apply(sqlite_db: str) -> None:
    payload = msgspec.msgpack.encode([1.0, SAMPLES, None])
    batch = decode_message(encode_frames(b"kv", 0, payload), source_id="trt@x", engine_id="engine-a", received_at=0.0)
    assert isinstance(batch, ReceivedBatch) and not batch.dead_letters and len(batch.events) == len(SAMPLES)

    async def run():
        writer = await LedgerWriter.open(sqlite_db)
        try:
            return await writer.append([batch])
        finally:
            await writer.close()

    result = asyncio.run(run())
    assert result.events_applied == len(SAMPLES) and result.dead_letters == 0
    rows = blocks(sqlite_db)
    assert rows[9622824665191806685]["cache_level"] == 1 and rows[9622824665191806685]["state"] == "live"
    assert rows[10]["state"] == "live" and 104 in rows
    assert counter(sqlite_db, "removed_unknown") == 3
    assert counter(sqlite_db, "gaps.event_id_gap") == counter(sqlite_db, "gaps.event_id_regression") == 0  # hashes 1 (dp rank 2), 10385…, 12379… were never stored
    assert_replay_equal(sqlite_db)
