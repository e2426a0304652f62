"""Resume after an engine restart nobody saw (issue #18, defect 2), over real loopback ZMQ.

The ledger's last seq is 108; the engine (our publisher, ``consumer.bridge.KvEventPublisher``, with
its replay buffer) restarts and publishes past 108 while no consumer runs. On start the consumer
asks replay for seq 108: the new run's 108 has another digest than the batch the ledger logged
there (carried in ``SourcePosition.last_digest``), so the new run is replayed from 0 and logged
whole, in a new source epoch. Before the fix the new run's 108 was passed on as the ledger's own
last batch, the ledger bumped the epoch there and the new run's seqs 0..107 stayed in the
engine's buffer, never asked for, with no gap recorded. A variant: the buffer no longer holds the
new run's first batches, which the ledger records as a gap.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
import zmq
from sqlalchemy import func, select

from consumer.bridge import KvEventPublisher
from ledger import events as ev
from ledger.db import sync_engine
from ledger.replay import replay
from ledger.schema import CounterRow, LogRow
from tests.engine_runs import EngineRun
from tests.integration.consumer.daemon_support import DaemonRun, settings_for, wait_until

ENGINE = "trt-0"
EVENTS_PER_BATCH = 4
OLD_LAST_SEQ, NEW_RUN_BATCHES = 108, 120
_LOG = LogRow.__table__


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db(request) -> str:
    return request.getfixturevalue("sqlite_db" if request.param == "sqlite" else "postgres_db")


def publish_run(pub: KvEventPublisher, run: int, batches: int) -> None:
    engine = EngineRun("trt")
    for seq in range(batches):
        hashes = [hash((run, seq, i)) % 2**64 for i in range(EVENTS_PER_BATCH)]
        pub.publish(engine.events(("stored", hashes[:1]), ("stored", hashes[1:2]), ("stored", hashes[2:3]),
                                  ("removed", hashes[:1])))
    assert pub.flush(10)


def restarted(endpoint: str, replay_endpoint: str, **options) -> KvEventPublisher:
    """The engine again, on the ports its previous run bound (retried while the OS frees them)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return KvEventPublisher(endpoint, replay_endpoint, topic=b"kv", **options)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def logged(db: str) -> tuple[Counter, Counter, dict[str, int], list[tuple[int, int]]]:
    """Batch rows per (epoch, seq), engine event rows per (epoch, seq), counters, gaps (expected, got)."""
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            batches = Counter(tuple(r) for r in conn.execute(
                select(_LOG.c.source_epoch, _LOG.c.zmq_seq).where(_LOG.c.kind == "batch_received")))
            events = Counter({(r[0], r[1]): r[2] for r in conn.execute(
                select(_LOG.c.source_epoch, _LOG.c.zmq_seq, func.count()).where(_LOG.c.batch_index >= 0)
                .group_by(_LOG.c.source_epoch, _LOG.c.zmq_seq))})
            counters = {r[0]: r[1] for r in conn.execute(select(CounterRow.name, func.sum(CounterRow.value))
                                                          .group_by(CounterRow.name))}
            gaps = [ev.BODY_DECODER.decode(bytes(r[0])) for r in conn.execute(
                select(_LOG.c.body).where(_LOG.c.kind == "gap_detected").order_by(_LOG.c.seq))]
    finally:
        engine.dispose()
    return batches, events, counters, [(g.expected, g.got) for g in gaps]


async def consume(db: str, pub: KvEventPublisher, batches: int) -> None:
    source = {"engine_id": ENGINE, "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint}
    async with DaemonRun(settings_for(db, source)) as run:
        await wait_until(lambda: run.daemon.stats.batches >= batches, 20, f"{batches} batches")
        stats = await run.stop()
    assert stats.batches == batches and stats.clean_exit


@pytest.mark.parametrize("new_run_buffer", [10_000, 100], ids=["buffer-holds-the-new-run", "buffer-dropped-its-start"])
async def test_restart_while_the_consumer_is_down_logs_the_new_run_once(db, new_run_buffer):
    first = KvEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic=b"kv")
    endpoints = (first.endpoint, first.replay_endpoint)
    try:
        publish_run(first, run=0, batches=OLD_LAST_SEQ + 1)  # buffered; the start-up probe fetches it
        await consume(db, first, OLD_LAST_SEQ + 1)
    finally:
        first.close()
    # The engine restarts and publishes past the ledger's last seq while no consumer runs.
    second = restarted(*endpoints, buffer_steps=new_run_buffer)
    try:
        publish_run(second, run=1, batches=NEW_RUN_BATCHES)
        kept = min(NEW_RUN_BATCHES, new_run_buffer)
        await consume(db, second, kept)
    finally:
        second.close()

    batches, events, counters, gaps = logged(db)
    first_kept = NEW_RUN_BATCHES - kept
    assert batches == Counter({**{(1, s): 1 for s in range(OLD_LAST_SEQ + 1)},
                               **{(2, s): 1 for s in range(first_kept, NEW_RUN_BATCHES)}})
    # every event of the new run that its buffer held: logged exactly once, in the new epoch
    assert events == Counter({key: EVENTS_PER_BATCH for key in batches})
    assert counters["generation_bumps.seq_reset"] == 1
    if first_kept:
        assert gaps == [(0, first_kept)] and counters["gaps.seq_gap"] == 1  # what the buffer no longer held
    else:
        assert gaps == [] and not any(name.startswith("gaps.") for name in counters)
    report = replay(db)
    assert report.equal, [(d.table, d.totals) for d in report.diffs if d.count]
