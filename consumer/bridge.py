"""Publisher bridge: TensorRT-LLM KV cache events → ZMQ PUB with a replay ROUTER (DESIGN §4, §6).

Runs inside the TensorRT-LLM process (or beside an ``LLM`` object). TensorRT-LLM's LLM API only
offers a pull queue (``LLM.get_kv_cache_events``, reference/WIRE.md §A); this module turns it into
the same wire as vLLM's ``ZmqEventPublisher`` (vllm-project/vllm ``vllm/distributed/kv_events.py``)
so one consumer ingests all engines (``trtllm-serve`` hands out no ``LLM``: ``consumer/serve_bridge.py``
polls its HTTP endpoint into the same publisher)::

    llm = LLM(model=path, kv_cache_config=KvCacheConfig(enable_block_reuse=True, event_buffer_max_size=16384))
    with LlmEventBridge(llm, KvEventPublisher("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")):  # start() ... close()
        llm.generate(prompts)  # on exit: drain the engine's queue, flush, close the publisher

Wire (reference/WIRE.md §B, checked against the recorded engine in shared/fixtures/README.md):

* live: PUB multipart ``[topic, seq as 8 bytes big-endian, payload]``; ``payload`` is msgpack
  ``[ts: float (s since epoch), events: list, attention_dp_rank: int | None]``. ``seq`` starts at 0
  and grows by 1 per batch, also for batches that were dropped (full queue), failed to encode or
  were lost before reaching the publisher (:meth:`KvEventPublisher.mark_lost`), so a subscriber
  sees every loss as a gap, never as a silent hole. Python ints ≥ 2**63 encode as msgpack
  uint64, as TensorRT-LLM's unsigned block hashes need.
* replay: ROUTER. A DEALER sends ``[b"", start_seq8]`` (a REQ the same on the wire); the server
  answers every buffered batch with ``seq >= start_seq`` as ``envelope + [topic, seq8, payload]``
  (byte-identical to live) and then the end marker ``envelope + [b"", ff×8, b""]``. A start beyond
  the buffer gets only the end marker. Like vLLM, the buffer holds the *encoded* frames.

Defaults: port 5557, ``buffer_steps=10_000``, ``hwm=100_000``, ``max_queue_size=100_000`` are
vLLM's ``KVEventsConfig`` defaults, but we bind loopback only (``tcp://127.0.0.1:5557``; vLLM binds
``*``). vLLM's ``replay_endpoint`` defaults to None (off); ours defaults to
``tcp://127.0.0.1:5558`` (the port vLLM's example subscriber uses) because DESIGN §5 recovers gaps
through replay. Pass ``None`` to turn it off. Unlike vLLM, binding is explicit (``bind=True``)
rather than guessed from a ``*`` in the endpoint.

Security (``consumer/curve.py``, docs/security.md): ``curve=CurveKeys.from_files("engine.key_secret",
"consumers/")`` makes the PUB and the replay ROUTER CURVE servers that admit only the consumers'
public keys; binding a non-loopback address without it raises an :class:`InsecureEndpointWarning`.
Refused handshakes are counted in :meth:`KvEventPublisher.stats` (``handshakes_refused``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import msgspec
import structlog
import zmq

from consumer.curve import CurveKeys, HandshakeMonitor, ZapAuthorizer, warn_if_exposed
from consumer.wire import SEQ_END_MARKER, WireLimits, encode_frames

__all__ = [
    "DEFAULT_ENDPOINT", "DEFAULT_REPLAY_ENDPOINT", "DEFAULT_TOPIC", "KvEventPublisher", "LlmEventBridge",
    "PollingBridge", "PublisherStats", "ReplayBuffer", "ReplayStats", "group_by_dp_rank", "open_socket",
    "serve_replay_request", "socket_endpoint",
]  # fmt: skip

log = structlog.get_logger(__name__)

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
DEFAULT_REPLAY_ENDPOINT = "tcp://127.0.0.1:5558"
CURVE_DOMAIN = "semkv-publisher"  # ZAP domain of the publishers' CURVE server sockets
DEFAULT_TOPIC = b"kv"

_SEQ_BYTES = 8


def _unpack_start_seq(frame: bytes) -> int:
    # unsigned, as vLLM reads the request: ff×8 asks for nothing rather than (signed -1) everything
    return int.from_bytes(frame, "big")


# --- replay serving, shared with consumer/publish.py ------------------------------------------

_IDLE_WAIT_S = 0.01  # publisher thread wake-up: bounds replay latency when no batch arrives
_REPLAYS_PER_TURN = 16  # replay requests served between two batches, so a flood cannot starve live
_CLOSE_LINGER_MS = 2000  # time ZMQ keeps sending already-queued frames after a socket closes
_FINAL_DRAINS = 100  # LlmEventBridge polls at close, at most


@dataclass
class ReplayStats:
    """Counters of one replay ROUTER (mutated by the thread that owns the socket)."""

    requests: int = 0
    batches_sent: int = 0
    aborted: int = 0  # client vanished or stopped reading: no end marker sent
    bad_requests: int = 0  # not ``envelope + [seq8]``: ignored, like vLLM


class ReplayBuffer:
    """The last ``max_batches`` encoded batches ``(seq, frames)``, oldest first.

    Seqs must be appended in increasing order; a publisher whose seq restarts (engine restart)
    calls :meth:`clear` first so a replay never mixes two runs.
    """

    def __init__(self, max_batches: int) -> None:
        if max_batches < 1:
            raise ValueError("buffer_steps must be >= 1")
        self._items: deque[tuple[int, tuple[bytes, ...]]] = deque(maxlen=max_batches)

    def append(self, seq: int, frames: Sequence[bytes]) -> None:
        self._items.append((seq, tuple(frames)))

    def clear(self) -> None:
        self._items.clear()

    def since(self, start_seq: int) -> list[tuple[bytes, ...]]:
        """Frames of every buffered batch with ``seq >= start_seq``, in seq order."""
        return [frames for seq, frames in self._items if seq >= start_seq]

    def __len__(self) -> int:
        return len(self._items)


def _split_envelope(request: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """ROUTER request -> (envelope to echo, body). The envelope ends at the first empty frame
    (REQ, or a DEALER that sends ``b""`` first); without one, it is the identity frames alone."""
    for index in range(1, len(request)):
        if not request[index]:
            return request[: index + 1], request[index + 1 :]
    return request[:-1], request[-1:]


def serve_replay_request(sock: zmq.Socket, buffer: ReplayBuffer, stats: ReplayStats) -> bool:
    """Answer one pending replay request on ROUTER ``sock`` without blocking.

    Returns False when no request was waiting. Sends ``envelope + frames`` per buffered batch
    with seq >= the requested start, then ``envelope + [b"", SEQ_END_MARKER, b""]``. ``sock``
    should have ``ROUTER_MANDATORY`` set (see :func:`open_socket`): if the client is gone or
    stops reading, the replay stops without the end marker, so the client's timeout reports a
    failed replay instead of silently accepting a truncated one.
    """
    try:
        request = sock.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return False
    envelope, body = _split_envelope(request)
    if not envelope or len(body) != 1 or len(body[0]) != _SEQ_BYTES:
        stats.bad_requests += 1
        log.warning("replay.bad_request", frame_lens=[len(f) for f in request])
        return True
    stats.requests += 1
    batches = buffer.since(_unpack_start_seq(body[0]))
    try:
        for frames in batches:
            sock.send_multipart([*envelope, *frames], zmq.NOBLOCK)
        sock.send_multipart([*envelope, b"", SEQ_END_MARKER, b""], zmq.NOBLOCK)
    except zmq.ZMQError as exc:  # EAGAIN: client's pipe full; EHOSTUNREACH: client gone
        stats.aborted += 1
        log.warning("replay.aborted", error=str(exc), batches=len(batches))
        return True
    stats.batches_sent += len(batches)
    return True


def open_socket(
    ctx: zmq.Context, socket_type: int, endpoint: str, *, bind: bool, sndhwm: int,
    curve: CurveKeys | None = None,
    on_create: Callable[[zmq.Socket], None] | None = None,
) -> zmq.Socket:
    """Create a socket, set its send high-water mark (and CURVE: server when it binds, client when
    it connects), call ``on_create`` (e.g. attach a handshake monitor), then bind or connect it.

    ROUTER sockets get ``ROUTER_MANDATORY`` so replies to vanished or slow clients fail loudly.
    Raises ``zmq.ZMQError`` (socket closed first) when the endpoint is invalid or in use, and
    ``consumer.curve.CurveError`` when a connecting CURVE socket has not exactly one server key.
    """
    sock = ctx.socket(socket_type)
    try:
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS)
        if curve is not None:
            curve.configure(sock, server=bind, domain=CURVE_DOMAIN)
        if socket_type == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if on_create is not None:
            on_create(sock)
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def socket_endpoint(sock: zmq.Socket) -> str:
    """The resolved endpoint (``tcp://127.0.0.1:*`` -> the port the OS picked)."""
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


# --- the publisher ------------------------------------------------------------------------------


class _Batch(NamedTuple):
    seq: int
    ts: float
    events: list[Any]
    attention_dp_rank: int | None


@dataclass
class PublisherStats:
    """Counters of a :class:`KvEventPublisher` (:meth:`~KvEventPublisher.stats` returns a copy).

    Every seq below ``next_seq`` is exactly one of: published, send_failures (buffered, so
    replay can still recover it), dropped_queue_full, encode_failures, abandoned_at_close,
    lost_upstream (:meth:`~KvEventPublisher.mark_lost`), or still queued / being encoded.
    """

    next_seq: int = 0
    published: int = 0
    dropped_queue_full: int = 0
    encode_failures: int = 0
    send_failures: int = 0
    abandoned_at_close: int = 0
    lost_upstream: int = 0  # seqs consumed by mark_lost(): batches lost before they reached the publisher
    queued: int = 0
    buffered: int = 0
    replay: ReplayStats = field(default_factory=ReplayStats)
    handshakes_succeeded: int = 0  # subscribers/replay clients admitted (PUB and ROUTER together)
    handshakes_refused: int = 0  # refused: key not authorized, no CURVE, wrong server key (consumer/curve.py)
    refused_by_reason: dict[str, int] = field(default_factory=dict)


class KvEventPublisher:
    """ZMQ PUB + replay ROUTER owned by one background thread; callers only enqueue.

    Args:
        endpoint: PUB endpoint; ``tcp://host:0`` or ``tcp://host:*`` picks a free port
            (read it back from :attr:`endpoint`).
        replay_endpoint: ROUTER endpoint (always bound, as in vLLM); None disables replay.
        topic: first frame of every message (str is UTF-8 encoded).
        bind: bind the PUB (default) or connect it to a subscriber that binds.
        hwm: PUB send high-water mark in messages (ZMQ drops beyond it per subscriber; the seq
            gap shows it).
        buffer_steps: batches kept for replay.
        max_queue_size: batches waiting for the thread; when full, :meth:`publish` drops.
        encode: payload encoder ``(ts, events, rank) -> bytes``; default msgspec msgpack.
        context: ZMQ context (default: the process-wide instance, never terminated here).
        curve: CURVE keys (``CurveKeys.from_files(own NAME.key_secret, consumer key file or
            directory)``): the bound PUB and the ROUTER admit only those consumers; a connecting
            PUB pins the one consumer key. The publisher then uses a private context (with its ZAP
            handler), so ``context`` must be None.

    Raises:
        zmq.ZMQError: binding or connecting failed (raised from the constructor).
        ValueError: ``curve`` together with ``context``; ``consumer.curve.CurveError`` (a
            ValueError) for a connecting CURVE PUB without exactly one consumer key.
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        replay_endpoint: str | None = DEFAULT_REPLAY_ENDPOINT,
        *,
        topic: bytes | str = DEFAULT_TOPIC,
        bind: bool = True,
        hwm: int = 100_000,
        buffer_steps: int = 10_000,
        max_queue_size: int = 100_000,
        encode: Callable[[tuple[float, list[Any], int | None]], bytes] | None = None,
        context: zmq.Context | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        if curve is not None and context is not None:
            raise ValueError("a CURVE publisher owns its context (its ZAP handler is per context): pass no context")
        if bind:
            warn_if_exposed(endpoint, curve=curve is not None, what="KvEventPublisher's PUB")
        warn_if_exposed(replay_endpoint, curve=curve is not None, what="KvEventPublisher's replay ROUTER")
        self._topic = topic.encode() if isinstance(topic, str) else bytes(topic)
        self._buffer = ReplayBuffer(buffer_steps)
        self._queue: queue.Queue[_Batch] = queue.Queue(maxsize=max_queue_size)
        self._encode = encode or msgspec.msgpack.Encoder().encode
        self._curve = curve
        self._own_ctx = curve is not None
        self._ctx = zmq.Context() if self._own_ctx else (context or zmq.Context.instance())
        self._zap = ZapAuthorizer(self._ctx) if curve is not None else None
        if self._zap is not None and curve is not None:
            self._zap.authorize(CURVE_DOMAIN, curve.peers)
        self.handshakes = HandshakeMonitor("publisher")  # drained by the publisher thread
        self._config = (endpoint, replay_endpoint, bind, hwm, buffer_steps)
        self._lock = threading.Lock()  # seq allocation + enqueue happen together: queue order = seq order
        self._done = threading.Condition()
        self._closing = threading.Event()
        self._abort = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._enqueued = self._processed = 0
        self._stats = PublisherStats()  # counters written by one thread each, read anywhere
        self.endpoint: str | None = None  # resolved by the thread before the constructor returns
        self.replay_endpoint: str | None = None
        self._thread = threading.Thread(target=self._run, name="semkv-kv-publisher", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            self._release_context()
            raise self._start_error

    # -- caller side (any thread; never blocks) --

    def publish(self, events: list[Any], attention_dp_rank: int | None = None) -> int:
        """Enqueue one batch and return the seq it will carry (also when it is dropped).

        ``events`` is encoded later on the publisher thread: do not mutate it afterwards.
        Raises RuntimeError after :meth:`close`.
        """
        ts = time.time()
        with self._lock:
            if self._closing.is_set():
                raise RuntimeError("KvEventPublisher is closed")
            seq = self._stats.next_seq
            self._stats.next_seq += 1  # consumed even if dropped: the loss must show up as a seq gap
            try:
                self._queue.put_nowait(_Batch(seq, ts, events, attention_dp_rank))
            except queue.Full:
                self._stats.dropped_queue_full += 1
                dropped = self._stats.dropped_queue_full
            else:
                self._enqueued += 1
                return seq
        if dropped == 1 or dropped % 1000 == 0:  # rate-limited: an overloaded engine must not log per batch
            log.warning("publisher.queue_full_dropped", seq=seq, dropped_total=dropped)
        return seq

    def mark_lost(self) -> int:
        """Consume one seq without sending anything and return it: the caller lost a batch before
        it could publish it (e.g. an HTTP response the engine had drained its queue into, and
        that never arrived whole), so subscribers see the loss as a seq gap, as for a dropped
        batch. Counted in ``lost_upstream``. Raises RuntimeError after :meth:`close`.
        """
        with self._lock:
            if self._closing.is_set():
                raise RuntimeError("KvEventPublisher is closed")
            seq = self._stats.next_seq
            self._stats.next_seq += 1
            self._stats.lost_upstream += 1
        log.warning("publisher.seq_marked_lost", seq=seq, lost_total=self._stats.lost_upstream)
        return seq

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every batch enqueued so far was sent (or failed); False on timeout."""
        with self._lock:
            target = self._enqueued
        with self._done:
            return self._done.wait_for(lambda: self._processed >= target, timeout=timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting batches, send what is queued (up to ``timeout_s``), close the sockets.

        Batches still queued at the deadline are abandoned and counted. Idempotent.
        """
        with self._lock:
            self._closing.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._abort.set()  # deadline passed: stop sending, let the thread close its sockets
            self._thread.join()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
            self._stats.abandoned_at_close += 1
        if self._stats.abandoned_at_close:
            log.warning("publisher.abandoned_at_close", batches=self._stats.abandoned_at_close)
        self._release_context()

    def _release_context(self) -> None:
        if self._zap is not None:
            self._zap.stop()
            self._zap = None
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()

    def stats(self) -> PublisherStats:
        s = self._stats
        succeeded, refused, by_reason = self.handshakes.snapshot()
        return replace(s, queued=self._queue.qsize(), buffered=len(self._buffer), replay=replace(s.replay),
                       handshakes_succeeded=succeeded, handshakes_refused=refused, refused_by_reason=by_reason)

    def __repr__(self) -> str:
        s = self.stats()
        return f"<KvEventPublisher {self.endpoint} next_seq={s.next_seq} published={s.published}>"

    def __enter__(self) -> KvEventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- publisher thread: owns both sockets for their whole life --

    def _run(self) -> None:
        try:
            pub, replay = self._open_sockets()
        except BaseException as exc:  # reported to the constructor, which re-raises it
            self.handshakes.close()
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(pub, replay)
        finally:
            self.handshakes.drain()
            self.handshakes.close()
            pub.close()
            if replay is not None:
                replay.close()

    def _open_sockets(self) -> tuple[zmq.Socket, zmq.Socket | None]:
        endpoint, replay_endpoint, bind, hwm, buffer_steps = self._config
        pub = open_socket(self._ctx, zmq.PUB, endpoint, bind=bind, sndhwm=hwm, curve=self._curve,
                          on_create=lambda sock: self.handshakes.watch("pub", sock))
        self.endpoint = socket_endpoint(pub)
        if replay_endpoint is None:
            return pub, None
        try:
            # the HWM must hold a whole replay, or ZMQ would refuse part of it (EAGAIN)
            replay = open_socket(self._ctx, zmq.ROUTER, replay_endpoint, bind=True, sndhwm=max(hwm, buffer_steps + 1),
                                 curve=self._curve, on_create=lambda sock: self.handshakes.watch("replay", sock))
        except BaseException:
            self.handshakes.close()
            pub.close(linger=0)
            raise
        self.replay_endpoint = socket_endpoint(replay)
        return pub, replay

    def _loop(self, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        while not self._abort.is_set():
            self.handshakes.drain()
            for _ in range(_REPLAYS_PER_TURN):
                if replay is None or not serve_replay_request(replay, self._buffer, self._stats.replay):
                    break
            try:
                batch = self._queue.get(timeout=_IDLE_WAIT_S)
            except queue.Empty:
                if self._closing.is_set():  # closing and drained: publish() can no longer enqueue
                    return
                continue
            self._emit(pub, batch)
            with self._done:
                self._processed += 1
                self._done.notify_all()

    def _emit(self, pub: zmq.Socket, batch: _Batch) -> None:
        try:
            payload = self._encode((batch.ts, batch.events, batch.attention_dp_rank))
        except Exception as exc:  # boundary: one unencodable batch must not stop the publisher
            self._stats.encode_failures += 1
            log.error("publisher.encode_failed", seq=batch.seq, error=repr(exc))
            return
        frames = encode_frames(self._topic, batch.seq, payload)
        # buffered before sending: a batch whose send fails can still be recovered by replay
        self._buffer.append(batch.seq, frames)
        try:
            pub.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._stats.send_failures += 1
            log.error("publisher.send_failed", seq=batch.seq, error=str(exc))
            return
        self._stats.published += 1


# --- the LLM-API bridge -------------------------------------------------------------------------


def group_by_dp_rank(events: list[Any]) -> list[tuple[int | None, list[Any]]]:
    """Split one drain into batches per ``attention_dp_rank`` (None when absent), keeping the
    events' order inside each rank and ranks in order of first appearance. Under attention DP
    TensorRT-LLM gathers every rank's events to rank 0 (reference/WIRE.md §A)."""
    groups: dict[int | None, list[Any]] = {}
    for event in events:
        rank = event.get("attention_dp_rank") if isinstance(event, dict) else None
        # a malformed rank stays with its event under None: the consumer's decoder judges it
        groups.setdefault(rank if isinstance(rank, int) else None, []).append(event)
    return list(groups.items())


def split_to_limits(events: list[Any], limits: WireLimits = WireLimits()) -> list[list[Any]]:
    """Cut one rank's drain into consecutive batches within the consumer's default per-message
    limits (``limits.max_events_per_message`` and ``max_blocks_per_message``), so a large drain
    (TensorRT-LLM's ``event_buffer_max_size`` may be set high) is never a dead letter at the
    consumer. Order is kept. An event whose own blocks exceed the limit travels alone (the consumer
    refuses it: configure ``max_blocks_per_message`` above one request's blocks)."""
    parts: list[list[Any]] = [[]]
    blocks = 0
    for event in events:
        count = _blocks_of(event)
        part = parts[-1]
        if part and (len(part) >= limits.max_events_per_message or blocks + count > limits.max_blocks_per_message):
            parts.append(part := [])
            blocks = 0
        part.append(event)
        blocks += count
    return [part for part in parts if part]


def _blocks_of(event: Any) -> int:
    """Blocks of a TensorRT-LLM LLM-API event dict (reference/WIRE.md §A); 1 for anything else."""
    data = event.get("data") if isinstance(event, dict) else None
    if isinstance(data, dict):
        listed = data.get("blocks", data.get("block_hashes"))
        if isinstance(listed, list):
            return len(listed)
    return 1


class PollingBridge:
    """Background thread that polls an event source and republishes each drain (shared by
    :class:`LlmEventBridge` and ``consumer.serve_bridge.ServeEventBridge``).

    Subclasses implement :meth:`_drain_once`: one poll, returning the number of events published,
    or None when the poll failed (then the thread backs off exponentially, ``min_backoff_s`` up to
    ``max_backoff_s``, so a broken source is never spun on). After a good poll the thread waits
    ``idle_wait_s`` (0: poll again at once, the source itself blocks). :meth:`close` stops the
    loop, then polls with ``final=True`` until a drain comes back empty or failed (at most
    ``_FINAL_DRAINS`` times), then flushes (and by default closes) the publisher.
    """

    def __init__(
        self,
        publisher: KvEventPublisher,
        *,
        close_publisher: bool = True,
        max_backoff_s: float = 1.0,
        min_backoff_s: float = 0.01,
        idle_wait_s: float = 0.0,
        thread_name: str = "semkv-event-bridge",
    ) -> None:
        self.publisher = publisher
        self._close_publisher = close_publisher
        self._max_backoff_s = max_backoff_s
        self._min_backoff_s = min(min_backoff_s, max_backoff_s)
        self._idle_wait_s = idle_wait_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self.events_seen = self.batches_published = self.poll_errors = 0
        self.seq_gaps_marked = 0
        """Seqs consumed for polls that may have lost events: one per run of consecutive such polls."""
        self._gap_open = False  # a seq was marked lost for the current run of failed polls

    def start(self) -> PollingBridge:
        self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop polling, drain what the source still holds, flush (and close) the publisher."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("bridge.close_timeout", timeout_s=timeout_s)
        if self._close_publisher:
            self.publisher.close(timeout_s)
        else:
            self.publisher.flush(timeout_s)

    def __enter__(self) -> PollingBridge:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self) -> None:
        backoff_s = 0.0
        while not self._stop.is_set():
            if self._drain_once(final=False) is None:
                backoff_s = min(max(2 * backoff_s, self._min_backoff_s), self._max_backoff_s)
                self._stop.wait(backoff_s)  # don't spin on a broken source
            else:
                backoff_s = 0.0
                if self._idle_wait_s > 0:
                    self._stop.wait(self._idle_wait_s)
        # Final drain of what the source queued before close(); bounded in case the engine is
        # still generating.
        for _ in range(_FINAL_DRAINS):
            if not self._drain_once(final=True):
                break

    def _drain_once(self, *, final: bool) -> int | None:
        """One poll; the number of events published, or None when the poll failed."""
        raise NotImplementedError

    def _mark_possible_loss(self) -> bool:
        """A failed poll may have taken events out of the engine's queue that never reached us:
        consume one seq without sending anything (once per run of such polls), so subscribers see a
        gap the engine's replay cannot fill and the ledger bumps the engine's generation. True when
        a seq was marked now."""
        if self._gap_open:
            return False
        try:
            self.publisher.mark_lost()
        except RuntimeError:  # publisher closed (close() timed out): nobody left to tell
            return False
        self.seq_gaps_marked += 1
        self._gap_open = True
        return True

    def _poll_succeeded(self) -> None:
        """A poll came back whole: the next lost one opens a new gap."""
        self._gap_open = False

    def _publish_drain(self, events: Sequence[Any]) -> int | None:
        """Publish one drain as one batch per attention-DP rank; the number of events, or None
        when the publisher is already closed (the events are then lost, and logged)."""
        if not events:
            return 0
        self.events_seen += len(events)
        for rank, group in group_by_dp_rank(list(events)):
            for part in split_to_limits(group):
                try:
                    self.publisher.publish(part, rank)
                except RuntimeError:  # publisher closed under us (close() timed out): nothing to send to
                    log.error("bridge.publisher_closed", events_lost=len(part))
                    return None
                self.batches_published += 1
        return len(events)


class LlmEventBridge(PollingBridge):
    """Background thread: ``llm.get_kv_cache_events(timeout=poll_timeout_s)`` → publisher.

    ``llm`` is TensorRT-LLM's ``LLM`` or anything with ``get_kv_cache_events(timeout=seconds) ->
    list[dict]`` that drains a queue (reference/WIRE.md §A). Each non-empty drain becomes one
    batch per attention-DP rank. The engine never waits on the bridge: TensorRT-LLM queues events
    itself, and :meth:`KvEventPublisher.publish` never blocks.
    An exception from the drain is a possible LOSS, never a silent skip: the engine's queue may
    already have been drained into it (TensorRT-LLM's ``KVCacheEventSerializer._updated_to_json``
    raises ``AttributeError`` on the ``updated`` event of a host offload, whose ``priority`` diff is
    None, after the C++ queue was emptied; NVIDIA/TensorRT-LLM ``tensorrt_llm/_utils.py``). It is
    counted (``poll_errors``), logged, marked as a seq gap (:meth:`KvEventPublisher.mark_lost`, once
    per run of failed polls: the ledger bumps the engine's generation and quarantines what it knew),
    then retried after a back-off.
    """

    def __init__(
        self,
        llm: Any,
        publisher: KvEventPublisher,
        *,
        poll_timeout_s: float = 0.1,
        close_publisher: bool = True,
        max_backoff_s: float = 1.0,
    ) -> None:
        super().__init__(publisher, close_publisher=close_publisher, max_backoff_s=max_backoff_s,
                         thread_name="semkv-llm-event-bridge")
        self._llm = llm
        self._poll_timeout_s = poll_timeout_s

    def start(self) -> LlmEventBridge:
        super().start()
        return self

    def __enter__(self) -> LlmEventBridge:
        return self.start()

    def _drain_once(self, *, final: bool) -> int | None:
        # At close: timeout 0, never None (None may mean "wait forever" to the executor).
        timeout_s = 0 if final else self._poll_timeout_s
        try:
            events = self._llm.get_kv_cache_events(timeout=timeout_s)
        except Exception as exc:  # boundary: an executor error must not kill the bridge
            self.poll_errors += 1
            marked = self._mark_possible_loss()
            log.error("bridge.poll_failed", error=repr(exc), errors_total=self.poll_errors, seq_marked_lost=marked)
            return None
        self._poll_succeeded()
        return self._publish_drain(events or [])
