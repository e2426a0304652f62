"""Values of donor discovery (issue 6; DESIGN §2 rules 2 and 4): what a provider returns and indexes.

Pure module: frozen dataclasses, the provider protocol and the bounded quality buckets. Nothing
here loads KV, and nothing a provider returns is ever materialized by itself: a
``semantic_candidate`` is telemetry or placement advice only; an ``exact_equivalent`` match is the
ledger's own exact span and still goes through the scheduler's lease and the worker's revalidation.

Shapes and units:

* token ids are non-negative ints; arrays are ``numpy.int64`` of shape ``[num_tokens]`` and
  read-only (``flags.writeable = False``) wherever a value is shared between threads;
* positions and counts are in tokens unless a name says blocks; a donor block ``p`` covers donor
  tokens ``[p * tokens_per_block, (p + 1) * tokens_per_block)``;
* scores are floats in ``[0, 1]``; they leave this package only as bucket labels (bounded
  cardinality, safe as Prometheus labels).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, NamedTuple, Protocol, runtime_checkable

import numpy as np

__all__ = ["CONFIDENCE_BUCKETS", "SCORE_BUCKETS", "BlockRef", "DiscoveryProvider", "DonorRecord", "Match",
           "MatchType", "Query", "Segment", "confidence_rank", "readonly_tokens", "request_text", "score_bucket"]

MatchType = Literal["exact_equivalent", "semantic_candidate"]

SCORE_BUCKETS = ("lt_0.50", "0.50_0.70", "0.70_0.80", "0.80_0.90", "0.90_0.95", "ge_0.95")
"""Labels of :func:`score_bucket`, lowest first; ``exact`` is used for exact-equivalent matches."""
CONFIDENCE_BUCKETS = ("low", "medium", "high", "exact")
"""Confidence labels, weakest first (:func:`confidence_rank` orders them)."""
_EDGES = (0.5, 0.7, 0.8, 0.9, 0.95)


def score_bucket(value: float) -> str:
    """Bucket label of a score in ``[0, 1]`` (values outside are clamped)."""
    for edge, label in zip(_EDGES, SCORE_BUCKETS, strict=False):
        if value < edge:
            return label
    return SCORE_BUCKETS[-1]


def confidence_rank(label: str) -> int:
    """0 for ``low`` … 3 for ``exact``; -1 for an unknown label."""
    return CONFIDENCE_BUCKETS.index(label) if label in CONFIDENCE_BUCKETS else -1


def request_text(request: object) -> str | None:
    """The request's prompt text if the serving layer attached one (a ``prompt_text`` or
    ``py_prompt_text`` string attribute), else None. TensorRT-LLM's ``LlmRequest`` carries token ids
    only; the connector's scheduler uses this as its default ``text_of``, and only when the
    discovery settings allow prompt text."""
    for name in ("prompt_text", "py_prompt_text"):
        value = getattr(request, name, None)
        if isinstance(value, str):
            return value
    return None


def readonly_tokens(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``token_ids`` as a read-only ``int64`` array ``[n]`` (no copy when it already is one).

    Raises:
        ValueError: not one-dimensional, or a negative token id.
    """
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == np.int64 and token_ids.ndim == 1 \
            and not token_ids.flags.writeable:
        return token_ids
    arr = np.array(token_ids, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and int(arr.min()) < 0:
        raise ValueError("token ids must be non-negative")
    arr.flags.writeable = False
    return arr


class BlockRef(NamedTuple):
    """One donor block: the donor, the block's position in it, and the engine's block hash if known."""

    donor_id: str
    position: int
    block_hash: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    """Target tokens ``[target_start, target_start + token_count)`` equal donor tokens
    ``[donor_start, donor_start + token_count)`` (token for token; verified, not estimated).

    ``donor_block_refs`` are the donor blocks wholly inside the donor span. ``layer_recompute_mask``
    (one bool per layer, True = recompute) is reserved for selective-recompute schemes; the built-in
    providers leave it None. A segment at another position or after another prefix is NOT exact KV.
    """

    target_start: int
    donor_start: int
    token_count: int
    donor_block_refs: tuple[BlockRef, ...] = ()
    layer_recompute_mask: tuple[bool, ...] | None = None

    @property
    def relocated(self) -> bool:
        """The span sits at another position in the target than in the donor."""
        return self.target_start != self.donor_start


@dataclasses.dataclass(frozen=True, slots=True)
class Match:
    """A donor a provider found for a target prompt (DESIGN §2 rule 2: evidence, never authority).

    Attributes:
        donor_id: the ledger's donor id.
        reusable_token_count: tokens the segments cover (what could have been reused; for an
            ``exact_equivalent`` match, the ledger span's whole blocks).
        match_type: ``exact_equivalent`` (ledger exact span) or ``semantic_candidate`` (anything else).
        donor_token_ids: the donor's indexed token ids (read-only ``int64`` array ``[n]``).
        donor_block_refs: the donor blocks the segments use, in target order.
        segments: token-exact spans shared by target and donor, in target order, non-overlapping.
        similarity_bucket, token_overlap_bucket: :data:`SCORE_BUCKETS` labels (``exact`` for exact).
        confidence_bucket: :data:`CONFIDENCE_BUCKETS` label.
        provider_generation: the provider's index generation (changes when its scoring changes).
        provider: the provider's name; donor_engine_id, donor_generation: from the registration.
        score: the provider's raw score in ``[0, 1]`` (ranking only; never a metric label).
    """

    donor_id: str
    reusable_token_count: int
    match_type: MatchType
    donor_token_ids: Sequence[int]
    donor_block_refs: tuple[BlockRef, ...]
    segments: tuple[Segment, ...]
    similarity_bucket: str
    token_overlap_bucket: str
    confidence_bucket: str
    provider_generation: int
    provider: str = ""
    donor_engine_id: str = ""
    donor_generation: int | None = None
    score: float = 0.0

    def rank_key(self) -> tuple:
        """Sort key, best first when sorted descending: exact, confidence, reusable tokens, score."""
        return (self.match_type == "exact_equivalent", confidence_rank(self.confidence_bucket),
                self.reusable_token_count, self.score)


@dataclasses.dataclass(frozen=True, slots=True)
class DonorRecord:
    """A donor as the discovery index sees it (registered off the scheduler path).

    Attributes:
        donor_id, engine_id, namespace: as in the ledger (``namespace`` is the digest, 32 hex chars).
        model_id: tokenizer/model identity; token ids are only compared within one model id.
        token_ids: the donor's tokens whose KV it holds (whole blocks), read-only ``int64`` ``[n]``.
        tokens_per_block: block size (tokens).
        generation: the engine generation the donor was registered in, or None to take the ledger's.
        text: the donor prompt's text; None unless the settings allow prompt text.
        block_hashes: the engine's block hashes of the donor's blocks (for :class:`BlockRef`), or ().
    """

    donor_id: str
    engine_id: str
    namespace: str
    model_id: str
    token_ids: np.ndarray
    tokens_per_block: int
    generation: int | None = None
    text: str | None = None
    block_hashes: tuple[int, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.token_ids) // self.tokens_per_block

    def block_ref(self, position: int) -> BlockRef:
        h = self.block_hashes[position] if position < len(self.block_hashes) else None
        return BlockRef(self.donor_id, position, h)

    def refs_for(self, donor_start: int, token_count: int) -> tuple[BlockRef, ...]:
        """Blocks wholly inside donor tokens ``[donor_start, donor_start + token_count)``."""
        tpb = self.tokens_per_block
        first, end = -(-donor_start // tpb), (donor_start + token_count) // tpb
        return tuple(self.block_ref(p) for p in range(first, min(end, self.num_blocks)))


@dataclasses.dataclass(frozen=True, slots=True)
class Query:
    """One lookup as providers see it. ``inline``: on the scheduler path, where a provider must not
    compute anything heavy (no embedding); it answers from what is already indexed or misses."""

    token_ids: np.ndarray
    text: str | None
    model_id: str
    namespace: str
    tokens_per_block: int
    inline: bool = False


@runtime_checkable
class DiscoveryProvider(Protocol):
    """What a discovery provider implements (built-ins: :mod:`.chunks`, :mod:`.minhash`,
    :mod:`.embedding`, :mod:`.exact`). Constructed as ``cls(settings, db=ledger_url)``.

    Threads: :meth:`index`, :meth:`forget` and :meth:`prepare` run on the service's one indexer
    thread; :meth:`candidates` runs on the provider's own lookup thread, concurrently with indexing,
    so it must read an immutable snapshot or take a short lock. Nothing here runs on the engine's
    thread. Exceptions are caught by the service and counted (``error``), never propagated.
    """

    name: str
    generation: int
    needs_text: bool

    def index(self, donor: DonorRecord) -> None:
        """Add a donor (indexer thread). May be slow (embedding)."""

    def forget(self, donor_id: str) -> None:
        """Drop a donor (indexer thread); unknown ids are ignored."""

    def candidates(self, query: Query, limit: int) -> list[Match]:
        """Up to ``limit`` matches, best first, not yet checked against the ledger (lookup thread)."""

    def prepare(self, query: Query) -> None:
        """Precompute what an ``inline`` lookup of ``query`` will need (indexer thread); may be a no-op."""

    def flush(self, force: bool = True) -> None:
        """Publish what was indexed so lookups see it (indexer thread; called when its queue is idle)."""

    def close(self) -> None:
        """Release resources."""


def semantic_match(provider: DiscoveryProvider, donor: DonorRecord, target_len: int,
                   spans: Sequence[tuple[int, int, int]], *, similarity: float, confidence: str) -> Match:
    """A ``semantic_candidate`` :class:`Match` of ``donor`` with token-exact ``spans``
    ``(target_start, donor_start, token_count)`` (from :func:`connector.discovery.tokens.align_segments`).

    ``token_overlap_bucket`` is the share of the target's ``target_len`` tokens the spans cover.
    """
    segments = tuple(Segment(t, d, n, donor.refs_for(d, n)) for t, d, n in spans)
    covered = sum(n for _, _, n in spans)
    return Match(
        donor_id=donor.donor_id, reusable_token_count=covered, match_type="semantic_candidate",
        donor_token_ids=donor.token_ids, donor_block_refs=tuple(r for s in segments for r in s.donor_block_refs),
        segments=segments, similarity_bucket=score_bucket(similarity),
        token_overlap_bucket=score_bucket(covered / target_len if target_len else 0.0),
        confidence_bucket=confidence, provider_generation=provider.generation, provider=provider.name,
        donor_engine_id=donor.engine_id, donor_generation=donor.generation, score=float(similarity))
