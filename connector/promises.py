"""The promise life cycle: from a lookup's answer to the release of everything it held.

``get_num_new_matched_tokens`` returning ``n > 0`` is a PROMISE (DESIGN §2 rule 3). A promise holds
the donor pinned in this process's store, a ledger lease once the engine allocated its target
blocks, and — where the engine cannot retract it — the donor's checksummed file itself
(:class:`~connector.donor_store.SecuredEntry`). :class:`PromiseBook` keeps each request's state and
releases all of that exactly once (rule 7): when the plan's load is over, at ``request_finished``,
on a re-lookup, at shutdown, or — for a request the engine dropped without telling the connector
(TensorRT-LLM's AsyncTransferManager-era executor never calls ``request_finished`` for a cancelled
or failed request; fact sheet in connector/README.md) — once nothing was heard of it for
``request_orphan_timeout_s``, by a periodic job, so an idle engine releases too.

What a promise means is chosen once per engine (:mod:`connector.engine_contract`):

* :class:`RetractablePromises` (vLLM): the lease is written on the ledger thread after allocation
  and ``build_connector_meta`` waits for it (``lease_confirm_timeout_s``); a lease refused, short,
  failed or late ships the plan FAILED, and the engine recomputes its blocks. With
  ``lease_confirm_in_worker`` a lease still being written ships with its plan unconfirmed and the
  worker waits for the ledger to show it held before its first copy (same deadline).
* :class:`BindingPromises` (TensorRT-LLM): the donor's file is secured BEFORE the answer (no system
  call: the store keeps the files it checksummed open), so nothing the ledger, the donor engine or
  another process does afterwards can take the bytes; the plan ships at once and no ledger lease is
  written. The secured file does what the lease did — keep the bytes from being evicted under the
  load — and does it better; a lease would only add two writes per hit to the shared ledger and a
  Python job on the connector's ledger thread beside the engine's next lookups (measured: 8K hit
  p99 0.38 ms with it, 0.28 ms without). What the ledger says after the answer is read by the
  worker's revalidation, as a freshness signal.

And when the ledger lease is written is chosen once from the settings: after allocation (vLLM; none
on TensorRT-LLM) or, with ``lease_before_answer``, inside the lookup under
``lease_in_lookup_timeout_s`` on either engine (a donor gone stale since the donor view's last
catch-up is then a miss rather than a signal or a failed plan).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from connector.donor_store import DonorStore, SecuredEntry, SecuredShards
from connector.lookup import BackgroundRunner, DeadlineRunner, stale_reason_name
from connector.metrics import ConnectorMetrics
from connector.namespace import KvLayout, Namespace, NamespaceUnknown, PrefixKeys
from connector.plan import LoadPlan, SaveInstruction
from connector.profit import Forecast, ReuseCostModel
from connector.settings import ConnectorSettings
from connector.spans import LookupMiss, SpanFinder
from ledger.errors import LedgerError
from ledger.client import LedgerClient
from ledger.reads import DonorSpan
from ledger.writes import Lease
from ledger.types import FreshnessPolicy, StaleReason

__all__ = ["BindingPromises", "LedgerBackoff", "Promise", "PromiseBook", "RequestState", "RetractablePromises"]

log = logging.getLogger(__name__)
_LEDGER_BACKOFF_S = (1.0, 30.0)
"""After a ledger write failed (a lease: any ledger error; a donor registration: the write lock's
timeout), lookups miss (``ledger_busy``, retractable promises) and finished requests are not
registered for this long (seconds), doubling with each failure in a row up to the second value; a
write that succeeds resets it. Each promise made into a locked ledger would otherwise break, and
each registration wait ``register_lock_wait_s``, in turn."""


_LEASE_RELEASE_RETRY_S = 1.0
"""A lease release the ledger refused (down, locked past its timeout) is tried again this often (seconds)."""


@dataclasses.dataclass(slots=True)
class Promise:
    """What one answered lookup holds until it is released."""

    span: DonorSpan
    lease_id: str
    start_block: int
    num_blocks: int
    namespace: str
    promised_at: float
    """When the lookup answered (seconds since the epoch): the lease's clock."""
    lease: Future[Lease | StaleReason] | None = None
    """The ledger lease: written in the lookup, or queued once the engine allocated the target
    blocks (None until then: a promise never allocated needs no ledger write)."""
    secured: SecuredEntry | SecuredShards | None = None
    """The donor's checksummed file (every shard's, under tensor parallelism), held (binding promises) until handed to the worker."""
    shipped_at: float | None = None
    """``time.monotonic()`` when its plan shipped (None: not yet)."""
    forecast: Forecast | None = None
    """What the profitability gate predicted for it (None: no gate)."""


@dataclasses.dataclass(slots=True)
class RequestState:
    """What the scheduler knows of one in-flight request."""

    request_id: Any = None
    namespace: Namespace | NamespaceUnknown | None = None
    keys: PrefixKeys | None = None
    promise: Promise | None = None
    plan: LoadPlan | None = None
    shipped: bool = False
    block_hashes: list[int] = dataclasses.field(default_factory=list)
    seen_at: float = 0.0
    """``time.monotonic()`` of the last hook that named this request (orphan detection)."""
    armed: SaveInstruction | None = None
    """Its armed donor save (:mod:`connector.saves`), once made at allocation."""
    armed_shipped: bool = False
    prompt_len: int = 0
    reused_tokens: int = 0
    """Prompt tokens TensorRT-LLM matched in its own reuse tree (``num_computed_tokens`` at the lookup;
    not block-aligned after a partial hit)."""
    reuse_keys: PrefixKeys | None = None
    """The prompt's keys as TensorRT-LLM's reuse tree matches blocks (``namespace.without_multimodal``;
    ``keys`` itself for a text request), for the reuse guard."""
    allocated: bool = False
    """The engine allocated the request's blocks (``update_state_after_alloc``)."""
    alloc_iteration: int = 0
    """The scheduler's ``build_connector_meta`` count when it was allocated (its report is due in the next)."""
    computed_position: int | None = None
    """Tokens with valid KV before the forward of the request's last report (None: never reported)."""
    prefill_done: bool = False
    reported_in: int = 0
    """The ``build_connector_meta`` iteration that last reported the request."""
    abandoned: bool = False
    """Taken for freed by the engine, its blocks stored (:mod:`connector.reuse_guard`), and not seen since."""


class LedgerBackoff:
    """Pauses the scheduler's ledger writes after a failure (``_LEDGER_BACKOFF_S``), and leases while
    the connector's ledger thread is backed up past ``busy_s``; shared by leases and registrations."""

    def __init__(self, ledger_jobs: BackgroundRunner, busy_s: float) -> None:
        self._jobs, self._busy_s = ledger_jobs, busy_s
        self._paused_until, self._backoff_s = 0.0, _LEDGER_BACKOFF_S[0]

    def writable(self) -> bool:
        """May a lease be written now (not backing off, the ledger thread not backed up)?"""
        return not self.backing_off() and self._jobs.backlog_s() <= self._busy_s

    def backing_off(self) -> bool:
        """Did a write fail less than a back-off ago? (Registrations then wait; unlike a lease, a
        registration may queue behind a busy ledger thread: nothing waits for it.)"""
        return time.monotonic() < self._paused_until

    def succeeded(self) -> None:
        """A ledger write went through: the next failure backs off from the shortest pause again."""
        self._backoff_s = _LEDGER_BACKOFF_S[0]

    def failed(self) -> None:
        """A ledger write failed: pause writes for the back-off, then double it."""
        self._paused_until = time.monotonic() + self._backoff_s
        self._backoff_s = min(2 * self._backoff_s, _LEDGER_BACKOFF_S[1])


class RetractablePromises:
    """vLLM: a promise may still fail after the answer (the engine recomputes); see the module docstring."""

    binding = False
    takes_lease = True
    """The lease, written once the blocks are allocated, is what the worker's revalidation asks for."""

    def secure(self, store: DonorStore, span: DonorSpan) -> SecuredEntry | LookupMiss | None:
        """Nothing to secure: a failed load is recomputed."""
        return None

    def lease_broken(self, book: PromiseBook, state: RequestState, plan: LoadPlan, wait_until: float) -> LoadPlan:
        """The plan, or a FAILED plan when its lease is not held in time (counted, released). With
        ``lease_confirm_in_worker``, a lease still being written ships with the plan unconfirmed: the
        worker confirms it in the ledger before its first copy (:meth:`PromiseBook.confirm_in_worker`)."""
        promise = state.promise
        if (book.settings.lease_confirm_in_worker and promise is not None and promise.lease is not None
                and not promise.lease.done()):
            return book.confirm_in_worker(promise, plan, wait_until)
        broken = book.lease_outcome(promise, wait_until)
        if broken is None:
            return plan
        book.metrics.promises_broken.labels(reason=broken[0]).inc()
        book.release(state, "lease_" + broken[0])
        return dataclasses.replace(plan, failed=broken[1])


class BindingPromises:
    """TensorRT-LLM: a promise cannot be retracted, so its bytes are secured before the answer and
    what the ledger says afterwards is a signal; see the module docstring."""

    binding = True
    takes_lease = False
    """The secured file keeps the bytes; a ledger lease would only add ledger writes (module docstring)."""

    def secure(self, store: DonorStore, span: DonorSpan) -> SecuredEntry | LookupMiss | None:
        """The donor's checksummed file, held; a miss (``store_unsecured``) when this process has
        not checksummed it, or it is gone or changed since."""
        assert span.store_ref is not None and span.checksum is not None
        secured = store.secure(span.store_ref, span.checksum)
        return secured if secured is not None else LookupMiss("store_unsecured")

    def lease_broken(self, book: PromiseBook, state: RequestState, plan: LoadPlan, wait_until: float) -> LoadPlan:
        """The plan as it is: nothing the ledger says after the answer can take the secured bytes."""
        return plan


class PromiseBook:
    """Every in-flight request's :class:`RequestState`, and the promise life cycle (module docstring).

    Args:
        settings, ledger, store, metrics: the scheduler's.
        finder: the scheduler's :class:`~connector.spans.SpanFinder`.
        ledger_jobs: the connector's ledger thread (lease writes and releases, in order).
        backoff: shared with donor registration.
        binding: True on engines that cannot retract a promise (TensorRT-LLM).
        holder: who holds the leases (engine id, else host:pid).
        tokens_per_block: the engine's block size.
        layout: the pool layout plans must match (``KvLayout.describe()``), "" when unknown.
        cost_model: the engine pool's :class:`~connector.profit.ReuseCostModel`; with
            ``settings.profit.enabled`` a candidate it predicts does not pay is a miss
            (``unprofitable``).
        memory_level: where this store's bytes are (``host_ram``, ``local_file``, ...), for the model.
    """

    def __init__(self, settings: ConnectorSettings, ledger: LedgerClient, store: DonorStore,
                 metrics: ConnectorMetrics, finder: SpanFinder, ledger_jobs: BackgroundRunner,
                 backoff: LedgerBackoff, *, binding: bool, holder: str, tokens_per_block: int,
                 layout: KvLayout | None, cost_model: ReuseCostModel | None = None,
                 memory_level: str = "local_file") -> None:
        self.settings, self.ledger, self.store, self.metrics = settings, ledger, store, metrics
        self.finder, self.backoff, self.holder = finder, backoff, holder
        self.tokens_per_block = tokens_per_block
        self.layout = layout.describe() if layout is not None else ""
        self.cost_model, self.memory_level = cost_model, memory_level
        self._gated = cost_model is not None and settings.profit.enabled
        self.policy = FreshnessPolicy(settings.freshness_policy)
        self.protocol: RetractablePromises | BindingPromises = BindingPromises() if binding else RetractablePromises()
        self._jobs = ledger_jobs
        self._lease_prefix, self._lease_seq = uuid.uuid4().hex[:16], itertools.count()
        self._lock = threading.Lock()
        """Guards :attr:`requests` against the orphan reaper (uncontended on the engine's thread:
        acquiring it does not release the GIL)."""
        self.requests: dict[Any, RequestState] = {}
        self.unshipped: set[Any] = set()
        """Requests holding a promise whose plan has not shipped."""
        self._answer = (_LeaseInLookup(self, settings.lease_in_lookup_timeout_s) if settings.lease_before_answer
                        else _LeaseAfterAlloc(self))
        self._unreleased: dict[str, tuple[str, float]] = {}
        """Lease id -> (reason, ``time.monotonic()`` past which the ledger has expired it anyway)."""
        """Lease id -> release reason, for releases the ledger refused (retried; ledger thread only)."""
        ledger_jobs.every("lease release retry", _LEASE_RELEASE_RETRY_S, self.retry_lease_releases)

    # ------------------------------------------------------------------ request states
    def begin(self, request_id: Any) -> RequestState:
        """The request's state for a (re-)lookup: an earlier promise is void and released."""
        state = self.state_for(request_id)
        if state.promise is not None:  # asked again (re-allocation): the old promise is void
            self.release(state, "relookup")
        state.plan, state.shipped = None, False
        return state

    def state_for(self, request_id: Any) -> RequestState:
        """The request's state (marked seen), made if the engine never asked the lookup about it."""
        with self._lock:
            state = self.requests.get(request_id)
            if state is None:
                state = self.requests[request_id] = RequestState(request_id)
            state.seen_at = time.monotonic()
        return state

    def get(self, request_id: Any) -> RequestState | None:
        """The request's state (marked seen, so the reaper leaves it alone from now on), or None."""
        with self._lock:
            state = self.requests.get(request_id)
            if state is not None:
                state.seen_at = time.monotonic()
        return state

    def pop(self, request_id: Any) -> RequestState:
        """Remove and return the request's state (a fresh one if it had none); its promise is the
        caller's to release."""
        with self._lock:
            return self.requests.pop(request_id, None) or RequestState(request_id)

    # ------------------------------------------------------------------ 1. the answer
    def promise(self, state: RequestState, ns: Namespace, keys: list[bytes], start_block: int) -> int:
        """Find, secure and pin a span for ``state``; the promised token count.

        Raises:
            LookupMiss: nothing to promise (the reason is counted by the caller).
        """
        if len(self.unshipped) >= self.settings.max_plans_per_iteration:
            raise LookupMiss("plan_limit")
        promise = self._answer.promise(state.request_id, ns, keys, start_block, state.prompt_len)
        state.promise = promise
        self.unshipped.add(state.request_id)
        self.metrics.promises.inc()
        self.metrics.promised_tokens.inc(promise.num_blocks * self.tokens_per_block)
        self.metrics.leases_held.inc()
        return promise.num_blocks * self.tokens_per_block

    def judge(self, span: DonorSpan, start_block: int, context_tokens: int) -> Forecast | None:
        """The profitability gate's forecast for loading ``span`` past ``start_block`` into a prompt
        of ``context_tokens`` tokens (None: no cost model).

        Raises:
            LookupMiss: ``unprofitable``, with the gate on and the load predicted not to pay (the
                forecast is kept in the cost model's bounded ``declined`` list).
        """
        if self.cost_model is None:
            return None
        tokens = (span.num_blocks - start_block) * self.tokens_per_block
        forecast = self.cost_model.forecast(tokens, context_tokens, self.memory_level)
        if self._gated and not forecast.pays:
            log.debug("semkv: declined donor %s: %s", span.donor_id, forecast.describe())
            raise LookupMiss("unprofitable")
        return forecast

    def hold(self, span: DonorSpan, ns: Namespace, start_block: int, secured: SecuredEntry | None, *,
             lease_id: str | None = None, lease: Future[Lease | StaleReason] | None = None,
             forecast: Forecast | None = None) -> Promise:
        """Pin ``span``'s donor in the store (capacity eviction in this process skips it)."""
        self.store.lease(span.donor_id)
        return Promise(span, lease_id or self.new_lease_id(), start_block, span.num_blocks - start_block, ns.digest,
                       time.time(), lease=lease, secured=secured, forecast=forecast)

    def secure(self, span: DonorSpan) -> SecuredEntry | None:
        """Secure ``span``'s bytes as the promise protocol wants (None: nothing to secure).

        Raises:
            LookupMiss: binding promises whose bytes cannot be secured.
        """
        secured = self.protocol.secure(self.store, span)
        if isinstance(secured, LookupMiss):
            raise secured
        return secured

    def new_lease_id(self) -> str:
        """A lease id unique in the fleet: this scheduler's random 64-bit prefix and a counter, 32 hex
        characters (``uuid4()`` reads ``os.urandom``, which releases the GIL on the engine's thread)."""
        return f"{self._lease_prefix}{next(self._lease_seq):016x}"

    # ------------------------------------------------------------------ 2. after allocation
    def bind(self, state: RequestState, block_ids: list[int]) -> None:
        """Bind the allocated target blocks to the request's promise and queue its lease (where the
        protocol takes one); an allocation that does not match the promise makes its plan FAILED
        (and releases it)."""
        if state.promise is None:
            return
        p = state.promise
        targets = tuple(int(b) for b in block_ids[p.start_block : p.start_block + p.num_blocks])
        failed = None
        if len(targets) != p.num_blocks:
            failed = (f"allocation gave {len(targets)} target blocks for {p.num_blocks} promised "
                      f"(block_ids={len(block_ids)}, start_block={p.start_block})")
        state.plan = self.plan(state, targets, failed)
        if failed:
            log.error("semkv: request %s: %s; its plan fails", state.request_id, failed)
            self.release(state, "alloc_mismatch")
        elif p.lease is None and self.protocol.takes_lease:
            self._take_lease(state.request_id, p)

    def fail_bound(self, state: RequestState | None, reason: str) -> None:
        """After an internal error past the promise: a FAILED plan (never a silent unloaded block)."""
        if state is not None and state.promise is not None:
            state.plan = self.plan(state, (), reason)
            self.release(state, "error")

    def plan(self, state: RequestState, targets: tuple[int, ...], failed: str | None) -> LoadPlan:
        p, ns = state.promise, state.namespace
        assert p is not None and isinstance(ns, Namespace)
        return LoadPlan(
            request_id=state.request_id, donor_id=p.span.donor_id, provider_generation=p.span.provider_generation,
            namespace=ns.digest, mode="exact_equivalent", target_block_ids=targets, donor_block_start=p.start_block,
            num_blocks=p.num_blocks, token_count=p.num_blocks * self.tokens_per_block, score_bucket="exact",
            lease_id=p.lease_id, store_ref=p.span.store_ref or "", checksum=p.span.checksum or "",
            donor_engine_id=p.span.engine_id, donor_generation=p.span.generation, layout=self.layout,
            freshness_policy=str(self.policy), failed=failed, binding=self.protocol.binding,
            shards=self._shards(p),
            shard_handles=p.secured.handles() if isinstance(p.secured, SecuredShards) else (),
            predicted_saved_s=p.forecast.predicted_saving_s if p.forecast is not None else None)

    def _shards(self, p: Promise) -> tuple[tuple[str, str], ...]:
        """Every rank's shard of a tensor-parallel donor: those the promise secured, else those of the
        manifest this process verified; ``()`` for a whole donor."""
        if isinstance(p.secured, SecuredShards):
            return tuple((entry.ref, entry.checksum) for entry in p.secured.shards)
        return self.store.shards_of(p.span.store_ref) if p.span.store_ref else ()

    def _take_lease(self, request_id: Any, p: Promise) -> None:
        """Queue the promise's ledger lease on the ledger thread (FIFO with its release, so a release
        never overtakes its take). The lease re-checks the donor and every promised block in its
        write transaction; ``build_connector_meta`` waits for it (:meth:`lease_outcome`)."""
        outcome: Future[Lease | StaleReason] = Future()
        p.lease = outcome
        up_to, min_blocks = p.start_block + p.num_blocks, p.start_block + self.settings.min_match_blocks

        def take() -> None:
            if not outcome.set_running_or_notify_cancel():
                return
            try:
                outcome.set_result(self.ledger.take_lease(
                    p.span.donor_id, request_id=str(request_id), holder=self.holder, namespace=p.namespace,
                    num_blocks=min_blocks, up_to_blocks=up_to, ttl_s=self.settings.lease_ttl_s,
                    policy=self.policy, lease_id=p.lease_id, now=p.promised_at))
                self.backoff.succeeded()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever reads the outcome
                if isinstance(exc, LedgerError):
                    self.backoff.failed()
                outcome.set_exception(exc)

        self._jobs.submit(take, must=True)

    # ------------------------------------------------------------------ 3. shipping
    def ship(self, data: Any, state: RequestState, wait_until: float) -> LoadPlan:
        """The request's plan for this iteration's metadata (its first report), checked against the
        report; the secured bytes are handed to this process's worker."""
        plan = state.plan
        assert plan is not None
        self.unshipped.discard(state.request_id)
        state.shipped = True
        if plan.failed:
            return plan
        plan = self.protocol.lease_broken(self, state, plan, wait_until)
        if plan.failed:
            return plan
        start = int(data.computed_position) // self.tokens_per_block
        reported = tuple(int(b) for b in data.new_block_ids[start : start + plan.num_blocks])
        if start != plan.donor_block_start or reported != plan.target_block_ids:
            self.release(state, "report_mismatch")
            return dataclasses.replace(plan, failed=f"scheduler report disagrees with the promise (computed_position="
                                       f"{data.computed_position}, blocks {reported} vs {plan.target_block_ids})")
        promise = state.promise
        if promise is not None:
            promise.shipped_at = time.monotonic()
            if promise.secured is not None:
                self.store.hand_over(promise.lease_id, promise.secured)
                promise.secured = None
        return plan

    def ship_failed(self, state: RequestState, reason: str) -> LoadPlan | None:
        """After an error while building the metadata: the unshipped plan, FAILED."""
        if state.plan is None or state.shipped:
            return None
        self.unshipped.discard(state.request_id)
        state.shipped = True
        return dataclasses.replace(state.plan, failed=reason)

    def confirm_in_worker(self, promise: Promise, plan: LoadPlan, wait_until: float) -> LoadPlan:
        """``plan`` shipped before its lease committed: the worker waits for the ledger to show the
        lease held until the deadline of the scheduler's own wait (``wait_until``, monotonic, as epoch
        seconds). A lease that ends refused or failed is counted here when it does, as the scheduler's
        wait would have counted it; the load, not confirmed, fails in the worker and vLLM recomputes.
        The promise is released as any shipped one (load over, ``request_finished``)."""
        lease = promise.lease
        assert lease is not None

        def counted(_: Future[Lease | StaleReason]) -> None:  # on the ledger thread (a counter is thread-safe)
            broken = self.lease_outcome(promise, time.monotonic())  # done: no wait
            if broken is not None:
                self.metrics.promises_broken.labels(reason=broken[0]).inc()

        lease.add_done_callback(counted)
        return dataclasses.replace(plan, lease_confirm_by=time.time() + max(0.0, wait_until - time.monotonic()))

    def lease_outcome(self, promise: Promise | None, wait_until: float) -> tuple[str, str] | None:
        """None when the promise's ledger lease is held for every promised block, else
        ``(reason, message)``: refused (the donor went stale between the lookup's read and the
        lease's write), shorter than promised, expired, failed, or not committed by ``wait_until``
        (``time.monotonic()``)."""
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

    def loaded(self, state: RequestState) -> None:
        """A binding plan shipped in an earlier iteration has been loaded by now (TensorRT-LLM's
        worker loads it in that iteration's ``start_load_kv``): its pin (and a lease taken in the
        lookup) go."""
        promise = state.promise
        if promise is not None and promise.shipped_at is not None and self.protocol.binding:
            self.release(state, "loaded")

    # ------------------------------------------------------------------ releases
    def release(self, state: RequestState, reason: str) -> None:
        """Release the request's promise (pin, secured bytes not yet handed over or never claimed,
        ledger lease after its take); idempotent."""
        self.unshipped.discard(state.request_id)
        promise, state.promise = state.promise, None
        if promise is None:
            return
        self.metrics.leases_held.dec()
        self.metrics.leases_released.labels(reason=reason).inc()
        self.store.release(promise.span.donor_id)
        if promise.secured is not None:
            promise.secured.release()
        else:
            self.store.drop_unclaimed(promise.lease_id)  # handed over and never claimed by a worker
        if promise.lease is not None:  # a ledger lease was queued: release it after its take
            self.release_lease_later(promise.lease_id, reason)

    def release_lease_later(self, lease_id: str, reason: str) -> None:
        """Queue the ledger's ``lease_released`` on the ledger thread (after the lease's take, FIFO);
        a release the ledger refuses is retried every ``_LEASE_RELEASE_RETRY_S`` until it goes in or
        ``lease_ttl_s`` has passed (then the ledger counts the lease expired: it no longer holds the
        donor; DESIGN §2 rule 7)."""
        self._jobs.submit(lambda: self._release_lease(lease_id, reason), must=True)

    def _release_lease(self, lease_id: str, reason: str) -> bool:
        """One attempt; False when the ledger refused it (kept for the retry job)."""
        try:
            self.ledger.release_lease(lease_id, reason)
        except LedgerError as exc:
            if lease_id not in self._unreleased:
                log.warning("semkv: releasing lease %s failed (%s); retried every %.0f s until it expires", lease_id,
                            exc, _LEASE_RELEASE_RETRY_S)
                self._unreleased[lease_id] = (reason, time.monotonic() + self.settings.lease_ttl_s)
            return False
        self._unreleased.pop(lease_id, None)
        return True

    def retry_lease_releases(self) -> None:
        """The periodic job (on the ledger thread): release again what the ledger refused before,
        oldest first, stopping at the first refusal (the ledger is still locked or unreachable: each
        attempt could wait ``ledger_statement_timeout_s`` in front of lease takes and the view's catch-up)."""
        now = time.monotonic()
        for lease_id, (reason, expires) in list(self._unreleased.items()):
            if now >= expires:
                del self._unreleased[lease_id]
            elif not self._release_lease(lease_id, reason):
                return

    def reap_orphans(self, now: float | None = None) -> list[RequestState]:
        """Release every request not named by any hook for ``request_orphan_timeout_s`` (the engine
        dropped it without ``request_finished``); returns their states. Runs on the ledger thread."""
        now = time.monotonic() if now is None else now
        horizon = now - self.settings.request_orphan_timeout_s
        with self._lock:
            orphans = [state for state in self.requests.values() if state.seen_at < horizon]
            for state in orphans:
                del self.requests[state.request_id]
        for state in orphans:
            log.warning("semkv: request %s not seen for %.0f s: released (the engine dropped it without "
                        "request_finished)", state.request_id, now - state.seen_at)
            self.release(state, "orphaned")
        if orphans:
            self.metrics.orphans_released.inc(len(orphans))
        return orphans

    def close(self, reason: str = "shutdown") -> None:
        """Shutdown: release every request's promise; stop the lookup thread of ``lease_before_answer``."""
        with self._lock:
            states = list(self.requests.values())
        for state in states:
            self.release(state, reason)
        if isinstance(self._answer, _LeaseInLookup):
            self._answer.close()


class _LeaseAfterAlloc:
    """Default: the answer writes nothing to the ledger; the lease is queued at allocation."""

    def __init__(self, book: PromiseBook) -> None:
        self.book = book

    def promise(self, request_id: Any, ns: Namespace, keys: list[bytes], start_block: int,
                context_tokens: int) -> Promise:
        book = self.book
        if not book.protocol.binding and not book.backoff.writable():
            raise LookupMiss("ledger_busy")  # its lease could not be written before build_connector_meta gives up
        span = book.finder.find(ns, keys, start_block)
        if isinstance(span, LookupMiss):
            raise span
        if span.num_blocks <= start_block:  # cannot happen: find() honours min_match_blocks
            raise LookupMiss("too_short")
        forecast = book.judge(span, start_block, context_tokens)
        promised_at = time.time()
        if promised_at + book.settings.lease_ttl_s <= time.time():  # a TTL shorter than this very call
            raise LookupMiss("lease_expired")
        return book.hold(span, ns, start_block, book.secure(span), forecast=forecast)


class _LeaseInLookup:
    """``lease_before_answer``: find the span, secure it and write its ledger lease before answering,
    on a lookup thread under ``timeout_s`` (a write can wait for the ledger's write lock, which no
    progress handler interrupts). A lease the ledger refuses is a miss; a lease finished after the
    engine stopped waiting is released."""

    def __init__(self, book: PromiseBook, timeout_s: float) -> None:
        self.book, self.timeout_s = book, timeout_s
        self._runner = DeadlineRunner("semkv-lookup-lease")  # made now: the first lookup must not pay for it

    def promise(self, request_id: Any, ns: Namespace, keys: list[bytes], start_block: int,
                context_tokens: int) -> Promise:
        book = self.book
        view = book.finder.ready_view()

        def find_and_lease(job: Any) -> Promise | LookupMiss:
            span = book.finder.find_unbounded(ns, keys, start_block, view)
            if isinstance(span, LookupMiss) or job.abandoned:
                return span if isinstance(span, LookupMiss) else LookupMiss("timeout")
            try:
                forecast = book.judge(span, start_block, context_tokens)  # before a lease is written for it
            except LookupMiss as miss:
                return miss
            lease_id, min_blocks = book.new_lease_id(), start_block + book.settings.min_match_blocks
            lease = book.ledger.take_lease(span.donor_id, request_id=str(request_id), holder=book.holder,
                                           namespace=ns.digest, num_blocks=min_blocks, up_to_blocks=span.num_blocks,
                                           ttl_s=book.settings.lease_ttl_s, policy=book.policy, lease_id=lease_id)
            if isinstance(lease, StaleReason):
                return LookupMiss(stale_reason_name(lease))
            if lease.expires_at <= time.time():
                book.release_lease_later(lease_id, "expired_at_take")
                return LookupMiss("lease_expired")
            span = dataclasses.replace(span, num_blocks=min(span.num_blocks, lease.num_blocks))
            try:
                secured = book.secure(span)
            except LookupMiss as miss:
                book.release_lease_later(lease_id, "unsecured")
                return miss
            taken: Future[Lease | StaleReason] = Future()
            taken.set_result(lease)
            return book.hold(span, ns, start_block, secured, lease_id=lease_id, lease=taken, forecast=forecast)

        finished, result = self._runner.run(find_and_lease, self.timeout_s, on_abandon=self._abandoned)
        if not finished:
            raise LookupMiss("timeout")
        if isinstance(result, LookupMiss):
            raise result
        return result

    def _abandoned(self, result: Any) -> None:
        """A lease taken after the engine stopped waiting for the answer: release it."""
        if isinstance(result, Promise):
            book = self.book
            book.store.release(result.span.donor_id)
            if result.secured is not None:
                result.secured.release()
            book.release_lease_later(result.lease_id, "lookup_timeout")
            book.metrics.leases_released.labels(reason="lookup_timeout").inc()

    def close(self) -> None:
        self._runner.close()
