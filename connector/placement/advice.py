"""Placement advice (Mode 3): which engine should serve a request, from fresh ledger state only.

For a request (token ids, optional text, namespace digest, cache salt, LoRA task) the
:class:`PlacementAdvisor` answers from ONE read of the ledger
(:meth:`ledger.client.LedgerClient.placement`: one transaction on SQLite, so every number and every
generation comes from the same snapshot):

* per engine, the **exact live overlap**: the leading blocks of the request whose engine block hashes
  (TensorRT-LLM's ``v1_block_key`` chain with the request's cache salt and LoRA task, WIRE.md §A.1,
  :func:`connector.block_keys.block_hash_chain`) are live in that engine's CURRENT generation
  — what the engine's own prefix reuse would serve if the request were routed there;
* per engine, the longest **fresh donor span** (with a namespace digest) over the request's
  chained content keys: fresh as :mod:`ledger.freshness` says (the lookup's rule), block liveness
  aside (freshness policy ``store``);
* **semantic candidates** from a :class:`~connector.discovery.service.DiscoveryService` (optional),
  each already checked fresh against the ledger, with its engine's generation at the read.

Engines whose status is not ``active`` (resynchronising after lost events) are reported with
``fresh = False`` and no overlap: their blocks are not trusted until the consumer has a new
baseline. Engines are ranked by ``max(live_blocks, donor_blocks)``, then by semantic evidence.
Nothing here changes anything: it is advice for a router, never a promise (docs/modes.md).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from connector.block_keys import block_hash_chain
from connector.namespace import Namespace, content_keys
from ledger.client import LedgerClient

__all__ = ["Advice", "EngineAdvice", "PlacementAdvisor", "SemanticAdvice"]


@dataclasses.dataclass(frozen=True, slots=True)
class EngineAdvice:
    """One engine's exact overlap with the request, read at ``generation`` (blocks and tokens)."""

    engine_id: str
    generation: int
    status: str
    fresh: bool
    live_blocks: int
    live_tokens: int
    donor_id: str | None
    donor_blocks: int
    donor_tokens: int
    semantic_tokens: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class SemanticAdvice:
    """A fresh semantic (or exact) candidate from discovery, with its engine's generation at the read."""

    donor_id: str
    engine_id: str
    generation: int | None
    provider: str
    match_type: str
    reusable_token_count: int
    segments: int
    similarity_bucket: str
    token_overlap_bucket: str
    confidence_bucket: str
    provider_generation: int


@dataclasses.dataclass(frozen=True, slots=True)
class Advice:
    """Engines best first, semantic candidates best first, the ledger sequence the snapshot includes."""

    engines: tuple[EngineAdvice, ...]
    semantic: tuple[SemanticAdvice, ...]
    ledger_seq: int
    tokens_per_block: int
    num_tokens: int
    elapsed_s: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class PlacementAdvisor:
    """See the module docstring.

    Args:
        db: ledger URL (read-only use).
        discovery: semantic candidates come from here (None: exact overlap only).
        tokens_per_block: the fleet's block size (tokens), unless a request gives its own.
        semantic_timeout_s: deadline of the discovery part of one answer (seconds).

    Raises (from :meth:`advise` and :meth:`ledger_seq`): :class:`~ledger.errors.PersistenceError`
    when the ledger cannot be read; ValueError for malformed input (negative token ids,
    ``tokens_per_block < 1``). The constructor raises :class:`~ledger.errors.LedgerError`
    (``SchemaOutOfDate`` included) for a database that is not a migrated ledger.
    """

    def __init__(self, db: str, *, discovery: Any = None, tokens_per_block: int = 32,
                 semantic_timeout_s: float = 0.05, max_semantic: int = 8) -> None:
        self.db = db
        self.discovery = discovery
        self.tokens_per_block = tokens_per_block
        self.semantic_timeout_s = semantic_timeout_s
        self.max_semantic = max_semantic
        self._ledger = LedgerClient(db)

    def close(self) -> None:
        self._ledger.close()

    def ledger_seq(self) -> int:
        """The ledger's last sequence number (also a reachability check)."""
        return self._ledger.last_seq()

    def advise(self, token_ids: Sequence[int], *, text: str | None = None, namespace: str | None = None,
               cache_salt: str | None = None, lora_task_id: int | None = None, model_id: str = "",
               tokens_per_block: int | None = None, max_semantic: int | None = None) -> Advice:
        """Rank the fleet's engines for one request (see the module docstring)."""
        started = time.perf_counter()
        tpb = tokens_per_block or self.tokens_per_block
        tokens = [int(t) for t in token_ids]
        if tpb < 1 or any(t < 0 for t in tokens):
            raise ValueError("token ids must be >= 0 and tokens_per_block >= 1")
        hashes = block_hash_chain(tokens, tpb, cache_salt=cache_salt, lora_task_id=lora_task_id)
        keys = content_keys(Namespace(namespace, {}), tokens, tpb) if namespace else []
        snapshot = self._ledger.placement(hashes, namespace, keys)
        engines = snapshot.engines
        out = [EngineAdvice(e.engine_id, e.generation, e.status, e.fresh, e.live_blocks, e.live_blocks * tpb,
                            e.donor_id, e.donor_blocks, e.donor_blocks * tpb) for e in engines]
        generations = {e.engine_id: e.generation for e in engines}
        semantic = self._semantic(tokens, text, model_id, namespace, tpb, generations,
                                  self.max_semantic if max_semantic is None else max_semantic)
        by_engine: dict[str, int] = {}
        for s in semantic:
            by_engine[s.engine_id] = max(by_engine.get(s.engine_id, 0), s.reusable_token_count)
        ranked = sorted((dataclasses.replace(a, semantic_tokens=by_engine.get(a.engine_id, 0)) for a in out),
                        key=lambda a: (-max(a.live_blocks, a.donor_blocks), -a.live_blocks, -a.semantic_tokens,
                                       a.engine_id))
        return Advice(tuple(ranked), tuple(semantic), snapshot.seq, tpb, len(tokens), time.perf_counter() - started)

    def _semantic(self, tokens: list[int], text: str | None, model_id: str, namespace: str | None, tpb: int,
                  generations: dict[str, int], limit: int) -> list[SemanticAdvice]:
        if self.discovery is None or not namespace or limit <= 0:
            return []
        matches = self.discovery.candidates(tokens, text, model_id, namespace, tokens_per_block=tpb,
                                            deadline_s=self.semantic_timeout_s, inline=False, path="placement")
        out = []
        for m in matches:
            if m.donor_engine_id not in generations:
                continue  # the ledger does not know the donor's engine: nothing fresh to say
            out.append(SemanticAdvice(m.donor_id, m.donor_engine_id, generations.get(m.donor_engine_id), m.provider,
                                      m.match_type, m.reusable_token_count, len(m.segments), m.similarity_bucket,
                                      m.token_overlap_bucket, m.confidence_bucket, m.provider_generation))
            if len(out) >= limit:
                break
        return out

