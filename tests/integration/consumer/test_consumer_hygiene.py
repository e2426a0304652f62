"""Small hardening of ``consume`` (issue #18, defect 7), each with a real daemon, real ZMQ on
127.0.0.1 and a real SQLite ledger:

* the ``--record`` capture holds prompt token ids: mode 0600 under the default umask 022, like the
  ledger, also when appending to a file created wider;
* ``--topic kv`` takes topic ``kv`` only: ZMQ's SUBSCRIBE is a prefix match, so ``kvX`` reaches the
  SUB; it is dropped and counted, never recorded, dead-lettered or logged;
* a metrics server bound off loopback logs a warning, as sources bound off loopback do.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from consumer.capture import CaptureWriter, read_capture
from tests.integration.consumer.daemon_support import (
    DaemonRun,
    FaultPublisher,
    PayloadMaker,
    ledger_counts,
    migrated_db,
    settings_for,
    subscribed,
    wait_until,
)

ENGINE = "trt-0"


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.usefixtures("umask_022")
@pytest.mark.parametrize("append", [False, True])
def test_a_capture_is_0600_whatever_the_umask_new_or_existing(tmp_path, append):
    new = tmp_path / "new.bin"
    with CaptureWriter(new, append=append) as writer:
        writer.write([b"kv", b"\0" * 8, b"payload"], 1)
    assert mode(new) == 0o600
    old = tmp_path / "old.bin"
    with CaptureWriter(old) as writer:
        writer.write([b"kv", b"\0" * 8, b"first"], 1)
    old.chmod(0o644)  # as an older release left it
    with CaptureWriter(old, append=append) as writer:
        writer.write([b"kv", b"\0" * 8, b"second"], 2)
    assert mode(old) == 0o600
    assert [m.frames[2] for m in read_capture(old)] == ([b"first", b"second"] if append else [b"second"])


@pytest.mark.usefixtures("umask_022")
async def test_the_daemons_record_file_is_0600(tmp_path):
    db, _ = migrated_db(tmp_path)
    capture = tmp_path / "capture.bin"
    make = PayloadMaker()
    with FaultPublisher(replay=False) as pub:
        source = {"engine_id": ENGINE, "endpoint": pub.endpoint}
        async with DaemonRun(settings_for(db, source, record=str(capture))) as run:
            await subscribed(pub)
            for seq in range(3):
                pub.publish(seq, make(seq))
            await wait_until(lambda: run.daemon.stats.batches == 3, what="3 batches")
            await run.stop()
    assert mode(capture) == 0o600
    assert len(list(read_capture(capture))) == 3


async def test_a_longer_topic_that_the_prefix_match_lets_through_is_dropped_silently(tmp_path):
    db, path = migrated_db(tmp_path)
    make = PayloadMaker()
    with structlog.testing.capture_logs() as logs, FaultPublisher(replay=False, topic=b"kv") as pub:
        source = {"engine_id": ENGINE, "endpoint": pub.endpoint, "topic": "kv"}
        async with DaemonRun(settings_for(db, source)) as run:
            await subscribed(pub)
            before = len(logs)
            for seq in range(5):  # another engine's stream on the same endpoint, valid in every other way
                pub.send_raw([b"kvX", seq.to_bytes(8, "big"), make(seq)])
            await wait_until(lambda: run.metric("semkv_consumer_foreign_topic_dropped_total", engine_id=ENGINE) == 5,
                             what="5 foreign messages dropped")
            assert logs[before:] == []  # nothing logged for them
            for seq in range(3):
                pub.publish(seq, make(seq))  # topic kv: this source's
            await wait_until(lambda: run.daemon.stats.batches == 3, what="3 batches")
            stats = await run.stop()
    counts = ledger_counts(path)
    assert counts.batches == 3 == stats.batches and counts.dead_letters == 0
    assert run.metric("semkv_consumer_messages_received_total", engine_id=ENGINE) == 3
    assert run.metric("semkv_consumer_foreign_topic_dropped_total", engine_id=ENGINE) == 5


async def test_the_empty_topic_still_takes_every_topic(tmp_path):
    """vLLM's default topic is "": a source left at "" records what its engine publishes on any topic."""
    db, path = migrated_db(tmp_path)
    make = PayloadMaker()
    with FaultPublisher(replay=False, topic=b"kv@engine-7") as pub:
        source = {"engine_id": ENGINE, "endpoint": pub.endpoint}
        async with DaemonRun(settings_for(db, source)) as run:
            await subscribed(pub)
            for seq in range(3):
                pub.publish(seq, make(seq))
            await wait_until(lambda: run.daemon.stats.batches == 3, what="3 batches")
            await run.stop()
    assert ledger_counts(path).batches == 3
    assert run.metric("semkv_consumer_foreign_topic_dropped_total", engine_id=ENGINE) == 0


@pytest.mark.parametrize(("host", "warned"), [("0.0.0.0", True), ("127.0.0.1", False)])
async def test_a_metrics_server_off_loopback_is_logged_as_exposed(tmp_path, host, warned):
    db, _ = migrated_db(tmp_path)
    with structlog.testing.capture_logs() as logs, FaultPublisher(replay=False) as pub:
        source = {"engine_id": ENGINE, "endpoint": pub.endpoint}
        async with DaemonRun(settings_for(db, source, metrics_port=0, metrics_host=host)) as run:
            port = run.daemon.metrics_port
            await run.stop()
    exposed = [e for e in logs if e["event"] == "metrics.exposed"]
    if not warned:
        assert exposed == []
        return
    [event] = exposed
    assert event["log_level"] == "warning" and event["host"] == host and event["port"] == port
    assert f"listens on {host}:{port} (not loopback)" in event["message"]
    assert "/metrics and /healthz" in event["message"]


async def test_a_daemon_without_sources_stops_cleanly(tmp_path):
    """The CLI refuses a consumer with no source, but the ``Daemon`` API takes one (an embedding
    that adds none): its stop waited on the empty set of source tasks and raised ValueError."""
    db, _ = migrated_db(tmp_path)
    settings = settings_for(db, {"engine_id": ENGINE, "endpoint": "tcp://127.0.0.1:1"}).model_copy(
        update={"sources": []})
    async with DaemonRun(settings) as run:
        stats = await run.stop()
    assert stats.clean_exit


async def test_a_replay_endpoint_that_stopped_answering_is_logged_once_a_minute_not_per_probe(tmp_path):
    """A stopped engine's replay ROUTER times out at every idle probe (~2.5 s with the defaults: 241
    warnings in 25 minutes, seen by a newcomer). The first timeout is logged, later ones at most once
    per REPLAY_TIMEOUT_LOG_EVERY_S with the count in a row; an answer again is logged once."""
    import asyncio
    import threading

    import zmq

    from consumer.bridge import ReplayBuffer, ReplayStats, serve_replay_request

    db, _ = migrated_db(tmp_path)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    answering, stop = threading.Event(), threading.Event()

    def serve() -> None:  # drops every request until ``answering``, then answers: nothing buffered, the end marker
        while not stop.is_set():
            if router.poll(10):
                if answering.is_set():
                    serve_replay_request(router, ReplayBuffer(8), ReplayStats())
                else:
                    router.recv_multipart()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with structlog.testing.capture_logs() as logs, FaultPublisher(replay=False) as pub:
            source = {"engine_id": ENGINE, "endpoint": pub.endpoint, "replay_endpoint": f"tcp://127.0.0.1:{port}"}
            async with DaemonRun(settings_for(db, source, replay_timeout_s=0.05, idle_replay_s=0.05)) as run:
                probes = lambda: run.metric("semkv_consumer_replay_probes_total", engine_id=ENGINE)  # noqa: E731
                await wait_until(lambda: probes() >= 5, 20, "five probes")
                timeouts = [e for e in logs if e["event"] == "source.replay_timeout"]
                assert len(timeouts) == 1 and timeouts[0]["in_a_row"] == 1, timeouts
                answering.set()
                await wait_until(lambda: any(e["event"] == "source.replay_answered" for e in logs), 20, "an answer")
                [answered] = [e for e in logs if e["event"] == "source.replay_answered"]
                assert answered["after_timeouts"] >= 5
                await run.stop()
    finally:
        stop.set()
        thread.join()
        router.close()
        ctx.term()
