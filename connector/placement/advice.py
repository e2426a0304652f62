"""Placement advice (Mode 3): which engine should serve a request, from fresh ledger state only.

For a request (token ids, optional text, namespace digest, cache salt, LoRA task) the
:class:`PlacementAdvisor` answers, in ONE read transaction of the ledger (so every number and every
generation comes from the same snapshot):

* per engine, the **exact live overlap**: the leading blocks of the request whose engine block hashes
  (TensorRT-LLM's ``v1_block_key`` chain with the request's cache salt and LoRA task, WIRE.md §A.1,
  :func:`connector.harness.block_hash.block_hash_chain`) are live in that engine's CURRENT generation
  — what the engine's own prefix reuse would serve if the request were routed there;
* per engine, the longest **fresh donor span** (with a namespace digest): donor state ``live``
  (bytes saved), donor generation = the engine's, not expired, same namespace (freshness policy
  ``store``), over the request's chained content keys;
* **semantic candidates** from a :class:`~connector.discovery.service.DiscoveryService` (optional),
  each already checked fresh against the ledger, with its engine's generation at the read.

Engines whose status is not ``active`` (resynchronising after lost events) are reported with
``fresh = False`` and no overlap: their blocks are not trusted until the consumer has a new
baseline. Engines are ranked by ``max(live_blocks, donor_blocks)``, then by semantic evidence.
Nothing here changes anything: it is advice for a router, never a promise (DESIGN §3 modes).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import and_, func, select

from connector.namespace import Namespace, content_keys
from ledger.db import sync_engine
from ledger.schema import BlockRow, DonorBlockRow, DonorRow, EngineRow, LogRow, StreamRow
from ledger.types import BlockState, DonorState, EngineStatus, split_hash

__all__ = ["Advice", "EngineAdvice", "PlacementAdvisor", "SemanticAdvice"]



def _load_block_hash() -> Any:
    """``connector/harness/block_hash.py`` (TensorRT-LLM's ``v1_block_key``, pure Python + blake3)
    without importing the ``connector.harness`` package, whose ``__init__`` imports torch: a placement
    host needs no torch. (Open item: move ``block_hash.py`` out of the harness package.)"""
    loaded = sys.modules.get("connector.harness.block_hash")
    if loaded is not None:
        return loaded
    path = Path(__file__).resolve().parents[1] / "harness" / "block_hash.py"
    spec = importlib.util.spec_from_file_location("semkv_placement_block_hash", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


block_hash_chain = _load_block_hash().block_hash_chain
_E, _S, _B = EngineRow.__table__, StreamRow.__table__, BlockRow.__table__
_D, _DB, _LOG = DonorRow.__table__, DonorBlockRow.__table__, LogRow.__table__


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

    Raises (from :meth:`advise`): ledger errors as ``sqlalchemy.exc.SQLAlchemyError``; ValueError for
    malformed input (negative token ids, ``tokens_per_block < 1``).
    """

    def __init__(self, db: str, *, discovery: Any = None, tokens_per_block: int = 32,
                 semantic_timeout_s: float = 0.05, max_semantic: int = 8) -> None:
        self.db = db
        self.discovery = discovery
        self.tokens_per_block = tokens_per_block
        self.semantic_timeout_s = semantic_timeout_s
        self.max_semantic = max_semantic
        self._engine = sync_engine(db)

    def close(self) -> None:
        self._engine.dispose()

    def ledger_seq(self) -> int:
        """The ledger's last sequence number (also a reachability check; raises SQLAlchemyError)."""
        with self._engine.connect() as conn:
            return int(conn.execute(select(func.max(_LOG.c.seq))).scalar() or 0)

    def advise(self, token_ids: Sequence[int], *, text: str | None = None, namespace: str | None = None,
               cache_salt: str | None = None, lora_task_id: int | None = None, model_id: str = "",
               tokens_per_block: int | None = None, max_semantic: int | None = None) -> Advice:
        """Rank the fleet's engines for one request (see the module docstring)."""
        started = time.perf_counter()
        tpb = tokens_per_block or self.tokens_per_block
        tokens = [int(t) for t in token_ids]
        if tpb < 1 or any(t < 0 for t in tokens):
            raise ValueError("token ids must be >= 0 and tokens_per_block >= 1")
        hashes = [split_hash(h) for h in block_hash_chain(tokens, tpb, cache_salt=cache_salt,
                                                           lora_task_id=lora_task_id)]
        keys = content_keys(Namespace(namespace, {}), tokens, tpb) if namespace else []
        now = time.time()
        with self._engine.connect() as conn, conn.begin():
            seq = conn.execute(select(func.max(_LOG.c.seq))).scalar() or 0
            engines = conn.execute(select(_E.c.engine_id, _E.c.generation, _E.c.status)
                                   .order_by(_E.c.engine_id)).all()
            streams: dict[str, list[tuple[int, int]]] = {}
            for row in conn.execute(select(_S.c.engine_id, _S.c.attention_dp_rank, _S.c.window_size)):
                streams.setdefault(row.engine_id, []).append((row.attention_dp_rank, row.window_size))
            donors = _donor_spans(conn, namespace, keys, now) if keys else {}
            out = []
            for e in engines:
                fresh = e.status == EngineStatus.ACTIVE
                live = max((_live_run(conn, e.engine_id, dp, window, e.generation, hashes)
                            for dp, window in streams.get(e.engine_id, [])), default=0) if fresh and hashes else 0
                donor_id, donor_blocks = donors.get(e.engine_id, (None, 0)) if fresh else (None, 0)
                out.append(EngineAdvice(e.engine_id, e.generation, e.status, fresh, live, live * tpb, donor_id,
                                        donor_blocks, donor_blocks * tpb))
        generations = {e.engine_id: e.generation for e in engines}
        semantic = self._semantic(tokens, text, model_id, namespace, tpb, generations,
                                  self.max_semantic if max_semantic is None else max_semantic)
        by_engine: dict[str, int] = {}
        for s in semantic:
            by_engine[s.engine_id] = max(by_engine.get(s.engine_id, 0), s.reusable_token_count)
        ranked = sorted((dataclasses.replace(a, semantic_tokens=by_engine.get(a.engine_id, 0)) for a in out),
                        key=lambda a: (-max(a.live_blocks, a.donor_blocks), -a.live_blocks, -a.semantic_tokens,
                                       a.engine_id))
        return Advice(tuple(ranked), tuple(semantic), int(seq), tpb, len(tokens), time.perf_counter() - started)

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


def _live_run(conn: Any, engine_id: str, dp: int, window: int, generation: int, hashes: list[tuple[int, bytes]]) -> int:
    """Leading ``hashes`` live in the engine's stream ``(dp, window)`` in ``generation`` (blocks)."""
    live: set[tuple[int, bytes]] = set()
    for start in range(0, len(hashes), 4096):
        part = hashes[start : start + 4096]
        rows = conn.execute(select(_B.c.block_hash, _B.c.block_hash_ext).where(
            _B.c.engine_id == engine_id, _B.c.attention_dp_rank == dp, _B.c.window_size == window,
            _B.c.block_hash.in_({h for h, _ in part}), _B.c.state == BlockState.LIVE, _B.c.generation == generation))
        live.update((r.block_hash, bytes(r.block_hash_ext)) for r in rows)
    count = 0
    for key in hashes:
        if key not in live:
            break
        count += 1
    return count


def _donor_spans(conn: Any, namespace: str, keys: list[bytes], now: float) -> dict[str, tuple[str, int]]:
    """``{engine_id: (donor_id, blocks)}``: per engine, the fresh donor holding the longest key prefix."""
    best: dict[str, tuple[str, int]] = {}
    fresh = and_(_D.c.namespace == namespace, _D.c.state == DonorState.LIVE, _D.c.generation == _E.c.generation,
                 _E.c.status == EngineStatus.ACTIVE, (_D.c.expires_at.is_(None)) | (_D.c.expires_at > now))
    position = {key: i for i, key in enumerate(keys)}
    for start in range(0, len(keys), 4096):
        part = keys[start : start + 4096]
        rows = conn.execute(select(_D.c.engine_id, _D.c.donor_id, _DB.c.content_key)
                            .select_from(_DB.join(_D, _D.c.donor_id == _DB.c.donor_id)
                                         .join(_E, _E.c.engine_id == _D.c.engine_id))
                            .where(_DB.c.content_key.in_(part), fresh))
        for r in rows:
            blocks = position[bytes(r.content_key)] + 1  # chained keys: holding key i means holding 0..i
            if blocks > best.get(r.engine_id, ("", 0))[1]:
                best[r.engine_id] = (r.donor_id, blocks)
    return best
