"""Fault injection into a live daemon (real ZMQ on 127.0.0.1, SQLite files), each with the exact
count check "events published = events in the log + dead letters (+ what the ledger declared lost)"."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

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
from ledger.replay import replay

ENGINE = "trt-0"


def source_of(pub: FaultPublisher, **extra) -> dict:
    return {"engine_id": ENGINE, "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint, **extra}


@pytest.mark.parametrize("dialect", ["vllm", "trt"])
async def test_dropped_frames_recovered_by_replay(tmp_path, dialect):
    db, path = migrated_db(tmp_path)
    make = PayloadMaker(dialect)
    # phases, each committed before the next: the first batch lost (late joiner), two in a row, one
    # alone, and the very last one (no later batch shows that gap: the idle replay probe finds it)
    phases = [(range(0, 10), {0}), (range(10, 50), {10, 11}), (range(50, 99), {50}), (range(99, 100), {99})]
    with FaultPublisher() as pub:
        async with DaemonRun(settings_for(db, source_of(pub))) as run:
            await subscribed(pub, run)
            for seqs, dropped in phases:
                for seq in seqs:
                    pub.publish(seq, make(seq), send=seq not in dropped)
                await wait_until(lambda n=seqs.stop: run.daemon.stats.batches == n, what=f"{seqs.stop} batches")
            stats = await run.stop()
    counts = ledger_counts(path)
    assert counts.engine_events == 100 * EVENTS_PER_BATCH == stats.events_applied
    assert counts.batches == 100 and counts.duplicate_keys == 0
    assert counts.bumps() == {} and counts.gaps() == {}
    assert run.metric("semkv_consumer_replays_total", engine_id=ENGINE, outcome="ok") == 3
    assert run.metric("semkv_consumer_replays_total", engine_id=ENGINE, outcome="failed") == 0
    assert run.metric("semkv_consumer_replay_probes_total", engine_id=ENGINE) >= 2  # start-up + idle
    assert replay(db).equal


async def test_dropped_beyond_replay_buffer_is_a_gap_and_quarantine(tmp_path):
    db, path = migrated_db(tmp_path)
    make = PayloadMaker()
    with FaultPublisher(buffer_steps=5) as pub:
        async with DaemonRun(settings_for(db, source_of(pub))) as run:
            await subscribed(pub, run)
            for seq in range(20):
                pub.publish(seq, make(seq))
            await wait_until(lambda: run.daemon.stats.batches == 20, what="first 20")
            for seq in range(20, 30):
                pub.publish(seq, make(seq), send=False)  # lost on the wire; the buffer keeps only 5
            pub.publish(30, make(30))
            # handshake: the replay request for [20, …) was answered (with 26..30) before more is sent
            await wait_until(lambda: pub.replay_stats.batches_sent >= 5, what="replay served")
            for seq in range(31, 40):
                pub.publish(seq, make(seq))
            await wait_until(lambda: run.daemon.stats.batches == 34, what="34 batches")
            stats = await run.stop()
    lost = 6  # seqs 20..25 left the replay buffer before the consumer asked
    counts = ledger_counts(path)
    assert counts.engine_events == (40 - lost) * EVENTS_PER_BATCH == stats.events_applied
    assert counts.gaps() == {"seq_gap": 1} and counts.bumps() == {"seq_gap": 1}
    assert counts.block_states.get("quarantined", 0) > 0
    assert run.metric("semkv_consumer_replays_total", engine_id=ENGINE, outcome="partial") == 1
    assert replay(db).equal


async def test_a_gap_found_by_a_restarted_consumers_probe_is_counted_as_seen_and_partial(tmp_path):
    """The consumer stopped at seq 9; while it was down the engine published 10..39 and its replay
    buffer kept only the last 5. The restarted consumer's start-up probe finds the hole: the ledger
    records it (``semkv_consumer_gaps_total``), and so must the source's own counters, which the
    dashboard's gap panel and the replay alert read (before: ``seq_gaps_total`` 0, no replay counted)."""
    db, path = migrated_db(tmp_path)
    make = PayloadMaker()
    with FaultPublisher(buffer_steps=5) as pub:
        async with DaemonRun(settings_for(db, source_of(pub))) as run:
            await subscribed(pub, run)
            for seq in range(10):
                pub.publish(seq, make(seq))
            await wait_until(lambda: run.daemon.stats.batches == 10, what="first 10")
            await run.stop()
        for seq in range(10, 40):
            pub.publish(seq, make(seq))  # nobody subscribed: only the replay buffer keeps the last 5
        async with DaemonRun(settings_for(db, source_of(pub))) as run:
            await wait_until(lambda: run.daemon.stats.batches == 5, what="the 5 the buffer held")
            await run.stop()
    assert ledger_counts(path).gaps() == {"seq_gap": 1}
    assert run.metric("semkv_consumer_gaps_total", engine_id=ENGINE, reason="seq_gap") == 1
    assert run.metric("semkv_consumer_seq_gaps_total", engine_id=ENGINE) == 1
    assert run.metric("semkv_consumer_replays_total", engine_id=ENGINE, outcome="partial") == 1
    assert replay(db).equal


async def test_duplicated_and_reordered_batches_with_replay(tmp_path):
    db, path = migrated_db(tmp_path)
    make = PayloadMaker("trt")
    with FaultPublisher() as pub:
        async with DaemonRun(settings_for(db, source_of(pub))) as run:
            await subscribed(pub, run)
            for seq in range(50):
                pub.publish(seq, make(seq), send=seq != 20)
                if seq == 10:
                    pub.resend(10)  # duplicate right away
                if seq == 21:
                    pub.resend(20)  # 21 overtook 20
                if seq == 30:
                    pub.resend(15)  # a late duplicate
            await wait_until(lambda: run.daemon.stats.batches == 50, what="50 batches")
            await wait_until(lambda: run.metric("semkv_consumer_messages_received_total", engine_id=ENGINE) >= 53,
                             what="all copies received")
            stats = await run.stop()
    counts = ledger_counts(path)
    assert counts.engine_events == 50 * EVENTS_PER_BATCH == stats.events_applied
    assert counts.batches == 50 and counts.duplicate_keys == 0
    assert counts.bumps() == {} and counts.gaps() == {}
    assert run.metric("semkv_consumer_duplicate_batches_dropped_total", engine_id=ENGINE) >= 3
    assert replay(db).equal


async def test_reordered_without_replay_fails_closed_and_loses_nothing(tmp_path):
    db, path = migrated_db(tmp_path)
    make = PayloadMaker()
    with FaultPublisher(replay=False) as pub:
        async with DaemonRun(settings_for(db, source_of(pub))) as run:
            await subscribed(pub, run)
            for seq in range(30):
                pub.publish(seq, make(seq), send=seq != 20)
                if seq == 21:
                    pub.resend(20)
                if seq == 25:
                    pub.resend(24)  # a duplicate the source drops by digest
            await wait_until(lambda: run.daemon.stats.batches == 30, what="30 batches")
            stats = await run.stop()
    counts = ledger_counts(path)
    assert counts.engine_events == 30 * EVENTS_PER_BATCH  # every event logged once
    # 21 arrives after 19: a gap. 20, at a seq the ledger declared lost, is logged and never applied
    # (a late Stored(A) must not resurrect A); without replay nobody can prove that the engine did not
    # restart, so the generation is bumped too (fail closed). 22 follows 21: no gap.
    assert stats.events_applied == 29 * EVENTS_PER_BATCH and stats.events_stale == EVENTS_PER_BATCH
    assert counts.bumps() == {"seq_gap": 1, "seq_reset": 1}
    assert replay(db).equal


async def test_publisher_restart_mid_stream(tmp_path):
    db, path = migrated_db(tmp_path)
    first = FaultPublisher()
    endpoints = (first.endpoint, first.replay_endpoint)
    async with DaemonRun(settings_for(db, source_of(first))) as run:
        make = PayloadMaker(run=0)
        await subscribed(first)
        for seq in range(30):
            first.publish(seq, make(seq))
        await wait_until(lambda: run.daemon.stats.batches == 30, what="first run")
        first.close()  # the engine process goes away …
        make = PayloadMaker(run=1)
        with FaultPublisher(endpoint=endpoints[0], replay_endpoint=endpoints[1]) as second:  # … and comes back
            await subscribed(second)  # the SUB reconnected
            for seq in range(20):
                second.publish(seq, make(seq))
            await wait_until(lambda: run.daemon.stats.batches == 50, what="second run")
            stats = await run.stop()
    counts = ledger_counts(path)
    assert counts.engine_events == 50 * EVENTS_PER_BATCH == stats.events_applied
    assert counts.bumps() == {"seq_reset": 1} and counts.gaps() == {}
    assert replay(db).equal


async def test_restarted_engine_whose_first_batches_were_missed(tmp_path):
    """Restart seen at seq 5 of the new run: replay from 0 recovers 0..4 before the live batch."""
    db, path = migrated_db(tmp_path)
    make = PayloadMaker(run=0)
    with FaultPublisher() as pub:
        async with DaemonRun(settings_for(db, source_of(pub))) as run:
            await subscribed(pub, run)
            for seq in range(30):
                pub.publish(seq, make(seq))
            await wait_until(lambda: run.daemon.stats.batches == 30, what="first run")
            pub.restart()
            make = PayloadMaker(run=1)
            for seq in range(10):
                pub.publish(seq, make(seq), send=seq >= 5)
            await wait_until(lambda: run.daemon.stats.batches == 40, what="second run")
            stats = await run.stop()
    counts = ledger_counts(path)
    assert counts.engine_events == 40 * EVENTS_PER_BATCH == stats.events_applied
    assert counts.bumps() == {"seq_reset": 1} and counts.gaps() == {}


async def test_late_joiner_without_replay_declares_earlier_state_unknown(tmp_path):
    db, path = migrated_db(tmp_path)
    make = PayloadMaker()
    with FaultPublisher(buffer_steps=3) as pub:
        for seq in range(10):  # published before anyone subscribed; only 7..9 stay in the buffer
            pub.publish(seq, make(seq), send=False)
        async with DaemonRun(settings_for(db, source_of(pub))) as run:
            await subscribed(pub, run)
            for seq in range(10, 15):
                pub.publish(seq, make(seq))
            await wait_until(lambda: run.daemon.stats.batches == 8, what="8 batches")
            stats = await run.stop()
    counts = ledger_counts(path)
    assert counts.engine_events == 8 * EVENTS_PER_BATCH == stats.events_applied
    assert counts.gaps() == {"seq_gap": 1} and counts.bumps() == {"seq_gap": 1}


async def test_slow_joiner_recovers_first_messages_by_replay(tmp_path):
    """The consumer binds and is up first; the publisher connects and sends at once (no handshake)."""
    db, path = migrated_db(tmp_path)
    make = PayloadMaker()
    source = {"engine_id": ENGINE, "endpoint": "tcp://127.0.0.1:0", "bind": True}
    async with DaemonRun(settings_for(db, source)) as run:
        with FaultPublisher(endpoint=run.daemon.sources[0].endpoint, bind=False) as pub:
            # replay endpoint learnt only now: hand it to the running source
            run.daemon.sources[0].config = run.daemon.sources[0].config.model_copy(
                update={"replay_endpoint": pub.replay_endpoint})
            for seq in range(20):
                pub.publish(seq, make(seq))
            await wait_until(lambda: run.daemon.stats.batches == 20, what="20 batches")
            stats = await run.stop()
    counts = ledger_counts(path)
    assert counts.engine_events == 20 * EVENTS_PER_BATCH == stats.events_applied
    assert counts.gaps() == {} and counts.bumps() == {}


async def test_resume_after_restart_replays_what_was_missed(tmp_path):
    db, path = migrated_db(tmp_path)
    make = PayloadMaker()
    with FaultPublisher() as pub:
        settings = settings_for(db, source_of(pub))
        async with DaemonRun(settings) as run:
            await subscribed(pub, run)
            for seq in range(20):
                pub.publish(seq, make(seq))
            await wait_until(lambda: run.daemon.stats.batches == 20, what="first 20")
            await run.stop()
        for seq in range(20, 40):  # while no consumer runs
            pub.publish(seq, make(seq))
        async with DaemonRun(settings) as run:
            await wait_until(lambda: run.daemon.stats.batches == 20, what="20 more, by resume replay")
            stats = await run.stop()
    counts = ledger_counts(path)
    assert counts.engine_events == 40 * EVENTS_PER_BATCH
    # seq 19 re-requested to prove continuity: its digest came with the ledger's position, so the
    # source drops the copy itself (it never reaches the ledger)
    assert stats.duplicate_batches == 0 and counts.batches == 40
    assert counts.gaps() == {} and counts.bumps() == {}


async def test_database_briefly_locked_is_retried(tmp_path, monkeypatch):
    import ledger.backends.sqlite

    monkeypatch.setattr(ledger.backends.sqlite, "SQLITE_BUSY_TIMEOUT_MS", 50)  # fail fast, so the retry path runs
    db, path = migrated_db(tmp_path)
    make = PayloadMaker()
    locker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    with FaultPublisher() as pub:
        async with DaemonRun(settings_for(db, source_of(pub), db_retry_max_s=0.2)) as run:
            await subscribed(pub, run)
            locker.execute("BEGIN IMMEDIATE")  # another writer holds the database ...
            for seq in range(60):
                pub.publish(seq, make(seq))
            await wait_until(lambda: run.daemon.stats.db_retries >= 1, what="a retry")
            locker.execute("COMMIT")  # ... until a retry was seen (a 1 s timer could let go before the first try)
            await wait_until(lambda: run.daemon.stats.batches == 60, what="60 batches after the lock")
            stats = await run.stop()
    locker.close()
    counts = ledger_counts(path)
    assert counts.engine_events == 60 * EVENTS_PER_BATCH == stats.events_applied
    assert run.metric("semkv_consumer_db_retries_total") >= 1
    assert counts.gaps() == {} and counts.bumps() == {}


async def test_backpressure_bounds_the_queue_and_loses_nothing(tmp_path):
    db, path = migrated_db(tmp_path)
    make = PayloadMaker()
    with FaultPublisher() as pub:
        settings = settings_for(db, source_of(pub), queue_max_batches=2, batch_max_events=EVENTS_PER_BATCH)
        async with DaemonRun(settings) as run:
            await subscribed(pub, run)
            for seq in range(300):
                pub.publish(seq, make(seq))
            await wait_until(lambda: run.daemon.stats.batches == 300, what="300 batches")
            stats = await run.stop()
    counts = ledger_counts(path)
    assert counts.engine_events == 300 * EVENTS_PER_BATCH == stats.events_applied
    assert run.metric("semkv_consumer_backpressure_total", engine_id=ENGINE) > 0
    assert stats.transactions >= 150  # one message per transaction: the queue never held more than 2


async def test_two_engines_one_daemon(tmp_path):
    db, path = migrated_db(tmp_path)
    with FaultPublisher() as a, FaultPublisher() as b:
        sources = [{"engine_id": "a", "endpoint": a.endpoint, "replay_endpoint": a.replay_endpoint},
                   {"engine_id": "b", "endpoint": b.endpoint, "replay_endpoint": b.replay_endpoint}]
        async with DaemonRun(settings_for(db, *sources)) as run:
            await asyncio.gather(subscribed(a), subscribed(b))
            make_a, make_b = PayloadMaker(run=0), PayloadMaker(run=1)
            for seq in range(25):
                a.publish(seq, make_a(seq))
                b.publish(seq, make_b(seq), send=seq != 7)
            await wait_until(lambda: run.daemon.stats.batches == 50, what="50 batches")
            await run.stop()
    assert ledger_counts(path, "a").engine_events == ledger_counts(path, "b").engine_events == 25 * EVENTS_PER_BATCH
    assert ledger_counts(path).bumps() == {}


async def test_late_batch_after_its_gap_was_declared_lost_is_logged_once(tmp_path):
    """Reordered beyond the replay buffer: 11 arrives after 15. Replay from 15 shows the same run (15's
    digest is known), so 11 is a late batch: logged once, never applied, nothing re-fed, and no
    generation bump for it (the consumer proved the engine did not restart)."""
    db, path = migrated_db(tmp_path)
    make = PayloadMaker()
    with FaultPublisher(buffer_steps=3) as pub:
        async with DaemonRun(settings_for(db, source_of(pub))) as run:
            await subscribed(pub, run)
            for seq in range(16):
                pub.publish(seq, make(seq), send=seq < 10 or seq == 15)
            await wait_until(lambda: run.daemon.stats.batches == 13, what="0..9, 13..15")
            pub.resend(11)
            await wait_until(lambda: run.daemon.stats.batches == 14, what="late 11")
            for seq in range(16, 20):
                pub.publish(seq, make(seq))
            await wait_until(lambda: run.daemon.stats.batches == 18, what="16..19")
            stats = await run.stop()
    counts = ledger_counts(path)
    assert counts.batches == 18 and counts.engine_events == 18 * EVENTS_PER_BATCH
    assert stats.events_applied == 17 * EVENTS_PER_BATCH and stats.events_stale == EVENTS_PER_BATCH
    conn = sqlite3.connect(path)
    seqs = [r[0] for r in conn.execute("SELECT zmq_seq FROM log WHERE kind = 'batch_received' ORDER BY seq")]
    late = {r[0] for r in conn.execute("SELECT DISTINCT applied FROM log WHERE zmq_seq = 11 AND batch_index >= 0")}
    conn.close()
    assert sorted(seqs) == sorted(set(seqs)) == [*range(10), 11, *range(13, 20)]
    assert late == {0}  # logged, not applied
    assert counts.bumps() == {"seq_gap": 1}  # the gap 10..12 only
    assert replay(db).equal


async def test_restart_hidden_behind_a_gap_is_found_by_replay(tmp_path):
    """The restarted engine's new run is past our last seq when we hear from it again (8 > 4 + 1):
    re-requesting seq 4 shows another digest, so the new run is replayed from 0 (one seq_reset)."""
    db, path = migrated_db(tmp_path)
    with FaultPublisher() as pub:
        async with DaemonRun(settings_for(db, source_of(pub))) as run:
            await subscribed(pub, run)
            make = PayloadMaker(run=0)
            for seq in range(5):
                pub.publish(seq, make(seq))
            await wait_until(lambda: run.daemon.stats.batches == 5, what="first run")
            pub.restart()
            make = PayloadMaker(run=1)
            for seq in range(10):
                pub.publish(seq, make(seq), send=seq >= 8)
            await wait_until(lambda: run.daemon.stats.batches == 15, what="second run, all of it")
            stats = await run.stop()
    counts = ledger_counts(path)
    assert counts.engine_events == 15 * EVENTS_PER_BATCH == stats.events_applied
    assert counts.bumps() == {"seq_reset": 1} and counts.gaps() == {}
    assert run.metric("semkv_consumer_engine_restarts_seen_total", engine_id=ENGINE) == 1
    assert replay(db).equal
