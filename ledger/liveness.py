"""Donor block liveness kept current from the log, for the donor view (policy ``engine``).

Under freshness policy ``engine`` a donor is fresh only while every block it needs is live in its
engine (DESIGN §5). Reading that from the ``blocks`` projection costs one primary-key probe per
block: ~1.5 µs, so 96 µs for a 2K-token donor and 2.7 ms for a 32K one on the 2-core reference
machine (tools/results/connector-*.md) — more than DESIGN §7's whole lookup budget.
:class:`LivenessCache` pays that once per donor and then follows the log: an applied
``block_removed`` row marks the donor positions that held the removed block dead, an applied
``block_stored`` row of such a block makes them live again (the projection does the same, see
:mod:`ledger.apply`), and an ``all_blocks_cleared`` row kills every watched block of that engine.
Generation changes (restart, gap, clear) need nothing here: a donor of an older generation is stale
whatever its blocks say, and the donor view checks generations itself.

A donor can be registered before the consumer has committed its blocks' ``stored`` events (the
engine's events lag): it is read with those blocks dead, and they come alive when their rows
arrive. Memory: one watch entry per donor block (~200 bytes). Thread-safe: changes (put, forget,
apply) are serialized by one lock, and readers (``live_prefix``) wait only for the short section
where a change is applied, never for the decoding of a catch-up's rows. No database access here —
:class:`ledger.client.LedgerClient` reads the rows and hands them in.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from ledger import events as ev
from ledger.types import split_hash

__all__ = ["LIVENESS_KINDS", "LivenessCache"]

LIVENESS_KINDS = ("block_stored", "block_removed", "all_blocks_cleared")
"""Log ``kind`` values that change whether a block is live without changing its generation."""

Stream = tuple[str, int, int]  # (engine_id, attention_dp_rank, window_size)
_WatchKey = tuple[str, int, int, int, bytes]  # stream + (block_hash, block_hash_ext) storage columns


@dataclasses.dataclass(slots=True)
class _Entry:
    stream: Stream
    hashes: list[tuple[int, bytes]]
    """Storage columns of the donor's blocks, in position order."""
    dead: set[int]
    """Positions known not live."""


class LivenessCache:
    """Which blocks of each watched donor are live, caught up from the log's block rows."""

    def __init__(self) -> None:
        self.cursor = 0
        """Log seq up to which block rows have been applied."""
        self._entries: dict[str, _Entry] = {}
        self._watch: dict[_WatchKey, list[tuple[str, int]]] = {}
        self._engines: Counter[str] = Counter()
        self._lock = threading.Lock()  # the state readers see
        self._changing = threading.Lock()  # one change at a time; held across a catch-up's decoding

    def live_prefix(self, donor_id: str, num_blocks: int) -> int | None:
        """Leading blocks of the donor known live, at most ``num_blocks``; None if not watched."""
        with self._lock:
            entry = self._entries.get(donor_id)
            if entry is None:
                return None
            live = min(num_blocks, len(entry.hashes))
            return min(min(entry.dead, default=live), live)

    def put(self, donor_id: str, stream: Stream, hashes: Sequence[tuple[int, bytes]], live: Sequence[bool],
            read_at_seq: int) -> bool:
        """Watch a donor's blocks, ``live[i]`` telling whether block i was live in a read at log
        seq ``read_at_seq``. Refused (False) when block rows past that read were already applied
        (they would be missed for this donor)."""
        with self._changing, self._lock:
            if read_at_seq < self.cursor:
                return False
            self._drop(donor_id)
            self._entries[donor_id] = _Entry(stream, list(hashes), {i for i, ok in enumerate(live) if not ok})
            self._engines[stream[0]] += 1
            engine_id, dp_rank, window = stream
            for position, (h, ext) in enumerate(hashes):
                self._watch.setdefault((engine_id, dp_rank, window, h, ext), []).append((donor_id, position))
            return True

    def forget(self, donor_id: str) -> None:
        """Stop watching a donor's blocks."""
        with self._changing, self._lock:
            self._drop(donor_id)

    def apply(self, rows: Iterable[Any], upto_seq: int) -> None:
        """Apply log rows ``(seq, kind, engine_id, attention_dp_rank, window_size, body)`` of the
        :data:`LIVENESS_KINDS` with ``seq`` in ``(cursor, upto_seq]``, in seq order (applied rows
        only); the cursor then stands at ``upto_seq``. Rows of engines no watched donor lives in
        are not decoded. The rows are decoded before the lock is taken, so lookups
        (:meth:`live_prefix`) never wait for the decoding of a large catch-up; :meth:`put` and
        :meth:`forget` do wait for it (a donor watched midway would miss its rows)."""
        with self._changing:
            if upto_seq <= self.cursor:
                return
            marks = self._marks(rows)
            with self._lock:
                for key, dead in marks:
                    if key is None:
                        self._clear_engine(dead)
                    else:
                        self._mark(key, dead=dead)
                self.cursor = upto_seq

    def _marks(self, rows: Iterable[Any]) -> list[tuple[Any, Any]]:
        """``[(watch key, dead)]`` of watched blocks, in log order; ``(None, engine_id)`` for an
        engine's clear (``_changing`` held: nothing else changes what is watched)."""
        marks: list[tuple[Any, Any]] = []
        for seq, kind, engine_id, dp_rank, window, body in rows:
            if seq <= self.cursor or not self._engines.get(engine_id):
                continue
            if kind == "all_blocks_cleared":
                marks.append((None, engine_id))
                continue
            event = ev.BODY_DECODER.decode(bytes(body))
            stream = (engine_id, dp_rank or 0, window or 0)
            watched = self._watch
            if kind == "block_removed":
                keys = [stream + split_hash(h) for h in event.block_hashes]
                marks += [(key, True) for key in keys if key in watched]
            else:
                keys = [stream + split_hash(block.block_hash) for block in event.blocks]
                marks += [(key, False) for key in keys if key in watched]
        return marks

    def stats(self) -> dict[str, int]:
        """Watched donors and blocks (metrics, tests)."""
        with self._lock:
            return {"donors": len(self._entries), "blocks": sum(len(e.hashes) for e in self._entries.values())}

    # -- internals (lock held) ---------------------------------------------------------------

    def _mark(self, key: _WatchKey, *, dead: bool) -> None:
        for donor_id, position in self._watch.get(key, ()):
            dead_positions = self._entries[donor_id].dead
            if dead:
                dead_positions.add(position)
            else:
                dead_positions.discard(position)

    def _clear_engine(self, engine_id: str) -> None:
        for entry in self._entries.values():
            if entry.stream[0] == engine_id:
                entry.dead.update(range(len(entry.hashes)))

    def _drop(self, donor_id: str) -> None:
        entry = self._entries.pop(donor_id, None)
        if entry is None:
            return
        self._engines[entry.stream[0]] -= 1
        engine_id, dp_rank, window = entry.stream
        for position, (h, ext) in enumerate(entry.hashes):
            key = (engine_id, dp_rank, window, h, ext)
            refs = self._watch.get(key)
            if refs is None:
                continue
            refs.remove((donor_id, position))
            if not refs:
                del self._watch[key]
