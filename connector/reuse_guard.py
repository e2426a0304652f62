"""Blocks TensorRT-LLM keeps for reuse although their prefill never ran: never let a donor spread them.

TensorRT-LLM releases a request that ends before its prefill completed — cancelled, or failed by
``_handle_errors`` — by storing its blocks in the reuse tree as they are: ``releaseBlocks`` →
``storeBlocksForReuse`` stores every block of ``tokens[:-1]``, the partial last one included,
computed or not (NVIDIA/TensorRT-LLM ``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``; the
reference engine harness models it). The engine's next request with that prefix then reuses blocks
nobody computed — whole, or with ``enable_partial_reuse`` (TensorRT-LLM's default) the leading tokens
of one (``KVCacheBlock::findMatchingBlock``: the child of the last matched block with the longest
leading run). That much is TensorRT-LLM's own, on one engine; a connector that registered that next
request as a donor would copy the same garbage into every engine of the fleet.

:class:`UnverifiedBlocks` remembers, per engine, what an abandoned prefill left behind, from the
first block its last report had not computed yet (``computed_position``; the device match at its
lookup when never reported) to its last prompt block: the blocks' content keys in the namespace
less its images' digest (``namespace.without_multimodal``: token prefix, cache salt, LoRA, as
TensorRT-LLM's own reuse matches text blocks) and their parents' keys (where a partial hit hangs).

A request is taken for ended when ``request_finished`` comes (some executors call it on every exit),
when a scheduled iteration's report leaves it out although due (reported before, or allocated since
the last report: the executor freed it), when it is looked up again (freed and re-added), or when
the orphan reaper releases it; if its prefill had not completed, its uncomputed blocks are held. A
request reported again without a new lookup was merely skipped for an iteration: what it left is
cleared; one looked up again keeps it held. A finishing request whose DEVICE-REUSED tokens (matched
in TensorRT-LLM's tree: ``num_computed_tokens`` at its lookup) reach such KV — a whole block by its
key, a partial hit by its parent — is not registered as a donor
(``semkv_donors_not_registered_total{reason="unverified_blocks"}``). Since TensorRT-LLM stores ITS
blocks too when it ends, those from its partial hit or first whole block on (KV copied from, or
computed on top of, garbage, under the request's own keys) are held the same way
(:meth:`UnverifiedBlocks.refused`). Connector-loaded blocks are never in question.

It errs towards safety: the chunk of the iteration a cancel followed counts as uncomputed (the
scheduler cannot tell a cancel after a forward from a failed forward), a partial hit under a parent
with any abandoned child is refused, and nothing is forgotten because TensorRT-LLM evicted it (the
connector does not see this engine's tree): only the oldest of :data:`MAX_ABANDONED_REQUESTS`.
Requests without a namespace (p-tuning, unknown fields) are not tracked.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

from connector.namespace import PrefixKeys

__all__ = ["MAX_ABANDONED_REQUESTS", "UnverifiedBlocks"]

MAX_ABANDONED_REQUESTS = 4096
"""Abandoned prefills remembered at most (oldest forgotten first); each holds two keys of 16 bytes
per block."""


class UnverifiedBlocks:
    """What abandoned prefills left in the engine's reuse tree (module docstring). Thread-safe (the
    orphan reaper runs on the connector's ledger thread)."""

    def __init__(self, max_requests: int = MAX_ABANDONED_REQUESTS) -> None:
        self._by_entry: OrderedDict[Any, _Entry] = OrderedDict()
        self._blocks: dict[bytes, int] = {}
        """Keys of blocks whose KV is not what their tokens compute."""
        self._parents: dict[bytes, int] = {}
        """Keys of blocks with such a child: a partial hit under one may copy its leading tokens."""
        self._any_child: dict[bytes, int] = {}
        """Keys of blocks with such a child whose own key is unknown: any reuse under one is suspect."""
        self._max = max_requests
        self._kept = itertools.count()
        self._lock = threading.Lock()

    def abandoned(self, request_id: Any, keys: PrefixKeys, first: int, last: int) -> None:
        """``request_id``'s prefill ended with blocks ``first..last`` (inclusive; ``last`` may be the
        partial block past ``len(keys)``) uncomputed."""
        if first > last:
            return
        blocks = frozenset(keys[i] for i in range(first, min(last + 1, len(keys))))
        parents = frozenset(keys.parent(i) for i in range(first, min(last, len(keys)) + 1))
        self._hold(request_id, _Entry(blocks, parents, frozenset()))

    def refused(self, request_id: Any, keys: PrefixKeys, reused_tokens: int, tokens_per_block: int) -> None:
        """``request_id`` (refused as a donor: it reused unverified KV) finished; TensorRT-LLM stores
        its blocks too, and every block from the first it reused partly or computed on top of
        unverified KV holds KV its tokens do not compute — under the request's OWN keys, which a later
        request reaches whole. Those blocks are held like an abandoned prefill's."""
        first = reused_tokens // tokens_per_block
        if first < len(keys):
            self.abandoned(("refused", request_id), keys, first, len(keys))
        else:  # only its last, partial prompt block, filled up later by generated tokens: key unknown
            self._hold(("refused", request_id), _Entry(frozenset(), frozenset(), frozenset({keys.parent(first)})))

    def seen_again(self, request_id: Any) -> None:
        """``request_id`` is alive after all (skipped for an iteration): its blocks are its own to compute."""
        if request_id in self._by_entry:
            with self._lock:
                self._forget(request_id)

    def keep(self, request_id: Any) -> None:
        """``request_id`` was freed and is back (looked up again): what it left stays in the tree,
        whatever it does from now on."""
        with self._lock:
            entry = self._by_entry.pop(request_id, None)
            if entry is not None:
                self._by_entry[("kept", next(self._kept))] = entry

    def touches(self, keys: PrefixKeys, reused_tokens: int, tokens_per_block: int) -> bool:
        """Do the first ``reused_tokens`` of a prompt with ``keys`` reach KV an abandoned prefill left
        behind (a whole block by its key; the partial hit past the whole ones by its parent)?"""
        whole, partial = divmod(reused_tokens, tokens_per_block)
        if reused_tokens <= 0 or not self._by_entry:
            return False
        with self._lock:
            for i in range(min(whole, len(keys))):
                if keys[i] in self._blocks or keys.parent(i) in self._any_child:
                    return True
            if not partial or whole > len(keys):
                return False
            parent = keys.parent(whole)
            return parent in self._parents or parent in self._any_child

    def __len__(self) -> int:
        return len(self._by_entry)

    def _hold(self, entry_id: Any, entry: _Entry) -> None:
        with self._lock:
            self._forget(entry_id)
            self._by_entry[entry_id] = entry
            _add(self._blocks, entry.blocks)
            _add(self._parents, entry.parents)
            _add(self._any_child, entry.any_child)
            while len(self._by_entry) > self._max:
                self._forget(next(iter(self._by_entry)))

    def _forget(self, entry_id: Any) -> None:
        """Under the lock."""
        entry = self._by_entry.pop(entry_id, None)
        if entry is not None:
            _remove(self._blocks, entry.blocks)
            _remove(self._parents, entry.parents)
            _remove(self._any_child, entry.any_child)


class _Entry(NamedTuple):
    blocks: frozenset[bytes]
    parents: frozenset[bytes]
    any_child: frozenset[bytes]


def _add(counts: dict[bytes, int], keys: frozenset[bytes]) -> None:
    for key in keys:
        counts[key] = counts.get(key, 0) + 1


def _remove(counts: dict[bytes, int], keys: frozenset[bytes]) -> None:
    for key in keys:
        left = counts[key] - 1
        if left:
            counts[key] = left
        else:
            del counts[key]
