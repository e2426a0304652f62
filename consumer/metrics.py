"""Prometheus metrics of the consumer daemon and its HTTP endpoint (DESIGN §8).

Every :class:`ConsumerMetrics` owns its own ``CollectorRegistry`` (never the process-global one),
so several daemons can run in one process (tests). Names are ``semkv_consumer_*``; counters end in
``_total``, durations are histograms in ``_seconds``.

Which side counts what:

* sources (label ``engine_id``): messages and events received, messages on a foreign topic
  dropped (the SUB matches topic prefixes; see ``SourceSettings.topic``), dead letters (label ``reason``),
  seq gaps seen, handshakes completed and refused (labels ``socket`` = ``sub``/``replay`` and
  ``reason``, see ``consumer/curve.py``), replays (label ``outcome``: ``ok`` covered the gap, ``partial`` recovered some
  batches, ``failed`` recovered none or timed out), duplicates dropped before the ledger,
  back-pressure waits;
* the writer (one per database): what the ledger decided in each transaction (events applied /
  duplicate / stale; gaps it recorded and generation bumps, both labelled ``engine_id`` and
  ``reason``, a ``GenerationReason`` value), commit latency, lag (engine ``ts`` of a batch to its
  commit), database retries, queue depth.

Per-engine continuity series exist at 0 from the start (:meth:`ConsumerMetrics.track_engine`), so
that ``increase()`` sees an engine's first gap.

:class:`MetricsServer` serves ``GET /metrics`` (Prometheus text format) and ``GET /healthz`` (JSON:
``{"status": "ok"|"degraded"|"unhealthy", "db": {...}, "sources": {source_id: {...}}}``) on one
port, as a small asyncio server in the daemon's event loop (no thread). ``unhealthy`` (HTTP 503):
the database or a task is down. ``degraded`` (HTTP 200, so that a liveness probe does not restart
a daemon that a restart cannot fix, and a refused peer cannot make it fail): a source's security
handshakes are refused and no message arrived since (``handshakes_refused_since_last_message``;
wrong keys, or CURVE on one side only; see docs/troubleshooting.md).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ledger.types import DeadLetterReason, GenerationReason

__all__ = ["ConsumerMetrics", "HealthCheck", "MetricsServer", "MetricsServerError"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_ENGINE = ("engine_id",)
_LOSS = ("engine_id", "reason")  # reason: a GenerationReason value (bounded)
_REPLAY_OUTCOMES = ("ok", "partial", "failed")

HealthCheck = Callable[[], Awaitable[tuple[bool, dict[str, Any]]]]
"""Returns (healthy, JSON-able details)."""


class ConsumerMetrics:
    """All metrics of one daemon, registered on :attr:`registry`."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.messages_received = Counter("semkv_consumer_messages_received_total",
                                         "ZMQ messages (batches) received, live or by replay", _ENGINE, registry=r)
        self.events_received = Counter("semkv_consumer_events_received_total",
                                       "Engine events decoded from received messages", _ENGINE, registry=r)
        self.dead_letters = Counter("semkv_consumer_dead_letters_total",
                                    "Inputs dead-lettered by the decoder", (*_ENGINE, "reason"), registry=r)
        self.gaps_seen = Counter("semkv_consumer_seq_gaps_total",
                                 "ZMQ seq gaps seen by a source (before replay)", _ENGINE, registry=r)
        self.replays = Counter("semkv_consumer_replays_total", "Replay requests by outcome",
                               (*_ENGINE, "outcome"), registry=r)
        self.replayed_batches = Counter("semkv_consumer_replayed_batches_total",
                                        "Batches recovered by replay and passed to the ledger", _ENGINE, registry=r)
        self.replay_probes = Counter("semkv_consumer_replay_probes_total",
                                     "Replay requests made without a seen gap (start-up, idle)", _ENGINE, registry=r)
        self.replay_seconds = Histogram("semkv_consumer_replay_seconds", "Duration of one replay request",
                                        _ENGINE, buckets=_LATENCY_BUCKETS, registry=r)
        self.restarts_seen = Counter("semkv_consumer_engine_restarts_seen_total",
                                     "Seq went backwards with a new payload (engine restart)", _ENGINE, registry=r)
        self.duplicates_dropped = Counter("semkv_consumer_duplicate_batches_dropped_total",
                                          "Batches a source had already passed on (same seq, same digest)",
                                          _ENGINE, registry=r)
        self.foreign_topic_dropped = Counter("semkv_consumer_foreign_topic_dropped_total",
                                             "Messages on another topic that the SUB's prefix match let through "
                                             "(e.g. 'kvX' for topic 'kv'): not this source's, dropped unrecorded",
                                             _ENGINE, registry=r)
        self.backpressure = Counter("semkv_consumer_backpressure_total",
                                    "Times a source found the writer queue full and stopped reading ZMQ",
                                    _ENGINE, registry=r)
        self.backpressure_seconds = Counter("semkv_consumer_backpressure_seconds_total",
                                            "Time sources spent waiting on a full queue", _ENGINE, registry=r)
        self.source_up = Gauge("semkv_consumer_source_up", "1 while the source task runs", _ENGINE, registry=r)
        self.curve_refused = Counter("semkv_consumer_curve_refused_total",
                                     "Security handshakes refused on a source's sockets (CURVE key not "
                                     "authorized, wrong publisher key, or CURVE on one side only)",
                                     (*_ENGINE, "socket", "reason"), registry=r)
        self.handshakes = Counter("semkv_consumer_handshakes_total",
                                  "ZMQ handshakes completed on a source's sockets (CURVE or plain)",
                                  (*_ENGINE, "socket"), registry=r)
        self._writer_metrics(r)

    def _writer_metrics(self, r: CollectorRegistry) -> None:
        self.transactions = Counter("semkv_consumer_transactions_total", "Ledger transactions committed", registry=r)
        self.batches_committed = Counter("semkv_consumer_batches_committed_total",
                                         "Batches the ledger recorded (not duplicates)", registry=r)
        self.events_applied = Counter("semkv_consumer_events_applied_total",
                                      "Engine events the ledger applied to its projections", registry=r)
        self.events_duplicate = Counter("semkv_consumer_events_duplicate_total",
                                        "Engine events in batches the ledger already had (no-op)", registry=r)
        self.events_stale = Counter("semkv_consumer_events_stale_total",
                                    "Engine events logged but not applied (older event_id)", registry=r)
        self.dead_letters_committed = Counter("semkv_consumer_dead_letters_committed_total",
                                              "Dead letters written to the ledger", registry=r)
        self.gaps_recorded = Counter("semkv_consumer_gaps_total",
                                     "Gaps the ledger recorded (replay could not cover them), by engine and reason",
                                     _LOSS, registry=r)
        self.generation_bumps = Counter("semkv_consumer_generation_bumps_total",
                                        "Engine generation bumps decided by the ledger, by engine and reason",
                                        _LOSS, registry=r)
        self.commit_seconds = Histogram("semkv_consumer_commit_seconds", "Duration of one ledger transaction",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.log_lock_wait_seconds = Histogram(
            "semkv_consumer_log_lock_wait_seconds",
            "Wait of one ledger transaction for the log lock, behind other writers' commits (PostgreSQL only)",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.lag_seconds = Histogram("semkv_consumer_lag_seconds", "Engine batch ts to ledger commit",
                                     buckets=_LAG_BUCKETS, registry=r)
        self.lag_last_seconds = Gauge("semkv_consumer_lag_last_seconds",
                                      "Lag of the newest committed batch of each engine", _ENGINE, registry=r)
        self.db_retries = Counter("semkv_consumer_db_retries_total",
                                  "Transactions retried after a transient database error", registry=r)
        self.queue_depth = Gauge("semkv_consumer_queue_depth", "Messages waiting for the writer", registry=r)
        self.queue_capacity = Gauge("semkv_consumer_queue_capacity", "Bound of the writer queue", registry=r)

    def track_engine(self, engine_id: str) -> None:
        """Create the engine's continuity series at 0 (every reason, every replay outcome).

        A series that first appears at 1 shows no ``increase()`` in Prometheus (one sample), so
        without this the first gap, bump, replay failure or dead letter of an engine would fire no
        alert. The label values are enums: a bounded number of series per engine.
        """
        for reason in GenerationReason:
            self.gaps_recorded.labels(engine_id=engine_id, reason=reason.value)
            self.generation_bumps.labels(engine_id=engine_id, reason=reason.value)
        for dead_reason in DeadLetterReason:
            self.dead_letters.labels(engine_id=engine_id, reason=dead_reason.value)
        for outcome in _REPLAY_OUTCOMES:
            self.replays.labels(engine_id=engine_id, outcome=outcome)
        self.gaps_seen.labels(engine_id=engine_id)
        self.restarts_seen.labels(engine_id=engine_id)

    def render(self) -> bytes:
        """The Prometheus text exposition of :attr:`registry`."""
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float:
        """Current value of one sample (0.0 when absent), e.g. ``value("semkv_consumer_gaps_total")``."""
        found = self.registry.get_sample_value(name, labels)
        return 0.0 if found is None else found


class MetricsServerError(OSError):
    """The metrics server cannot listen; the message names the setting to change."""


class MetricsServer:
    """``/metrics`` and ``/healthz`` over HTTP/1.0 on one port (asyncio; one request per connection).

    ``port=0`` picks a free port; read it back from :attr:`port` after :meth:`start`.
    Raises :class:`MetricsServerError` (an ``OSError``) from :meth:`start` when the address cannot
    be bound.
    """

    _READ_TIMEOUT_S = 5.0

    def __init__(self, metrics: ConsumerMetrics, health: HealthCheck, host: str, port: int) -> None:
        self._metrics, self._health = metrics, health
        self._host, self.port = host, port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, self._host, self.port)
        except OSError as exc:
            error = MetricsServerError(_listen_error(self._host, self.port, exc))
            error.errno = exc.errno
            raise error from exc
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._READ_TIMEOUT_S)
            parts = head.split(b"\r\n", 1)[0].split()
            method, path = (parts[0], parts[1].split(b"?")[0]) if len(parts) >= 2 else (b"", b"")
            status, ctype, body = await self._route(method, path)
            writer.write(b"HTTP/1.0 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                         % (status, ctype.encode(), len(body)))
            if method != b"HEAD":
                writer.write(body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass  # a client that hangs up or sends garbage gets nothing; the server goes on
        finally:
            writer.close()

    async def _route(self, method: bytes, path: bytes) -> tuple[bytes, str, bytes]:
        if method not in (b"GET", b"HEAD"):
            return b"405 Method Not Allowed", "text/plain", b"GET only\n"
        if path == b"/metrics":
            return b"200 OK", CONTENT_TYPE_LATEST, self._metrics.render()
        if path == b"/healthz":
            healthy, details = await self._health()
            status = "ok" if healthy else "unhealthy"
            if healthy and any(isinstance(s, dict) and s.get("degraded")
                               for s in (details.get("sources") or {}).values()):
                status = "degraded"
            body = json.dumps({"status": status, **details}).encode()
            return (b"200 OK" if healthy else b"503 Service Unavailable"), "application/json", body
        return b"404 Not Found", "text/plain", b"try /metrics or /healthz\n"


def _listen_error(host: str, port: int, exc: OSError) -> str:
    """One line naming the setting at fault: the port (in use, not allowed) or the host."""
    code = exc.errno if isinstance(exc.errno, int) else None
    why = f"{os.strerror(code)} (errno {code})" if code and code > 0 else (exc.strerror or str(exc))
    if exc.errno in (errno.EADDRINUSE, errno.EACCES):
        option = f"--metrics-port {port} (metrics_port)"
    elif code is None or code < 0 or code == errno.EADDRNOTAVAIL or isinstance(exc, socket.gaierror):
        option = f"--metrics-host {host} (metrics_host)"
    else:
        option = f"--metrics-host/--metrics-port {host}:{port}"
    return f"{option}: metrics server cannot listen on {host}:{port}: {why}"
