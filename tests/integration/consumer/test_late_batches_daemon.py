"""A late Stored(A) through the real consumer (issue #18, defect 3), in dialects (a) and (b), over
real loopback ZMQ with an engine stand-in whose replay buffer holds 2 batches.

The engine publishes 0 Stored(X), 1 Stored(A), 2 Stored(Z), 3 Removed(A), 4 Stored(Y); only 0 and 4
reach the consumer, and the buffer no longer holds 1 and 2: the ledger logs the gap and applies
Removed(A) from replay. Then Stored(A) arrives late. Before the fix the consumer passed it on,
the ledger bumped the generation, opened a new source epoch at seq 1 and applied it (A live), and
after a kill -9 the restarted consumer resumed from that epoch's seq 1 and logged Removed(A) a
second time. Now: logged once, never applied, no epoch, and the restart logs nothing again.
"""

from __future__ import annotations

import os
import signal
import sqlite3
from pathlib import Path

import pytest
import xxhash

from ledger.replay import replay
from tests.engine_runs import DIALECTS, EngineRun
from tests.integration.consumer.daemon_support import (
    DaemonRun,
    FaultPublisher,
    migrated_db,
    settings_for,
    subscribed,
    wait_until,
)
from tests.integration.consumer.test_daemon_process import Consumer, batches_in, source_args, wait_for

ENGINE = "trt-0"
X, A, Z, Y, W = 11, 2**64 - 7, 12, 13, 14


def publish_lost_store_then_removal(pub: FaultPublisher, dialect: str) -> EngineRun:
    engine = EngineRun(dialect)
    for seq, ops, sent in ((0, ("stored", [X]), True), (1, ("stored", [A]), False), (2, ("stored", [Z]), False),
                           (3, ("removed", [A]), False), (4, ("stored", [Y]), True)):
        pub.publish(seq, engine.payload(ops), send=sent)
    return engine


def log_of(path: Path) -> tuple[list[tuple[int, int, int]], dict[int, set[bool]], str | None]:
    """(epoch, seq, xxh3 digest) of each batch row; per seq the ``applied`` values of its events;
    A's block state."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        from ledger import events as ev

        batches = [(r[0], r[1], ev.BODY_DECODER.decode(r[2]).digest) for r in conn.execute(
            "SELECT source_epoch, zmq_seq, body FROM log WHERE kind = 'batch_received' ORDER BY seq")]
        applied: dict[int, set[bool]] = {}
        for seq, flag in conn.execute("SELECT zmq_seq, applied FROM log WHERE batch_index >= 0"):
            applied.setdefault(seq, set()).add(bool(flag))
        a_hash = A - 2**64  # stored as signed 64-bit
        row = conn.execute("SELECT state FROM blocks WHERE block_hash = ?", (a_hash,)).fetchone()
    finally:
        conn.close()
    return batches, applied, None if row is None else row[0]


def assert_each_batch_logged_once(batches: list[tuple[int, int, int]], pub: FaultPublisher) -> None:
    digests = {seq: xxhash.xxh3_64_intdigest(frames[2]) for seq, frames in pub.sent.items()}
    assert sorted((seq, digest) for _, seq, digest in batches) == sorted(
        (seq, digests[seq]) for seq in {seq for _, seq, _ in batches})  # every row is a batch the engine sent
    assert len({(seq, digest) for _, seq, digest in batches}) == len(batches)  # ... logged once


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_late_store_after_removal_never_resurrects(tmp_path, dialect):
    db, path = migrated_db(tmp_path)
    with FaultPublisher(buffer_steps=2) as pub:
        async with DaemonRun(settings_for(db, {"engine_id": ENGINE, "endpoint": pub.endpoint,
                                               "replay_endpoint": pub.replay_endpoint})) as run:
            await subscribed(pub, run)
            engine = publish_lost_store_then_removal(pub, dialect)
            await wait_until(lambda: run.daemon.stats.batches == 3, what="0, then 3 and 4 (3 by replay)")
            pub.resend(1)  # Stored(A), late
            await wait_until(lambda: run.daemon.stats.batches == 4, what="the late batch")
            pub.publish(5, engine.payload(("stored", [W])))
            await wait_until(lambda: run.daemon.stats.batches == 5, what="the next batch")
            stats = await run.stop()
    batches, applied, a_state = log_of(path)
    assert a_state is None  # removed, and not resurrected by the late store
    assert [(epoch, seq) for epoch, seq, _ in batches] == [(1, 0), (1, 3), (1, 4), (1, 1), (1, 5)]
    assert applied[1] == {False} and all(applied[seq] == {True} for seq in (0, 3, 4, 5))
    assert (stats.gaps, stats.generation_bumps, stats.events_stale) == (1, 1, 1)  # the gap 1..2 only
    assert_each_batch_logged_once(batches, pub)
    assert replay(db).equal


@pytest.mark.parametrize("dialect", DIALECTS)
def test_kill_9_after_a_late_batch_then_restart_logs_nothing_twice(tmp_path, dialect):
    db, path = migrated_db(tmp_path)
    with FaultPublisher(buffer_steps=2) as pub:
        consumer = Consumer(*source_args(db, pub, "--idle-replay-s", "0.3"))
        consumer.wait_event("source.started")
        pub.wait_for_subscriber()
        publish_lost_store_then_removal(pub, dialect)
        wait_for(lambda: batches_in(path) == 3, 20, "0, then 3 and 4 (3 by replay)")
        pub.resend(1)  # Stored(A), late
        wait_for(lambda: batches_in(path) == 4, 20, "the late batch")
        os.kill(consumer.proc.pid, signal.SIGKILL)
        consumer.finish()
        restarted = Consumer(*source_args(db, pub, "--idle-replay-s", "0.3", "--exit-when-idle", "1.5"))
        assert restarted.finish(60) == 0, "".join(restarted.lines)[-3000:]
        batches, applied, a_state = log_of(path)
        assert_each_batch_logged_once(batches, pub)
    assert [(epoch, seq) for epoch, seq, _ in batches] == [(1, 0), (1, 3), (1, 4), (1, 1)]
    assert a_state is None and applied[1] == {False} and applied[3] == {True}
    assert replay(db).equal
