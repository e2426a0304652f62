"""Span finding: the longest fresh donor span for a prompt, whose checksummed bytes this host holds.

The lookup's read side, for :class:`~connector.scheduler.SemKvScheduler` (rank 0, inside
``get_num_new_matched_tokens``, under TensorRT-LLM's block-manager lock):

* from the scheduler's :class:`~ledger.donor_view.DonorView` (memory; donors whose bytes this host's
  store holds, with their block liveness), caught up every ``donor_view_refresh_s`` by a periodic
  job on the connector's ledger thread; until it is loaded (or with ``donor_view_refresh_s = 0``)
  from the ledger itself, under the hard deadline ``lookup_timeout_s``: on SQLite on the engine's
  own thread, the ledger interrupting its statements at the deadline; on PostgreSQL on a lookup
  thread that is abandoned;
* the bytes: this process's record of the store entries it checksummed (no system call, re-checked
  against the files every ``store_recheck_s`` on the same ledger thread), else a checksum inline for
  a small entry or in the background for a big one (a miss until then).

Nothing on the view path releases the GIL: a released GIL goes to whichever connector thread waits
for it and comes back after up to ``sys.getswitchinterval()`` (5 ms; tools/results/connector-*.md).
Misses are :class:`LookupMiss` values with the reason the metrics count; a ``no_donor`` miss is
explained in the background (:class:`~connector.lookup.MissDiagnosis`). ``discovery_only`` and
``placement`` lookups run here too, entirely in the background (telemetry only).
"""

from __future__ import annotations

import logging
import threading
import time

from connector.donor_store import ChecksumMismatch, DonorStore, DonorStoreError, EntryMissing
from connector.lookup import BackgroundRunner, DeadlineRunner, MissDiagnosis
from connector.metrics import ConnectorMetrics
from connector.namespace import Namespace, content_keys, probe_key
from connector.settings import ConnectorSettings
from ledger.donor_view import DonorView, ViewDonor
from ledger.errors import DeadlineExceeded, LedgerError
from ledger.client import LedgerClient
from ledger.reads import DonorSpan
from ledger.types import FreshnessPolicy

__all__ = ["RECHECK_ENTRIES_PER_TICK", "LookupMiss", "SpanFinder"]

log = logging.getLogger(__name__)
RECHECK_ENTRIES_PER_TICK = 256
"""Donor store entries stat'ed per ``store_recheck_s`` run (round robin): 2.2 ms of the ledger
thread per run here (measured, 1000 entries) however many entries the store verified, ~4 % of one
CPU at the default 50 ms; an entry changed outside the store is found within ``ceil(entries / 256)``
runs."""


class LookupMiss(Exception):
    """A lookup that promises nothing: ``reason`` is the metric's label (``""``: counted elsewhere,
    e.g. by a background diagnosis), ``field`` the namespace field for ``namespace_mismatch``."""

    def __init__(self, reason: str, field: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.field = reason, field


def _span_of(donor: ViewDonor, num_blocks: int) -> DonorSpan:
    return DonorSpan(donor.donor_id, donor.engine_id, donor.generation, num_blocks, donor.tokens_per_block,
                     donor.store_ref, donor.checksum, donor.provider_generation)


class SpanFinder:
    """Finds donor spans for one scheduler (see the module docstring).

    Args:
        settings: the connector's settings.
        ledger, store, metrics: the scheduler's.
        background: the telemetry thread (miss diagnosis, background checksums, discovery lookups).
        tokens_per_block: the engine's block size (tokens).
    """

    def __init__(self, settings: ConnectorSettings, ledger: LedgerClient, store: DonorStore,
                 metrics: ConnectorMetrics, background: BackgroundRunner, tokens_per_block: int) -> None:
        self.settings, self.ledger, self.store, self.metrics = settings, ledger, store, metrics
        self.policy = FreshnessPolicy(settings.freshness_policy)
        self.tokens_per_block = tokens_per_block
        self._background = background
        self._diagnosis = MissDiagnosis(ledger, store)
        self._verifying: set[str] = set()
        self._verifying_lock = threading.Lock()
        # SQLite reads run on the engine's thread under an interrupting deadline; PostgreSQL's on a thread
        self._hot = None if ledger.interruptible else DeadlineRunner("semkv-lookup")
        self.view: DonorView | None = None
        self._trust_store_record = False
        """Lookups trust the store's record of verified entries (re-checked by a periodic job)."""
        if settings.materializes and settings.donor_view_refresh_s > 0:
            # A view whose catch-up fails is not used after 20 periods (lookups read the ledger); one
            # whose catch-up is only late (it shares the ledger thread with lease writes) after
            # lease_confirm_timeout_s (past half that, lookups miss with ledger_busy anyway).
            failing_s = max(0.1, 20 * settings.donor_view_refresh_s)
            self.view = DonorView(self._in_store, settings.donor_view_max_blocks,
                                  max(failing_s, settings.lease_confirm_timeout_s), max_failing_s=failing_s)

    def start(self, ledger_jobs: BackgroundRunner) -> None:
        """Load the donor view and start its catch-up and the store's recheck on ``ledger_jobs``
        (after the engine's start is recorded: this engine's old donors are stale in it)."""
        if self.view is None:
            return
        try:
            self.ledger.refresh_view(self.view)
        except LedgerError as exc:  # the ledger is down: lookups read it (and miss) until a catch-up loads the view
            log.warning("semkv: could not load the donor view: %s", exc)
        ledger_jobs.every("donor view catch-up", self.settings.donor_view_refresh_s, self._catch_up_view)
        if self.settings.store_recheck_s > 0:
            self._trust_store_record = True
            ledger_jobs.every("donor store recheck", self.settings.store_recheck_s,
                              lambda: self.store.recheck_verified(RECHECK_ENTRIES_PER_TICK))

    # ------------------------------------------------------------------ the lookup's read side
    def find(self, ns: Namespace, keys: list[bytes], start_block: int) -> DonorSpan | LookupMiss:
        """The longest span of ``keys`` past ``start_block`` that is fresh and whose bytes this host
        holds, at most ``lookup_timeout_s`` (see the module docstring). Never raises a ledger error
        as such: the caller's boundary turns any exception into a miss."""
        view = self.ready_view()
        if view is not None:
            return self.find_unbounded(ns, keys, start_block, view)
        timeout = self.settings.lookup_timeout_s
        if self._hot is None:
            try:
                with self.ledger.deadline(timeout):
                    return self.find_unbounded(ns, keys, start_block, None)
            except DeadlineExceeded:
                return LookupMiss("timeout")
        finished, result = self._hot.run(lambda job: self.find_unbounded(ns, keys, start_block, None), timeout)
        return result if finished else LookupMiss("timeout")

    def find_unbounded(self, ns: Namespace, keys: list[bytes], start_block: int,
                       view: DonorView | None) -> DonorSpan | LookupMiss:
        """:meth:`find` without its deadline, from ``view`` (None: the ledger). With the view, the
        store's record of what this process checksummed (re-checked off the path) stands for the
        bytes, without an ``os.stat`` on the engine's thread."""
        min_blocks = start_block + self.settings.min_match_blocks
        if view is None:
            span = self.ledger.find_donor_span(ns.digest, keys, policy=self.policy, min_blocks=min_blocks)
        else:
            found = view.longest_span(ns.digest, keys, now=time.time(), min_blocks=min_blocks,
                                      check_blocks=self.policy == FreshnessPolicy.ENGINE)
            span = None if found is None else _span_of(*found)
        if span is None:
            return LookupMiss("no_donor")
        if span.store_ref is None or span.checksum is None:
            return LookupMiss("donor_not_saved")
        if view is not None and self._trust_store_record and self.store.known_verified(span.store_ref, span.checksum):
            return span
        return self._check_bytes(span) or span

    def ready_view(self) -> DonorView | None:
        """The donor view when lookups may use it (loaded and caught up lately), else None."""
        return self.view if self.view is not None and self.view.ready else None

    def view_age_s(self) -> float:
        """The donor view's age for the metric: seconds, -1.0 without a view (or before its load)."""
        age = self.view.age_s() if self.view is not None else float("inf")
        return age if age != float("inf") else -1.0

    def sync(self) -> None:
        """Catch the view up and re-check the store's verified entries now (tests; no-op without a view)."""
        if self.view is not None:
            self.ledger.refresh_view(self.view)
            self.store.recheck_verified()

    def close(self) -> None:
        if self._hot is not None:
            self._hot.close()

    # ------------------------------------------------------------------ bytes
    def _check_bytes(self, span: DonorSpan) -> LookupMiss | None:
        ref, checksum = span.store_ref, span.checksum
        assert ref is not None and checksum is not None
        try:
            if not self.store.local:  # a networked store: never a round trip on the engine's thread
                if self.store.known_verified(ref, checksum):
                    return None
                self._verify_once(span.donor_id, ref, checksum)
                return LookupMiss("store_unverified")
            if self.store.verified(ref, checksum):
                return None
            if self.store.size_of(ref) > self.settings.store_inline_verify_max_bytes:
                self._verify_once(span.donor_id, ref, checksum)
                return LookupMiss("store_unverified")
            self.store.verify(ref, checksum)
            return None
        except EntryMissing:
            self.store.forget_verified(ref)  # and close the file this process kept open for it
            return LookupMiss("store_missing")
        except ChecksumMismatch as exc:
            log.error("semkv: donor %s failed its checksum (%s); evicting it", span.donor_id, exc)
            self._background.submit(lambda: self.store.evict(span.donor_id, "checksum_mismatch", force=True),
                                    must=True)
            return LookupMiss("checksum_mismatch")

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

    def _catch_up_view(self) -> None:
        """The periodic catch-up of the donor view; a failure shortens how long the view is used."""
        assert self.view is not None
        try:
            self.ledger.refresh_view(self.view)
        except Exception:
            self.view.catch_up_failed()
            raise

    # ------------------------------------------------------------------ telemetry (background)
    def explain_later(self, ns: Namespace, keys: list[bytes], start_block: int, head: list[int]) -> None:
        """Count a ``no_donor`` miss under the reason the ledger and the store explain (queued; the
        probe key of the prompt's ``head`` is hashed there, off the engine's path), as of what the
        lookup saw: the donor view's cursor when the view answered."""
        view = self.ready_view()
        as_of = view.cursor if view is not None else None
        self._background.submit(lambda: self._explain(ns, keys, start_block, probe_key(head), as_of))

    def discover_later(self, ns: Namespace, prompt: list[int], start_block: int, max_blocks: int) -> None:
        """``discovery_only`` / ``placement``: hash and look up ``prompt`` in the background and count
        what a materializing lookup would have found (telemetry only)."""
        self._background.submit(lambda: self._discover(ns, prompt, start_block, max_blocks))

    def _explain(self, ns: Namespace, keys: list[bytes], start_block: int, probe: str | None,
                 as_of_seq: int | None = None) -> None:
        reason, field = self._diagnosis.explain(ns, keys, start_block, probe, self.policy, as_of_seq)
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
