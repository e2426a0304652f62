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
TensorRT-LLM's own reuse matches text blocks) and their parents' keys (where a partial hit hangs). A request is taken for abandoned mid-prefill when ``request_finished`` comes before its
prefill completed (executors that call it on every exit), when a scheduled iteration's report leaves
it out while its prefill was under way (the others: the executor freed it), or when the orphan
reaper releases it. A request reported again without a new lookup was merely skipped for an
iteration: what it left is cleared. One looked up again was freed and re-added (its blocks were
stored): what it left stays. A finishing request whose DEVICE-REUSED tokens (matched in TensorRT-LLM's
tree: ``num_computed_tokens`` at its lookup) reach such a block — a whole one by its key, a partial
hit by its parent — is not registered as a donor
(``semkv_donors_not_registered_total{reason="unverified_blocks"}``); its own computed and
connector-loaded blocks are not in question.

It errs towards safety: the chunk of the iteration a cancel followed counts as uncomputed (the
scheduler cannot tell a cancel after a forward from a failed forward), a partial hit under a parent
with any abandoned child is refused, and nothing is forgotten because TensorRT-LLM evicted it (the
connector does not see this engine's tree): only the oldest of :data:`MAX_ABANDONED_REQUESTS`.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import Any

from connector.namespace import PrefixKeys

__all__ = ["MAX_ABANDONED_REQUESTS", "UnverifiedBlocks"]

MAX_ABANDONED_REQUESTS = 4096
"""Abandoned prefills remembered at most (oldest forgotten first); each holds two keys of 16 bytes
per block."""


class UnverifiedBlocks:
    """What abandoned prefills left in the engine's reuse tree (module docstring). Thread-safe (the
    orphan reaper runs on the connector's ledger thread)."""

    def __init__(self, max_requests: int = MAX_ABANDONED_REQUESTS) -> None:
        self._by_entry: OrderedDict[Any, tuple[frozenset[bytes], frozenset[bytes]]] = OrderedDict()
        self._blocks: dict[bytes, int] = {}
        self._parents: dict[bytes, int] = {}
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
        with self._lock:
            self._forget(request_id)
            self._by_entry[request_id] = (blocks, parents)
            _add(self._blocks, blocks)
            _add(self._parents, parents)
            while len(self._by_entry) > self._max:
                self._forget(next(iter(self._by_entry)))

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
        """Do the first ``reused_tokens`` of a prompt with ``keys`` reach a block an abandoned
        prefill left behind (a whole block by its key; the partial hit past the whole ones by its
        parent)?"""
        whole, partial = divmod(reused_tokens, tokens_per_block)
        if not self._blocks or reused_tokens <= 0:
            return False
        with self._lock:
            if any(keys[i] in self._blocks for i in range(min(whole, len(keys)))):
                return True
            return bool(partial) and whole <= len(keys) and keys.parent(whole) in self._parents

    def __len__(self) -> int:
        return len(self._by_entry)

    def _forget(self, entry: Any) -> None:
        """Under the lock."""
        blocks, parents = self._by_entry.pop(entry, ((), ()))
        _remove(self._blocks, blocks)
        _remove(self._parents, parents)


def _add(counts: dict[bytes, int], keys: frozenset[bytes]) -> None:
    for key in keys:
        counts[key] = counts.get(key, 0) + 1


def _remove(counts: dict[bytes, int], keys: frozenset[bytes] | tuple) -> None:
    for key in keys:
        left = counts[key] - 1
        if left:
            counts[key] = left
        else:
            del counts[key]
