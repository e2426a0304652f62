"""``DiscoveryService``: providers behind a hard deadline, fresh-only answers, asynchronous indexing.

The one object the scheduler (or any caller) talks to::

    service = DiscoveryService(load_discovery_settings(), db="sqlite:///ledger.db")
    service.register_donor(DonorRecord(...))            # queued; indexed on the indexer thread
    match = service.lookup(token_ids, None, model_id, namespace_digest)   # ≤ lookup_timeout_s
    service.lookup_async(token_ids, text, model_id, namespace_digest)     # telemetry, off the path

Lookup contract (DESIGN §2 rule 4, §7):

* every provider runs on its own thread (:mod:`.runner`), or with ``provider_isolation = "process"``
  in its own child process (:mod:`.isolation`; the caller then waits on pipes and never for the GIL
  of a provider running Python); with ``wait_priority = "fifo"`` an inline caller runs at
  ``SCHED_FIFO`` priority 1 until it returns (:mod:`.priority`); the caller waits at most the deadline
  (``lookup_timeout_s``, default 2 ms, for :meth:`lookup`) plus a small bound, then returns;
  unfinished providers are ``timeout`` misses, exceptions ``error`` misses, refusals
  ``policy_denied`` — all counted (:mod:`.telemetry`), none raised;
* every candidate is checked against the ledger before it can be returned
  (:meth:`ledger.client.LedgerClient.donor_freshness` without block liveness: donor state,
  generation = the engine's, expiry, namespace digest — which covers the cache salt, LoRA, model
  and layout): a stale,
  quarantined, evicted, unsaved or expired donor is dropped as ``stale``, a donor of another
  namespace as ``namespace_mismatch``; neither is ever returned. Block liveness (freshness policy
  ``engine``) is NOT re-checked here: the scheduler's lease and the worker's revalidation do that
  before any load, and a semantic candidate is never loaded;
* prompt text reaches providers only when ``allow_prompt_text``; the text is dropped otherwise.

Indexing contract: :meth:`register_donor` only enqueues (bounded; a full queue drops and counts).
The indexer thread drops a registration whose donor the ledger reports stale, or whose generation
differs from the engine's current one (``generation_mismatch``), strips the text unless allowed,
then hands the record to every provider; beyond ``max_indexed_donors`` the oldest is forgotten.

Raises (constructor only): ConnectorConfigError for bad providers; PersistenceError when the
ledger is unreachable.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from connector.discovery.embedding import NotPrepared
from connector.discovery.isolation import ProcessProvider, start_processes, wait_processes
from connector.discovery.priority import raised_priority
from connector.discovery.registry import build_providers
from connector.discovery.runner import Job, ProviderLane, fresh_only, wait_all
from connector.discovery.settings import DiscoverySettings
from connector.discovery.telemetry import DiscoveryMetrics, log_lookup, metrics_for
from connector.discovery.types import DiscoveryProvider, DonorRecord, Match, Query, readonly_tokens
from ledger.client import LedgerClient
from ledger.types import FreshnessPolicy, StaleReason

__all__ = ["DiscoveryService"]

log = logging.getLogger(__name__)
_DIGEST = re.compile(r"^[0-9a-f]{32}$")
_OK_AT_INDEX = {None, StaleReason.NOT_SAVED}  # a donor is indexed before its bytes are saved
_IDLE_S = 0.05


@dataclasses.dataclass(slots=True)
class _Result:
    matches: list[Match]
    outcomes: dict[str, str]
    dropped: dict[str, int]


class DiscoveryService:
    """See the module docstring.

    Args:
        settings: discovery settings (default: :class:`DiscoverySettings` defaults).
        db: the ledger URL (required: nothing is shown without a ledger check).
        metrics: where to count (default: a private registry, or the shared metrics of ``registry``).
        providers: already built providers, used instead of ``settings.providers``.
    """

    def __init__(self, settings: DiscoverySettings | None = None, *, db: str, metrics: DiscoveryMetrics | None = None,
                 registry: Any = None, providers: Sequence[DiscoveryProvider] | None = None) -> None:
        self.settings = s = settings or DiscoverySettings()
        self.metrics = metrics or (metrics_for(registry) if registry is not None else DiscoveryMetrics())
        self._processes: list[ProcessProvider] = []
        if providers is None and s.provider_isolation == "process":
            self._processes = start_processes(s, db=db, registry_metrics=self.metrics)
            self.providers: list[DiscoveryProvider] = list(self._processes)
        else:
            self.providers = list(providers) if providers is not None else build_providers(s, db=db)
        for provider in self.providers:
            if hasattr(provider, "on_embed"):
                provider.on_embed = self.metrics.embedding_seconds.observe  # type: ignore[attr-defined]
        self.db = db
        try:
            self._ledger = LedgerClient(db, check=False)  # thread-safe: one DBAPI connection per thread
        except BaseException:
            for proc in self._processes:  # no provider process outlives a service that failed to start
                proc.close(0.5)
            raise
        self._lanes = {} if self._processes else {
            p.name: ProviderLane(p.name, s.provider_queue_max) for p in self.providers}
        self._order: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._index_queue: queue.Queue[tuple[str, Any] | None] = queue.Queue(maxsize=s.index_queue_max)
        self._lookup_queue: queue.Queue[tuple | None] = queue.Queue(maxsize=s.lookup_queue_max)
        self._indexer = threading.Thread(target=self._index_loop, name="semkv-discovery-index", daemon=True)
        self._looker = threading.Thread(target=self._lookup_loop, name="semkv-discovery-lookup", daemon=True)
        self._indexer.start()
        self._looker.start()
        self._closed = False

    # ============================================================ lookups
    def lookup(self, token_ids: Sequence[int] | np.ndarray, prompt_text: str | None, model_id: str, namespace: str,
               *, tokens_per_block: int = 32, deadline_s: float | None = None, inline: bool = True,
               request_id: str | None = None) -> Match | None:
        """The best FRESH match for a target prompt, or None. Waits at most ``deadline_s`` (default
        ``lookup_timeout_s``) plus a small bound; never raises for a provider's sake.

        Args:
            token_ids: the target prompt's token ids.
            prompt_text: its text, used only when the settings allow prompt text.
            model_id: tokens are only compared with donors of the same model id.
            namespace: the request's namespace digest (32 hex chars); anything else is ``policy_denied``.
            inline: on the scheduler path (providers must not embed; see :class:`Query`).
        """
        matches = self.candidates(token_ids, prompt_text, model_id, namespace, tokens_per_block=tokens_per_block,
                                  deadline_s=deadline_s, inline=inline, request_id=request_id,
                                  path="inline" if inline else "background")
        return matches[0] if matches else None

    def candidates(self, token_ids: Sequence[int] | np.ndarray, prompt_text: str | None, model_id: str,
                   namespace: str, *, tokens_per_block: int = 32, deadline_s: float | None = None,
                   inline: bool = False, request_id: str | None = None, path: str = "placement",
                   limit: int | None = None) -> list[Match]:
        """Every fresh match of every provider that answered in time, best first (placement advice).

        Raises:
            ValueError: malformed ``token_ids`` (negative, not one-dimensional) or ``tokens_per_block < 1``.
        """
        if tokens_per_block < 1:
            raise ValueError("tokens_per_block must be >= 1")
        args = (token_ids, prompt_text, model_id, namespace, tokens_per_block, deadline_s, inline, request_id, path,
                limit)
        if inline and self.settings.wait_priority == "fifo":  # the whole call: the OS may preempt it anywhere
            with raised_priority(lambda r: self.metrics.wait_priority.labels(result=r).inc()):
                return self._candidates(*args)
        return self._candidates(*args)

    def _candidates(self, token_ids: Sequence[int] | np.ndarray, prompt_text: str | None, model_id: str,
                    namespace: str, tokens_per_block: int, deadline_s: float | None, inline: bool,
                    request_id: str | None, path: str, limit: int | None) -> list[Match]:
        started = time.perf_counter()
        timeout = deadline_s if deadline_s is not None else (
            self.settings.lookup_timeout_s if inline else self.settings.background_timeout_s)
        text = prompt_text if self.settings.allow_prompt_text else None
        query = Query(readonly_tokens(token_ids), text, model_id, namespace, tokens_per_block, inline)
        deadline = started + timeout
        result = self._run(query, deadline, prompt_text is not None)
        elapsed = time.perf_counter() - started
        self.metrics.lookups.labels(path=path).inc()
        self.metrics.lookup_seconds.labels(path=path).observe(elapsed)
        result.matches.sort(key=Match.rank_key, reverse=True)
        best = result.matches[0] if result.matches else None
        if best is not None and path != "placement":
            if best.match_type == "exact_equivalent":
                self.metrics.exact_hits.inc()
            else:
                self.metrics.semantic_placement.labels(provider=best.provider).inc()
                self.metrics.semantic_placement_tokens.labels(provider=best.provider).inc(best.reusable_token_count)
        log_lookup(request_id=request_id, path=path, elapsed_s=elapsed, outcomes=result.outcomes,
                   dropped=result.dropped, best=best)
        return result.matches[:limit] if limit is not None else result.matches

    def lookup_async(self, token_ids: Sequence[int] | np.ndarray, prompt_text: str | None, model_id: str,
                     namespace: str, *, tokens_per_block: int = 32, request_id: str | None = None) -> bool:
        """Queue a telemetry lookup (``background_timeout_s``, may embed); False (counted) when full."""
        if self._closed:
            return False
        try:
            self._lookup_queue.put_nowait((np.array(token_ids, dtype=np.int64), prompt_text, model_id, namespace,
                                           tokens_per_block, request_id))
            return True
        except queue.Full:
            self.metrics.async_dropped.inc()
            return False

    def _submit(self, provider: DiscoveryProvider, query: Query, deadline_mono: float) -> Job | None:
        """Hand ``query`` to ``provider``: to its child process, or to its thread's lane."""
        if self._processes:
            return provider.submit(query, self.settings.candidates_per_provider, deadline_mono)  # type: ignore[attr-defined]
        return self._lanes[provider.name].submit(lambda job, p=provider: self._provider_job(p, query, job))

    def _run(self, query: Query, deadline: float, text_given: bool) -> _Result:
        outcomes: dict[str, str] = {}
        dropped: dict[str, int] = {}
        denied = self._denied(query)
        jobs: list[tuple[DiscoveryProvider, Job | None]] = []
        deadline_mono = time.monotonic() + (deadline - time.perf_counter())
        for provider in self.providers:  # self._processes when providers run in processes
            if denied or (provider.needs_text and not query.text):
                outcomes[provider.name] = "policy_denied"
                continue
            jobs.append((provider, self._submit(provider, query, deadline_mono)))
        if self._processes:
            finished = wait_processes(jobs, deadline)  # type: ignore[arg-type]
        else:
            finished = wait_all([job for _, job in jobs], deadline)
        matches: list[Match] = []
        for (provider, job), done in zip(jobs, finished, strict=True):
            name = provider.name
            if not done or job is None:
                outcomes[name] = "timeout"
            elif isinstance(job.error, NotPrepared):
                outcomes[name] = "not_prepared"
                self._enqueue(("prepare", (provider, dataclasses.replace(query, inline=False))))
            elif job.error is not None:
                outcomes[name] = "error"
                log.error("semkv discovery: provider %s failed: %r", name, job.error)
            else:
                fresh, drops = job.value
                self.metrics.provider_seconds.labels(provider=name).observe(job.elapsed_s)
                for reason, count in drops.items():
                    self.metrics.dropped.labels(provider=name, reason=reason).inc(count)
                    dropped[f"{name}:{reason}"] = count
                outcomes[name] = "hit" if fresh else "miss"
                matches.extend(fresh)
        for name, outcome in outcomes.items():
            self.metrics.outcomes.labels(provider=name, outcome=outcome).inc()
        return _Result(matches, outcomes, dropped)

    def _denied(self, query: Query) -> bool:
        allowed = self.settings.allowed_models
        return not _DIGEST.match(query.namespace or "") or (allowed is not None and query.model_id not in allowed)

    def _provider_job(self, provider: DiscoveryProvider, query: Query, job: Job) -> tuple[list[Match], dict[str, int]]:
        found = provider.candidates(query, self.settings.candidates_per_provider)
        return fresh_only(found, query.namespace, self._ledger, lambda: job.abandoned)

    # ============================================================ indexing
    def register_donor(self, record: DonorRecord) -> bool:
        """Queue a donor for indexing (never blocks). False, counted ``queue_full``, when full."""
        return self._enqueue(("donor", record))

    def prepare(self, text: str) -> bool:
        """Queue the embedding of ``text`` so an inline lookup with it can answer from cache."""
        query = Query(readonly_tokens([]), text, "", "", 1, False)
        return all(self._enqueue(("prepare", (p, query))) for p in self.providers if p.needs_text)

    def forget(self, donor_id: str) -> bool:
        """Queue the removal of a donor from every index."""
        return self._enqueue(("forget", donor_id))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything queued so far is indexed and published, and queued lookups ran.
        False when the service is closed or the wait timed out."""
        if self._closed:
            return False
        done_index, done_lookup = threading.Event(), threading.Event()
        self._index_queue.put(("flush", done_index), timeout=timeout_s)
        self._lookup_queue.put(("flush", done_lookup), timeout=timeout_s)  # type: ignore[arg-type]
        return done_index.wait(timeout_s) and done_lookup.wait(timeout_s)

    def indexed(self) -> dict[str, int]:
        """Donors per provider index (providers that expose ``size``)."""
        return {p.name: int(getattr(p, "size", 0)) for p in self.providers}

    def _enqueue(self, item: tuple[str, Any]) -> bool:
        if self._closed:
            return False
        try:
            self._index_queue.put_nowait(item)
        except queue.Full:
            self.metrics.index.labels(outcome="queue_full").inc()
            return False
        self.metrics.index_queue.set(self._index_queue.qsize())
        return True

    def _index_loop(self) -> None:
        while True:
            try:
                # providers in processes publish on their own: then this thread sleeps until there is work
                # (a thread waking 20 times a second can hold the GIL just when the inline caller wakes)
                item = self._index_queue.get(timeout=None if self._processes else _IDLE_S)
            except queue.Empty:
                self._flush_providers(force=False)
                continue
            if item is None:
                return
            kind, payload = item
            try:
                if kind == "donor":
                    self._index(payload)
                elif kind == "prepare":
                    payload[0].prepare(payload[1])
                elif kind == "forget":
                    self._forget(payload)
                elif kind == "flush":
                    self._flush_providers(force=True)
                    payload.set()
            except Exception:  # boundary: the indexer thread never dies on one bad item
                log.exception("semkv discovery: indexing %s failed", kind)
                self.metrics.index.labels(outcome="error").inc()
            self.metrics.index_queue.set(self._index_queue.qsize())

    def _index(self, record: DonorRecord) -> None:
        reason = self._freshness(record.donor_id, record.namespace, time.time())
        if reason == StaleReason.GENERATION_MISMATCH or (
                reason in _OK_AT_INDEX and record.generation is not None
                and record.generation != self._engine_generation(record.engine_id)):
            self.metrics.index.labels(outcome="generation_mismatch").inc()
            return
        if reason not in _OK_AT_INDEX:
            self.metrics.index.labels(outcome="stale").inc()
            return
        if record.text is not None and not self.settings.allow_prompt_text:
            record = dataclasses.replace(record, text=None)
        if not record.text and any(p.needs_text for p in self.providers):
            self.metrics.index.labels(outcome="no_text").inc()
        for provider in self.providers:
            if provider.needs_text and not record.text:
                continue
            try:
                provider.index(record)
            except Exception:  # boundary: one provider's failure leaves the others' indexes intact
                log.exception("semkv discovery: provider %s failed to index %s", provider.name, record.donor_id)
                self.metrics.index.labels(outcome="error").inc()
        self._order[record.donor_id] = None
        self._order.move_to_end(record.donor_id)
        while len(self._order) > self.settings.max_indexed_donors:
            self._forget(next(iter(self._order)))
        self.metrics.index.labels(outcome="indexed").inc()
        for name, size in self.indexed().items():
            self.metrics.indexed.labels(provider=name).set(size)

    def _forget(self, donor_id: str) -> None:
        self._order.pop(donor_id, None)
        for provider in self.providers:
            provider.forget(donor_id)

    def _flush_providers(self, *, force: bool) -> None:
        for provider in self.providers:
            try:
                provider.flush(force)
            except Exception:  # boundary
                log.exception("semkv discovery: provider %s failed to publish its index", provider.name)

    def _freshness(self, donor_id: str, namespace: str, now: float) -> StaleReason | None:
        """The donor's freshness without block liveness (namespace, state, expiry, generation). None: fresh."""
        return self._ledger.donor_freshness(donor_id, namespace=namespace, num_blocks=0,
                                            policy=FreshnessPolicy.STORE, now=now)

    def _engine_generation(self, engine_id: str) -> int | None:
        engine = self._ledger.engine(engine_id)
        return None if engine is None else engine.generation

    # ============================================================ background lookups, lifecycle
    def _lookup_loop(self) -> None:
        while (item := self._lookup_queue.get()) is not None:
            if isinstance(item[0], str):  # ("flush", event)
                item[1].set()
                continue
            tokens, text, model_id, namespace, tpb, request_id = item
            try:
                self.lookup(tokens, text, model_id, namespace, tokens_per_block=tpb, inline=False,
                            request_id=request_id)
            except Exception:  # boundary: telemetry never kills its thread
                log.exception("semkv discovery: background lookup failed")

    def close(self) -> None:
        """Stop the threads (queued work is abandoned) and close the providers and ledger reads."""
        if self._closed:
            return
        self._closed = True
        for q in (self._index_queue, self._lookup_queue):
            try:
                q.put(None, timeout=2.0)  # type: ignore[arg-type]
            except queue.Full:
                log.warning("semkv discovery: queue full at close; its thread is abandoned (daemon)")
        self._indexer.join(5.0)
        self._looker.join(5.0)
        for lane in self._lanes.values():
            lane.close()
        for provider in self.providers:
            try:
                provider.close()
            except Exception:  # shutdown goes on: every other provider (and process) is still closed
                log.exception("semkv discovery: closing provider %s failed", provider.name)
        self._ledger.close()

    def __enter__(self) -> DiscoveryService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
