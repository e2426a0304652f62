"""Publisher bridge over real loopback ZMQ: LlmEventBridge -> KvEventPublisher -> SUB / DEALER.

Synchronisation is by handshake, never by sleeping: :func:`sync_subscriber` publishes probe
batches until the SUB receives one. PUB->SUB delivery over one connection is complete and in
order from the first message a subscriber receives, so afterwards every count is exact; the
probes the SUB missed are still in the replay buffer.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from consumer.bridge import KvEventPublisher, LlmEventBridge, group_by_dp_rank, split_to_limits
from consumer.wire import WireLimits

LOOPBACK = "tcp://127.0.0.1:*"  # ephemeral port, read back from publisher.endpoint
END_MARKER = (-1).to_bytes(8, "big", signed=True)
RECV_TIMEOUT_MS = 5000  # a lost message fails the test instead of hanging it
BIG_HASHES = [9622824665191806685, 10385249491213107555, 12379813738877118345]  # > 2**63 (WIRE.md §A)


def _token(token_id: int) -> dict[str, Any]:
    return {"type": "unique_token", "token_id": token_id, "token_extra_id": 0}


# Three drains of TensorRT-LLM LLM-API event dicts (reference/WIRE.md §A); the last mixes two
# attention-DP ranks, so it must become two batches.
DRAINS: list[list[dict[str, Any]]] = [
    [
        {"event_id": 0, "window_size": 64, "data": {"type": "created", "num_blocks_per_cache_level": [2231, 0]}},
        {"event_id": 1, "window_size": 64, "data": {"type": "stored", "parent_hash": None, "blocks": [
            {"type": "stored_block", "block_hash": BIG_HASHES[0], "tokens": [_token(1), _token(2860), _token(278)],
             "cache_level": 0, "priority": 35}]}},
    ],
    [
        {"event_id": 4, "window_size": 64, "data": {"type": "stored", "parent_hash": BIG_HASHES[0], "blocks": [
            {"type": "stored_block", "block_hash": 10, "tokens": [{"token_id": 5, "token_extra_id": 0}]}]}},
        {"event_id": 9, "window_size": 64, "data": {"type": "updated", "block_hash": BIG_HASHES[0],
            "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0}, "priority": None}},
    ],
    [
        {"event_id": 7, "attention_dp_rank": 2, "window_size": 64,
         "data": {"type": "removed", "block_hashes": [1]}},
        {"event_id": 151, "attention_dp_rank": 0, "window_size": 64,
         "data": {"type": "removed", "block_hashes": BIG_HASHES[1:]}},
        {"event_id": 8, "attention_dp_rank": 2, "window_size": 64,
         "data": {"type": "removed", "block_hashes": [2**64 - 1]}},
    ],
]  # fmt: skip


class FakeLlm:
    """Stands in for ``tensorrt_llm.LLM``: ``get_kv_cache_events(timeout)`` drains a queue.

    Each :meth:`emit` is returned by exactly one call (the real LLM returns whatever accumulated),
    so the test knows the batch boundaries. ``fail_next`` makes the next call raise.
    """

    def __init__(self) -> None:
        self._drains: queue.Queue[list[dict[str, Any]]] = queue.Queue()
        self.fail_next = 0
        self.calls = 0

    def emit(self, events: list[dict[str, Any]]) -> None:
        self._drains.put(events)

    def get_kv_cache_events(self, timeout: float | None = 2) -> list[dict[str, Any]]:
        self.calls += 1
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("executor is shutting down")
        try:
            return self._drains.get(timeout=timeout) if timeout else self._drains.get_nowait()
        except queue.Empty:
            return []


class TrackingContext(zmq.Context):
    """Keeps every socket alive until teardown closes it (no GC of sockets mid-test)."""

    opened: list[zmq.Socket]  # declared on the class: pyzmq maps unknown attributes to socket options

    def __init__(self) -> None:
        super().__init__()
        self.opened: list[zmq.Socket] = []

    def socket(self, socket_type: int, **kwargs: Any) -> zmq.Socket:  # type: ignore[override]
        sock = super().socket(socket_type, **kwargs)
        self.opened.append(sock)
        return sock


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = TrackingContext()
    yield context
    for sock in context.opened:
        sock.close(linger=0)
    context.term()


@pytest.fixture
def publisher() -> Iterator[KvEventPublisher]:
    pub = KvEventPublisher(LOOPBACK, LOOPBACK, topic=b"kv")
    yield pub
    pub.close()


def subscribe(ctx: zmq.Context, endpoint: str, topic: bytes = b"kv") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    sock.connect(endpoint)
    return sock


def seq_of(frames: list[bytes]) -> int:
    return int.from_bytes(frames[1], "big")


def sync_subscriber(publisher: KvEventPublisher, sub: zmq.Socket) -> int:
    """Publish probe batches until ``sub`` gets one; drain the rest; return how many were sent."""
    probes = 0
    while True:
        publisher.publish([{"probe": probes}])
        probes += 1
        if sub.poll(50):
            break
        assert probes < 100, "subscriber never connected"
    first = seq_of(sub.recv_multipart())
    for expected in range(first + 1, probes):
        assert seq_of(sub.recv_multipart()) == expected
    return probes


def replay(sock: zmq.Socket, start_seq: int) -> list[list[bytes]]:
    """DEALER replay request; returns the batches (envelope stripped) before the end marker."""
    sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
    batches = []
    while True:
        frames = sock.recv_multipart()
        assert frames[0] == b""
        if frames[2] == END_MARKER:
            assert frames[1:] == [b"", END_MARKER, b""]
            return batches
        batches.append(frames[1:])


def test_llm_events_reach_a_subscriber_once_in_order_byte_exact(
    ctx: zmq.Context, publisher: KvEventPublisher
) -> None:
    sub = subscribe(ctx, publisher.endpoint)
    probes = sync_subscriber(publisher, sub)
    llm = FakeLlm()
    for drain in DRAINS:
        llm.emit(drain)
    expected = [group for drain in DRAINS for group in group_by_dp_rank(drain)]
    assert [rank for rank, _ in expected] == [None, None, 2, 0]

    bridge = LlmEventBridge(llm, publisher, poll_timeout_s=0.01, close_publisher=False).start()
    received = [sub.recv_multipart() for _ in expected]
    bridge.close()

    assert [seq_of(f) for f in received] == list(range(probes, probes + len(expected)))
    for frames, (rank, events) in zip(received, expected, strict=True):
        assert frames[0] == b"kv" and len(frames) == 3
        ts, decoded_events, decoded_rank = msgspec.msgpack.decode(frames[2])
        assert isinstance(ts, float)
        assert decoded_events == events and decoded_rank == rank
        # re-encoding the decoded value reproduces the payload: nothing was coerced on the way
        assert msgspec.msgpack.encode([ts, decoded_events, decoded_rank]) == frames[2]
    payloads = b"".join(f[2] for f in received)
    for big in [*BIG_HASHES, 2**64 - 1]:
        assert b"\xcf" + big.to_bytes(8, "big") in payloads  # msgpack uint64, not int64 or float
    assert bridge.events_seen == sum(len(d) for d in DRAINS)
    assert bridge.batches_published == len(expected)
    stats = publisher.stats()
    assert (stats.published, stats.dropped_queue_full, stats.encode_failures) == (probes + 4, 0, 0)


def test_replay_from_k_returns_k_onwards_then_the_end_marker(
    ctx: zmq.Context, publisher: KvEventPublisher
) -> None:
    sub = subscribe(ctx, publisher.endpoint)
    probes = sync_subscriber(publisher, sub)
    for i in range(5):
        publisher.publish([{"event_id": i, "data": {"type": "removed", "block_hashes": [BIG_HASHES[i % 3]]}}])
    live = [sub.recv_multipart() for _ in range(5)]
    req = dealer(ctx, publisher.replay_endpoint)

    k = probes + 2
    assert replay(req, k) == live[2:]  # byte-identical to live, seq k and later
    everything = replay(req, 0)
    assert [seq_of(f) for f in everything] == list(range(probes + 5))
    assert everything[probes:] == live
    assert replay(req, probes + 5) == []  # beyond the buffer: only the end marker
    assert replay(req, 2**64 - 1) == []
    assert publisher.stats().replay.requests == 4


def test_replay_protocol_variants(ctx: zmq.Context, publisher: KvEventPublisher) -> None:
    """REQ (one reply readable), DEALER without the empty delimiter, and a malformed request."""
    for i in range(3):
        publisher.publish([{"event_id": i}])
    assert publisher.flush()
    first = replay(dealer(ctx, publisher.replay_endpoint), 1)[0]

    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    req.connect(publisher.replay_endpoint)
    req.send((1).to_bytes(8, "big"))
    assert req.recv_multipart() == first  # REQ strips the envelope itself

    bare = dealer(ctx, publisher.replay_endpoint)
    bare.send((2).to_bytes(8, "big"))  # no delimiter: the reply carries none either
    assert seq_of(bare.recv_multipart()) == 2
    assert bare.recv_multipart() == [b"", END_MARKER, b""]

    bad = dealer(ctx, publisher.replay_endpoint)
    bad.send_multipart([b"", b"\x01\x02"])  # not 8 bytes: ignored, like vLLM
    bad.send_multipart([b"", (2).to_bytes(8, "big")])  # the socket still works afterwards
    assert seq_of(bad.recv_multipart()[1:]) == 2
    assert publisher.stats().replay.bad_requests == 1


def test_replay_buffer_is_bounded(ctx: zmq.Context) -> None:
    with KvEventPublisher(LOOPBACK, LOOPBACK, buffer_steps=5) as publisher:
        for i in range(8):
            publisher.publish([{"event_id": i}])
        assert publisher.flush()
        req = dealer(ctx, publisher.replay_endpoint)
        assert [seq_of(f) for f in replay(req, 0)] == [3, 4, 5, 6, 7]
        assert publisher.stats().buffered == 5


class GatedEncoder:
    """msgpack encoder that blocks on a batch whose first event has ``"gate"``, until released:
    it holds the publisher thread so the queue fills deterministically."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self._encoder = msgspec.msgpack.Encoder()

    def __call__(self, batch: tuple[float, list[Any], int | None]) -> bytes:
        events = batch[1]
        if events and "gate" in events[0]:
            self.entered.set()
            assert self.release.wait(10)
        if events and "poison" in events[0]:
            raise TypeError("unencodable event")
        return self._encoder.encode(batch)


def test_queue_overflow_leaves_a_visible_gap_and_counts_drops(ctx: zmq.Context) -> None:
    gate = GatedEncoder()
    with KvEventPublisher(LOOPBACK, LOOPBACK, max_queue_size=3, encode=gate) as publisher:
        sub = subscribe(ctx, publisher.endpoint)
        p = sync_subscriber(publisher, sub)
        assert publisher.publish([{"gate": True}]) == p
        assert gate.entered.wait(5)  # the thread is now stuck encoding seq p
        assert [publisher.publish([{"n": i}]) for i in range(3)] == [p + 1, p + 2, p + 3]  # queued
        assert [publisher.publish([{"n": i}]) for i in range(3, 5)] == [p + 4, p + 5]  # queue full
        gate.release.set()
        assert publisher.flush()
        assert publisher.publish([{"n": 5}]) == p + 6

        seqs = [seq_of(sub.recv_multipart()) for _ in range(5)]
        assert seqs == [p, p + 1, p + 2, p + 3, p + 6]  # the gap p+4..p+5 is visible
        assert publisher.flush()  # counters move after the send the SUB already saw
        stats = publisher.stats()
        assert (stats.dropped_queue_full, stats.next_seq, stats.published) == (2, p + 7, p + 5)
        assert [seq_of(f) for f in replay(dealer(ctx, publisher.replay_endpoint), p)] == seqs


def test_unencodable_batch_leaves_a_gap_not_a_hole(ctx: zmq.Context) -> None:
    with KvEventPublisher(LOOPBACK, LOOPBACK, encode=GatedEncoder()) as publisher:
        sub = subscribe(ctx, publisher.endpoint)
        p = sync_subscriber(publisher, sub)
        publisher.publish([{"poison": True}])
        publisher.publish([{"n": 1}])
        assert seq_of(sub.recv_multipart()) == p + 1
        assert publisher.flush()
        assert publisher.stats().encode_failures == 1


def test_close_flushes_queued_batches_then_refuses_more(ctx: zmq.Context) -> None:
    publisher = KvEventPublisher(LOOPBACK, None)
    sub = subscribe(ctx, publisher.endpoint)
    p = sync_subscriber(publisher, sub)
    for i in range(200):
        publisher.publish([{"event_id": i, "data": {"type": "removed", "block_hashes": [i]}}])
    publisher.close()  # no flush() first: close itself sends what is queued
    assert [seq_of(sub.recv_multipart()) for _ in range(200)] == list(range(p, p + 200))
    stats = publisher.stats()
    assert (stats.published, stats.abandoned_at_close, stats.queued) == (p + 200, 0, 0)
    with pytest.raises(RuntimeError):
        publisher.publish([])
    publisher.close()  # idempotent


def test_bridge_survives_llm_errors_marks_them_lost_and_drains_at_close(ctx: zmq.Context) -> None:
    """A failed drain may have emptied the engine's queue (TensorRT-LLM's serializer raises after
    draining): one seq per run of failed polls is consumed unsent, so subscribers see a gap."""
    publisher = KvEventPublisher(LOOPBACK, LOOPBACK)
    sub = subscribe(ctx, publisher.endpoint)
    p = sync_subscriber(publisher, sub)
    llm = FakeLlm()
    llm.fail_next = 2
    llm.emit(DRAINS[0])
    bridge = LlmEventBridge(llm, publisher, poll_timeout_s=0.01, max_backoff_s=0.02).start()
    assert seq_of(sub.recv_multipart()) == p + 1  # seq p: the two failed polls' gap, never sent
    llm.emit(DRAINS[1])  # emitted just before close: the final drain must still publish it
    bridge.close()  # closes the publisher too (close_publisher defaults to True)
    frames = sub.recv_multipart()
    assert seq_of(frames) == p + 2 and msgspec.msgpack.decode(frames[2])[1] == DRAINS[1]
    assert (bridge.poll_errors, bridge.seq_gaps_marked, publisher.stats().lost_upstream) == (2, 1, 1)
    with pytest.raises(RuntimeError):
        publisher.publish([])


def test_connect_mode_feeds_a_subscriber_that_binds(ctx: zmq.Context) -> None:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    with KvEventPublisher(f"tcp://127.0.0.1:{port}", None, bind=False, topic="kv-trt") as publisher:
        p = sync_subscriber(publisher, sub)
        publisher.publish(DRAINS[2], attention_dp_rank=2)
        frames = sub.recv_multipart()
        assert frames[0] == b"kv-trt" and seq_of(frames) == p
        assert msgspec.msgpack.decode(frames[2])[1:] == [DRAINS[2], 2]


def test_bind_error_is_raised_by_the_constructor(publisher: KvEventPublisher) -> None:
    with pytest.raises(zmq.ZMQError):
        KvEventPublisher(publisher.endpoint, None)  # address already in use
    with pytest.raises(zmq.ZMQError):
        KvEventPublisher(LOOPBACK, publisher.replay_endpoint)


def test_group_by_dp_rank_keeps_order_and_tolerates_odd_events() -> None:
    events: list[Any] = [{"attention_dp_rank": 1, "n": 0}, {"n": 1}, {"attention_dp_rank": [1], "n": 2},
                         {"attention_dp_rank": 1, "n": 3}, "not a dict"]  # fmt: skip
    assert group_by_dp_rank(events) == [
        (1, [events[0], events[3]]),
        (None, [events[1], events[2], events[4]]),
    ]


def test_a_drain_larger_than_the_consumers_limits_is_cut_into_batches_it_accepts() -> None:
    limits = WireLimits(max_events_per_message=3, max_blocks_per_message=5)

    def removed(blocks: int) -> dict[str, Any]:
        return {"event_id": 0, "data": {"type": "removed", "block_hashes": list(range(blocks))}}
    events = [removed(2), removed(2), removed(2), removed(1), removed(1), removed(1), removed(1), removed(9), "odd"]
    parts = split_to_limits(events, limits)
    assert [x for part in parts for x in part] == events  # order kept, nothing lost
    assert [len(p) for p in parts] == [2, 3, 2, 1, 1]  # 2+2 blocks; 2+1+1 (3 events); 1+1; 9 alone; "odd"
    assert all(len(p) <= 3 for p in parts)
    assert split_to_limits([], limits) == []
