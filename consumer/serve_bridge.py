"""trtllm-serve bridge: ``POST {url}/kv_cache_events`` → ZMQ PUB with a replay ROUTER (issue 8).

``trtllm-serve`` (TensorRT-LLM's OpenAI-compatible server) does not hand out its ``LLM`` object, so
:class:`~consumer.bridge.LlmEventBridge` cannot run beside it. It serves the same event dicts over
HTTP instead; :class:`ServeEventBridge` polls that endpoint and republishes every returned event
through the same :class:`~consumer.bridge.KvEventPublisher` path (one batch per attention-DP rank
per response, :class:`~consumer.bridge.PollingBridge`), so the consumer sees one wire for all engines::

    publisher = KvEventPublisher("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    with ServeEventBridge("http://127.0.0.1:8000", publisher):   # start() ... close()
        ...                                                       # or: semkv-ledger bridge-serve

The endpoint, as read in NVIDIA/TensorRT-LLM (``tensorrt_llm/serve/openai_server.py`` at
00057725d9a6591f033e44f31c219e2426827bb7; ``tensorrt_llm/executor/executor.py``,
``tensorrt_llm/executor/result.py``):

* ``OpenAIServer.register_routes`` adds ``/kv_cache_events`` with ``methods=["POST"]`` (no body).
  Its handler iterates ``generator.get_kv_cache_events_async(2)``, stops on ``IndexError`` and
  returns ``JSONResponse(content=events)``: a JSON list of the LLM-API event dicts of
  reference/WIRE.md §A (block hashes as plain JSON integers, exact also above 2**63). Every call
  drains the queue: what one response carried is gone from the server.
* The drain waits up to 2 s for each next event (``IterationResult.__anext__``), so a call returns
  only after 2 s without a new event; under steady traffic it may take long (``timeout_s``).
  After such a timeout the result stays "done" (``[]`` at once) until the next request is
  submitted (``IterationResult.mark_undone``).
* Before the first generation request there is no event queue yet: ``GenerationExecutor.
  aget_kv_events`` asserts, and the server answers HTTP 500.
* Events exist only with ``kv_cache_config.event_buffer_max_size > 0`` (and block reuse on).

Failure policy (fail closed, never crash): every failed poll is logged, counted
(:class:`ServeBridgeStats`) and retried with exponential back-off. A failed poll whose response
may have carried drained events (a timeout or a broken connection after the request went out, a
2xx body that is not a JSON list, a 5xx once the server has answered 200) consumes one seq without
sending anything (:meth:`KvEventPublisher.mark_lost`, once per run of consecutive such failures):
subscribers see the loss as a seq gap, replay cannot fill it, and the ledger records it. A poll that
never reached the server (connection refused, connect timeout), a 4xx (no handler ran) and a 5xx
before the first 200 (no queue yet, see above) drained nothing and leave no gap.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import structlog

from consumer.bridge import KvEventPublisher, PollingBridge

__all__ = ["DEFAULT_POLL_INTERVAL_S", "DEFAULT_TIMEOUT_S", "DEFAULT_URL", "EVENTS_PATH", "ServeBridgeStats",
           "ServeEventBridge", "events_url"]  # fmt: skip

log = structlog.get_logger(__name__)

DEFAULT_URL = "http://127.0.0.1:8000"  # trtllm-serve's default --host/--port
EVENTS_PATH = "/kv_cache_events"
DEFAULT_POLL_INTERVAL_S = 0.05
DEFAULT_TIMEOUT_S = 30.0  # > the server's own 2 s wait per event; past it the response is counted lost

# httpx errors raised before the request reached the server: nothing can have been drained
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol,
             httpx.LocalProtocolError)  # fmt: skip


def events_url(url: str) -> str:
    """``{url}/kv_cache_events`` for trtllm-serve's base URL; ValueError unless absolute http(s)."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"invalid trtllm-serve URL {url!r}: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"trtllm-serve URL must be http(s)://host[:port], got {url!r}")
    if parsed.port is not None and not 1 <= parsed.port <= 65535:  # httpx keeps 99999 as given
        raise ValueError(f"trtllm-serve URL {url!r}: port {parsed.port} is not in 1..65535")
    return url.rstrip("/") + EVENTS_PATH


@dataclass
class ServeBridgeStats:
    """Counters of a :class:`ServeEventBridge` (:meth:`~ServeEventBridge.stats` returns a copy).

    ``poll_errors = connect_errors + http_errors + transport_errors + decode_errors``.
    """

    polls: int = 0  # HTTP requests made
    polls_ok: int = 0  # answered 2xx with a JSON list (empty lists included)
    events_seen: int = 0
    batches_published: int = 0
    poll_errors: int = 0
    connect_errors: int = 0  # never reached the server (refused, connect timeout): nothing drained
    http_errors: int = 0  # answered with a status other than 2xx
    transport_errors: int = 0  # failed after the request went out (read timeout, reset, truncated body)
    decode_errors: int = 0  # 2xx, but the body is not a JSON list
    polls_lost: int = 0  # failed polls whose response may have carried drained events
    seq_gaps_marked: int = 0  # seqs consumed for them: one per run of consecutive lost polls
    status_codes: dict[int, int] = field(default_factory=dict)  # non-2xx answers by status


class ServeEventBridge(PollingBridge):
    """Background thread: ``POST {url}/kv_cache_events`` every ``poll_interval_s`` → publisher.

    Args:
        url: trtllm-serve's base URL (``http://host:port``; a path prefix is kept).
        publisher: where the events go (closed by :meth:`close` unless ``close_publisher=False``).
        poll_interval_s: wait after each successful poll.
        timeout_s: HTTP timeout (connect; and no byte for this long while reading: trtllm-serve
            sends its response whole, so in effect the response time). A slower response is
            abandoned and counted lost (a seq gap): the server had drained its queue into it.
        min_backoff_s / max_backoff_s: retry delays after a failed poll (doubling).
        client: an ``httpx.Client`` to use instead of the bridge's own (not closed by the bridge).

    Raises:
        ValueError: ``url`` is not an absolute http(s) URL.
    """

    def __init__(
        self,
        url: str,
        publisher: KvEventPublisher,
        *,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        close_publisher: bool = True,
        min_backoff_s: float = 0.1,
        max_backoff_s: float = 2.0,
        client: httpx.Client | None = None,
    ) -> None:
        self.events_url = events_url(url)
        if poll_interval_s < 0 or timeout_s <= 0:
            raise ValueError("poll_interval_s must be >= 0 and timeout_s > 0")
        super().__init__(publisher, close_publisher=close_publisher, max_backoff_s=max_backoff_s,
                         min_backoff_s=min_backoff_s, idle_wait_s=poll_interval_s,
                         thread_name="semkv-serve-event-bridge")
        self.url = url.rstrip("/")
        self._own_client = client is None
        # trust_env=False: a sidecar talks to its trtllm-serve directly, never through HTTP(S)_PROXY
        self._client = client or httpx.Client(timeout=httpx.Timeout(timeout_s), trust_env=False,
                                              headers={"accept": "application/json"})
        self._stats = ServeBridgeStats()
        self._served_ok = False  # a 2xx seen: the server's event queue exists (5xx may now lose events)
        self._consecutive_failures = 0

    def start(self) -> ServeEventBridge:
        super().start()
        return self

    def __enter__(self) -> ServeEventBridge:
        return self.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop polling, poll until the server returns nothing more, flush (and close) the
        publisher, close the HTTP client. Idempotent."""
        super().close(timeout_s)
        if self._own_client:
            self._client.close()  # a poll still running after the timeout fails and is counted

    def stats(self) -> ServeBridgeStats:
        return replace(self._stats, events_seen=self.events_seen, batches_published=self.batches_published,
                       poll_errors=self.poll_errors, status_codes=dict(self._stats.status_codes))

    def __repr__(self) -> str:
        s = self.stats()
        return f"<ServeEventBridge {self.events_url} polls={s.polls} events={s.events_seen} errors={s.poll_errors}>"

    # -- bridge thread --

    def _drain_once(self, *, final: bool) -> int | None:
        s = self._stats
        s.polls += 1
        try:
            response = self._client.post(self.events_url)
        except _NOT_SENT as exc:
            s.connect_errors += 1
            return self._failed("connect", repr(exc), maybe_lost=False)
        except Exception as exc:  # boundary: read timeout, reset, truncated body, client closed at close()
            s.transport_errors += 1
            return self._failed("transport", repr(exc), maybe_lost=True)
        if not response.is_success:
            s.http_errors += 1
            s.status_codes[response.status_code] = s.status_codes.get(response.status_code, 0) + 1
            return self._failed("http", f"HTTP {response.status_code}: {response.text[:200]!r}",
                                maybe_lost=response.status_code >= 500 and self._served_ok,
                                status=response.status_code)
        self._served_ok = True
        try:
            events: Any = response.json()  # json.loads: integers of any size stay exact
        except ValueError as exc:  # not JSON, or not UTF-8
            s.decode_errors += 1
            return self._failed("decode", f"{exc!r} body={response.content[:200]!r}", maybe_lost=True)
        if not isinstance(events, list):
            s.decode_errors += 1
            return self._failed("decode", f"not a JSON list: {type(events).__name__}", maybe_lost=True)
        s.polls_ok += 1
        if self._consecutive_failures:
            log.info("serve_bridge.recovered", url=self.events_url, failed_polls=self._consecutive_failures)
        self._consecutive_failures = 0
        self._poll_succeeded()
        return self._publish_drain(events)

    def _failed(self, kind: str, error: str, *, maybe_lost: bool, status: int | None = None) -> None:
        """Count and log a failed poll; mark a seq lost when its response may have held events."""
        self.poll_errors += 1
        self._consecutive_failures += 1
        n = self._consecutive_failures
        if maybe_lost:
            self._stats.polls_lost += 1
            if self._mark_possible_loss():
                self._stats.seq_gaps_marked += 1
        if n & (n - 1) == 0 or n % 100 == 0:  # 1st, 2nd, 4th, 8th... and every 100th of a run
            hint = None
            if status is not None and status >= 500 and not self._served_ok:
                hint = "trtllm-serve answers 500 until its first generation request (no event queue yet)"
            elif kind == "http" and status == 404:
                hint = ("no /kv_cache_events route: is the URL trtllm-serve's base URL (not a multimodal "
                        "encoder's or a disaggregated router's)?")
            log.error("serve_bridge.poll_failed", kind=kind, url=self.events_url, error=error, maybe_lost=maybe_lost,
                      consecutive=n, errors_total=self.poll_errors, hint=hint)
        return None
