"""One thread per provider, and waiting for several of them under one hard deadline.

A :class:`ProviderLane` owns one daemon thread and a queue of at most ``max_pending`` jobs. The
caller submits a job to every lane, then :func:`wait_all` waits for all of them until ONE deadline:
the caller never waits longer than the deadline plus the cost of a few ``Event.wait`` calls, whatever
a provider does (sleeps, blocks on a lock, loops). A job still unfinished at the deadline is marked
abandoned: if it has not started it never runs; if it is running its result is discarded when it
ends. A provider stuck for good fills its lane's queue, after which it is skipped at submission
(counted as a ``timeout`` by the service) instead of queueing without bound.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ledger.types import FreshnessPolicy, StaleReason

__all__ = ["Job", "ProviderLane", "fresh_only", "wait_all"]


class Job:
    """A submitted call: ``finished``/``abandoned`` flip under ``lock``; ``value``/``error`` once finished."""

    __slots__ = ("abandoned", "done", "elapsed_s", "error", "finished", "fn", "lock", "value")

    def __init__(self, fn: Callable[[Job], Any]) -> None:
        self.fn = fn
        self.done, self.lock = threading.Event(), threading.Lock()
        self.finished = self.abandoned = False
        self.value: Any = None
        self.error: BaseException | None = None
        self.elapsed_s = 0.0


class ProviderLane:
    """One worker thread for one provider; at most ``max_pending`` jobs queued or running."""

    def __init__(self, name: str, max_pending: int) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._pending = 0
        self._max = max_pending
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"semkv-discovery-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[Job], Any]) -> Job | None:
        """Queue ``fn(job)``; None when the lane already holds ``max_pending`` jobs."""
        with self._lock:
            if self._pending >= self._max:
                return None
            self._pending += 1
        job = Job(fn)
        self._queue.put(job)
        return job

    def close(self, timeout_s: float = 2.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                if job.abandoned:
                    continue
                started = time.perf_counter()
                try:
                    value, error = job.fn(job), None
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller, counted there
                    value, error = None, exc
                with job.lock:
                    job.finished, job.value, job.error = True, value, error
                    job.elapsed_s = time.perf_counter() - started
                job.done.set()
            finally:
                with self._lock:
                    self._pending -= 1


def wait_all(jobs: Sequence[Job | None], deadline: float) -> list[bool]:
    """Wait for ``jobs`` until ``deadline`` (``time.perf_counter()`` value). Returns, per job, whether
    it finished in time; unfinished jobs are marked abandoned (a None job counts as unfinished)."""
    out = []
    for job in jobs:
        if job is None:
            out.append(False)
            continue
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            job.done.wait(remaining)
        with job.lock:
            if not job.finished:
                job.abandoned = True
            out.append(job.finished)
    return out


def fresh_only(found: Sequence[Any], namespace: str, ledger: Any, stop: Callable[[], bool]) -> tuple[list[Any], dict[str, int]]:
    """The matches of ``found`` whose donor the ledger reports fresh for ``namespace`` (donor state,
    generation, expiry, namespace; not block liveness), and the others counted by reason
    (``namespace_mismatch`` or ``stale``). Stops early, returning what it has, once ``stop()`` is true
    (the caller gave up). ``ledger``: a :class:`ledger.client.LedgerClient`."""
    fresh: list[Any] = []
    drops: dict[str, int] = {}
    now = time.time()
    for match in found:
        if stop():
            break
        reason = ledger.donor_freshness(match.donor_id, namespace=namespace, num_blocks=0,
                                        policy=FreshnessPolicy.STORE, now=now)
        if reason is None:
            fresh.append(match)
        else:
            key = "namespace_mismatch" if reason == StaleReason.NAMESPACE_MISMATCH else "stale"
            drops[key] = drops.get(key, 0) + 1
    return fresh, drops
