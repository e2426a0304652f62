"""An engine that restarts and stays idle is seen by the idle probe (issue #22), over real loopback ZMQ.

A restarted vLLM or Dynamo worker starts again at seq 0 and answers a replay request for the old
position with the end marker only. The consumer's idle probe re-requests the last seq it passed on
(whose digest it knows): the engine's buffer always holds its newest batch, so an answer with
nothing at all proves the restart, and the generation is bumped within 2 s with the default
settings, once (the new run's first batch opens the new source epoch without a second bump).
An idle engine that did not restart answers every probe with the batch it holds there, and is
never bumped; a replay endpoint that never answers proves nothing and the consumer stays up.

Every dialect the consumer decodes: TensorRT-LLM LLM-API dicts with replies ``[topic, seq8,
payload]``, Dynamo's maps and vLLM's positional arrays with replies ``[seq8, payload]``.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest
import zmq

from consumer.settings import ConsumerSettings
from ledger.replay import replay
from tests.engine_runs import EngineRun
from tests.integration.consumer.daemon_support import (DaemonRun, FaultPublisher, ledger_counts, migrated_db,
                                                       read_rows, settings_for, subscribed, wait_until)

ENGINE = "worker-0"
DEFAULTS = {name: ConsumerSettings.model_fields[name].default for name in ("idle_replay_s", "replay_timeout_s")}
# (EngineRun dialect, replies carry the topic frame)
DIALECTS = {"tensorrt-llm": ("trt", True), "dynamo": ("vllm", False), "vllm": ("vllm-array", False)}


@pytest.fixture(params=list(DIALECTS))
def dialect(request) -> tuple[str, bool]:
    return DIALECTS[request.param]


def engine_row(path: Path) -> tuple[int, str]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT generation, status FROM engines WHERE engine_id = ?", (ENGINE,)).fetchone()
    finally:
        conn.close()


def live_blocks(path: Path) -> int:
    return ledger_counts(path, ENGINE).block_states.get("live", 0)


def publish(pub: FaultPublisher, run: EngineRun, batches: int, *, send: bool = True) -> None:
    for _ in range(batches):
        seq = run.next_seq
        hashes = [hash((id(run), seq, i)) % 2**63 for i in range(2)]
        pub.publish(seq, run.payload(("stored", hashes[:1]), ("stored", hashes[1:])), send=send)
        run.next_seq += 1


def source(pub: FaultPublisher, replay_endpoint: str | None = None) -> dict:
    return {"engine_id": ENGINE, "endpoint": pub.endpoint, "replay_endpoint": replay_endpoint or pub.replay_endpoint}


@pytest.mark.parametrize("unseen", [0, 2], ids=["new-run-silent", "new-run-published-unseen"])
async def test_an_idle_restart_bumps_the_generation_within_2_s_with_the_default_settings(tmp_path, dialect, unseen):
    kind, with_topic = dialect
    db, path = migrated_db(tmp_path)
    pub = FaultPublisher(replay_topic=with_topic)
    endpoints = (pub.endpoint, pub.replay_endpoint)
    settings = settings_for(db, source(pub), **DEFAULTS)
    async with DaemonRun(settings) as run:
        try:
            await subscribed(pub, run)
            publish(pub, EngineRun(kind), 5)
            await wait_until(lambda: run.daemon.stats.batches == 5, 10, "the first run")
            assert engine_row(path) == (1, "active") and live_blocks(path) == 10
        finally:
            pub.close()  # the worker stops (SIGTERM) ...
        await asyncio.sleep(0.3)
        # ... and comes back on the same ports, seq from 0, with nothing buffered of the old run
        pub = FaultPublisher(replay_topic=with_topic, endpoint=endpoints[0], replay_endpoint=endpoints[1])
        try:
            new_run = EngineRun(kind)
            publish(pub, new_run, unseen, send=False)  # published before the SUB reconnected: replay only
            back = time.monotonic()
            await wait_until(lambda: engine_row(path)[0] == 2, 5, "the generation bump")
            elapsed = time.monotonic() - back
            assert elapsed <= 2.0, f"the idle restart took {elapsed:.2f} s to be seen"
            assert live_blocks(path) == 2 * unseen  # the old run's blocks are not live any more
            await asyncio.to_thread(pub.wait_for_subscriber)
            publish(pub, new_run, 3)
            await wait_until(lambda: run.daemon.stats.batches == 5 + unseen + 3, 10, "the new run")
            await run.stop()
        finally:
            pub.close()
    counts = ledger_counts(path, ENGINE)
    assert counts.bumps() == {"seq_reset": 1}, counts.counters  # one restart, one bump
    assert engine_row(path) == (2, "active") and live_blocks(path) == 2 * (unseen + 3)
    assert run.metric("semkv_consumer_engine_restarts_seen_total", engine_id=ENGINE) == 1
    epochs = read_rows(path, "SELECT source_epoch, count(*) FROM log WHERE kind = 'batch_received' "
                             "GROUP BY source_epoch ORDER BY source_epoch")
    assert epochs == [(1, 5), (2, unseen + 3)]
    assert replay(db).equal


async def test_an_idle_engine_that_did_not_restart_is_never_bumped(tmp_path, dialect):
    kind, with_topic = dialect
    db, path = migrated_db(tmp_path)
    with FaultPublisher(replay_topic=with_topic) as pub:
        async with DaemonRun(settings_for(db, source(pub), idle_replay_s=0.02)) as run:
            await subscribed(pub, run)
            engine = EngineRun(kind)
            for _ in range(3):  # idle stretches between bursts: each ends on a batch the probes re-ask
                publish(pub, engine, 2)
                await wait_until(lambda: run.daemon.stats.batches == engine.next_seq, 10, "a burst")
                before = run.metric("semkv_consumer_replay_probes_total", engine_id=ENGINE)
                await wait_until(lambda: run.metric("semkv_consumer_replay_probes_total",
                                                    engine_id=ENGINE) >= before + 20, 20, "20 idle probes")
            stats = await run.stop()
    assert stats.generation_bumps == 0 and stats.batches == 6 and stats.duplicate_batches == 0
    assert engine_row(path) == (1, "active") and live_blocks(path) == 12
    assert ledger_counts(path, ENGINE).bumps() == {}
    assert run.metric("semkv_consumer_engine_restarts_seen_total", engine_id=ENGINE) == 0


async def test_a_replay_endpoint_that_never_answers_proves_nothing_and_the_consumer_stays_up(tmp_path, dialect):
    kind, _ = dialect
    db, path = migrated_db(tmp_path)
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # bound, never read: every replay request goes unanswered
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:0")
    try:
        with FaultPublisher(replay=False) as pub:
            settings = settings_for(db, source(pub, silent.getsockopt(zmq.LAST_ENDPOINT).decode()),
                                    idle_replay_s=0.05, replay_timeout_s=0.2)
            async with DaemonRun(settings) as run:
                await asyncio.to_thread(pub.wait_for_subscriber)
                engine = EngineRun(kind)
                for _ in range(4):  # live batches keep arriving between probes that time out
                    publish(pub, engine, 3)
                    await wait_until(lambda: run.daemon.stats.batches == engine.next_seq, 10, "live batches")
                    await asyncio.sleep(0.5)
                healthy, health = await run.daemon.health()
                probes = run.metric("semkv_consumer_replay_probes_total", engine_id=ENGINE)
                stats = await run.stop()
    finally:
        silent.close()
        ctx.term()
    assert healthy and health["sources"][f"{ENGINE}@{pub.endpoint}"]["alive"]
    assert probes >= 4  # the probes were made (each timed out after 0.2 s)
    assert stats.batches == 12 and stats.generation_bumps == 0
    assert engine_row(path) == (1, "active") and live_blocks(path) == 24
