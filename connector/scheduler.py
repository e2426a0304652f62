"""Scheduler half of the semkv KV Cache Connector (rank 0, or every attention-DP rank; DESIGN §2, §3, §4).

:class:`SemKvScheduler` is TensorRT-LLM's ``KvCacheConnectorScheduler``: each hook is a boundary
(nothing raises into the engine: DESIGN §2 rule 4) that delegates to a collaborator built once for
the engine it runs in (:mod:`connector.engine_contract`):

* :class:`~connector.spans.SpanFinder` — the longest fresh donor span whose checksummed bytes this
  host holds (donor view, store record, deadlines);
* :class:`~connector.promises.PromiseBook` — request states and the promise life cycle: pins,
  secured bytes, ledger leases, plans, releases, orphans;
* :mod:`connector.saves` — when a finished request becomes a donor and how its save reaches the
  worker; :class:`~connector.donors.DonorRegistrar` writes ``donor_registered``.

Hooks, in TensorRT-LLM's call order (``connector/_trtllm.py``; what each version's executor does
around them is in docs/tensorrt-llm.md):

1. ``get_num_new_matched_tokens(request, num_computed_tokens)`` — once per request (per allocation),
   from C++ ``addSequence`` while the block manager HOLDS ITS LOCK. TensorRT-LLM's own prefix reuse
   ran first (rule 1): the lookup starts at the block boundary ``num_computed_tokens`` and only adds
   whole blocks past it, leaving at least one prompt token to compute. ``exact_equivalent`` promises
   ``(n, False)``; on TensorRT-LLM the donor's checksummed file is secured before the answer leaves
   (a promise there cannot be retracted). Any doubt is ``(0, False)``, counted by reason.
   ``discovery_only`` and ``placement`` answer ``(0, False)`` at once and look up in the background.
   With donor discovery on, the prompt is shown to discovery only AFTER the answer is fixed
   (rules 2 and 4).
2. ``update_state_after_alloc(request, block_ids)`` — binds the target blocks
   ``block_ids[num_computed // tpb : ... + n_blocks]`` into a :class:`~connector.plan.LoadPlan`,
   queues the ledger lease, and (TensorRT-LLM) arms the request's donor save.
3. ``build_connector_meta(scheduler_output)`` — every scheduled iteration: plans with the request's
   first report (checked against it), armed or queued saves, disarmed ids; releases the promise of a
   plan loaded in an earlier iteration.
4. ``request_finished(request, cache_block_ids)`` — releases the request's promise; a request whose
   prefill completed becomes a donor (True: the engine keeps the blocks until the worker reports
   the save, in the same iteration on TensorRT-LLM). Requests an engine drops without this call are
   released after ``request_orphan_timeout_s`` (:meth:`PromiseBook.reap_orphans`).

There is no ``cancel_load`` or ``request_reset``: no TensorRT-LLM version has them.

Attention data parallelism (``enable_attention_dp``; docs/modes.md, "Parallel layouts"): TensorRT-LLM
2026 main builds one scheduler per rank, each seeing only its rank's requests and block ids, and
calls it without broadcasting; ``supports_attention_dp = True`` opts in (its manager refuses a
connector that does not). Lookups need no rank (a donor of any rank of the same namespace is loaded
into this rank's blocks; its liveness is read from its own rank's blocks); donors are registered
under the rank ``build_connector_meta`` is told (:class:`~connector.donors.DonorRank`).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from connector._trtllm import KvCacheConnectorScheduler
from connector.discovery.hook import SchedulerDiscovery
from connector.donor_store import DonorStore, open_donor_store
from connector.donors import DonorRank, DonorRegistrar, prefill_completed
from connector.engine_contract import TENSORRT_LLM, EngineContract
from connector.layouts import process_rank
from connector.lookup import BackgroundRunner
from connector.metrics import ConnectorMetrics, process_metrics, serve_metrics
from connector.namespace import (DeploymentNamespace, Namespace, NamespaceUnknown, PROBE_TOKENS, pool_key, pool_layout,
                                 prefix_keys, without_multimodal)
from connector.plan import ConnectorMetadata, LoadPlan
from connector.profit import cost_model_for, memory_level_of
from connector.promises import LedgerBackoff, PromiseBook, RequestState
from connector.reuse_guard import UnverifiedBlocks
from connector.saves import ArmedSaves, NoSaves, SavesAfterFinish, activity_for
from connector.settings import ConnectorSettings, load_connector_settings, unknown_env_settings
from connector.spans import LookupMiss, SpanFinder
from ledger.errors import LedgerError
from ledger.client import LedgerClient
from ledger.reads import DonorSpan
from ledger.types import FreshnessPolicy, normalize_hash

if TYPE_CHECKING:
    from connector.discovery.service import DiscoveryService

__all__ = ["SemKvScheduler", "process_rank"]

log = logging.getLogger(__name__)


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


class _IterationWork:
    """What one iteration's forward computes, for the profitability gate's prefill cost
    (:mod:`connector.profit`): every reported request's ``num_scheduled_tokens`` (TensorRT-LLM's
    ``RequestData``), and the longest prompt among those still in prefill."""

    __slots__ = ("context", "tokens")

    def __init__(self) -> None:
        self.tokens = self.context = 0

    def add(self, data: Any, state: RequestState | None) -> None:
        self.tokens += int(getattr(data, "num_scheduled_tokens", 0) or 0)
        if state is not None and state.computed_position is not None and state.computed_position < state.prompt_len:
            self.context = max(self.context, state.prompt_len)


class SemKvScheduler(KvCacheConnectorScheduler):
    """The connector's scheduler (see the module docstring for each hook's contract).

    One per engine, or one per attention-DP rank (each on its own rank's requests and KV pool).

    Args:
        llm_args: TensorRT-LLM's ``TorchLlmArgs`` (or the harness's, or an adapter's).
        settings, ledger, store, metrics: injected for tests and embedding; by default settings come
            from ``TRTLLM_SEMKV_CONFIG`` / ``TRTLLM_SEMKV_*``, the rest from the settings.
        discovery: a :class:`~connector.discovery.service.DiscoveryService` to use (and share, e.g.
            between the engines of one process; the caller closes it). Default: when
            ``settings.discovery.enabled``, one built from ``settings.discovery`` on ``settings.db``,
            counting on ``metrics``' registry and closed by :meth:`close`; otherwise none.
        text_of: ``request -> str | None``, the prompt text given to discovery when
            ``allow_prompt_text`` (default :func:`~connector.discovery.types.request_text`).
        engine: the engine hosting the connector (default TensorRT-LLM; the vLLM adapter passes
            :data:`~connector.engine_contract.VLLM`).

    Raises:
        ConnectorConfigError: invalid settings (including ``mode = "experimental"``, or a discovery
            provider that cannot be built).
        SchemaOutOfDate, PersistenceError: the ledger is not migrated or not reachable.
    """

    supports_attention_dp = True
    """Owner-local under attention DP (NVIDIA/TensorRT-LLM ``connectors/kv_cache_connector.py`` @
    035ab91cad04, ``validate_attention_dp``): this rank's lookups, plans and donors concern only its
    own requests and blocks; the donor store and the ledger are shared, keyed by namespace and rank."""

    def __init__(self, llm_args: Any, *, settings: ConnectorSettings | None = None, ledger: LedgerClient | None = None,
                 store: DonorStore | None = None, metrics: ConnectorMetrics | None = None,
                 discovery: DiscoveryService | None = None, text_of: Callable[[Any], str | None] | None = None,
                 engine: EngineContract = TENSORRT_LLM) -> None:
        super().__init__(llm_args)
        self.settings = s = settings or load_connector_settings()
        if settings is None and (typos := unknown_env_settings()):
            log.warning("semkv: environment variables naming no connector setting, ignored: %s", ", ".join(typos))
        self.engine = engine
        self.metrics = metrics or process_metrics()
        if s.metrics_port is not None:
            serve_metrics(self.metrics, s.metrics_port + process_rank(), s.metrics_host)
        # the hot path's labelled children, looked up once (labels() costs a few µs per call)
        self._lookups_counted = self.metrics.lookups.labels(mode=s.mode)
        self._lookup_timed = self.metrics.lookup_seconds.labels(mode=s.mode)
        self.namespace = DeploymentNamespace(llm_args, s.namespace, s.engine_id)
        if self.namespace.unknown is not None:
            u = self.namespace.unknown
            log.warning("semkv: no request of this engine can be materialized: namespace field %s %s: %s",
                        u.field, u.kind, u.detail)
        self.tokens_per_block = self.namespace.tokens_per_block or llm_args.kv_cache_config.tokens_per_block
        self.policy = FreshnessPolicy(s.freshness_policy)
        self.ledger = ledger or LedgerClient(s.db, statement_timeout_s=s.ledger_statement_timeout_s)
        self.store = store or open_donor_store(s, self.ledger, keep_bytes=not engine.recomputes_failed_loads)
        self._discovery = SchedulerDiscovery.start(
            s.discovery, discovery, db=s.db, registry=self.metrics.registry, ledger=self.ledger, metrics=self.metrics,
            engine_id=s.engine_id or "", model_id=self.model_id, tokens_per_block=self.tokens_per_block,
            text_of=text_of)
        self.discovery = self._discovery.service if self._discovery is not None else None
        """The discovery service (shared, or this scheduler's own); None when discovery is off."""
        self._background = BackgroundRunner("semkv-background", on_drop=self.metrics.telemetry_dropped.inc)
        # leases in order (a release never overtakes its take), never behind telemetry or a
        # background checksum of a big entry; when none is queued, the view's catch-up, the store's
        # recheck and the orphan reaper (one thread: fewer threads taking the GIL from the engine's)
        self._ledger_jobs = BackgroundRunner("semkv-ledger")
        backoff = LedgerBackoff(self._ledger_jobs, s.lease_confirm_timeout_s / 2)
        self.spans = SpanFinder(s, self.ledger, self.store, self.metrics, self._background, self.tokens_per_block)
        self.promises = PromiseBook(
            s, self.ledger, self.store, self.metrics, self.spans, self._ledger_jobs, backoff,
            binding=not engine.recomputes_failed_loads, holder=s.engine_id or f"{socket.gethostname()}:{os.getpid()}",
            tokens_per_block=self.tokens_per_block, layout=self.namespace.layout,
            cost_model=cost_model_for(pool_key(s.engine_id, s.store_dir), **s.profit.model_dump(exclude={"enabled"})),
            memory_level=memory_level_of(self.store, binding=not engine.recomputes_failed_loads))
        attention_dp = bool(getattr(llm_args, "enable_attention_dp", False))
        self.donor_rank = DonorRank(s, attention_dp=attention_dp,
                                    num_ranks=int(getattr(llm_args, "tensor_parallel_size", 1) or 1))
        """The attention-DP rank this scheduler's donors are registered under (learnt from
        ``SchedulerOutput.attention_dp_rank`` under attention DP)."""
        registrar = DonorRegistrar(s, self.namespace, self.ledger, _FreshSpans(self.ledger, self.policy),
                                   self.metrics, self.tokens_per_block, _window_size(llm_args, s), self.donor_rank)
        self._guard = UnverifiedBlocks() if engine.drops_requests_silently else None
        """Blocks abandoned prefills left in the engine's reuse tree (:mod:`connector.reuse_guard`);
        TensorRT-LLM, which reports every live request in every iteration it schedules."""
        saves_class = ArmedSaves if engine.finished_ids_are_saves else SavesAfterFinish
        if s.mode == "discovery_only" and not s.save_in_discovery_only:
            saves_class = NoSaves  # discovery_only changes nothing in the engine: no block held after finish
        self.saves = saves_class(s, registrar, self._ledger_jobs, self.metrics, backoff, self._guard)
        self._iteration = 0
        self._pool_key = pool_key(s.engine_id, s.store_dir)
        self._activity = activity_for(self._pool_key, llm_args)
        """Which requests are live, for this engine's worker (:class:`~connector.saves.EngineActivity`)."""
        self._namespace_layout = self.namespace.layout.describe() if self.namespace.layout is not None else None
        self._pool_mismatch_logged: str | None = None
        self._record_engine_start()
        self.metrics.ledger_backlog_seconds.set_function(self._ledger_jobs.backlog_s)
        self.metrics.donor_view_age_seconds.set_function(self.spans.view_age_s)
        self.spans.start(self._ledger_jobs)
        if engine.drops_requests_silently:
            self._ledger_jobs.every("orphan reaper", s.request_orphan_timeout_s / 4, self._reap_orphans)

    def _record_engine_start(self) -> None:
        """A connector starting means a new engine process: what the ledger knew of this engine's
        blocks and donors is stale even if its ``created`` event or seq reset is lost on the way."""
        if not self.settings.engine_id or self.settings.mode == "discovery_only":
            return
        try:
            self.ledger.record_engine_start(self.settings.engine_id)
        except LedgerError as exc:  # the ledger is down: lookups will miss until it is back
            log.warning("semkv: could not record the engine start in the ledger: %s", exc)

    @property
    def model_id(self) -> str:
        """The deployment's model id (the namespace's ``model_id`` field), or ``""`` when unknown."""
        return (self.namespace.fields or {}).get("model_id", "")

    # ============================================================ 1. lookup (block-manager lock held)
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` the worker will load before attention reads them.

        Returns ``(n, False)``: ``n`` whole blocks' worth of tokens (0 on any doubt); loads are
        synchronous, so ``load_is_async`` is always False. Never raises. Discovery, when on, runs
        after ``n`` is fixed and cannot change it.
        """
        started = time.perf_counter()
        self._lookups_counted.inc()
        try:
            try:
                n = self._lookup(request, int(num_computed_tokens))
            except LookupMiss as miss:
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
        state = self.promises.begin(request.request_id)
        self._relooked(state, num_computed)
        tpb = self.tokens_per_block
        state.namespace = ns = self.namespace.for_request(request)
        if num_computed % tpb:  # a partial hit (enable_partial_reuse): the device reuse stays in state
            raise LookupMiss("unaligned")
        if isinstance(ns, NamespaceUnknown):
            raise LookupMiss("unknown_namespace_field" if ns.kind == "unknown" else "unsupported", ns.field)
        if not self._pool_matches():
            raise LookupMiss("layout_mismatch")
        prompt_len = state.prompt_len = int(request.prompt_len)
        tokens = request.get_tokens(0)  # the prompt is its first prompt_len tokens: sliced where needed, once
        start_block, max_blocks = num_computed // tpb, (prompt_len - 1) // tpb
        if max_blocks - start_block < self.settings.min_match_blocks:
            raise LookupMiss("too_short")
        if not self.settings.materializes:  # telemetry only: hash and look up off the engine's path
            self.spans.discover_later(ns, tokens[:prompt_len], start_block, max_blocks)
            raise LookupMiss("")  # counted by the background job (hit or miss)
        state.keys = keys = prefix_keys(ns, tokens, tpb, prompt_len // tpb)  # each computed when probed
        try:
            return self.promises.promise(state, ns, keys[:max_blocks], start_block)
        except LookupMiss as miss:
            if miss.reason == "no_donor":  # explained off the path (the probe key is telemetry)
                self.spans.explain_later(ns, keys, start_block, tokens[: min(prompt_len, PROBE_TOKENS)])
                raise LookupMiss("") from None
            raise

    def _relooked(self, state: RequestState, num_computed: int) -> None:
        """A (re-)lookup: the device match is known. A request allocated before and looked up again
        was freed and re-added: it ended as far as its blocks go (if not noticed yet), and what it
        left stays unverified whatever it does now (:mod:`connector.reuse_guard`)."""
        if state.allocated and not state.abandoned:
            self._ended(state, state.prefill_done)
        if state.abandoned and self._guard is not None:
            self._guard.keep(state.request_id)
        state.reused_tokens, state.allocated = num_computed, False
        state.abandoned, state.computed_position, state.prefill_done, state.reported_in = False, None, False, 0

    def _pool_matches(self) -> bool:
        """Does the pool this process's worker registered have the layout every plan names? (True
        while unknown: a worker in another process.) A mismatch — a ``[namespace] kv_layout`` or
        ``kv_dtype`` that disagrees with the engine's real pool — is logged once and makes every
        lookup a miss, where it would otherwise fail every promised load. Asked on every lookup (a
        dictionary read): a worker that registers again is seen at once."""
        registered = pool_layout(self._pool_key)
        if registered is None or self._namespace_layout is None:
            return True
        matches = registered == self._namespace_layout
        if not matches and self._pool_mismatch_logged != registered:
            self._pool_mismatch_logged = registered
            log.error("semkv: the engine's KV pool is %s but the namespace names %s (check [namespace] kv_layout "
                      "and kv_dtype): nothing will be materialized", registered, self._namespace_layout)
        return matches

    def _namespace_of(self, request: Any) -> Namespace | NamespaceUnknown:
        """The request's namespace: the one its lookup computed, else derived now."""
        state = self.promises.requests.get(request.request_id)
        if state is not None and state.namespace is not None:
            return state.namespace
        return self.namespace.for_request(request)

    # ============================================================ 2. after allocation
    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        """Bind target blocks to the promise and arm the donor save (lock released). Never raises."""
        state = None
        try:
            state = self.promises.state_for(request.request_id)
            self.promises.bind(state, block_ids)
            state.allocated, state.alloc_iteration = True, self._iteration
            self._know_prompt(request, state)
            self.saves.arm(request, list(block_ids), state)
        except Exception:  # boundary: never raise into the engine; a bound promise must still fail closed
            log.exception("semkv: update_state_after_alloc failed for request %s", request.request_id)
            self.promises.fail_bound(state, "internal error after the promise")

    def update_state_after_alloc_by_layer_group(self, request: Any, block_ids_by_layer_group: list[list[int]]) -> None:
        """Per-layer-group form (TensorRT-LLM 2026 main, a cache of several layer groups: VSWA).
        One group is the flat hook. Several are not served (docs/modes.md, "Variable sliding
        windows"): the namespace refuses such a deployment and the worker registers no pool, so no
        lookup promised anything; a promise made anyway (a namespace that did not see the windows)
        fails closed. Implemented so that TensorRT-LLM starts the engine (it rejects, at bring-up,
        a scheduler with only the flat forms under several groups: ``reject_flat_only_scheduler``,
        ``connectors/kv_cache_connector.py`` @ 035ab91cad04). Never raises."""
        if len(block_ids_by_layer_group) == 1:
            self.update_state_after_alloc(request, block_ids_by_layer_group[0])
            return
        state = self.promises.get(request.request_id)
        if state is not None and state.promise is not None:
            log.error("semkv: request %s: a promise on a cache of %d layer groups, which the connector does not "
                      "serve; its plan fails", request.request_id, len(block_ids_by_layer_group))
            self.promises.fail_bound(state, f"{len(block_ids_by_layer_group)} KV layer groups are not served")

    def request_finished_by_layer_group(self, request: Any, cache_block_ids_by_layer_group: list[list[int]]) -> bool:
        """Per-layer-group form of ``request_finished``: one group is the flat hook; several register
        no donor (see :meth:`update_state_after_alloc_by_layer_group`) and keep no block. Never raises."""
        if len(cache_block_ids_by_layer_group) == 1:
            return self.request_finished(request, cache_block_ids_by_layer_group[0])
        self._activity.finished(request.request_id)
        try:
            state = self.promises.pop(request.request_id)
            self.promises.release(state, "finished")
            self.saves.forget(state)
        except Exception:  # boundary
            log.exception("semkv: request_finished_by_layer_group failed for request %s", request.request_id)
        return False

    def _know_prompt(self, request: Any, state: RequestState) -> None:
        """What the reuse guard needs of a request: its prompt length and its keys as TensorRT-LLM's
        reuse tree tells blocks apart (hashed here for a request the lookup did not get to hash:
        discovery modes, too-short prompts, partial hits; or whose images make its own keys finer)."""
        if not state.prompt_len:
            state.prompt_len = int(request.prompt_len)
        ns = state.namespace if state.namespace is not None else self.namespace.for_request(request)
        state.namespace = ns
        if self._guard is None or not isinstance(ns, Namespace):
            return
        reuse_ns, num_blocks = without_multimodal(ns), state.prompt_len // self.tokens_per_block
        if reuse_ns is ns and state.keys is not None:
            state.reuse_keys = state.keys
        else:
            state.reuse_keys = prefix_keys(reuse_ns, request.get_tokens(0), self.tokens_per_block, num_blocks)

    # ============================================================ 3. metadata
    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMetadata:
        """This iteration's plans, saves and disarmed saves (picklable, bounded). Never raises."""
        started = time.perf_counter()
        wait_until = time.monotonic() + self.settings.lease_confirm_timeout_s  # one wait for all plans
        self._iteration += 1
        loads: list[LoadPlan] = []
        work = _IterationWork()
        try:
            self._activity.scheduled(
                [data.request_id for group in ("new_requests", "cached_requests")
                 for data in getattr(scheduler_output, group, None) or ()])
            self.donor_rank.observe(getattr(scheduler_output, "attention_dp_rank", None))
            for data in getattr(scheduler_output, "new_requests", []) or []:
                state = self._reported(data)
                work.add(data, state)
                if state is not None and state.plan is not None and not state.shipped:
                    loads.append(self.promises.ship(data, state, wait_until))
            for data in getattr(scheduler_output, "cached_requests", []) or []:
                state = self._reported(data)
                work.add(data, state)
                if state is not None:
                    self.promises.loaded(state)
            self._note_abandoned_prefills()
        except Exception:  # boundary: an unshipped plan would break a promise; fail its request instead
            log.exception("semkv: build_connector_meta failed")
            for state in list(self.promises.requests.values()):
                failed = self.promises.ship_failed(state, "connector metadata error")
                if failed is not None:
                    loads.append(failed)
        saves, disarmed = self.saves.to_ship()
        self.saves.shipped(saves, self.promises.requests.get)
        self.metrics.metadata_build_seconds.observe(time.perf_counter() - started)
        scheduled = getattr(scheduler_output, "semkv_work", None)  # an adapter's own count (vLLM)
        tokens, context = scheduled if scheduled is not None else (work.tokens, work.context)
        return ConnectorMetadata(tuple(loads), saves, self._iteration, disarmed, tokens, context)

    def _reported(self, data: Any) -> RequestState | None:
        """The state of a request in this iteration's report, with its engine block hashes and its
        prefill's progress updated."""
        state = self.promises.get(data.request_id)
        if state is None:
            return None
        hashes = getattr(data, "block_hashes", None)
        if hashes and len(hashes) >= len(state.block_hashes):
            # the engine's own form (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: 32-byte hashes), canonical
            state.block_hashes = [normalize_hash(h) for h in hashes]
        state.computed_position, state.reported_in = int(data.computed_position), self._iteration
        state.prefill_done = state.prefill_done or (0 < state.prompt_len <= state.computed_position)
        if state.abandoned and self._guard is not None:
            self._guard.seen_again(state.request_id)
            state.abandoned = False
        return state

    def _note_abandoned_prefills(self) -> None:
        """Requests this scheduled iteration's report left out although due (reported before, or
        allocated since the last report): the executor freed them (a cancel, ``_handle_errors``),
        storing their blocks as they are."""
        if self._guard is None:
            return
        for state in list(self.promises.requests.values()):
            due_since = state.reported_in or (state.alloc_iteration if state.allocated else None)
            if due_since is not None and due_since < self._iteration and not state.abandoned:
                self._ended(state, state.prefill_done)

    def _ended(self, state: RequestState, prefill_done: bool) -> None:
        """The engine is done with ``state``'s blocks: TensorRT-LLM stores them in its reuse tree as
        they are. Hold as unverified (:mod:`connector.reuse_guard`) the blocks it built on unverified
        KV it reused, and those an unfinished prefill left uncomputed."""
        if self._guard is None or not state.allocated or state.reuse_keys is None:
            return
        tpb, state.abandoned = self.tokens_per_block, True
        if self._guard.touches(state.reuse_keys, state.reused_tokens, tpb):
            self._guard.refused(state.request_id, state.reuse_keys, state.reused_tokens, tpb)
        if not prefill_done:
            computed = state.reused_tokens if state.computed_position is None else state.computed_position
            # blocks first..last of prompt[:-1] (TensorRT-LLM stores tokens[:-1], the partial last block too)
            first, last = computed // tpb, (state.prompt_len - 2) // tpb
            self._guard.abandoned(state.request_id, state.reuse_keys, first, last)

    # ============================================================ 4. finish
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """Release the request's promise; register it as a donor. True: keep blocks until saved."""
        self._activity.finished(request.request_id)
        state = self.promises.pop(request.request_id)
        try:
            self.promises.release(state, "finished")
            self._ended(state, prefill_completed(request))  # some executors call it on every exit
            if not self._pool_matches():  # its bytes could never be saved under the namespace's layout
                self.saves.forget(state)
                return False
            donor = self.saves.finished(request, list(cache_block_ids), state)
            if donor is None:
                return False
            if self._discovery is not None and (record := self._discovery.donor_record(request, *donor)) is not None:
                # indexed once registered: the ledger thread runs this behind the registration's write
                self._ledger_jobs.submit(functools.partial(self._discovery.index_donor, record))
            return True
        except Exception:  # boundary: a donor we failed to register is just not a donor
            log.exception("semkv: request_finished failed for request %s", request.request_id)
            return False

    def release(self, request: Any, reason: str) -> None:
        """Release the request's promise now (an adapter whose engine did not take it, e.g. vLLM
        allocating no external tokens); its state stays until ``request_finished``. Never raises."""
        try:
            state = self.promises.get(request.request_id)
            if state is not None:
                self.promises.release(state, reason)
                state.plan, state.shipped = None, False
        except Exception:  # boundary
            log.exception("semkv: releasing request %s failed", getattr(request, "request_id", "?"))

    def _reap_orphans(self) -> None:
        for state in self.promises.reap_orphans():
            self._ended(state, state.prefill_done)
            self.saves.forget(state)

    # ============================================================ lifecycle
    def donor_view_seq(self) -> int | None:
        """The ledger log seq the donor view reflects (-1 before its load; None without a view):
        lookups see every donor registered at or before it."""
        return self.spans.view.cursor if self.spans.view is not None else None

    def sync_view(self) -> None:
        """Catch the donor view up with the ledger, and re-check the store's verified entries, now
        instead of at their next periodic runs (tests that need a change they just made seen; no-op
        without a view)."""
        self.spans.sync()

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait for background work (lease takes and releases, telemetry, discovery lookups and
        indexing) queued so far; tests and shutdown."""
        self._ledger_jobs.flush(timeout_s)
        self._background.flush(timeout_s)
        if self._discovery is not None:
            self._discovery.flush(timeout_s)

    def close(self) -> None:
        """Release every lease still held, stop the threads, close the ledger (and the discovery
        service this scheduler built; an injected one is its owner's to close)."""
        self.promises.close("shutdown")
        self._ledger_jobs.close()
        self._background.close()
        self.spans.close()
        self.store.close()
        self.ledger.close()
        if self._discovery is not None:
            self._discovery.close()
