"""An in-memory view of the ledger's fresh donors, for the scheduler's lookup (DESIGN §4, §7).

``get_num_new_matched_tokens`` runs under TensorRT-LLM's block-manager lock with a budget of 250 µs
at 2K tokens (DESIGN §7). A SQLite read costs ~100 µs there by itself: every commit of another
connection (the consumer, the lease writer) makes a reader drop its page cache, so the first
statements after it read their pages again (tools/results/connector-*.md). :class:`DonorView`
answers the lookup from memory instead. It is a read model of the ledger's own projections, caught
up by :meth:`ledger.client.LedgerClient.refresh_view` (a periodic job of the connector, every few ms) from what
changed since the log seq it reflects (:attr:`DonorView.cursor`):

* donors whose ``updated_seq`` moved: a saved (``live``) donor the caller wants (its bytes are in
  this host's donor store) enters with its content keys and block hashes and the liveness of its
  blocks (one read of the ``blocks`` projection); any other state leaves;
* engines' current generations (a donor of an older one is stale);
* the log's ``block_stored`` / ``block_removed`` / ``all_blocks_cleared`` rows, which make donor
  blocks live or not (:class:`~ledger.liveness.LivenessCache`; policy ``engine``).

What the view says is normally one period old (at most the staleness its owner allows). That is
safe because it is not the last word: the scheduler's ledger lease re-checks the donor and every promised block in its write transaction and
the plan ships only once that lease is held, and the worker re-reads the ledger before every layer
(DESIGN §2 rules 3 and 6).

Thread-safe (one lock). No database access here.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ledger.freshness import DonorFacts, longest_prefix, stale_reason
from ledger.liveness import LivenessCache
from ledger.types import DonorState

__all__ = ["DonorView", "ViewDonor"]

_LIVE = str(DonorState.LIVE)


@dataclasses.dataclass(frozen=True, slots=True)
class ViewDonor:
    """A saved donor as the view holds it (the ``donors`` projection row's fields it needs)."""

    donor_id: str
    namespace: str
    engine_id: str
    attention_dp_rank: int
    window_size: int
    generation: int
    tokens_per_block: int
    provider_generation: int
    expires_at: float | None
    store_ref: str
    checksum: str
    registered_seq: int
    content_keys: tuple[bytes, ...]


class DonorView:
    """Fresh, wanted donors by content key, with their block liveness.

    Args:
        wanted: ``(donor_id, store_ref, checksum) -> bool``: keep this saved donor (default: all).
            The scheduler keeps those whose bytes its host's donor store holds (no other can be
            loaded), and starts checksumming them off the engine's path.
        max_blocks: donor blocks held at most; beyond it the oldest donors leave the view (a
            lookup then misses them; counted in :attr:`dropped`).
        max_staleness_s: the view is not :attr:`ready` when its last catch-up is older (seconds):
            a ledger that cannot be read must not leave lookups on an old picture.
        max_failing_s: the same bound while the latest catch-up attempt failed (default
            ``max_staleness_s``): a catch-up that is merely late may get longer than one that fails.
    """

    def __init__(self, wanted: Callable[[str, str, str], bool] | None = None, max_blocks: int = 131_072,
                 max_staleness_s: float = 1.0, max_failing_s: float | None = None) -> None:
        self.wanted = wanted or (lambda donor_id, store_ref, checksum: True)
        self.max_blocks, self.max_staleness_s = max_blocks, max_staleness_s
        self.max_failing_s = max_staleness_s if max_failing_s is None else max_failing_s
        self._failing = False
        self._caught_up_at = float("-inf")
        self.cursor = -1
        """Log seq the view reflects; -1 until the first refresh."""
        self.dropped = 0
        self.liveness = LivenessCache()
        self._donors: dict[str, ViewDonor] = {}
        self._by_key: dict[bytes, list[str]] = {}
        self._engines: dict[str, tuple[int, str]] = {}
        """engine_id -> (current generation, status)"""
        self._facts: dict[str, DonorFacts] = {}
        """donor_id -> what freshness reads of it, with its engine's generation and status (kept
        with the donors and the engines, so a lookup allocates nothing to apply the rule)"""
        self._blocks = 0
        self._lock = threading.Lock()
        self.catching_up = threading.Lock()
        """Held for a whole catch-up (the periodic catch-up and an explicit refresh must not interleave)."""

    @property
    def ready(self) -> bool:
        """True when the view has been caught up with the ledger within ``max_staleness_s``
        (seconds): loaded, and its refresh not failing. Otherwise read the ledger itself."""
        limit = self.max_failing_s if self._failing else self.max_staleness_s
        return self.cursor >= 0 and time.monotonic() - self._caught_up_at < limit

    def age_s(self) -> float:
        """Seconds since the last catch-up (infinite before the first)."""
        return time.monotonic() - self._caught_up_at

    def caught_up(self) -> None:
        """The ledger was read and nothing changed since :attr:`cursor`."""
        self._caught_up_at = time.monotonic()
        self._failing = False

    def catch_up_failed(self) -> None:
        """A catch-up attempt failed (the ledger could not be read): :attr:`ready` uses
        ``max_failing_s`` until one succeeds."""
        self._failing = True

    # -- lookup (memory only) ----------------------------------------------------------------

    def longest_span(self, namespace: str, content_keys: Sequence[bytes], *, now: float, min_blocks: int = 1,
                     check_blocks: bool = True) -> tuple[ViewDonor, int] | None:
        """``(donor, n)``: the donor with the longest fresh live prefix ``content_keys[:n]``
        (n ≥ ``min_blocks``), newest first among equals; None if there is none. Fresh:
        :func:`ledger.freshness.stale_reason` is None and (``check_blocks``, policy ``engine``) its
        first n blocks are live.
        :func:`ledger.freshness.longest_prefix` searches (a whole-prompt hit is one dict probe)."""
        with self._lock:
            lo, holders = longest_prefix(len(content_keys),
                                         lambda n: self._holders(namespace, content_keys[n - 1], now),
                                         min_blocks=min_blocks)
            best = None
            for donor in holders or ():
                live = self.liveness.live_prefix(donor.donor_id, lo) if check_blocks else lo
                if live is not None and live >= min_blocks and (best is None or live > best[1]):
                    best = (donor, live)
                if best is not None and best[1] == lo:
                    break
            return best

    def _holders(self, namespace: str, key: bytes, now: float) -> list[ViewDonor]:
        """Donors holding ``key`` that are fresh but for block liveness (:func:`ledger.freshness.stale_reason`
        on :attr:`_facts`; the view holds saved donors only), newest first. A list, not a lazy
        judgement: the search keeps the probe that answered, so the hit's holders are judged once
        (a second pass per hit cost ~4 µs of a ~55 µs lookup: tools/results/issue20-2026-12-03-lookup.md)."""
        facts, donors = self._facts, self._donors
        return [donors[d] for d in reversed(self._by_key.get(key, ()))
                if stale_reason(facts[d], namespace=namespace, now=now) is None]

    def _facts_of(self, donor: ViewDonor) -> DonorFacts:
        generation, status = self._engines.get(donor.engine_id, (None, None))
        return DonorFacts(donor.namespace, _LIVE, donor.expires_at, donor.generation, generation, status)

    def stats(self) -> dict[str, int]:
        """Donors and blocks held, donors dropped for size, the cursor (metrics, tests)."""
        with self._lock:
            return {"donors": len(self._donors), "blocks": self._blocks, "dropped": self.dropped,
                    "cursor": self.cursor}

    # -- catch-up (fed by LedgerClient.refresh_view) -----------------------------------------

    def changed(self, upto_seq: int, engines: Iterable[tuple[str, int]], donors: Iterable[Any],
                removals: Iterable[Any],
                load: Callable[[Any], tuple[list[bytes], list[tuple[int, bytes]], list[bool]]], *,
                complete: bool = True) -> None:
        """Apply what changed in ``(cursor, upto_seq]``: every engine's ``(engine_id, generation, status)``,
        the donor rows whose ``updated_seq`` moved (``donor_id, namespace, engine_id, dp_rank,
        window_size, generation, tokens_per_block, provider_generation, expires_at, state,
        store_ref, checksum, registered_seq``), and the log's block rows (see
        :meth:`LivenessCache.apply`). ``load(row)`` returns a new donor's content keys, block
        hashes and which blocks are live, read at ``upto_seq`` or later. ``complete``: the ledger
        holds nothing past ``upto_seq`` (a catch-up done in steps is caught up only at its last)."""
        with self._lock:
            current = {engine_id: (generation, status) for engine_id, generation, status in engines}
            if current != self._engines:  # an engine restarted, lost events or came back: re-derive facts
                self._engines = current
                self._facts = {donor_id: self._facts_of(donor) for donor_id, donor in self._donors.items()}
        self.liveness.apply(removals, upto_seq)
        for row in donors:
            donor_id, state, store_ref = row[0], row[9], row[10]
            held = self._donors.get(donor_id)
            if state != _LIVE or store_ref is None or not self.wanted(donor_id, store_ref, row[11] or ""):
                self._remove(donor_id)
            elif held is None or (held.store_ref, held.checksum, held.expires_at) != (store_ref, row[11], row[8]):
                self._remove(donor_id)  # new, or saved again (new bytes) / its expiry moved
                keys, hashes, live = load(row)
                self._add(row, keys, hashes, live, upto_seq)
        with self._lock:
            self.cursor = upto_seq
        if complete:
            self.caught_up()

    def _add(self, row: Any, keys: list[bytes], hashes: list[tuple[int, bytes]], live: list[bool], seq: int) -> None:
        if not keys or len(keys) > self.max_blocks:
            self.dropped += 1
            return
        donor = ViewDonor(row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7], row[8], row[10],
                          row[11] or "", row[12], tuple(keys))
        with self._lock:
            while self._donors and self._blocks + len(keys) > self.max_blocks:
                self.dropped += 1
                self._remove_locked(min(self._donors.values(), key=lambda d: d.registered_seq).donor_id)
            self._donors[donor.donor_id] = donor
            self._facts[donor.donor_id] = self._facts_of(donor)
            for key in keys:
                self._by_key.setdefault(key, []).append(donor.donor_id)
            self._blocks += len(keys)
        if not self.liveness.put(donor.donor_id, (donor.engine_id, donor.attention_dp_rank, donor.window_size),
                                 hashes, live, seq):
            self._remove(donor.donor_id)  # its liveness could not be followed: never serve it

    def _remove(self, donor_id: str) -> None:
        with self._lock:
            self._remove_locked(donor_id)

    def _remove_locked(self, donor_id: str) -> None:
        donor = self._donors.pop(donor_id, None)
        if donor is None:
            return
        del self._facts[donor_id]
        for key in donor.content_keys:
            holders = self._by_key.get(key)
            if holders is not None:
                holders.remove(donor_id)
                if not holders:
                    del self._by_key[key]
        self._blocks -= len(donor.content_keys)
        self.liveness.forget(donor_id)
