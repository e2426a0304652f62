"""Donor saves: when a request becomes a donor, and how its bytes reach the worker.

Chosen once per engine (:mod:`connector.engine_contract`):

* :class:`ArmedSaves` (TensorRT-LLM). TensorRT-LLM calls ``build_connector_meta`` only in an
  iteration that schedules a batch, and its loop blocks, calling no connector hook at all, once no
  request is active (NVIDIA/TensorRT-LLM ``py_executor.py``, every connector-era version): a save
  instruction queued at ``request_finished`` for "the next metadata" waits for the next request, with
  the donor's blocks pinned — forever on an idle engine. So the instruction is ARMED instead: made at
  ``update_state_after_alloc`` (the request's blocks are all allocated then), shipped with the
  request's first report, kept by the worker. ``request_finished`` registers the donor under the
  armed id and returns True; the same iteration's ``get_finished`` passes the request id to the
  worker among the finished saves (``KvCacheConnectorManager.get_finished``: exactly the requests
  whose ``request_finished`` returned True), and the worker gathers the bytes right there and
  reports them done. A request that finishes without becoming a donor, or that the engine drops,
  is disarmed with the next metadata (the worker also bounds what it keeps).
* :class:`SavesAfterFinish` (vLLM): ``request_finished`` registers the donor and queues its
  instruction; it ships with the next step's metadata (vLLM builds one every step) and the worker
  gathers it at that step's end.

Either way a request becomes a donor only when its prefill completed. The engine's thread decides
(:meth:`~connector.donors.DonorRegistrar.prepare`: reads only) and writes ``donor_registered`` itself
only if the ledger's write lock is free within ``_TRY_LOCK_S`` (handing a write to another thread
costs the engine's thread more than the write: that thread takes the GIL for it); otherwise the
write is queued on the connector's ledger thread, which waits at most ``register_lock_wait_s`` for
the lock: the engine never waits for a lock another process holds (before, a consumer holding
SQLite's lock for more than a quarter of a second cost the donor; tools/bench_registration.py). While the ledger backs
off a failed write (:class:`~connector.promises.LedgerBackoff`), or ``save_queue_max``
registrations are queued, no donor is added (``semkv_donors_not_registered_total{reason="ledger_busy"}``). The worker saves
the bytes once the registration is in the ledger (:meth:`connector.worker.SemKvWorker._registered`
waits for it on its store writer's thread). In ``discovery_only`` mode nothing is armed or registered unless
``save_in_discovery_only`` (:class:`NoSaves`).

The worker copies a donor's blocks out of the KV pool off the engine's thread
(:mod:`connector.save_copies`) and reports the request only once the copy has completed; whether it
may leave a copy to a later ``get_finished`` depends on whether the engine will call one:
:class:`EngineActivity` tells it, within one process.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections import OrderedDict, deque
from typing import Any

from connector.donors import Donation, DonorRegistrar, prefill_completed
from connector.lookup import BackgroundRunner
from connector.metrics import ConnectorMetrics
from connector.plan import SaveInstruction
from connector.promises import LedgerBackoff, RequestState
from connector.reuse_guard import UnverifiedBlocks
from connector.settings import ConnectorSettings
from ledger import events as ev
from ledger.errors import LedgerError, PersistenceError, lock_timed_out

__all__ = ["ArmedSaves", "EngineActivity", "NoSaves", "SavesAfterFinish", "activity_for"]

_TRY_LOCK_S = 0.001
"""How long (seconds) the engine's thread waits for the ledger's write lock to register a donor itself
before it queues the registration on the ledger thread (module docstring)."""
DonorSave = tuple[SaveInstruction, ev.DonorRegistered]
"""What ``finished`` answers for a donor: what the worker saves, and its registration (queued)."""

log = logging.getLogger(__name__)


class _DonorSaves:
    """What both protocols share: the registration (decided here, written on the ledger thread),
    and the queues of instructions and disarmed ids the next metadata carries."""

    def __init__(self, settings: ConnectorSettings, registrar: DonorRegistrar, ledger_jobs: BackgroundRunner,
                 metrics: ConnectorMetrics, backoff: LedgerBackoff, guard: UnverifiedBlocks | None = None) -> None:
        self.settings, self.registrar, self.ledger_jobs = settings, registrar, ledger_jobs
        self.metrics, self.backoff, self.guard = metrics, backoff, guard
        self._to_ship: deque[SaveInstruction] = deque()
        self._disarmed: deque[Any] = deque()
        self._queued = 0  # registrations queued on the ledger thread, not yet written (or refused)
        self._queued_lock = threading.Lock()

    def to_ship(self) -> tuple[tuple[SaveInstruction, ...], tuple[Any, ...]]:
        """This iteration's ``(saves, disarmed ids)``, each at most ``max_plans_per_iteration``
        (the rest wait for the next metadata)."""
        limit = self.settings.max_plans_per_iteration
        saves = tuple(self._to_ship.popleft() for _ in range(min(len(self._to_ship), limit)))
        disarmed = tuple(self._disarmed.popleft() for _ in range(min(len(self._disarmed), limit)))
        return saves, disarmed

    def register(self, request: Any, cache_block_ids: list[int], state: RequestState,
                 donor_id: str | None = None) -> Donation | None:
        """Decide whether ``request`` is a donor (under ``donor_id`` when armed) and queue its
        registration on the ledger thread; None: not a donor (nothing queued) — also, counted
        ``ledger_busy``, while the ledger backs off a failed write or ``save_queue_max``
        registrations are already queued."""
        if self.backoff.backing_off() or self._queued >= self.settings.save_queue_max:
            self.metrics.donors_not_registered.labels(reason="ledger_busy").inc()
            return None
        try:
            donation = self.registrar.prepare(request, list(cache_block_ids), namespace=state.namespace,
                                              keys=state.keys, block_hashes=state.block_hashes, donor_id=donor_id)
        except LedgerError as exc:
            self.metrics.donors_not_registered.labels(reason="ledger_error").inc()
            log.warning("semkv: request %s not registered as a donor: %s", request.request_id, exc)
            return None
        if donation is None:
            return None
        donor = donation.event
        if self._queued == 0:  # nothing queued: the lock is likely free, and writing here is cheapest
            try:
                self.registrar.write(donor, _TRY_LOCK_S)
                self.backoff.succeeded()
                return donation
            except LedgerError as exc:
                if not (isinstance(exc, PersistenceError) and lock_timed_out(exc)):
                    self._refused(donor, exc)
                    return None
        with self._queued_lock:
            self._queued += 1
        self.ledger_jobs.submit(lambda: self._write_queued(donor), must=True)
        return donation

    def _write_queued(self, donor: ev.DonorRegistered) -> None:
        """The ledger thread: append the registration, waiting for the lock at most
        ``register_lock_wait_s``. A refusal is counted; the worker, which waits for the registration
        before it publishes the bytes, gives up on its own (:meth:`connector.worker.SemKvWorker._registered`)."""
        try:
            self.registrar.write(donor, self.settings.register_lock_wait_s)
            self.backoff.succeeded()
        except LedgerError as exc:
            self._refused(donor, exc)
        finally:
            with self._queued_lock:
                self._queued -= 1

    def _refused(self, donor: ev.DonorRegistered, exc: LedgerError) -> None:
        busy = isinstance(exc, PersistenceError) and lock_timed_out(exc)
        if busy:
            self.backoff.failed()
        self.metrics.donors_not_registered.labels(reason="ledger_busy" if busy else "ledger_error").inc()
        log.warning("semkv: donor %s not registered: %s", donor.donor_id, exc)


class ArmedSaves(_DonorSaves):
    """TensorRT-LLM: instructions armed at allocation, gathered in ``get_finished`` (module docstring)."""

    def arm(self, request: Any, block_ids: list[int], state: RequestState) -> None:
        """At ``update_state_after_alloc``: arm a save for a request that may become a donor."""
        found = self.registrar.candidate(request, block_ids, state.namespace)
        if found is None:
            return
        ns, n = found
        state.armed = self.registrar.instruction(request, block_ids, ns, n, donor_id=uuid.uuid4().hex, on_finish=True)
        state.armed_shipped = False
        self._to_ship.append(state.armed)

    def shipped(self, saves: tuple[SaveInstruction, ...], state_of: Any) -> None:
        """Mark the armed instructions of this metadata as shipped (only those can be saved)."""
        for save in saves:
            state = state_of(save.request_id)
            if state is not None and state.armed is save:
                state.armed_shipped = True

    def finished(self, request: Any, cache_block_ids: list[int], state: RequestState) -> DonorSave | None:
        """At ``request_finished``: the armed save and its registration (queued) when the request is a
        donor (True to the engine: the worker gathers it in this iteration's ``get_finished``); None
        otherwise (and the worker's armed instruction is dropped with the next metadata)."""
        armed = state.armed
        if armed is None:
            return None
        if not state.armed_shipped:  # still queued: it never reaches the worker now
            with contextlib.suppress(ValueError):
                self._to_ship.remove(armed)
            self.metrics.donors_not_registered.labels(reason="not_armed").inc()
            return None
        same_blocks = tuple(int(b) for b in cache_block_ids[: armed.num_blocks]) == armed.block_ids
        donation = None
        if same_blocks and prefill_completed(request) and not self._reused_unverified(state):
            donation = self.register(request, cache_block_ids, state, donor_id=armed.donor_id)
        if donation is None:
            self._disarmed.append(armed.request_id)
            return None
        return armed, donation.event

    def _reused_unverified(self, state: RequestState) -> bool:
        """Did the request reuse, from TensorRT-LLM's own tree, a block an abandoned prefill left there
        uncomputed (:mod:`connector.reuse_guard`)? Then it is no donor."""
        tpb = self.registrar.tokens_per_block
        if self.guard is None or state.reuse_keys is None or not self.guard.touches(
                state.reuse_keys, state.reused_tokens, tpb):
            return False
        self.metrics.donors_not_registered.labels(reason="unverified_blocks").inc()
        log.warning("semkv: request %s reused blocks an abandoned prefill left uncomputed in the engine's "
                    "reuse tree: not registered as a donor", state.request_id)
        return True

    def forget(self, state: RequestState) -> None:
        """A request released without ``request_finished`` (orphaned): drop its armed save."""
        if state.armed is not None and state.armed_shipped:
            self._disarmed.append(state.armed.request_id)


class SavesAfterFinish(_DonorSaves):
    """vLLM: the instruction ships after ``request_finished`` (module docstring)."""

    def arm(self, request: Any, block_ids: list[int], state: RequestState) -> None:
        """Nothing is armed: vLLM's ``get_finished`` passes every finished request."""

    def shipped(self, saves: tuple[SaveInstruction, ...], state_of: Any) -> None:
        """Nothing to mark."""

    def finished(self, request: Any, cache_block_ids: list[int], state: RequestState) -> DonorSave | None:
        """Queue the donor's registration, and its instruction for the next metadata."""
        donation = self.register(request, cache_block_ids, state)
        if donation is None:
            return None
        save = self.registrar.instruction(request, list(cache_block_ids), donation.namespace, donation.num_blocks,
                                          donor_id=donation.event.donor_id)
        self._to_ship.append(save)
        return save, donation.event

    def forget(self, state: RequestState) -> None:
        """Nothing was armed."""


class NoSaves(_DonorSaves):
    """``discovery_only`` without ``save_in_discovery_only``: no request is armed, registered or saved;
    ``request_finished`` answers False and the engine frees the blocks at once."""

    def arm(self, request: Any, block_ids: list[int], state: RequestState) -> None:
        """Nothing is armed."""

    def shipped(self, saves: tuple[SaveInstruction, ...], state_of: Any) -> None:
        """Nothing ships."""

    def finished(self, request: Any, cache_block_ids: list[int], state: RequestState) -> DonorSave | None:
        """Not a donor."""
        return None

    def forget(self, state: RequestState) -> None:
        """Nothing was armed."""


class EngineActivity:
    """Does the engine have a live request besides those finishing now? The worker's question in
    ``get_finished`` about a donor whose copy is still running (:mod:`connector.save_copies`): if
    another request is live, TensorRT-LLM runs another iteration and calls ``get_finished`` again,
    so the id can wait for it; if not, its loop may block (calling no hook until a request arrives)
    and the worker waits for the copy there instead, which delays no other request.

    The scheduler records every scheduled iteration's request ids (``build_connector_meta``) and
    drops those that finish (``request_finished``), all on the engine's thread; the worker of the
    same engine in the same process reads it (:func:`activity_for`). A worker with no scheduler in
    its process (a TensorRT-LLM rank > 0, vLLM's worker process) sees nothing live and always waits:
    the safe answer. A request the engine drops without ``request_finished`` (a cancel on
    TensorRT-LLM's AsyncTransferManager-era executors) counts as live until the next scheduled
    iteration leaves it out: an id left waiting then is reported with the next request's first
    iteration (its blocks held meanwhile; no bytes at risk)."""

    def __init__(self) -> None:
        self._live: set[Any] = set()
        self._lock = threading.Lock()

    def scheduled(self, request_ids: Any) -> None:
        """This iteration's scheduled requests (new and cached)."""
        with self._lock:
            self._live = set(request_ids)

    def finished(self, request_id: Any) -> None:
        """``request_finished`` for ``request_id``."""
        with self._lock:
            self._live.discard(request_id)

    def others_live(self, finishing: Any = ()) -> bool:
        """Is a request other than ``finishing`` live (so another iteration will come)?"""
        with self._lock:
            return bool(self._live.difference(finishing))


_activities: OrderedDict[tuple[str, int], tuple[Any, EngineActivity]] = OrderedDict()
_activities_lock = threading.Lock()
_ACTIVITIES_KEPT = 256
"""Engines of one process remembered (tests build many; a real process has one per rank)."""


def activity_for(pool_key: str, llm_args: Any) -> EngineActivity:
    """The process's :class:`EngineActivity` of the engine built from ``llm_args`` on the pool
    ``pool_key`` (:func:`connector.namespace.pool_key`): TensorRT-LLM builds an engine's scheduler and
    worker from the same ``llm_args`` object, so they share it, while two engines of one process (the
    reference harness's attention-DP ranks share a pool key) do not."""
    key = (pool_key, id(llm_args))
    with _activities_lock:
        entry = _activities.get(key)
        if entry is None or entry[0] is not llm_args:  # a new object at a reused address is another engine
            entry = _activities[key] = (llm_args, EngineActivity())
            while len(_activities) > _ACTIVITIES_KEPT:
                _activities.popitem(last=False)
        return entry[1]
