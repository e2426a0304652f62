"""Helpers of the scheduler's lookup: the hard deadline, background work, and miss diagnosis.

* :class:`DeadlineRunner` runs the ledger/store part of a lookup on its own thread and waits for it
  at most ``timeout_s``. The engine thread (which holds TensorRT-LLM's block-manager lock) never
  waits longer, whatever the database does; a job finished after its caller gave up hands its
  result to ``on_abandon`` (the scheduler releases the lease it took), and a job abandoned before
  it started never runs.
* :class:`BackgroundRunner` runs work that must not delay the engine: leases, releases and evictions
  (``must`` jobs, never dropped), telemetry (discovery lookups, miss diagnosis, background
  checksum verification; dropped and counted when ``max_telemetry`` are waiting) and periodic jobs
  (the donor view's catch-up, the store's recheck).
* :class:`MissDiagnosis` explains a miss for the metrics (telemetry only, never a reason to load):
  a donor of the same namespace that is stale (and why: restart, quarantine after a gap, blocks
  removed, evicted, expired), or a donor of the same text in another namespace (which field
  differs: cache salt, LoRA, tokens per block, dtype …), else ``no_donor``. Its reads are the
  ledger's own (:meth:`ledger.client.LedgerClient.donors_for_key`, ``donor_freshness`` and
  ``engine(...).generation_reason``); the connector keeps no SQL of its own.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ledger.types import GenerationReason, StaleReason

__all__ = ["BackgroundRunner", "DeadlineRunner", "MissDiagnosis", "stale_reason_name"]

log = logging.getLogger(__name__)

_STALE_NAMES = {
    StaleReason.UNKNOWN_DONOR: "donor_unknown", StaleReason.NOT_SAVED: "donor_not_saved",
    StaleReason.EVICTED: "donor_evicted", StaleReason.QUARANTINED: "donor_quarantined",
    StaleReason.GENERATION_MISMATCH: "donor_generation_mismatch", StaleReason.ENGINE_UNKNOWN: "donor_unknown",
    StaleReason.BLOCKS_NOT_LIVE: "donor_blocks_removed", StaleReason.NAMESPACE_MISMATCH: "namespace_mismatch",
    StaleReason.EXPIRED: "donor_expired", StaleReason.LEASE_NOT_HELD: "lease_expired",
}
_RESTART_CAUSES = {GenerationReason.CREATED, GenerationReason.SEQ_RESET, GenerationReason.ENGINE_STARTED}
# Most telling field first when several namespace fields differ.
_FIELD_ORDER = ("cache_salt", "lora_task_id", "multimodal", "tenant", "tokens_per_block", "kv_dtype", "kv_layout",
                "model_id", "engine_version", "quant_algo", "kv_cache_quant_algo", "attention_backend")


def stale_reason_name(reason: StaleReason) -> str:
    """Metric reason for a ledger :class:`StaleReason` (``blocks_not_live`` -> ``donor_blocks_removed``)."""
    return _STALE_NAMES.get(reason, f"donor_{reason}")


class _Job:
    __slots__ = ("fn", "on_abandon", "done", "lock", "finished", "abandoned", "value", "error")

    def __init__(self, fn: Callable[[_Job], Any], on_abandon: Callable[[Any], None] | None) -> None:
        self.fn, self.on_abandon = fn, on_abandon
        self.done, self.lock = threading.Event(), threading.Lock()
        self.finished = self.abandoned = False
        self.value: Any = None
        self.error: BaseException | None = None


class DeadlineRunner:
    """One daemon thread; :meth:`run` waits for a job at most ``timeout_s`` seconds."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[[_Job], Any], timeout_s: float,
            on_abandon: Callable[[Any], None] | None = None) -> tuple[bool, Any]:
        """Run ``fn(job)`` on the thread. Returns ``(True, value)``, or ``(False, None)`` past the
        deadline. ``fn`` may poll ``job.abandoned``; exceptions of ``fn`` are re-raised here."""
        job = _Job(fn, on_abandon)
        self._queue.put(job)
        job.done.wait(timeout_s)
        with job.lock:
            if not job.finished:
                job.abandoned = True
                return False, None
        if job.error is not None:
            raise job.error
        return True, job.value

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.abandoned:
                continue
            try:
                value, error = job.fn(job), None
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                value, error = None, exc
            with job.lock:
                job.finished, job.value, job.error = True, value, error
                late = job.abandoned
            job.done.set()
            if late and job.on_abandon is not None and error is None:
                try:
                    job.on_abandon(value)
                except Exception:  # boundary: cleanup of an abandoned job; logged, never raised
                    log.exception("semkv: cleanup of an abandoned lookup failed")


class BackgroundRunner:
    """One daemon thread for work off the engine's path; see the module docstring.

    Besides queued jobs it runs periodic ones (:meth:`every`: the donor view's catch-up, the
    store's recheck), each one period after its previous run ended, whenever no queued job is
    waiting: queued jobs (leases) go first, and a job queued meanwhile waits for at most the
    periodic runs then under way. While jobs stay queued, a periodic job still runs once it is a
    whole period late (between two queued jobs), so a steady stream cannot starve it.
    Keeping them on one thread matters in the engine's process: every connector thread that runs
    Python takes the GIL from the engine's thread, and the more threads compete for it, the more
    often the engine's thread waits a whole ``sys.getswitchinterval()`` (5 ms) to get it back
    (measured: tools/results/connector-2026-12-01-*.md)."""

    def __init__(self, name: str, max_telemetry: int = 1024,
                 on_drop: Callable[[], None] | None = None) -> None:
        # SimpleQueue: its put is one C call on the engine's thread (Queue.put takes a Condition)
        self._queue: queue.SimpleQueue[tuple[bool, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._telemetry = 0
        self._max = max_telemetry
        self._on_drop = on_drop
        self._lock = threading.Lock()
        self._periodic: list[_Periodic] = []
        # when each queued job was queued, oldest first, and when the running job started (None:
        # idle): what backlog_s reads, from the engine's thread, without a lock
        self._queued_at: deque[float] = deque()
        self._running_since: float | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], *, must: bool = False) -> bool:
        """Queue ``fn``; a telemetry job is dropped (False) when too many are waiting."""
        if not must:
            with self._lock:
                if self._telemetry >= self._max:
                    if self._on_drop is not None:
                        self._on_drop()
                    return False
                self._telemetry += 1
        self._queued_at.append(time.monotonic())
        self._queue.put((must, fn))
        return True

    def backlog_s(self) -> float:
        """How long (seconds) the oldest unfinished job, queued or running (periodic ones
        included), has waited or run so far; 0.0 when the thread is idle. A new job would wait at
        least about this long."""
        oldest = self._running_since
        try:
            queued = self._queued_at[0]
        except IndexError:  # empty, or emptied by the thread meanwhile
            queued = None
        if queued is not None and (oldest is None or queued < oldest):
            oldest = queued
        return 0.0 if oldest is None else max(0.0, time.monotonic() - oldest)

    def every(self, name: str, period_s: float, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` ``period_s`` seconds after its previous run ended (the first time one
        period from now) until :meth:`close`. A failure is logged (once per distinct message in a
        row) and the next period runs it again."""
        with self._lock:
            self._periodic = [*self._periodic, _Periodic(name, period_s, fn, time.monotonic() + period_s)]
        self._queued_at.append(time.monotonic())
        self._queue.put((True, _wake))  # the loop recomputes how long it may sleep

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every job queued so far ran (tests, shutdown)."""
        done = threading.Event()
        self._queued_at.append(time.monotonic())
        self._queue.put((True, done.set))
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Run what is queued, then stop (periodic jobs stop after a pass under way)."""
        with self._lock:
            self._periodic = []
        self.flush(timeout_s)
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()  # queued jobs (leases) first ...
                self._run_due(overdue_only=True)  # ... unless a periodic job is a period late
            except queue.Empty:
                try:  # nothing queued: run the periodic jobs that are due, then wait for either
                    item = self._queue.get(timeout=min(self._run_due(), _MAX_SLEEP_S))
                except queue.Empty:
                    continue
            if item is None:
                return
            must, fn = item
            self._running_since = self._queued_at.popleft() if self._queued_at else time.monotonic()
            try:
                fn()
            except Exception:  # boundary: background work never kills the thread
                log.exception("semkv: background job failed")
            finally:
                self._running_since = None
                if not must:
                    with self._lock:
                        self._telemetry -= 1

    def _run_due(self, *, overdue_only: bool = False) -> float:
        """Run the periodic jobs that are due (``overdue_only``: due a whole period ago); returns
        seconds until the next is (long: none)."""
        with self._lock:
            periodic = self._periodic
        if not periodic:
            return _MAX_SLEEP_S
        now = time.monotonic()
        for job in periodic:
            if job.due + (job.period_s if overdue_only else 0.0) <= now:
                self._running_since = now
                job.run()
                self._running_since = None
                now = time.monotonic()
                job.due = now + job.period_s  # a full period between runs, however long one took
        return max(0.0, min(job.due for job in periodic) - now)


_MAX_SLEEP_S = 60.0
"""The loop wakes at least this often (seconds); also keeps a huge period from overflowing the
queue's timeout."""


def _wake() -> None:
    """A queued no-op: makes the loop recompute its sleep."""


class _Periodic:
    __slots__ = ("name", "period_s", "fn", "due", "last_error")

    def __init__(self, name: str, period_s: float, fn: Callable[[], Any], due: float) -> None:
        self.name, self.period_s, self.fn, self.due = name, period_s, fn, due
        self.last_error: str | None = None

    def run(self) -> None:
        try:
            self.fn()
            self.last_error = None
        except Exception as exc:  # boundary: a failed run is retried at the next period
            if str(exc) != self.last_error:
                log.warning("semkv: %s failed: %s", self.name, exc)
            self.last_error = str(exc)


class MissDiagnosis:
    """Why did a lookup find nothing? Telemetry only; reads the ledger and the store's probe index.

    Args:
        ledger: the scheduler's :class:`ledger.client.LedgerClient`.
        store: the :class:`~connector.donor_store.FileDonorStore` (probe index, headers).
    """

    def __init__(self, ledger: Any, store: Any) -> None:
        self.ledger, self.store = ledger, store

    def explain(self, namespace: Any, keys: list[bytes], start_block: int, probe: str | None,
                policy: Any, as_of_seq: int | None = None) -> tuple[str, str | None]:
        """``(reason, namespace field or None)`` for a lookup that found no usable donor.
        ``as_of_seq``: the log seq the lookup saw (its donor view's cursor); donors registered after
        it are not why it missed — the diagnosis runs later, when e.g. the request's own donor may
        be registered (None: every donor counts)."""
        if start_block < len(keys):
            donors = [d for d in self.ledger.donors_for_key(namespace.digest, keys[start_block], limit=8)
                      if as_of_seq is None or d.registered_seq <= as_of_seq][:1]
            if donors:
                donor = donors[0]
                stale = self.ledger.donor_freshness(donor.donor_id, namespace=namespace.digest,
                                                    num_blocks=start_block + 1, policy=policy)
                if stale is None:
                    return "no_donor", None
                if stale == StaleReason.QUARANTINED and self._restarted(donor.engine_id):
                    return "donor_restarted", None
                return stale_reason_name(stale), None
        if probe is not None:
            for donor_id in self.store.donors_with_probe(probe):
                try:
                    header = self.store.read_header(self.store.ref_of(donor_id))
                except Exception:  # noqa: BLE001 - a vanished or unreadable entry explains nothing
                    continue
                if header.namespace != namespace.digest:
                    return "namespace_mismatch", _first_difference(namespace.fields, header.namespace_fields)
        return "no_donor", None

    def _restarted(self, engine_id: str) -> bool:
        """Did the engine's current generation start with a restart (``created``, ZMQ seq reset)?"""
        engine = self.ledger.engine(engine_id)
        return engine is not None and engine.generation_reason in _RESTART_CAUSES


def _first_difference(mine: Any, theirs: dict[str, str]) -> str:
    differing = {k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)}
    for name in _FIELD_ORDER:
        if name in differing:
            return name
    return min(differing) if differing else "namespace"
