"""MinHash LSH provider over token shingles (datasketch): partial overlap and near-duplicates.

Each donor's set of token shingles (every window of ``minhash_shingle_tokens`` tokens, hashed by
:func:`~connector.discovery.tokens.window_hashes` and truncated to 32 bits) is summarised by a
``num_perm``-value MinHash and inserted into a datasketch ``MinHashLSH`` tuned for
``minhash_threshold``. The MinHash values are computed here with numpy, with datasketch's own
``affine32`` permutations (``h -> a * h + b mod 2**32``, ``a`` odd): the shingle hashes are already
mixed 64-bit values, so datasketch's per-item Python hashing (2 ms for 2K tokens) is skipped, and
the resulting ``MinHash(hashvalues=…, permutations=…, scheme="affine32")`` objects are datasketch's.

A lookup queries the LSH, ranks the keys by estimated Jaccard, and VERIFIES the best ones with an
exact token alignment (:func:`~connector.discovery.tokens.align_segments`): a candidate is reported
when its verified overlap covers ``minhash_min_overlap`` of the target or its estimated Jaccard
reaches the threshold. Every match is a ``semantic_candidate`` (telemetry / placement evidence).

Threads: the LSH's dicts are not safe to read while the indexer inserts, so both take a short lock
(one insert, or one query of ``b`` band tables: microseconds).
"""

from __future__ import annotations

import threading

import numpy as np
from datasketch import MinHash, MinHashLSH

from connector.discovery.settings import DiscoverySettings
from connector.discovery.tokens import align_segments, window_hashes
from connector.discovery.types import DonorRecord, Match, Query, semantic_match

__all__ = ["MinHashProvider", "minhash_values"]

_ROWS = 8192  # shingles per numpy step (bounds the temporary [rows, num_perm] matrix to 2 MiB)
_ANCHOR = 8  # verification anchor width (tokens)


def minhash_values(shingles: np.ndarray, permutations: np.ndarray) -> np.ndarray:
    """``uint32[num_perm]`` MinHash of a set of ``uint32`` shingle hashes under ``affine32`` permutations
    ``permutations = [a, b]`` (each ``uint32[num_perm]``). An empty set gives all ``2**32 - 1``."""
    a, b = permutations
    out = np.full(len(a), np.iinfo(np.uint32).max, dtype=np.uint32)
    with np.errstate(over="ignore"):
        for start in range(0, len(shingles), _ROWS):
            part = shingles[start : start + _ROWS, None]
            np.minimum(out, (part * a + b).min(axis=0), out=out)
    return out


class MinHashProvider:
    """See the module docstring. Constructed as ``MinHashProvider(settings, db=None)``."""

    name = "minhash"
    generation = 1
    needs_text = False

    def __init__(self, settings: DiscoverySettings, *, db: str | None = None) -> None:
        self.settings = s = settings
        template = MinHash(num_perm=s.minhash_num_perm, seed=s.minhash_seed, scheme="affine32")
        self._perms = np.asarray(template.permutations, dtype=np.uint32)
        self._lsh = MinHashLSH(threshold=s.minhash_threshold, num_perm=s.minhash_num_perm)
        self._donors: dict[str, tuple[DonorRecord, MinHash]] = {}
        self._lock = threading.Lock()

    def sketch(self, token_ids: np.ndarray) -> MinHash:
        """The datasketch MinHash of a token array's shingle set."""
        shingles = np.unique((window_hashes(token_ids, self.settings.minhash_shingle_tokens)
                              & np.uint64(0xFFFFFFFF)).astype(np.uint32))
        values = minhash_values(shingles, self._perms)
        return MinHash(num_perm=self.settings.minhash_num_perm, seed=self.settings.minhash_seed, hashvalues=values,
                       permutations=self._perms, scheme="affine32")

    # -- indexer thread ----------------------------------------------------------------------
    def index(self, donor: DonorRecord) -> None:
        if len(donor.token_ids) < self.settings.minhash_shingle_tokens:
            return
        mh = self.sketch(donor.token_ids)
        with self._lock:
            if donor.donor_id in self._donors:
                self._lsh.remove(donor.donor_id)
            self._lsh.insert(donor.donor_id, mh)
            self._donors[donor.donor_id] = (donor, mh)

    def forget(self, donor_id: str) -> None:
        with self._lock:
            if self._donors.pop(donor_id, None) is not None:
                self._lsh.remove(donor_id)

    def prepare(self, query: Query) -> None:
        """Nothing to precompute."""

    def flush(self, force: bool = True) -> None:
        """Inserts are visible at once."""

    @property
    def size(self) -> int:
        return len(self._donors)

    # -- lookup thread ---------------------------------------------------------------------------
    def candidates(self, query: Query, limit: int) -> list[Match]:
        target = query.token_ids
        if len(target) < self.settings.minhash_shingle_tokens:
            return []
        mh = self.sketch(target)
        with self._lock:
            keys = self._lsh.query(mh)
            found = [self._donors[k] for k in keys if k in self._donors]
        scored = sorted(((mh.jaccard(sketch), donor) for donor, sketch in found
                         if donor.model_id == query.model_id), key=lambda x: -x[0])
        out: list[Match] = []
        s = self.settings
        for jaccard, donor in scored[: 2 * limit]:
            spans = align_segments(target, donor.token_ids, anchor=max(_ANCHOR, s.minhash_shingle_tokens),
                                   min_tokens=s.min_segment_tokens)
            overlap = sum(n for _, _, n in spans) / len(target)
            if overlap < s.minhash_min_overlap and jaccard < s.minhash_threshold:
                continue
            confidence = "high" if jaccard >= 0.8 else "medium" if jaccard >= 0.5 else "low"
            out.append(semantic_match(self, donor, len(target), spans, similarity=jaccard, confidence=confidence))
            if len(out) >= limit:
                break
        out.sort(key=Match.rank_key, reverse=True)
        return out

    def close(self) -> None:
        with self._lock:
            self._donors.clear()
