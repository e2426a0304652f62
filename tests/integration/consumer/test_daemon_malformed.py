"""Malformed input reaches the ledger as dead letters (with reason and raw bytes) while the daemon
keeps running; random payloads never crash it and are counted exactly."""

from __future__ import annotations

import random
import sqlite3

import msgspec
import pytest

from consumer.source import seq_carrying_letter_as_batch
from consumer.wire import WireLimits, decode_message
from tests.integration.consumer.daemon_support import (
    EVENTS_PER_BATCH,
    DaemonRun,
    FaultPublisher,
    PayloadMaker,
    ledger_counts,
    migrated_db,
    settings_for,
    subscribed,
    wait_until,
)
from ledger.events import DeadLetter
from ledger.replay import replay

ENGINE = "trt-0"
ENC = msgspec.msgpack.Encoder()
MAX_FRAME = 1024


def source_of(pub: FaultPublisher) -> dict:
    return {"engine_id": ENGINE, "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint}


def mixed_payload() -> bytes:
    """Two good events around two bad ones: an unknown type and a negative TensorRT-LLM hash."""
    good = {"type": "BlockRemoved", "block_hashes": [12379813738877118345], "medium": "GPU"}
    unknown = {"type": "BlockTeleported", "block_hashes": [1]}
    negative = {"event_id": 0, "data": {"type": "removed", "block_hashes": [-5]}, "window_size": 32}
    return ENC.encode([1.0, [unknown, good, negative, good], 0])


async def test_malformed_messages_become_dead_letters_and_the_daemon_keeps_running(tmp_path):
    db, path = migrated_db(tmp_path)
    make = PayloadMaker()
    with FaultPublisher() as pub:
        async with DaemonRun(settings_for(db, source_of(pub), max_frame_bytes=MAX_FRAME)) as run:
            await subscribed(pub, run)
            pub.publish(0, make(0))
            pub.send_raw([b"kv"])  # wrong frame count
            pub.send_raw([b"kv", (1).to_bytes(8, "big"), b"\x90", b"extra"])  # wrong frame count
            pub.send_raw([b"kv", b"1234567", make(1)])  # 7-byte seq
            pub.send_raw([b"kv", b"\xff" * 8, b""])  # a replay end marker on the data path
            pub.publish(1, b"\xc1 not msgpack")  # malformed payload: consumes seq 1
            pub.publish(2, ENC.encode({"ts": 1.0}))  # wrong batch shape
            pub.publish(3, mixed_payload())  # 2 events + 2 dead letters in one batch
            pub.publish(4, ENC.encode([1.0, [], 0]) + b"\x00" * 2 * MAX_FRAME)  # oversized frame
            for seq in range(5, 10):
                pub.publish(seq, make(seq))
            await wait_until(lambda: run.daemon.stats.batches == 10, what="10 batches")
            await wait_until(lambda: run.daemon.stats.dead_letters == 9, what="9 dead letters")
            assert all(s.running for s in run.daemon.sources)
            stats = await run.stop()
    counts = ledger_counts(path)
    assert counts.dead_letters_by_reason == {"wrong_frame_count": 2, "bad_seq_frame": 2, "malformed_msgpack": 1,
                                             "bad_batch_shape": 1, "unknown_event_type": 1, "hash_out_of_range": 1,
                                             "oversized_frame": 1}
    assert counts.engine_events == 6 * EVENTS_PER_BATCH + 2 == stats.events_applied
    assert counts.gaps() == {} and counts.bumps() == {}  # bad payloads still consume their seq
    assert run.metric("semkv_consumer_dead_letters_total", engine_id=ENGINE, reason="wrong_frame_count") == 2
    conn = sqlite3.connect(path)  # the mixed batch (seq 3): every row keeps its payload position
    positions = conn.execute("SELECT kind, batch_index FROM log WHERE zmq_seq = 3 AND batch_index >= 0 "
                             "ORDER BY batch_index").fetchall()
    conn.close()
    assert positions == [("event_dead_lettered", 0), ("block_removed", 1), ("event_dead_lettered", 2),
                         ("block_removed", 3)]
    assert replay(db).equal


def fuzz_payload(rng: random.Random, make: PayloadMaker, seq: int) -> bytes:
    good = make(seq)
    choice = rng.randrange(6)
    if choice == 0:
        return rng.randbytes(rng.randrange(0, 64))
    if choice == 1:  # flip bytes of a good payload
        data = bytearray(good)
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if choice == 2:
        return good[:rng.randrange(len(good))]
    if choice == 3:  # random structure in a batch
        junk = [rng.choice([None, -1, 2**64 - 1, "x", b"\x00" * 32, [], {}, {"type": "BlockStored"},
                            ["BlockRemoved", [rng.randrange(-2**63, 2**63)]], 1.5]) for _ in range(3)]
        return ENC.encode([rng.random(), junk, rng.choice([None, 0, -1, "r"])])
    return good


def expected(frames: list[bytes], seq: int) -> tuple[int, int]:
    """(events, dead letters) the ledger must hold for one message, by decoding it here."""
    item = decode_message(frames, source_id="s", engine_id=ENGINE, received_at=0.0,
                          limits=WireLimits(max_frame_bytes=MAX_FRAME))
    item = seq_carrying_letter_as_batch(item, frames)
    if isinstance(item, DeadLetter):
        return 0, 1
    return len(item.events), len(item.dead_letters)


@pytest.mark.parametrize("seed", [7])
async def test_fuzzed_payloads_are_applied_or_dead_lettered(tmp_path, seed):
    rng = random.Random(seed)
    db, path = migrated_db(tmp_path)
    make = PayloadMaker()
    want_events = want_dead = 0
    n = 1500
    with FaultPublisher() as pub:
        async with DaemonRun(settings_for(db, source_of(pub), max_frame_bytes=MAX_FRAME)) as run:
            await subscribed(pub, run)
            for seq in range(n):
                frames = pub.publish(seq, fuzz_payload(rng, make, seq))
                events, dead = expected(frames, seq)
                want_events, want_dead = want_events + events, want_dead + dead
            await wait_until(lambda: run.daemon.stats.batches == n, 60, f"{n} batches")
            stats = await run.stop()
    counts = ledger_counts(path)
    assert want_dead > 100 and want_events > 1000
    assert (counts.engine_events, counts.dead_letters) == (want_events, want_dead)
    assert stats.events_applied + stats.events_stale == want_events
    assert counts.gaps() == {} and counts.duplicate_keys == 0
    assert replay(db).equal
