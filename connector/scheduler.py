"""Scheduler half of the semkv KV Cache Connector (rank 0; DESIGN §2, §3, §4).

Hooks, in TensorRT-LLM's call order (``connector/_trtllm.py``):

1. ``get_num_new_matched_tokens(request, num_computed_tokens)`` — once per request, from C++ while
   the block manager HOLDS ITS LOCK. TensorRT-LLM's own prefix reuse ran first (rule 1): the lookup
   starts at the block boundary ``num_computed_tokens`` and only adds tokens past it. In
   ``exact_equivalent`` it asks the ledger for the longest FRESH donor span of the request's
   chained content keys in the request's namespace — in memory, from the scheduler's
   :class:`~ledger.donor_view.DonorView` of the ledger (donors whose bytes this host's store holds,
   with their block liveness; caught up every ``donor_view_refresh_s`` by a periodic job on the
   connector's ledger thread) —
   checks the donor store holds checksummed bytes (this process's record of the entries it
   checksummed, re-checked against the files every ``store_recheck_s`` on the same thread), and
   pins the donor in the store BEFORE answering ``(n, False)`` in whole blocks, leaving at least
   one prompt token to compute. The view path makes no call that releases the GIL (no file
   system call, no ``os.urandom``, keys hashed in slices python-xxhash hashes holding it; its locks
   are held by other threads only for short sections): a released GIL goes to whichever
   connector thread waits for it, for up to ``sys.getswitchinterval()``. The ledger
   lease (``lease_taken``, which re-checks freshness and every promised block in its write
   transaction) is queued by ``update_state_after_alloc`` on that ledger thread, so the answer never
   waits for the ledger's write lock and a promise the engine never allocates costs no ledger
   write; ``build_connector_meta`` waits for that lease (``lease_confirm_timeout_s``) before it
   ships the plan, and a refused or late lease ships the plan FAILED — the request fails closed,
   or is recomputed where the engine can (counted in ``semkv_promises_broken_total``).
   The ledger/store part runs under a hard deadline (``lookup_timeout_s``): on SQLite on the
   engine's own thread, the ledger interrupting its statements at the deadline; on PostgreSQL on
   a lookup thread that is abandoned. Key hashing (O(prompt), CPU only) runs before it.
   Anything doubtful — unknown or unsupported namespace field, stale/quarantined donor, missing or
   corrupt bytes, refused or expiring lease, deadline, any exception — is a miss ``(0, False)``,
   counted by reason; nothing ever raises into the engine (rule 4). ``discovery_only`` and
   ``placement`` always answer ``(0, False)`` at once and do their lookup in the background
   (telemetry only). With donor discovery on (``[discovery] enabled = true``, or a ``discovery=``
   service injected), the prompt is then shown to the :class:`~connector.discovery.service.DiscoveryService`
   AFTER the answer is fixed: queued to its thread (default), or inline under its own hard deadline
   (``[discovery] inline = true``). Discovery is evidence, never authority: it cannot change the
   answer, and its failures are logged and ignored (rules 2 and 4).
2. ``update_state_after_alloc(request, block_ids)`` — binds the recipient-owned target blocks
   ``block_ids[num_computed // tpb : ... + n_blocks]`` into a :class:`~connector.plan.LoadPlan` and
   queues the promise's ledger lease. If the allocation does not match the promise, the pin is
   released and the plan is replaced by a FAILED plan, so the worker fails the request instead of
   letting it compute on unloaded blocks.
3. ``build_connector_meta(scheduler_output)`` — every iteration: ships plans (with the request's
   first report, after checking ``computed_position`` and block ids agree, and once the plan's
   ledger lease is confirmed) and save instructions.
4. ``request_finished(request, cache_block_ids)`` — once per request, also on failure: releases the
   request's lease (rule 7) and, for a request that completed its prefill, registers it as a donor
   in the ledger (content keys, engine block hashes, namespace, generation) and asks the worker to
   save its bytes; returns True so the blocks stay allocated until the worker reports the save.
   With discovery on, the new donor (its whole prompt blocks' tokens, the generation it was
   registered in, its text when allowed) is queued for indexing on discovery's bounded queue; the
   indexer thread drops it if the ledger says it is stale or its generation is no longer current.

Newer TensorRT-LLM ``cancel_load``/``request_reset`` (present only when the base class has them, or
via :class:`ResetHooksMixin`) release the lease and drop the plan; the engine then recomputes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from connector._trtllm import ENGINE_RECOMPUTES_FAILED_LOADS, TRTLLM_WITHOUT_RECOMPUTE, KvCacheConnectorScheduler
from connector.discovery.hook import SchedulerDiscovery
from connector.donors import DonorRegistrar, LedgerBusy
from connector.donor_store import ChecksumMismatch, DonorStoreError, EntryMissing, FileDonorStore
from connector.lookup import BackgroundRunner, DeadlineRunner, MissDiagnosis, stale_reason_name
from connector.metrics import ConnectorMetrics, process_metrics, serve_metrics
from connector.namespace import (
    DeploymentNamespace,
    Namespace,
    NamespaceUnknown,
    PROBE_TOKENS,
    PrefixKeys,
    content_keys,
    prefix_keys,
    probe_key,
)
from connector.plan import ConnectorMetadata, LoadPlan, SaveInstruction
from connector.settings import ConnectorSettings, load_connector_settings
from ledger.donor_view import DonorView, ViewDonor
from ledger.errors import DeadlineExceeded, LedgerError, PersistenceError, lock_timed_out
from ledger.queries import DonorSpan, Lease, LedgerClient
from ledger.types import FreshnessPolicy, StaleReason

if TYPE_CHECKING:
    from connector.discovery.service import DiscoveryService

__all__ = ["ResetHooksMixin", "SemKvScheduler", "process_rank"]

log = logging.getLogger(__name__)
_LEDGER_BACKOFF_S = (1.0, 30.0)
"""After a ledger write failed (a lease: any ledger error; a donor registration: the write lock's
timeout), lookups miss (``ledger_busy``) and finished requests are not registered for this long
(seconds), doubling with each failure in a row up to the second value; a write that succeeds resets
it. Each promise made into a locked ledger would otherwise break, and each registration wait
``register_lock_wait_s``, in turn."""
RECHECK_ENTRIES_PER_TICK = 256
"""Donor store entries stat'ed per ``store_recheck_s`` run (round robin): 2.2 ms of the ledger
thread per run here (measured, 1000 entries) however many entries the store verified, ~4 % of one
CPU at the default 50 ms; an entry changed outside the store is found within ``ceil(entries / 256)``
runs."""


class _Miss(Exception):
    def __init__(self, reason: str, field: str | None = None, detail: str = "") -> None:
        super().__init__(reason)
        self.reason, self.field, self.detail = reason, field, detail


@dataclasses.dataclass(slots=True)
class _Promise:
    span: DonorSpan
    lease_id: str
    lease: Future[Lease | StaleReason] | None
    """The ledger lease: queued once the engine allocated the target blocks, written by the lease
    thread (None until queued: a promise never allocated needs no ledger write)."""
    start_block: int
    num_blocks: int
    namespace: str
    promised_at: float
    """When the lookup answered (seconds since the epoch): the lease's clock."""


@dataclasses.dataclass(slots=True)
class _RequestState:
    request_id: int | None = None
    namespace: Namespace | NamespaceUnknown | None = None
    keys: PrefixKeys | None = None
    promise: _Promise | None = None
    plan: LoadPlan | None = None
    shipped: bool = False
    block_hashes: list[int] = dataclasses.field(default_factory=list)


def _span_of(donor: ViewDonor, num_blocks: int) -> DonorSpan:
    return DonorSpan(donor.donor_id, donor.engine_id, donor.generation, num_blocks, donor.tokens_per_block,
                     donor.store_ref, donor.checksum, donor.provider_generation)


def process_rank() -> int:
    """This process's MPI/torch rank from the usual environment variables (0 when none is set)."""
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def _window_size(llm_args: Any, settings: ConnectorSettings) -> int:
    """The attention window the engine's KV events carry, so donors match the event stream's blocks."""
    if settings.window_size:
        return settings.window_size
    adapted = getattr(llm_args, "semkv_window_size", None)  # an adapter whose events carry none says 0
    if adapted is not None:
        return int(adapted)
    value = getattr(llm_args, "max_seq_len", None)
    if not value:
        log.warning("semkv: llm_args.max_seq_len unknown; set window_size so donors match the engine's events")
    return int(value or 0)


class _FreshSpans:
    """What :class:`~connector.donors.DonorRegistrar` asks before registering a donor ("is the same
    span already a fresh donor?"), answered by the ledger: ``find_span`` checks block liveness
    itself under policy ``engine``, so ``live_prefix`` is the span's own length."""

    def __init__(self, ledger: LedgerClient, policy: FreshnessPolicy) -> None:
        self.ledger, self.policy = ledger, policy

    def find_span(self, namespace: str, keys: list[bytes], now: float, min_blocks: int = 1) -> DonorSpan | None:
        return self.ledger.find_donor_span(namespace, keys, policy=self.policy, now=now, min_blocks=min_blocks)

    def live_prefix(self, span: DonorSpan, num_blocks: int) -> int:
        return min(span.num_blocks, num_blocks)


class SemKvScheduler(KvCacheConnectorScheduler):
    """The connector's scheduler (see the module docstring for each hook's contract).

    Args:
        llm_args: TensorRT-LLM's ``TorchLlmArgs`` (or the harness's).
        settings, ledger, store, metrics: injected for tests and embedding; by default settings come
            from ``TRTLLM_SEMKV_CONFIG`` / ``TRTLLM_SEMKV_*``, the rest from the settings.
        discovery: a :class:`~connector.discovery.service.DiscoveryService` to use (and share, e.g.
            between the engines of one process; the caller closes it). Default: when
            ``settings.discovery.enabled``, one built from ``settings.discovery`` on ``settings.db``,
            counting on ``metrics``' registry and closed by :meth:`close`; otherwise none.
        text_of: ``request -> str | None``, the prompt text given to discovery when
            ``allow_prompt_text`` (default :func:`~connector.discovery.types.request_text`).

    Raises:
        ConnectorConfigError: invalid settings (including ``mode = "experimental"``, or a discovery
            provider that cannot be built).
        SchemaOutOfDate, PersistenceError: the ledger is not migrated or not reachable.
    """

    def __init__(self, llm_args: Any, *, settings: ConnectorSettings | None = None, ledger: LedgerClient | None = None,
                 store: FileDonorStore | None = None, metrics: ConnectorMetrics | None = None,
                 discovery: DiscoveryService | None = None,
                 text_of: Callable[[Any], str | None] | None = None) -> None:
        super().__init__(llm_args)
        self.settings = s = settings or load_connector_settings()
        self.metrics = metrics or process_metrics()
        if s.metrics_port is not None:
            serve_metrics(self.metrics, s.metrics_port + process_rank())
        # the hot path's labelled children, looked up once (labels() costs a few µs per call)
        self._lookups_counted = self.metrics.lookups.labels(mode=s.mode)
        self._lookup_timed = self.metrics.lookup_seconds.labels(mode=s.mode)
        self.namespace = DeploymentNamespace(llm_args, s.namespace, s.engine_id)
        if self.namespace.unknown is not None:
            u = self.namespace.unknown
            log.warning("semkv: no request of this engine can be materialized: namespace field %s %s: %s",
                        u.field, u.kind, u.detail)
        self.tokens_per_block = self.namespace.tokens_per_block or llm_args.kv_cache_config.tokens_per_block
        self.window_size = _window_size(llm_args, s)
        self.policy = FreshnessPolicy(s.freshness_policy)
        self.holder = s.engine_id or f"{socket.gethostname()}:{os.getpid()}"
        self.ledger = ledger or LedgerClient(s.db, statement_timeout_s=s.ledger_statement_timeout_s)
        self.store = store or FileDonorStore(s.store_dir, s.store_capacity_bytes, ledger=self.ledger)
        self._discovery = SchedulerDiscovery.start(
            s.discovery, discovery, db=s.db, registry=self.metrics.registry, ledger=self.ledger, metrics=self.metrics,
            engine_id=s.engine_id or "", model_id=self.model_id, tokens_per_block=self.tokens_per_block,
            text_of=text_of)
        # the discovery service (shared, or this scheduler's own); None when discovery is off
        self.discovery = self._discovery.service if self._discovery is not None else None
        self._diagnosis = MissDiagnosis(self.ledger, self.store)
        self.lease_before_answer = (TRTLLM_WITHOUT_RECOMPUTE if s.lease_before_answer is None
                                    else s.lease_before_answer)
        """Lease in the lookup (see ``ConnectorSettings.lease_before_answer``; None: on exactly where a
        failed plan cannot be recomputed)."""
        # SQLite reads run on the engine's thread under an interrupting deadline; others, and a lease
        # taken in the lookup (a write no progress handler interrupts), on a thread made now
        self._hot = (None if self.ledger.interruptible and not self.lease_before_answer
                     else DeadlineRunner("semkv-lookup"))
        self._view: DonorView | None = None
        if s.materializes and s.donor_view_refresh_s > 0:
            # A view whose catch-up fails is not used after 20 periods (lookups read the ledger); one
            # whose catch-up is only late (it shares the ledger thread with lease writes) after
            # lease_confirm_timeout_s (past half that, lookups miss with ledger_busy anyway).
            failing_s = max(0.1, 20 * s.donor_view_refresh_s)
            self._view = DonorView(self._in_store, s.donor_view_max_blocks,
                                   max(failing_s, s.lease_confirm_timeout_s), max_failing_s=failing_s)
        self._background = BackgroundRunner("semkv-background", on_drop=self.metrics.telemetry_dropped.inc)
        # leases in order (a release never overtakes its take), never behind telemetry or a
        # background checksum of a big entry; when none is queued, the view's catch-up and the
        # store's recheck (one thread for all three: fewer threads taking the GIL from the engine's)
        self._ledger_jobs = BackgroundRunner("semkv-ledger")
        self._lease_prefix, self._lease_seq = uuid.uuid4().hex[:16], itertools.count()
        self._ledger_paused_until, self._ledger_backoff_s = 0.0, _LEDGER_BACKOFF_S[0]  # see _ledger_failed
        self._ledger_busy_s = s.lease_confirm_timeout_s / 2
        """A lookup misses (``ledger_busy``) while the ledger thread's oldest job has waited or run
        this long (seconds): a lease queued now would likely not be confirmed in time, and a broken
        promise costs the engine ``lease_confirm_timeout_s`` of waiting and the request."""
        self._verifying: set[str] = set()
        self._verifying_lock = threading.Lock()
        self._requests: dict[int, _RequestState] = {}
        self._unshipped: set[int] = set()  # requests holding a promise whose plan has not shipped
        self._saves: deque[SaveInstruction] = deque()
        self._iteration = 0
        registrar_ledger = self._discovery.registrar_ledger if self._discovery is not None else self.ledger
        self._donors = DonorRegistrar(s, self.namespace, registrar_ledger, _FreshSpans(self.ledger, self.policy),
                                      self.metrics, self.tokens_per_block, self.window_size)
        self._record_engine_start()
        self.metrics.ledger_backlog_seconds.set_function(self._ledger_jobs.backlog_s)
        self.metrics.donor_view_age_seconds.set_function(self._view_age)
        self._trust_store_record = False
        """Lookups trust the store's record of verified entries (re-checked by a periodic job)."""
        if self._view is not None:  # after the start is recorded: this engine's old donors are stale in it
            self._load_view()
            self._ledger_jobs.every("donor view catch-up", s.donor_view_refresh_s, self._catch_up_view)
            if s.store_recheck_s > 0:
                self._trust_store_record = True
                self._ledger_jobs.every("donor store recheck", s.store_recheck_s,
                                   lambda: self.store.recheck_verified(RECHECK_ENTRIES_PER_TICK))

    def _catch_up_view(self) -> None:
        """The periodic catch-up of the donor view; a failure shortens how long the view is used."""
        assert self._view is not None
        try:
            self.ledger.refresh_view(self._view)
        except Exception:
            self._view.catch_up_failed()
            raise

    def _view_age(self) -> float:
        """The donor view's age for the metric: seconds, -1.0 without a view (or before its load)."""
        age = self._view.age_s() if self._view is not None else float("inf")
        return age if age != float("inf") else -1.0

    def _load_view(self) -> None:
        """Load the donor view before the first request (the periodic catch-up would take up to one
        period, and lookups read the ledger until then)."""
        assert self._view is not None
        try:
            self.ledger.refresh_view(self._view)
        except LedgerError as exc:  # the ledger is down: lookups read it (and miss) until a catch-up loads the view
            log.warning("semkv: could not load the donor view: %s", exc)

    def _record_engine_start(self) -> None:
        """A connector starting means a new engine process: what the ledger knew of this engine's
        blocks and donors is stale even if its ``created`` event or seq reset is lost on the way."""
        if not self.settings.engine_id or self.settings.mode == "discovery_only":
            return
        try:
            self.ledger.record_engine_start(self.settings.engine_id)
        except LedgerError as exc:  # the ledger is down: lookups will miss until it is back
            log.warning("semkv: could not record the engine start in the ledger: %s", exc)

    # ============================================================ 1. lookup (block-manager lock held)
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` the worker will load before attention reads them.

        Returns ``(n, False)``: ``n`` whole blocks' worth of tokens (0 on any doubt); loads are
        synchronous per layer, so ``load_is_async`` is always False. Never raises. Discovery, when
        on, runs after ``n`` is fixed and cannot change it.
        """
        started = time.perf_counter()
        self._lookups_counted.inc()
        try:
            try:
                n = self._lookup(request, int(num_computed_tokens))
            except _Miss as miss:
                if miss.reason:
                    self.metrics.record_miss(miss.reason, miss.field)
                n = 0
            except Exception:  # boundary (DESIGN §2 rule 4): a bug is a counted miss, never an engine error
                log.exception("semkv: lookup failed for request %s", getattr(request, "request_id", "?"))
                self.metrics.record_miss("error")
                n = 0
            if self._discovery is not None:  # after the answer is fixed; never raises
                self._discovery.observe(request, self._namespace_of)
            return n, False
        finally:
            self._lookup_timed.observe(time.perf_counter() - started)

    def _lookup(self, request: Any, num_computed: int) -> int:
        rid = request.request_id
        state = self._requests.setdefault(rid, _RequestState(rid))
        if state.promise is not None:  # asked again (re-allocation): the old promise is void
            self._release(state, "relookup")
        state.plan, state.shipped = None, False
        tpb = self.tokens_per_block
        if num_computed % tpb:
            raise _Miss("unaligned")
        state.namespace = ns = self.namespace.for_request(request)
        if isinstance(ns, NamespaceUnknown):
            log.debug("semkv: request %s: namespace field %s %s", rid, ns.field, ns.kind)
            raise _Miss("unknown_namespace_field" if ns.kind == "unknown" else "unsupported", ns.field)
        prompt_len = int(request.prompt_len)
        tokens = request.get_tokens(0)  # the prompt is its first prompt_len tokens: sliced where needed, once
        start_block, max_blocks = num_computed // tpb, (prompt_len - 1) // tpb
        if max_blocks - start_block < self.settings.min_match_blocks:
            raise _Miss("too_short")
        if not self.settings.materializes:  # telemetry only: hash and look up off the engine's path
            prompt = tokens[:prompt_len]
            self._background.submit(lambda: self._discover(ns, prompt, start_block, max_blocks))
            raise _Miss("")  # counted by the background job (hit or miss)
        state.keys = keys = prefix_keys(ns, tokens, tpb, prompt_len // tpb)  # each computed when probed
        lookup_keys = keys[:max_blocks]
        if len(self._unshipped) >= self.settings.max_plans_per_iteration:
            raise _Miss("plan_limit")
        if not self.lease_before_answer and not self._ledger_writable():
            raise _Miss("ledger_busy")  # its lease could not be written before build_connector_meta gives up
        if self.lease_before_answer:
            result = self._find_and_lease(rid, ns, lookup_keys, start_block)
        else:
            result = self._find_under_deadline(ns, lookup_keys, start_block)
        if isinstance(result, _Miss):
            if result.reason == "no_donor":
                head = tokens[: min(prompt_len, PROBE_TOKENS)]  # the probe key is telemetry: hashed off the path
                self._background.submit(lambda: self._explain(ns, keys, start_block, probe_key(head)))
                raise _Miss("")
            raise result
        state.promise = result if isinstance(result, _Promise) else self._promise(rid, ns, result, start_block)
        self._unshipped.add(rid)
        self.metrics.promises.inc()
        self.metrics.promised_tokens.inc(state.promise.num_blocks * tpb)
        self.metrics.leases_held.inc()
        return state.promise.num_blocks * tpb

    def _find_under_deadline(self, ns: Namespace, keys: list[bytes], start_block: int) -> DonorSpan | _Miss:
        """The ledger/store part of the lookup, at most ``lookup_timeout_s``.

        From the donor view (memory; see :mod:`ledger.donor_view`) once it is loaded; until then
        (or with ``donor_view_refresh_s = 0``) from the ledger: on SQLite on the engine's own thread
        (the ledger interrupts its statements at the deadline: no thread hand-off, ~30 µs here), on
        PostgreSQL, whose socket reads cannot be interrupted that way, on the lookup thread,
        abandoned at the deadline."""
        view = self._ready_view()
        if view is not None:
            return self._find(ns, keys, start_block, view, trust_store_record=self._trust_store_record)
        timeout = self.settings.lookup_timeout_s
        if self._hot is None:
            try:
                with self.ledger.deadline(timeout):
                    return self._find(ns, keys, start_block, None)
            except DeadlineExceeded:
                return _Miss("timeout")
        finished, result = self._hot.run(lambda job: self._find(ns, keys, start_block, None), timeout)
        return result if finished else _Miss("timeout")

    def _find(self, ns: Namespace, keys: list[bytes], start_block: int, view: DonorView | None, *,
              trust_store_record: bool = False) -> DonorSpan | _Miss:
        """The longest span the ledger says is fresh whose checksummed bytes the store holds.
        ``trust_store_record``: the store's record of what this process checksummed (re-checked off
        the path) stands for the bytes, without an ``os.stat`` on the engine's thread."""
        min_blocks = start_block + self.settings.min_match_blocks
        if view is None:
            span = self.ledger.find_donor_span(ns.digest, keys, policy=self.policy, min_blocks=min_blocks)
        else:
            found = view.longest_span(ns.digest, keys, now=time.time(), min_blocks=min_blocks,
                                      check_blocks=self.policy == FreshnessPolicy.ENGINE)
            span = None if found is None else _span_of(*found)
        if span is None:
            return _Miss("no_donor")
        if span.store_ref is None or span.checksum is None:
            return _Miss("donor_not_saved")
        if trust_store_record and self.store.known_verified(span.store_ref, span.checksum):
            return span
        return self._check_bytes(span) or span

    def _ready_view(self) -> DonorView | None:
        """The donor view when lookups may use it (loaded and caught up lately), else None."""
        return self._view if self._view is not None and self._view.ready else None

    def _in_store(self, donor_id: str, store_ref: str, checksum: str) -> bool:
        """Does this host's donor store hold the entry? (the donor view keeps only those) A kept
        entry this process has not verified is checksummed in the background now, so its first
        lookup need not read it on the engine's path."""
        try:
            if not self.store.verified(store_ref, checksum):
                self._verify_once(donor_id, store_ref, checksum)
            return True
        except DonorStoreError:
            return False

    def _find_and_lease(self, rid: int, ns: Namespace, keys: list[bytes], start_block: int) -> _Promise | _Miss:
        """``lease_before_answer``: find the span AND write its ledger lease before answering, on the
        lookup thread under the deadline (a write can wait for the ledger's write lock, which no
        progress handler interrupts). A lease the ledger refuses is a miss, never a broken promise;
        a lease finished after the engine stopped waiting is released."""
        assert self._hot is not None  # made in __init__ when lease_before_answer is on
        view = self._ready_view()

        def find_and_lease(job: Any) -> _Promise | _Miss:
            span = self._find(ns, keys, start_block, view)
            if isinstance(span, _Miss) or job.abandoned:
                return span if isinstance(span, _Miss) else _Miss("timeout")
            lease_id, min_blocks = self._new_lease_id(), start_block + self.settings.min_match_blocks
            lease = self.ledger.take_lease(span.donor_id, request_id=str(rid), holder=self.holder,
                                           namespace=ns.digest, num_blocks=min_blocks, up_to_blocks=span.num_blocks,
                                           ttl_s=self.settings.lease_ttl_s, policy=self.policy, lease_id=lease_id)
            if isinstance(lease, StaleReason):
                return _Miss(stale_reason_name(lease))
            if lease.expires_at <= time.time():
                self._ledger_jobs.submit(lambda: self.ledger.release_lease(lease_id, "expired_at_take"), must=True)
                return _Miss("lease_expired")
            span = dataclasses.replace(span, num_blocks=min(span.num_blocks, lease.num_blocks))
            self.store.lease(span.donor_id)
            taken: Future[Lease | StaleReason] = Future()
            taken.set_result(lease)
            return _Promise(span, lease_id, taken, start_block, span.num_blocks - start_block, ns.digest, time.time())

        finished, result = self._hot.run(find_and_lease, self.settings.lease_in_lookup_timeout_s,
                                         on_abandon=self._abandoned)
        return result if finished else _Miss("timeout")

    def _new_lease_id(self) -> str:
        """A lease id unique in the fleet: this scheduler's random 64-bit prefix and a counter, 32 hex
        characters (``uuid4()`` reads ``os.urandom``, which releases the GIL on the engine's thread)."""
        return f"{self._lease_prefix}{next(self._lease_seq):016x}"

    def _abandoned(self, result: Any) -> None:
        """A lease taken after the engine stopped waiting for the answer: release it."""
        if isinstance(result, _Promise):
            self.store.release(result.span.donor_id)
            self.ledger.release_lease(result.lease_id, "lookup_timeout")
            self.metrics.leases_released.labels(reason="lookup_timeout").inc()

    def _promise(self, rid: int, ns: Namespace, span: DonorSpan, start_block: int) -> _Promise:
        """Pin the donor in the store now (capacity eviction in this process skips it); its ledger
        lease is queued by :meth:`update_state_after_alloc`, off the lookup's budget."""
        promised_at = time.time()
        if promised_at + self.settings.lease_ttl_s <= time.time():  # a TTL shorter than this very call
            raise _Miss("lease_expired")
        self.store.lease(span.donor_id)
        return _Promise(span, self._new_lease_id(), None, start_block, span.num_blocks - start_block, ns.digest,
                        promised_at)

    def _take_lease(self, rid: int, p: _Promise) -> None:
        """Queue the promise's ledger lease on the ledger thread (FIFO with its release, so a release
        never overtakes its take). ``build_connector_meta`` waits for it before shipping the plan:
        the lease re-checks the donor and every promised block in its write transaction, and the
        worker's revalidation reads it (DESIGN §2 rules 3 and 6)."""
        outcome: Future[Lease | StaleReason] = Future()
        p.lease = outcome
        up_to, min_blocks = p.start_block + p.num_blocks, p.start_block + self.settings.min_match_blocks

        def take() -> None:
            if not outcome.set_running_or_notify_cancel():
                return
            try:
                outcome.set_result(self.ledger.take_lease(
                    p.span.donor_id, request_id=str(rid), holder=self.holder, namespace=p.namespace,
                    num_blocks=min_blocks, up_to_blocks=up_to, ttl_s=self.settings.lease_ttl_s,
                    policy=self.policy, lease_id=p.lease_id, now=p.promised_at))
                self._ledger_succeeded()
            except BaseException as exc:  # noqa: BLE001 - handed to build_connector_meta, which fails the plan
                if isinstance(exc, LedgerError):
                    self._ledger_failed()
                outcome.set_exception(exc)

        self._ledger_jobs.submit(take, must=True)

    @contextlib.contextmanager
    def _registration_access(self) -> Iterator[None]:
        """Around a donor registration's ledger access: skipped while writes are paused or the
        ledger thread is backed up (:class:`LedgerBusy`), else the write lock waited for at most
        ``register_lock_wait_s``."""
        if not self._ledger_writable():
            raise LedgerBusy("the ledger is busy: registration skipped")
        with self.ledger.lock_wait(self.settings.register_lock_wait_s):
            yield

    def _ledger_writable(self) -> bool:
        """May a lease or a registration be written now? Not while the ledger thread is backed up
        (``_ledger_busy_s``) or after a failed write (:meth:`_ledger_failed`)."""
        return time.monotonic() >= self._ledger_paused_until and self._ledger_jobs.backlog_s() <= self._ledger_busy_s

    def _ledger_succeeded(self) -> None:
        """A ledger write went through: the next failure backs off from the shortest pause again."""
        self._ledger_backoff_s = _LEDGER_BACKOFF_S[0]

    def _ledger_failed(self) -> None:
        """A ledger write failed: pause writes for the back-off, then double it (``_LEDGER_BACKOFF_S``)."""
        self._ledger_paused_until = time.monotonic() + self._ledger_backoff_s
        self._ledger_backoff_s = min(2 * self._ledger_backoff_s, _LEDGER_BACKOFF_S[1])

    def _check_bytes(self, span: Any) -> _Miss | None:
        ref, checksum = span.store_ref, span.checksum
        try:
            if self.store.verified(ref, checksum):
                return None
            if self.store.size_of(ref) > self.settings.store_inline_verify_max_bytes:
                self._verify_once(span.donor_id, ref, checksum)
                return _Miss("store_unverified")
            self.store.verify(ref, checksum)
            return None
        except EntryMissing:
            return _Miss("store_missing")
        except ChecksumMismatch as exc:
            log.error("semkv: donor %s failed its checksum (%s); evicting it", span.donor_id, exc)
            self._background.submit(lambda: self.store.evict(span.donor_id, "checksum_mismatch", force=True),
                                    must=True)
            return _Miss("checksum_mismatch")

    def _verify_once(self, donor_id: str, ref: str, checksum: str) -> None:
        """Queue a background checksum of the entry unless one is queued or running."""
        with self._verifying_lock:
            if ref in self._verifying:
                return
            self._verifying.add(ref)
        if not self._background.submit(lambda: self._verify_in_background(donor_id, ref, checksum)):
            with self._verifying_lock:
                self._verifying.discard(ref)

    def _verify_in_background(self, donor_id: str, ref: str, checksum: str) -> None:
        try:
            self.store.verify(ref, checksum)
        except ChecksumMismatch:
            self.store.evict(donor_id, "checksum_mismatch", force=True)
        except DonorStoreError as exc:  # vanished meanwhile: the next lookup misses with store_missing
            log.debug("semkv: background verification of %s: %s", donor_id, exc)
        finally:
            with self._verifying_lock:
                self._verifying.discard(ref)

    # -- background telemetry --------------------------------------------------------------------
    def _explain(self, ns: Namespace, keys: list[bytes], start_block: int, probe: str | None) -> None:
        reason, field = self._diagnosis.explain(ns, keys, start_block, probe, self.policy)
        self.metrics.record_miss(reason, field)

    def _discover(self, ns: Namespace, tokens: list[int], start_block: int, max_blocks: int) -> None:
        keys, probe = content_keys(ns, tokens, self.tokens_per_block, max_blocks), probe_key(tokens)
        span = self.ledger.find_donor_span(ns.digest, keys, policy=self.policy,
                                           min_blocks=start_block + self.settings.min_match_blocks)
        if span is None:
            self._explain(ns, keys, start_block, probe)
            return
        self.metrics.discovery_hits.inc()
        self.metrics.discovery_tokens.inc((span.num_blocks - start_block) * self.tokens_per_block)
        if self.settings.mode == "placement" and span.engine_id != self.settings.engine_id:
            self.metrics.placement_advice.labels(donor_engine_id=span.engine_id).inc()
            log.info("semkv placement advice: donor %s on engine %s holds %d blocks", span.donor_id,
                     span.engine_id, span.num_blocks)

    def _namespace_of(self, request: Any) -> Namespace | NamespaceUnknown:
        """The request's namespace: the one its lookup computed, else derived now."""
        state = self._requests.get(request.request_id)
        if state is not None and state.namespace is not None:
            return state.namespace
        return self.namespace.for_request(request)

    @property
    def model_id(self) -> str:
        """The deployment's model id (the namespace's ``model_id`` field), or ``""`` when unknown."""
        return (self.namespace.fields or {}).get("model_id", "")

    # ============================================================ 2. after allocation
    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        """Bind target blocks to the promise (lock released). Never raises."""
        try:
            state = self._requests.get(request.request_id)
            if state is None or state.promise is None:
                return
            p = state.promise
            targets = tuple(int(b) for b in block_ids[p.start_block : p.start_block + p.num_blocks])
            failed = None
            if len(targets) != p.num_blocks:
                failed = (f"allocation gave {len(targets)} target blocks for {p.num_blocks} promised "
                          f"(block_ids={len(block_ids)}, start_block={p.start_block})")
            state.plan = self._plan(request.request_id, state, targets, failed)
            if failed:
                log.error("semkv: request %s: %s; the request will fail", request.request_id, failed)
                self._release(state, "alloc_mismatch")
            elif p.lease is None:
                self._take_lease(request.request_id, p)
        except Exception:  # boundary: never raise into the engine; a bound promise must still fail closed
            log.exception("semkv: update_state_after_alloc failed for request %s", request.request_id)
            state = self._requests.get(request.request_id)
            if state is not None and state.promise is not None:
                state.plan = self._plan(request.request_id, state, (), "internal error after the promise")
                self._release(state, "error")

    def _plan(self, rid: int, state: _RequestState, targets: tuple[int, ...], failed: str | None) -> LoadPlan:
        p, ns = state.promise, state.namespace
        assert p is not None and isinstance(ns, Namespace)
        return LoadPlan(
            request_id=rid, donor_id=p.span.donor_id, provider_generation=p.span.provider_generation,
            namespace=ns.digest, mode="exact_equivalent", target_block_ids=targets, donor_block_start=p.start_block,
            num_blocks=p.num_blocks, token_count=p.num_blocks * self.tokens_per_block, score_bucket="exact",
            lease_id=p.lease_id, store_ref=p.span.store_ref or "", checksum=p.span.checksum or "",
            donor_engine_id=p.span.engine_id, donor_generation=p.span.generation,
            layout=self.namespace.layout.describe() if self.namespace.layout else "",
            freshness_policy=str(self.policy), failed=failed)

    # ============================================================ 3. metadata
    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMetadata:
        """This iteration's plans and save instructions (picklable, bounded). Never raises."""
        started = time.perf_counter()
        wait_until = time.monotonic() + self.settings.lease_confirm_timeout_s  # one wait for all plans
        self._iteration += 1
        loads: list[LoadPlan] = []
        try:
            new = getattr(scheduler_output, "new_requests", []) or []
            new_ids = {data.request_id for data in new}
            for data in [*new, *(getattr(scheduler_output, "cached_requests", []) or [])]:
                state = self._requests.get(data.request_id)
                if state is None:
                    continue
                hashes = getattr(data, "block_hashes", None)
                if hashes and len(hashes) >= len(state.block_hashes):
                    state.block_hashes = [int(h) for h in hashes]
                if state.plan is not None and not state.shipped and data.request_id in new_ids:
                    loads.append(self._checked(data, state, wait_until))
                    self._shipped(state)
        except Exception:  # boundary: an unshipped plan would break a promise; fail its request instead
            log.exception("semkv: build_connector_meta failed")
            for state in self._requests.values():
                if state.plan is not None and not state.shipped:
                    loads.append(dataclasses.replace(state.plan, failed="connector metadata error"))
                    self._shipped(state)
        saves = tuple(self._saves.popleft() for _ in range(min(len(self._saves), self.settings.max_plans_per_iteration)))
        self.metrics.metadata_build_seconds.observe(time.perf_counter() - started)
        return ConnectorMetadata(tuple(loads), saves, self._iteration)

    def _checked(self, data: Any, state: _RequestState, wait_until: float) -> LoadPlan:
        plan, tpb = state.plan, self.tokens_per_block
        assert plan is not None
        if plan.failed:
            return plan
        broken = self._lease_outcome(state, wait_until)
        if broken is not None:
            self.metrics.promises_broken.labels(reason=broken[0]).inc()
            self._release(state, "lease_" + broken[0])
            return dataclasses.replace(plan, failed=broken[1])
        start = int(data.computed_position) // tpb
        reported = tuple(int(b) for b in data.new_block_ids[start : start + plan.num_blocks])
        if start != plan.donor_block_start or reported != plan.target_block_ids:
            self._release(state, "report_mismatch")
            return dataclasses.replace(plan, failed=f"scheduler report disagrees with the promise (computed_position="
                                       f"{data.computed_position}, blocks {reported} vs {plan.target_block_ids})")
        return plan

    def _lease_outcome(self, state: _RequestState, wait_until: float) -> tuple[str, str] | None:
        """None when the promise's ledger lease is held for every promised block, else
        ``(reason, message)``: refused (the donor went stale between the lookup's read and the
        lease's write), shorter than promised, expired, failed, or not committed in time."""
        promise = state.promise
        if promise is None:  # released meanwhile (cannot happen between alloc and ship)
            return "released", "the promise's lease was released before its plan shipped"
        if promise.lease is None:  # cannot happen: a plan is made by the alloc, which queues the lease
            return "error", "the promise's ledger lease was never queued"
        try:
            lease = promise.lease.result(timeout=max(0.0, wait_until - time.monotonic()))
        except FutureTimeout:
            return "late", f"ledger lease not committed within {self.settings.lease_confirm_timeout_s} s"
        except Exception as exc:  # noqa: BLE001 - a ledger error: the plan fails closed
            return "error", f"ledger lease failed: {exc}"
        if isinstance(lease, StaleReason):
            return stale_reason_name(lease), f"donor {promise.span.donor_id} went stale before its lease: {lease}"
        if lease.num_blocks < promise.span.num_blocks:
            return "donor_blocks_removed", (f"lease covers {lease.num_blocks} of the {promise.span.num_blocks} "
                                            "donor blocks promised")
        if lease.expires_at <= time.time():
            return "lease_expired", "the lease expired before its plan shipped"
        return None

    # ============================================================ 4. finish, cancel
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """Release the request's lease; register it as a donor. True: keep blocks until saved."""
        state = self._requests.pop(request.request_id, None) or _RequestState()
        try:
            self._release(state, "finished")
            save = self._register(request, cache_block_ids, state)
            if save is None:
                return False
            self._saves.append(save)
            if self._discovery is not None:  # queued for indexing; never blocks, never raises
                self._discovery.index_donor(request, save)
            return True
        except Exception:  # boundary: a donor we failed to register is just not a donor
            log.exception("semkv: request_finished failed for request %s", request.request_id)
            return False

    def _register(self, request: Any, cache_block_ids: list[int], state: _RequestState) -> SaveInstruction | None:
        """The donor registration, its wait for the ledger's write lock bounded (``register_lock_wait_s``):
        the engine's thread must not stall behind another writer. After a lock timeout, and while
        the ledger thread is backed up, registrations are skipped at once (``_LEDGER_BACKOFF_S``: a
        batch of finishing requests must not wait that long each). None: not a donor."""
        try:
            save = self._donors.register(request, list(cache_block_ids), namespace=state.namespace,
                                         keys=state.keys, block_hashes=state.block_hashes,
                                         ledger_access=self._registration_access)
            if save is not None:  # written: the ledger takes writes again
                self._ledger_succeeded()
            return save
        except LedgerBusy:
            self.metrics.donors_not_registered.labels(reason="ledger_busy").inc()
            return None
        except LedgerError as exc:
            busy = isinstance(exc, PersistenceError) and lock_timed_out(exc)
            if busy:
                self._ledger_failed()
            self.metrics.donors_not_registered.labels(reason="ledger_busy" if busy else "ledger_error").inc()
            log.warning("semkv: request %s not registered as a donor: %s", request.request_id, exc)
            return None

    def _shipped(self, state: _RequestState) -> None:
        state.shipped = True
        self._unshipped.discard(state.request_id)

    def _release(self, state: _RequestState, reason: str) -> None:
        self._unshipped.discard(state.request_id)
        promise, state.promise = state.promise, None
        if promise is None:
            return
        self.metrics.leases_held.dec()
        self.metrics.leases_released.labels(reason=reason).inc()
        self.store.release(promise.span.donor_id)
        if promise.lease is not None:  # a ledger lease was queued: release it after its take
            self._ledger_jobs.submit(lambda: self.ledger.release_lease(promise.lease_id, reason), must=True)

    def _reset(self, request: Any, reason: str) -> None:
        state = self._requests.get(request.request_id)
        if state is not None:
            self._release(state, reason)
            state.plan, state.shipped = None, False

    # ============================================================ lifecycle
    def sync_view(self) -> None:
        """Catch the donor view up with the ledger, and re-check the store's verified entries, now
        instead of at their next periodic runs (tests that need a change they just made seen; no-op
        without a view)."""
        if self._view is not None:
            self.ledger.refresh_view(self._view)
            self.store.recheck_verified()

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait for background work (lease releases, telemetry, discovery lookups and indexing)
        queued so far; tests and shutdown."""
        self._ledger_jobs.flush(timeout_s)
        self._background.flush(timeout_s)
        if self._discovery is not None:
            self._discovery.flush(timeout_s)

    def close(self) -> None:
        """Release every lease still held, stop the threads, close the ledger (and the discovery
        service this scheduler built; an injected one is its owner's to close)."""
        for state in list(self._requests.values()):
            self._release(state, "shutdown")
        self._ledger_jobs.close()
        self._background.close()
        if self._hot is not None:
            self._hot.close()
        self.ledger.close()
        if self._discovery is not None:
            self._discovery.close()


class ResetHooksMixin:
    """Newer TensorRT-LLM's fall-back hooks: the engine discards a failed load and recomputes."""

    def cancel_load(self, request: Any, start: int, end: int) -> None:
        """The engine will recompute tokens ``[start, end)``; release the lease, drop the plan."""
        try:
            self._reset(request, "cancel_load")  # type: ignore[attr-defined]
        except Exception:  # boundary
            log.exception("semkv: cancel_load failed for request %s", request.request_id)

    def request_reset(self, request: Any) -> None:
        """The request restarts from scratch (it will be looked up again)."""
        try:
            self._reset(request, "request_reset")  # type: ignore[attr-defined]
        except Exception:  # boundary
            log.exception("semkv: request_reset failed for request %s", request.request_id)


if ENGINE_RECOMPUTES_FAILED_LOADS:
    class _SemKvSchedulerWithHooks(ResetHooksMixin, SemKvScheduler):
        __doc__ = SemKvScheduler.__doc__

    _SemKvSchedulerWithHooks.__name__ = _SemKvSchedulerWithHooks.__qualname__ = "SemKvScheduler"
    SemKvScheduler = _SemKvSchedulerWithHooks  # type: ignore[misc]
