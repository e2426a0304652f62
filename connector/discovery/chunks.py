"""Block-chunk provider: donor blocks that occur at OTHER positions in the target (discovery only).

Finds reordered RAG chunks, a tool schema repeated after another system prompt, a document quoted
again later in a conversation: any whole donor block whose tokens appear anywhere in the target.
KV at another position or after another prefix is not the KV the target needs (RoPE positions and
attention to a different prefix differ), so every match is a ``semantic_candidate``: telemetry and
placement evidence only (DESIGN §2 rule 2). Segments at the same position after an identical prefix
are the exact path's business (the ledger's content keys) and are left out.

Index: the position-independent hash of every whole donor block (``tokens_per_block`` tokens), kept
as an immutable snapshot of three parallel arrays sorted by hash (newest donor first among equal
hashes): ``hashes uint64[B]``, ``donor int32[B]``, ``position int32[B]``. The indexer thread appends
to a pending list and publishes a new snapshot (one merge sort) at most every ``_REBUILD_S``
seconds or on :meth:`flush`; lookups read whichever snapshot is current, without a lock.

Lookup: hash every window of ``tokens_per_block`` target tokens at every offset (vectorised,
:func:`~connector.discovery.tokens.window_hashes`), binary-search them in the snapshot, tally the
hits per donor (at most ``chunk_max_fanout`` donors per repeated block content), then for the best
donors chain the hits into runs, extend each run token by token to the chunk's real edges and verify
it. Cost: ``O(n log B)`` for an ``n``-token target over ``B`` indexed blocks.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np

from connector.discovery.settings import DiscoverySettings
from connector.discovery.tokens import window_hashes
from connector.discovery.types import DonorRecord, Match, Query, semantic_match

__all__ = ["BlockChunkProvider"]

_REBUILD_S = 0.05


@dataclasses.dataclass(frozen=True, slots=True)
class _Snapshot:
    hashes: np.ndarray
    donor: np.ndarray
    position: np.ndarray


_EMPTY = _Snapshot(np.empty(0, np.uint64), np.empty(0, np.int32), np.empty(0, np.int32))


class BlockChunkProvider:
    """See the module docstring. Constructed as ``BlockChunkProvider(settings, db=None)``."""

    name = "chunks"
    generation = 1
    needs_text = False

    def __init__(self, settings: DiscoverySettings, *, db: str | None = None) -> None:
        self.settings = settings
        self._records: list[DonorRecord | None] = []
        self._slot: dict[str, int] = {}
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._dead = 0
        self._snap = _EMPTY
        self._built_at = 0.0
        self._lock = threading.Lock()  # guards _records/_slot against concurrent candidates() reads

    # -- indexer thread ----------------------------------------------------------------------
    def index(self, donor: DonorRecord) -> None:
        tpb, n = donor.tokens_per_block, donor.num_blocks
        if n == 0:
            return
        self.forget(donor.donor_id)
        hashes = window_hashes(donor.token_ids[: n * tpb], tpb, stride=tpb)[:n]
        with self._lock:
            slot = len(self._records)
            self._records.append(donor)
            self._slot[donor.donor_id] = slot
        self._pending.append((hashes, np.full(n, slot, np.int32), np.arange(n, dtype=np.int32)))
        self.flush(force=False)

    def forget(self, donor_id: str) -> None:
        with self._lock:
            slot = self._slot.pop(donor_id, None)
            if slot is not None:
                self._records[slot] = None
                self._dead += 1

    def prepare(self, query: Query) -> None:
        """Nothing to precompute."""

    def flush(self, force: bool = True) -> None:
        """Publish pending blocks as a new snapshot (throttled unless ``force``)."""
        if not self._pending and not (force and self._dead):
            return
        if not force and time.monotonic() - self._built_at < _REBUILD_S:
            return
        snap, pending, self._pending = self._snap, self._pending, []
        with self._lock:
            alive = np.array([r is not None for r in self._records], dtype=bool)
        parts_h, parts_d, parts_p = [snap.hashes], [snap.donor], [snap.position]
        for h, d, p in pending:
            parts_h.append(h)
            parts_d.append(d)
            parts_p.append(p)
        hashes, donor, position = np.concatenate(parts_h), np.concatenate(parts_d), np.concatenate(parts_p)
        keep = alive[donor] if len(donor) else np.empty(0, bool)
        hashes, donor, position = hashes[keep], donor[keep], position[keep]
        order = np.lexsort((-donor.astype(np.int64), hashes))  # by hash, newest donor first
        self._snap = _Snapshot(hashes[order], donor[order], position[order])
        self._built_at = time.monotonic()

    @property
    def size(self) -> int:
        """Donors currently indexed."""
        return len(self._slot)

    # -- lookup thread ---------------------------------------------------------------------------
    def candidates(self, query: Query, limit: int) -> list[Match]:
        snap, tpb, target = self._snap, query.tokens_per_block, query.token_ids
        if not len(snap.hashes) or len(target) < tpb:
            return []
        wh = window_hashes(target, tpb)
        first = np.searchsorted(snap.hashes, wh)
        offsets, donors, positions = [], [], []
        for f in range(self.settings.chunk_max_fanout):
            j = first + f
            ok = j < len(snap.hashes)
            ok[ok] = snap.hashes[j[ok]] == wh[ok]
            if not ok.any():
                break
            offsets.append(np.flatnonzero(ok))
            donors.append(snap.donor[j[ok]])
            positions.append(snap.position[j[ok]])
        if not offsets:
            return []
        offset, donor, position = np.concatenate(offsets), np.concatenate(donors), np.concatenate(positions)
        slots, counts = np.unique(donor, return_counts=True)
        out: list[Match] = []
        for slot in slots[np.argsort(-counts, kind="stable")][: 4 * limit].tolist():
            with self._lock:
                record = self._records[slot]
            if record is None or record.model_id != query.model_id or record.tokens_per_block != tpb:
                continue
            mine = donor == slot
            match = self._match(query, record, offset[mine], position[mine])
            if match is not None:
                out.append(match)
            if len(out) >= limit:
                break
        out.sort(key=Match.rank_key, reverse=True)
        return out

    def _match(self, query: Query, donor: DonorRecord, offsets: np.ndarray, positions: np.ndarray) -> Match | None:
        tpb, target, source = query.tokens_per_block, query.token_ids, donor.token_ids
        order = np.lexsort((positions, offsets))
        runs: list[list[int]] = []  # [target_start, donor_start, tokens]
        for off, pos in zip(offsets[order].tolist(), positions[order].tolist(), strict=True):
            if runs and off == runs[-1][0] + runs[-1][2] and pos * tpb == runs[-1][1] + runs[-1][2]:
                runs[-1][2] += tpb
            elif not runs or off >= runs[-1][0] + runs[-1][2]:
                runs.append([off, pos * tpb, tpb])
        spans: list[tuple[int, int, int]] = []
        for i, (t0, d0, n) in enumerate(runs):
            low = spans[-1][0] + spans[-1][2] if spans else 0
            high = runs[i + 1][0] if i + 1 < len(runs) else len(target)
            while t0 > low and d0 > 0 and target[t0 - 1] == source[d0 - 1]:  # extend to the chunk's edges
                t0, d0, n = t0 - 1, d0 - 1, n + 1
            while t0 + n < high and d0 + n < len(source) and target[t0 + n] == source[d0 + n]:
                n += 1
            if t0 == d0 and np.array_equal(target[:t0], source[:d0]):
                continue  # same position after the same prefix: exact reuse, not this provider's
            spans.append((t0, d0, n))
        blocks = sum(len(donor.refs_for(d, n)) for _, d, n in spans)
        if blocks < self.settings.chunk_min_blocks:
            return None
        coverage = sum(n for _, _, n in spans) / len(target)
        confidence = "high" if blocks >= 4 else "medium" if blocks >= 2 else "low"
        return semantic_match(self, donor, len(target), spans, similarity=coverage, confidence=confidence)

    def close(self) -> None:
        self._snap = _EMPTY

    def __repr__(self) -> str:
        return f"BlockChunkProvider(donors={self.size}, blocks={len(self._snap.hashes)})"

