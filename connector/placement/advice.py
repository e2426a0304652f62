"""Placement advice (Mode 3): which engine should serve a request, from fresh ledger state only.

For a request (token ids, optional text, namespace digest, cache salt, LoRA task) the
:class:`PlacementAdvisor` answers from one snapshot of the ledger: its in-memory index of live
blocks (:class:`ledger.live_index.LiveIndex`, caught up with the log before each answer, at most
``refresh_s`` old; the default 0 catches up every time, one statement when nothing changed), or
with ``live_index=False`` ONE read of the ledger (:meth:`ledger.client.LedgerClient.placement`: one
transaction on SQLite, so every number and every generation comes from the same snapshot):

* per engine, the **exact live overlap**: the leading blocks of the request whose engine block hashes
  are live in that engine's CURRENT generation — what the engine's own prefix reuse would serve if
  the request were routed there. The hashes are computed the way the engine computes them, by its
  block-key scheme (:class:`~ledger.types.BlockKeyScheme`, from the ledger:
  :mod:`ledger.placement_reads`): TensorRT-LLM's ``v1_block_key`` chain with the request's cache
  salt and LoRA task (WIRE.md §A.1, :func:`connector.block_keys.block_hash_chain`), Dynamo's xxh3
  chain (:func:`connector.block_keys.dynamo_block_hashes`); or they are the caller's own
  (``block_hashes``: e.g. a router that hashed the request already, and the only way for vLLM and
  TensorRT-LLM ``v2`` engines, whose hashes are not computed here). An engine whose hashes are not
  known this way is answered with ``overlap = "unknown"`` (``live_blocks`` None, ``fresh`` False),
  never as a fresh engine holding nothing;
* per engine, the longest **fresh donor span** (with a namespace digest) over the request's
  chained content keys: fresh as :mod:`ledger.freshness` says (the lookup's rule), block liveness
  aside (freshness policy ``store``);
* **semantic candidates** from a :class:`~connector.discovery.service.DiscoveryService` (optional),
  each already checked fresh against the ledger, with its engine's generation at the read.

Engines whose status is not ``active`` (resynchronising after lost events) are reported with
``fresh = False`` and no overlap: their blocks are not trusted until the consumer has a new
baseline. Engines are ranked by ``max(live_blocks, donor_blocks)``, then by semantic evidence,
engines with an unknown overlap last. When no engine has any evidence (every score 0 or
unknown) the order is only ``engine_id`` order: the answer says so (``informed`` False and a
warning) instead of presenting the first engine as the best.

**Load**, where the caller knows it (``engine_load``: per engine, the KV blocks its running
requests hold and the tokens waiting for prefill, as a router tracks them; the ledger sees cached
blocks, which stay after requests end, so it cannot tell load itself): when every engine's load is
given, engines are ranked by Dynamo's own routing cost instead, lowest first, with the reuse our
evidence finds (``max(live, donor)`` blocks) as its overlap — ``overlap_weight × prefill blocks +
decode blocks``, prefill blocks ``(prefill_tokens + num_tokens − reusable tokens) / tokens_per_block``,
decode blocks ``active_blocks + ceil(num_tokens / tokens_per_block)`` (Dynamo's
``DefaultWorkerSelector::select_worker``, ai-dynamo/dynamo lib/llm/src/kv_router/scheduler.rs @
db19bd2a; its ``overlap_score_weight`` defaults to 1.0). An engine whose overlap is unknown is
costed as reusing nothing (an upper bound: it ranks no better than that, still flagged unknown).
Each engine's ``cost`` is in the answer and ``load_aware`` is True; with load for some engines
only, the ranking stays by evidence and a warning names the others; load for an engine the
ledger does not know is not used, with a warning.
Nothing here changes anything: it is advice for a router, never a promise (docs/modes.md).
"""

from __future__ import annotations

import dataclasses
import time
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from connector.block_keys import block_hash_chain, dynamo_block_hashes
from connector.namespace import Namespace, content_keys
from ledger.client import LedgerClient
from ledger.errors import LedgerError
from ledger.live_index import IndexKey, KeyArray, LiveIndex, index_keys, key_array
from ledger.placement_reads import EngineOverlap
from ledger.types import I64_MAX, TWO_64, U64_MAX, BlockHash, BlockKeyScheme, normalize_hash

__all__ = ["Advice", "EngineAdvice", "EngineLoad", "PlacementAdvisor", "SemanticAdvice", "canonical_hashes",
           "request_hashes"]
_I64_MIN = -(2**63)
MAX_OVERLAP_WEIGHT = 1e6
MAX_LOAD = 2**40
"""The largest ``active_blocks`` / ``prefill_tokens`` of an :class:`EngineLoad`."""
"""The largest ``overlap_weight``: with loads up to 2**40 blocks or tokens a cost stays finite (an
infinite one is NaN beside zero prefill, and orders nothing)."""


@dataclasses.dataclass(frozen=True, slots=True)
class EngineAdvice:
    """One engine's exact overlap with the request, read at ``generation`` (blocks and tokens).

    ``overlap``: ``known``, or ``unknown`` when the request's hashes in the engine's
    ``block_key_scheme`` are not known (``live_blocks``/``live_tokens`` None, ``fresh`` False).
    ``fresh``: the engine is ``active`` and its overlap known."""

    engine_id: str
    generation: int
    status: str
    fresh: bool
    live_blocks: int | None
    live_tokens: int | None
    donor_id: str | None
    donor_blocks: int
    donor_tokens: int
    semantic_tokens: int = 0
    block_key_scheme: str | None = None
    overlap: str = "known"
    cost: float | None = None
    """Dynamo's routing cost of this engine with its load and this reuse (lower is better; see the
    module docstring), or None when the caller gave no load for it."""

    def score(self) -> tuple[int, int, int, int]:
        """Sort key, best first: known before unknown, then blocks (live or donor), live, semantic."""
        live = self.live_blocks or 0
        return (self.live_blocks is None, -max(live, self.donor_blocks), -live, -self.semantic_tokens)


@dataclasses.dataclass(frozen=True, slots=True)
class EngineLoad:
    """What an engine is busy with, as the caller (a router) knows it.

    ``active_blocks``: KV blocks held by its running requests (decode load, blocks);
    ``prefill_tokens``: tokens waiting for or in prefill (tokens)."""

    active_blocks: int = 0
    prefill_tokens: int = 0


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
    informed: bool = True
    """Some engine has evidence (live, donor or semantic tokens): the order means something."""
    warnings: tuple[str, ...] = ()
    load_aware: bool = False
    """Ranked by each engine's ``cost`` (every engine's load was given), not by evidence alone."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class PlacementAdvisor:
    """See the module docstring.

    Args:
        db: ledger URL (read-only use).
        discovery: semantic candidates come from here (None: exact overlap only).
        tokens_per_block: the fleet's block size (tokens), unless a request gives its own.
        semantic_timeout_s: deadline of the discovery part of one answer (seconds).
        live_index: answer live overlaps from an in-memory index of live blocks (loaded here:
            one read of every live block) instead of one statement per engine per 64 blocks.
        refresh_s: catch the index up with the ledger before an answer when it is older than
            this (seconds; 0: before every answer). An index that cannot be caught up within its
            ``max_staleness_s`` (2 s) is not used: answers then read the ledger itself.
        overlap_weight: the weight of prefill blocks in the load-aware cost (Dynamo's
            ``overlap_score_weight``; higher favours reuse, lower spreads load), in
            [0, :data:`MAX_OVERLAP_WEIGHT`] (ValueError otherwise).

    Raises (from :meth:`advise` and :meth:`ledger_seq`): :class:`~ledger.errors.PersistenceError`
    when the ledger cannot be read; ValueError for malformed input (negative token ids,
    ``tokens_per_block < 1``). The constructor raises :class:`~ledger.errors.LedgerError`
    (``SchemaOutOfDate`` included) for a database that is not a migrated ledger.
    """

    def __init__(self, db: str, *, discovery: Any = None, tokens_per_block: int = 32,
                 semantic_timeout_s: float = 0.05, max_semantic: int = 8, live_index: bool = True,
                 refresh_s: float = 0.0, overlap_weight: float = 1.0) -> None:
        if not 0 <= overlap_weight <= MAX_OVERLAP_WEIGHT:  # NaN and inf too: a cost must stay a number
            raise ValueError(f"overlap_weight must be in [0, {MAX_OVERLAP_WEIGHT:g}], not {overlap_weight!r}")
        self.db = db
        self.overlap_weight = overlap_weight
        self.discovery = discovery
        self.tokens_per_block = tokens_per_block
        self.semantic_timeout_s = semantic_timeout_s
        self.max_semantic = max_semantic
        self.refresh_s = refresh_s
        self._ledger = LedgerClient(db)
        self.index: LiveIndex | None = None
        if live_index:
            self.index = LiveIndex()
            self._ledger.refresh_live_index(self.index)

    def close(self) -> None:
        self._ledger.close()

    def ledger_seq(self) -> int:
        """The ledger's last sequence number (also a reachability check)."""
        return self._ledger.last_seq()

    def advise(self, token_ids: Sequence[int] | np.ndarray, *, text: str | None = None, namespace: str | None = None,
               cache_salt: str | None = None, lora_task_id: int | None = None, model_id: str = "",
               tokens_per_block: int | None = None, max_semantic: int | None = None,
               block_hashes: Sequence[int | str | bytes] | np.ndarray | None = None,
               engine_load: Mapping[str, EngineLoad] | None = None) -> Advice:
        """Rank the fleet's engines for one request (see the module docstring).

        ``token_ids``: a sequence of ints, or a 1-D numpy array of an integer dtype (e.g. the
        uint32 array ``token_ids_le32`` of ``POST /v1/placement`` decodes to), answered the same
        way; an array's ids are hashed from its buffer, without Python ints, for Dynamo's scheme.
        ``block_hashes``: the request's block hashes as the engines compute them (one per full
        block, in order; ints in [-2**63, 2**64), or 32-byte / 64-hex wide hashes, or a 1-D numpy
        array of 64-bit integers), used for every engine instead of computing them; None: computed
        per engine's scheme.
        ``engine_load``: per ``engine_id``, its load as the caller knows it; given for every
        engine, the ranking is by cost (see the module docstring).

        Raises:
            ValueError: ``token_ids`` an array that is not 1-D of integers, a negative token id
                (where token ids are hashed: by an engine's scheme or for a namespace's content
                keys), ``tokens_per_block`` < 1, a malformed block hash, or more block hashes than
                ``token_ids`` has whole blocks, a negative load.
        """
        started = time.perf_counter()
        tpb = tokens_per_block or self.tokens_per_block
        tokens = token_ids if type(token_ids) is list else _token_array(token_ids)
        if tpb < 1:
            raise ValueError("tokens_per_block must be >= 1")
        if engine_load and not all(type(n) is int and 0 <= n <= MAX_LOAD for load in engine_load.values()
                                   for n in (load.active_blocks, load.prefill_tokens)):
            raise ValueError(f"engine_load: active_blocks and prefill_tokens must be integers in [0, {MAX_LOAD}]")
        given_keys = None if block_hashes is None else engine_hash_keys(block_hashes)
        if given_keys is not None and len(given_keys) > len(tokens) // tpb:  # an overlap longer than the prompt
            raise ValueError(f"block_hashes: {len(given_keys)} hashes for {len(tokens) // tpb} whole blocks of "
                             f"{tpb} tokens in token_ids ({len(tokens)} tokens)")
        keys = content_keys(Namespace(namespace, {}), _checked(_as_list(tokens)), tpb) if namespace else []

        given: list[BlockHash] = []  # the caller's hashes in canonical form, made once if the ledger is read

        def hashes_for(scheme: str | None) -> list[BlockHash] | None:
            if block_hashes is not None:
                if not given:
                    given.extend(canonical_hashes(block_hashes))  # valid: engine_hash_keys checked them
                return given
            return request_hashes(scheme, tokens, tpb, cache_salt=cache_salt, lora_task_id=lora_task_id)

        seq, engines = self._overlaps(hashes_for, namespace, keys, given_keys)
        generations = {e.engine_id: e.generation for e in engines}
        semantic = self._semantic(tokens, text, model_id, namespace, tpb, generations,
                                  self.max_semantic if max_semantic is None else max_semantic)
        by_engine: dict[str, int] = {}
        for s in semantic:
            by_engine[s.engine_id] = max(by_engine.get(s.engine_id, 0), s.reusable_token_count)
        loads = engine_load or {}
        advice = [EngineAdvice(e.engine_id, e.generation, e.status, e.fresh and e.live_blocks is not None,
                               e.live_blocks, None if e.live_blocks is None else e.live_blocks * tpb,
                               e.donor_id, e.donor_blocks, e.donor_blocks * tpb,
                               by_engine.get(e.engine_id, 0), e.block_key_scheme,
                               "unknown" if e.live_blocks is None else "known",
                               self._cost(loads[e.engine_id], e, len(tokens), tpb) if e.engine_id in loads else None)
                  for e in engines]
        load_aware = bool(advice) and all(a.cost is not None for a in advice)
        # by cost alone: an engine whose overlap is unknown is costed as reusing nothing, an upper bound
        ranked = sorted(advice, key=(lambda a: (a.cost, *a.score(), a.engine_id)) if load_aware
                        else (lambda a: (*a.score(), a.engine_id)))
        informed = any(a.score()[1:] != (0, 0, 0) for a in ranked)
        return Advice(tuple(ranked), tuple(semantic), seq, tpb, len(tokens), time.perf_counter() - started,
                      informed, _warnings(ranked, informed, load_aware, loads), load_aware)

    def _cost(self, load: EngineLoad, overlap: EngineOverlap, num_tokens: int, tpb: int) -> float:
        """Dynamo's routing cost of ``overlap``'s engine under ``load`` (see the module docstring)."""
        reusable_tokens = min(num_tokens, max(overlap.live_blocks or 0, overlap.donor_blocks) * tpb)
        prefill_blocks = (load.prefill_tokens + num_tokens - reusable_tokens) / tpb
        return self.overlap_weight * prefill_blocks + load.active_blocks + -(-num_tokens // tpb)

    def _overlaps(self, hashes_for: Any, namespace: str | None, keys: Sequence[bytes],
                  given_keys: KeyArray | list[IndexKey] | None) -> tuple[int, Sequence[EngineOverlap]]:
        """``(ledger seq, per-engine overlaps)``: live overlaps from the index when it is usable,
        donor spans (with a namespace) from one read of the ledger; else both from one read.
        ``given_keys``: the caller's block hashes as index keys, for every engine."""
        if not self._index_usable():
            snapshot = self._ledger.placement(hashes_for, namespace, keys)
            return snapshot.seq, snapshot.engines
        per_scheme: dict[str | None, KeyArray | list[IndexKey] | None] = {}

        def keys_for(scheme: str | None) -> KeyArray | list[IndexKey] | None:
            if given_keys is not None:
                return given_keys
            if scheme not in per_scheme:
                hashes = hashes_for(scheme)
                per_scheme[scheme] = None if hashes is None else key_array(hashes)
            return per_scheme[scheme]

        assert self.index is not None
        seq, engines = self.index.overlaps(keys_for)
        if not (namespace and keys):
            return seq, engines
        donors = {e.engine_id: e for e in self._ledger.placement(lambda scheme: None, namespace, keys).engines}
        return seq, [dataclasses.replace(e, donor_id=donors[e.engine_id].donor_id,
                                         donor_blocks=donors[e.engine_id].donor_blocks)
                     if e.engine_id in donors else e for e in engines]

    def _index_usable(self) -> bool:
        """Catch the index up when it is older than ``refresh_s``; True when it may answer."""
        index = self.index
        if index is None:
            return False
        if index.age_s() >= self.refresh_s:
            try:
                self._ledger.refresh_live_index(index)
            except LedgerError:
                pass  # within max_staleness_s the index still answers; past it, the ledger is read
        return index.ready

    def _semantic(self, tokens: list[int] | np.ndarray, text: str | None, model_id: str, namespace: str | None,
                  tpb: int, generations: dict[str, int], limit: int) -> list[SemanticAdvice]:
        if self.discovery is None or not namespace or limit <= 0:
            return []
        matches = self.discovery.candidates(_as_list(tokens), text, model_id, namespace, tokens_per_block=tpb,
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



def canonical_hashes(block_hashes: Sequence[int | str | bytes] | np.ndarray) -> list[BlockHash]:
    """The caller's block hashes in canonical form (:func:`ledger.types.normalize_hash`), with a
    fast path for 64-bit integers, signed or not (what engines publish), and for a 1-D numpy array
    of 64-bit integers.

    Raises:
        ValueError: a hash that is not an integer in [-2**63, 2**64), 32 bytes or 64 hex characters.
    """
    if isinstance(block_hashes, np.ndarray):
        return _hash_array(block_hashes).view(np.uint64).tolist()
    return [h % TWO_64 if type(h) is int and _I64_MIN <= h <= U64_MAX else normalize_hash(h) for h in block_hashes]


def _hash_array(block_hashes: np.ndarray) -> KeyArray:
    """A 1-D numpy array of 64-bit integer hashes (signed or not) as int64 index keys, without a copy.

    Raises:
        ValueError: not a 1-D array of 64-bit integers."""
    if block_hashes.ndim != 1 or block_hashes.dtype.kind not in "iu" or block_hashes.dtype.itemsize != 8:
        raise ValueError(f"block_hashes must be a 1-D array of 64-bit integers, not {block_hashes.dtype} "
                         f"of shape {block_hashes.shape}")
    return block_hashes.astype(block_hashes.dtype.newbyteorder("="), copy=False).view(np.int64)


def engine_hash_keys(block_hashes: Sequence[int | str | bytes] | np.ndarray) -> KeyArray | list[IndexKey]:
    """The caller's block hashes as :class:`~ledger.live_index.LiveIndex` keys, in one pass: as
    ``key_array(canonical_hashes(block_hashes))``, an int64 array when every hash is a 64-bit
    integer all signed or all unsigned (what engines publish; 2,048 of them, a 32K-token prompt at
    16 tokens per block, in ~0.07 ms), else ``index_keys(canonical_hashes(block_hashes))``.

    A 1-D numpy array of 64-bit integers (e.g. ``block_hashes_le64`` of ``POST /v1/placement``)
    is viewed as int64 keys without a copy.

    Raises:
        ValueError: as :func:`canonical_hashes`.
    """
    if isinstance(block_hashes, np.ndarray):
        return _hash_array(block_hashes)
    for typecode in ("Q", "q"):  # unsigned, then signed: the same int64 bits either way
        try:
            keys = np.frombuffer(array(typecode, block_hashes), dtype=np.int64)
        except OverflowError:
            continue
        except TypeError:  # a str or bytes hash (or not a hash at all: refused below)
            break
        if not ((keys == 0) | (keys == 1)).any():  # array() takes bools as 0 and 1: those go the exact way
            return keys
        break
    return [(h if h <= I64_MAX else h - TWO_64) if type(h) is int and _I64_MIN <= h <= U64_MAX
            else index_keys([normalize_hash(h)])[0] for h in block_hashes]


def request_hashes(scheme: str | None, tokens: Sequence[int] | np.ndarray, tokens_per_block: int, *,
                   cache_salt: str | None = None, lora_task_id: int | None = None) -> list[BlockHash] | None:
    """The request's block hashes as an engine of ``scheme`` computes them, or None when they
    cannot be computed here (unknown scheme, vLLM, TensorRT-LLM v2, or Dynamo with a cache salt
    or LoRA task, which its hashes do not mix in here)."""
    if scheme == BlockKeyScheme.TRTLLM_V1:
        return block_hash_chain(_checked(tokens), tokens_per_block, cache_salt=cache_salt, lora_task_id=lora_task_id)
    if scheme == BlockKeyScheme.DYNAMO and cache_salt is None and lora_task_id is None:
        return dynamo_block_hashes(tokens, tokens_per_block)  # type: ignore[return-value]  # refuses ids < 0 itself
    return None


def _checked(tokens: Sequence[int] | np.ndarray) -> Sequence[int] | np.ndarray:
    """``tokens``, refused (ValueError) when an id is negative."""
    if isinstance(tokens, np.ndarray):
        negative = tokens.dtype.kind == "i" and tokens.size and tokens.min() < 0
    else:
        negative = tokens and min(tokens) < 0
    if negative:
        raise ValueError("token ids must be >= 0")
    return tokens


def _token_array(token_ids: Any) -> list[int] | np.ndarray:
    """``token_ids`` as advise keeps them: a 1-D integer numpy array as it is, anything else as a
    list of ints.

    Raises:
        ValueError: a numpy array that is not 1-D or not of an integer dtype."""
    if not isinstance(token_ids, np.ndarray):
        return list(map(int, token_ids))
    if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be a 1-D integer array, not {token_ids.dtype} of shape {token_ids.shape}")
    return token_ids


def _as_list(tokens: list[int] | np.ndarray) -> list[int]:
    """Token ids as a list of Python ints (for the paths that want one: content keys, discovery)."""
    return tokens if type(tokens) is list else tokens.tolist()


def _warnings(ranked: Sequence[EngineAdvice], informed: bool, load_aware: bool,
              loads: Mapping[str, EngineLoad]) -> tuple[str, ...]:
    out = []
    if loads and not load_aware:
        unloaded = [a.engine_id for a in ranked if a.cost is None]
        out.append(f"engine_load not given for {len(unloaded)} engine(s) ({', '.join(unloaded[:8])}): ranked by "
                   "evidence alone, without load")
    strangers = sorted(set(loads).difference(a.engine_id for a in ranked))
    if strangers:
        out.append(f"engine_load names {len(strangers)} engine(s) the ledger does not know "
                   f"({', '.join(strangers[:8])}): their load was not used")
    unknown = [a.engine_id for a in ranked if a.overlap == "unknown"]
    if unknown:
        out.append(f"overlap unknown for {len(unknown)} engine(s) ({', '.join(unknown[:8])}): their block-key "
                   "scheme is not known or cannot be computed here; configure block_key_scheme for their "
                   "sources or pass block_hashes")
    if not informed and ranked and not load_aware:
        out.append("no engine holds any block of this request (or none is known): the order is engine_id "
                   "order, not evidence")
    return tuple(out)
