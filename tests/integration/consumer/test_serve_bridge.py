"""trtllm-serve bridge over real loopback HTTP and ZMQ: server -> ServeEventBridge -> SUB / DEALER / daemon.

The server is :class:`FakeTrtllmServe`: FastAPI + uvicorn on 127.0.0.1, as trtllm-serve itself, with
the handler of NVIDIA/TensorRT-LLM ``tensorrt_llm/serve/openai_server.py`` (``POST /kv_cache_events``
drains the engine's event queue, waiting a while for each next event, and answers
``JSONResponse(content=events)``). The events are TensorRT-LLM LLM-API dicts (reference/WIRE.md §A):
the examples of TensorRT-LLM's own tests and the newer shape of the reference harness's
``KvEventBuffer`` (``connector/harness/events.py``), under attention DP gathered from two ranks.
A script decides what each next request sees (which events enter the queue, which fault), so
batch boundaries and seqs are exact. Subscribers are synchronised by probe batches
(``sync_subscriber``) or read the replay buffer, never by sleeping.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import typer
import uvicorn
import zmq
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from typer.testing import CliRunner

from consumer.bridge import KvEventPublisher, group_by_dp_rank
from consumer.cli import register
from consumer.serve_bridge import ServeEventBridge
from tests.integration.consumer.daemon_support import DaemonRun, ledger_counts, migrated_db, settings_for, wait_until
from tests.integration.consumer.test_bridge import (
    BIG_HASHES,
    LOOPBACK,
    TrackingContext,
    dealer,
    replay,
    seq_of,
    subscribe,
    sync_subscriber,
)

FAST = {"poll_interval_s": 0.005, "min_backoff_s": 0.01, "max_backoff_s": 0.05, "timeout_s": 5.0}


# --------------------------------------------------------------------------------------------
# recorded TensorRT-LLM events
# --------------------------------------------------------------------------------------------


def wire_examples() -> list[dict[str, Any]]:
    """Events of TensorRT-LLM's own tests (reference/WIRE.md §A), as trtllm-serve's JSON carries them."""
    tok = [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in (1, 2860, 278)]
    return [
        {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [2231, 0]}},
        {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": [
            {"type": "stored_block", "block_hash": BIG_HASHES[0], "tokens": tok}]}},
        {"event_id": 4, "data": {"type": "stored", "parent_hash": BIG_HASHES[0], "blocks": [
            {"type": "stored_block", "block_hash": 10, "tokens": [{"token_id": 5, "token_extra_id": 0}]}]}},
        {"event_id": 7, "attention_dp_rank": 2, "data": {"type": "removed", "block_hashes": [1]}},
        {"event_id": 9, "data": {"type": "updated", "block_hash": 1}},
        {"event_id": 151, "data": {"type": "removed", "block_hashes": BIG_HASHES[1:]}},
    ]  # fmt: skip


def harness_events(steps: int, *, ranks: tuple[int | None, ...] = (None,)) -> list[list[dict[str, Any]]]:
    """``steps`` engine iterations in the newer 2026 shape, field for field as the reference harness's
    ``KvEventBuffer`` emits them (``connector/harness/events.py``; not imported here: its package
    pulls in torch): ``created``, then per iteration a stored chain of two blocks (one hash >= 2**63),
    the previous iteration's first block removed and its second offloaded (``updated`` 0 -> 1).
    With several ranks, each iteration's events of every rank, gathered as rank 0 does under
    attention DP. Event ids count from 0 per rank."""
    next_id = dict.fromkeys(ranks, 0)

    def event(rank: int | None, data: dict[str, Any]) -> dict[str, Any]:
        ev: dict[str, Any] = {"event_id": next_id[rank], "data": data, "window_size": 64}
        next_id[rank] += 1
        if rank is not None:
            ev["attention_dp_rank"] = rank
        ev["layer_group_id"], ev["hash_algo"] = 0, "v1_block_key"
        return ev

    def block(h: int, first: int) -> dict[str, Any]:
        tokens = [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in range(first, first + 16)]
        return {"type": "stored_block", "block_hash": h, "tokens": tokens, "cache_level": 0, "priority": 35,
                "mm_keys": [], "cache_salt": None}

    out: list[list[dict[str, Any]]] = []
    for step in range(steps):
        gathered: list[dict[str, Any]] = []
        for r, rank in enumerate(ranks):
            if step == 0:
                gathered.append(event(rank, {"type": "created", "num_blocks_per_cache_level": [2231, 0]}))
            h1, h2 = 2**63 + 1000 * r + 2 * step, 1000 * r + 2 * step + 1
            chain = [block(h1, 0), block(h2, 16)]
            gathered.append(event(rank, {"type": "stored", "parent_hash": None, "blocks": chain}))
            if step:
                gathered.append(event(rank, {"type": "removed", "block_hashes": [h1 - 2]}))
                diff = {"type": "event_diff", "new_value": 1, "old_value": 0}
                gathered.append(event(rank, {"type": "updated", "block_hash": h2 - 2, "cache_level": diff,
                                             "priority": None}))
        out.append(gathered)
    return out


# --------------------------------------------------------------------------------------------
# the server
# --------------------------------------------------------------------------------------------


@dataclass
class Step:
    """What one request sees: ``events`` enter the engine's queue when it arrives; ``fault``:
    None (200 + JSON list), ``no_queue`` (500 before draining: trtllm-serve before its first
    generation request), ``drained_500`` (500 after draining), ``malformed`` (200, the JSON cut
    short), ``not_a_list`` (200, a JSON object), ``not_found`` (404, no handler ran), ``slow``
    (drains, then answers after ``slow_s``)."""

    events: list[dict[str, Any]] = field(default_factory=list)
    fault: str | None = None
    slow_s: float = 0.0


class FakeTrtllmServe:
    """``POST /kv_cache_events`` of trtllm-serve on a real socket (see the module docstring).

    ``queue`` is the engine's pending events; ``script`` the next requests' :class:`Step` s (when
    empty, a request drains whatever is queued). ``wait_s`` stands for trtllm-serve's 2 s wait
    for each next event. The socket is bound at construction and listens only from :meth:`start`:
    until then connecting is refused.
    """

    def __init__(self, wait_s: float = 0.02) -> None:
        self.queue: deque[dict[str, Any]] = deque()
        self.script: deque[Step] = deque()
        self.wait_s = wait_s
        self.requests = 0
        self.responses: list[tuple[int, list[dict[str, Any]]]] = []  # (status, events drained)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        app = FastAPI()
        app.add_api_route("/kv_cache_events", self._kv_cache_events, methods=["POST"])
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    async def _kv_cache_events(self) -> Response:
        self.requests += 1
        step = self.script.popleft() if self.script else Step()
        self.queue.extend(step.events)  # the engine queued these by now, whatever this request meets
        if step.fault == "not_found":
            self.responses.append((404, []))
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        if step.fault == "no_queue":  # GenerationExecutor.aget_kv_events asserts: Starlette answers 500
            self.responses.append((500, []))
            return Response("Internal Server Error", status_code=500, media_type="text/plain")
        events: list[dict[str, Any]] = []
        while True:  # IterationResult.__anext__: the next event, or wait_s without one ends the drain
            deadline = time.monotonic() + self.wait_s
            while not self.queue and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            if not self.queue:
                break
            events.append(self.queue.popleft())
        if step.fault == "slow":  # until slow_s passed or the test is over
            deadline = time.monotonic() + step.slow_s
            while time.monotonic() < deadline and not self._closing.is_set():
                await asyncio.sleep(0.01)
        status = 500 if step.fault == "drained_500" else 200
        self.responses.append((status, events))
        if step.fault == "drained_500":
            return Response("Internal Server Error", status_code=500, media_type="text/plain")
        if step.fault == "malformed":
            return Response(json.dumps(events)[:-1], media_type="application/json")
        if step.fault == "not_a_list":
            return JSONResponse({"events": events})
        return JSONResponse(content=events)

    def start(self) -> FakeTrtllmServe:
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        return self

    def close(self) -> None:
        self._closing.set()
        if self._thread is not None:
            self._server.should_exit = True
            self._thread.join(10)
        self.sock.close()


def wait_for(predicate: Any, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture
def server() -> Iterator[FakeTrtllmServe]:
    srv = FakeTrtllmServe()
    yield srv
    srv.close()


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = TrackingContext()
    yield context
    for sock in context.opened:
        sock.close(linger=0)
    context.term()


@pytest.fixture
def publisher() -> Iterator[KvEventPublisher]:
    pub = KvEventPublisher(LOOPBACK, LOOPBACK)
    yield pub
    pub.close()  # idempotent: most tests' bridges closed it already


def batches_of(steps: list[Step]) -> list[tuple[int | None, list[dict[str, Any]]]]:
    """The batches the bridge must publish for the successful steps, in order."""
    return [group for step in steps for group in group_by_dp_rank(step.events)]


def assert_batches(received: list[list[bytes]], expected: list[tuple[int | None, list[dict[str, Any]]]]) -> None:
    for frames, (rank, events) in zip(received, expected, strict=True):
        assert frames[0] == b"kv" and len(frames) == 3
        ts, decoded_events, decoded_rank = msgspec.msgpack.decode(frames[2])
        assert isinstance(ts, float) and decoded_events == events and decoded_rank == rank


# --------------------------------------------------------------------------------------------
# the bridge
# --------------------------------------------------------------------------------------------


def test_served_events_reach_a_subscriber_in_order_with_the_engine_framing(
    ctx: zmq.Context, server: FakeTrtllmServe, publisher: KvEventPublisher
) -> None:
    steps = [Step(wire_examples()), *(Step(events) for events in harness_events(3, ranks=(0, 1)))]
    server.script.extend(steps)
    sub = subscribe(ctx, publisher.endpoint)
    probes = sync_subscriber(publisher, sub)
    server.start()
    expected = batches_of(steps)
    assert [rank for rank, _ in expected] == [None, 2, 0, 1, 0, 1, 0, 1]  # one batch per attention-DP rank

    bridge = ServeEventBridge(server.url, publisher, close_publisher=False, **FAST).start()
    received = [sub.recv_multipart() for _ in expected]
    bridge.close()

    assert [seq_of(f) for f in received] == list(range(probes, probes + len(expected)))
    assert_batches(received, expected)
    payloads = b"".join(f[2] for f in received)
    for big in [*BIG_HASHES, 2**63 + 1000]:
        assert b"\xcf" + big.to_bytes(8, "big") in payloads  # exact through JSON, then msgpack uint64
    # what the server drained, response by response, is exactly what was published
    served = [events for status, events in server.responses if events]
    assert [group for events in served for group in group_by_dp_rank(events)] == expected
    stats = bridge.stats()
    assert (stats.events_seen, stats.batches_published) == (sum(len(s.events) for s in steps), len(expected))
    assert (stats.poll_errors, stats.seq_gaps_marked) == (0, 0) and stats.polls_ok == stats.polls == server.requests
    assert publisher.stats().published == probes + len(expected)


def test_refused_500_and_malformed_responses_are_survived_counted_and_leave_gaps(
    ctx: zmq.Context, server: FakeTrtllmServe, publisher: KvEventPublisher
) -> None:
    sub = subscribe(ctx, publisher.endpoint)
    p = sync_subscriber(publisher, sub)
    bridge = ServeEventBridge(server.url, publisher, **FAST).start()
    wait_for(lambda: bridge.stats().connect_errors >= 3, "connection refused, retried")  # not listening yet
    assert publisher.stats().next_seq == p  # nothing was sent, so nothing can be lost: no gap

    runs = harness_events(8)
    good = [Step(runs[1]), Step(runs[5]), Step(runs[6]), Step(runs[7])]
    server.script.extend([
        Step(fault="no_queue"),                # 500 before any 200: no event queue yet, nothing drained
        Step(runs[0], fault="not_found"),      # 404: no handler ran; these events stay queued...
        good[0],                               # ...and come with runs[1] in the first 200
        Step(runs[2], fault="malformed"),      # drained, lost: one seq marked lost
        Step(runs[3], fault="drained_500"),    # lost too, same run of failures: no second gap
        Step(runs[4], fault="not_a_list"),     # lost too
        good[1],
        Step([], fault="malformed"),           # a lost empty drain still counts: a second gap
        good[2], good[3],
    ])  # fmt: skip
    server.start()
    expected = [group_by_dp_rank(runs[0] + runs[1])[0], *batches_of(good[1:])]
    received = [sub.recv_multipart() for _ in expected]
    assert [seq_of(f) for f in received] == [p, p + 2, p + 4, p + 5]  # the two gaps are visible
    assert_batches(received, expected)
    wait_for(lambda: not server.script, "the script to be served")
    # replay shows the same gaps: the lost seqs were never buffered
    assert replay(dealer(ctx, publisher.replay_endpoint), p) == received
    bridge.close()

    stats = bridge.stats()
    assert stats.connect_errors >= 3
    assert (stats.http_errors, stats.status_codes, stats.decode_errors, stats.transport_errors) == (
        3, {500: 2, 404: 1}, 3, 0)
    assert stats.poll_errors == stats.connect_errors + 6
    assert (stats.polls_lost, stats.seq_gaps_marked) == (4, 2)
    pub_stats = publisher.stats()
    assert (pub_stats.lost_upstream, pub_stats.published, pub_stats.next_seq) == (2, p + 4, p + 6)


def test_a_response_slower_than_the_timeout_is_counted_lost(
    ctx: zmq.Context, server: FakeTrtllmServe, publisher: KvEventPublisher
) -> None:
    runs = harness_events(3)
    server.script.extend([Step(runs[0]), Step(runs[1], fault="slow", slow_s=60), Step(runs[2])])
    sub = subscribe(ctx, publisher.endpoint)
    p = sync_subscriber(publisher, sub)
    server.start()
    bridge = ServeEventBridge(server.url, publisher, **{**FAST, "timeout_s": 1.0}).start()
    received = [sub.recv_multipart() for _ in range(2)]
    bridge.close()
    assert [seq_of(f) for f in received] == [p, p + 2]
    assert_batches(received, [(None, runs[0]), (None, runs[2])])
    stats = bridge.stats()
    assert (stats.transport_errors, stats.polls_lost, stats.seq_gaps_marked, stats.http_errors) == (1, 1, 1, 0)


def test_close_drains_the_server_and_flushes(
    ctx: zmq.Context, server: FakeTrtllmServe, publisher: KvEventPublisher
) -> None:
    sub = subscribe(ctx, publisher.endpoint)
    p = sync_subscriber(publisher, sub)
    server.start()
    # a long interval: after its first poll the bridge only polls again because close() asks it to
    bridge = ServeEventBridge(server.url, publisher, **{**FAST, "poll_interval_s": 60.0}).start()
    wait_for(lambda: bridge.stats().polls_ok == 1, "the first poll")
    events = harness_events(2)
    server.queue.extend(events[0] + events[1])  # queued by the engine after the last regular poll
    started = time.monotonic()
    bridge.close()
    assert time.monotonic() - started < 5
    assert server.requests == 3  # the final drain: one poll with the events, one that found none
    frames = sub.recv_multipart()
    assert seq_of(frames) == p
    assert_batches([frames], [(None, events[0] + events[1])])
    assert publisher.stats().published == p + 1
    with pytest.raises(RuntimeError):  # close() closed the publisher too (close_publisher defaults to True)
        publisher.publish([])
    bridge.close()  # idempotent


def test_bad_urls_are_refused_up_front() -> None:
    with KvEventPublisher(LOOPBACK, None) as publisher:
        for url in ("127.0.0.1:8000", "ftp://127.0.0.1:8000", "http://"):
            with pytest.raises(ValueError):
                ServeEventBridge(url, publisher)
        bridge = ServeEventBridge("http://127.0.0.1:8000/", publisher, close_publisher=False)
        assert bridge.events_url == "http://127.0.0.1:8000/kv_cache_events"
        bridge.close()  # never started: closes its HTTP client, leaves the publisher open


# --------------------------------------------------------------------------------------------
# the real consumer daemon
# --------------------------------------------------------------------------------------------


async def test_the_daemon_ingests_served_events_and_records_a_lost_response(
    tmp_path, server: FakeTrtllmServe, publisher: KvEventPublisher
) -> None:
    db, path = migrated_db(tmp_path)
    runs = harness_events(4)
    server.script.extend([Step(runs[0]), Step(runs[1]), Step(runs[2], fault="malformed"), Step(runs[3])])
    source = {"engine_id": "trtllm-serve-0", "endpoint": publisher.endpoint,
              "replay_endpoint": publisher.replay_endpoint}
    bridge = ServeEventBridge(server.url, publisher, **FAST)
    server.start()
    try:
        async with DaemonRun(settings_for(db, source)) as run:
            bridge.start()  # a late subscription is no loss: the daemon replays what its SUB missed
            await wait_until(lambda: run.daemon.stats.batches == 3, 30, "3 batches")
            stats = await run.stop()
    finally:
        await asyncio.to_thread(bridge.close)
    counts = ledger_counts(path)
    delivered = len(runs[0]) + len(runs[1]) + len(runs[3])
    assert counts.engine_events == delivered == stats.events_applied
    assert counts.batches == 3 and counts.dead_letters == 0
    # the lost response: a seq gap replay could not fill, a generation bump, the older blocks quarantined
    assert counts.gaps() == {"seq_gap": 1} and counts.bumps() == {"seq_gap": 1}
    assert counts.block_states.get("quarantined", 0) > 0
    assert bridge.stats().seq_gaps_marked == 1


# --------------------------------------------------------------------------------------------
# semkv-ledger bridge-serve
# --------------------------------------------------------------------------------------------


def _cli_app() -> typer.Typer:
    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    return app


def test_cli_help_and_the_non_loopback_warning() -> None:
    result = CliRunner().invoke(_cli_app(), ["bridge-serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for option in ["--url", "--endpoint", "--replay-endpoint", "--poll-interval-s", "--http-timeout-s", "--bind",
                   "--connect", "--curve-secret-key", "--curve-subscriber-keys"]:  # fmt: skip
        assert option in result.output
    assert "tcp://127.0.0.1:5557" in result.output and "tcp://127.0.0.1:5558" in result.output  # loopback by default
    # an exposed bind warns like `publish` (then the bad URL stops it before anything is bound)
    result = CliRunner().invoke(_cli_app(), ["bridge-serve", "--endpoint", "tcp://0.0.0.0:5557", "--url", "ftp://x"])
    assert result.exit_code == 2
    assert "warning: bridge-serve's PUB binds tcp://0.0.0.0:5557 (not loopback) without CURVE" in result.output
    result = CliRunner().invoke(_cli_app(), ["bridge-serve", "--curve-secret-key", "x.key_secret"])
    assert result.exit_code == 2 and "go together" in result.output


def test_cli_republishes_until_sigterm(ctx: zmq.Context, server: FakeTrtllmServe) -> None:
    runs = harness_events(2)
    server.script.extend([Step(fault="no_queue"), Step(runs[0]), Step(runs[1])])
    server.start()
    args = [sys.executable, "-m", "ledger", "bridge-serve", "--url", server.url, "--endpoint", LOOPBACK,
            "--replay-endpoint", LOOPBACK, "--poll-interval-s", "0.01"]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert ready["event"] == "bridge_serve.ready" and ready["url"] == server.url + "/kv_cache_events"
        wait_for(lambda: not server.script and len([r for r in server.responses if r[1]]) == 2, "the script")
        # replay, not a SUB: the batches are in the bridge's buffer whenever a subscriber joins
        req = dealer(ctx, ready["replay_endpoint"])
        wait_for(lambda: len(replay(req, 0)) == 2, "both batches published")
        batches = replay(req, 0)
        assert [seq_of(f) for f in batches] == [0, 1]
        assert_batches(batches, [(None, runs[0]), (None, runs[1])])
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["event"] == "bridge_serve.report"
    assert (report["events_seen"], report["batches_published"], report["http_errors"]) == (
        len(runs[0]) + len(runs[1]), 2, 1)
    assert report["seq_gaps_marked"] == 0 and report["publisher"]["published"] == 2
    assert '"event": "serve_bridge.poll_failed"' in err  # JSON log lines on stderr
