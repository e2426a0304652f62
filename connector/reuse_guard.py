"""Blocks TensorRT-LLM keeps for reuse although their prefill never ran: never let a donor spread them.

TensorRT-LLM releases a request that ends before its prefill completed — cancelled, or failed by
``_handle_errors`` — by storing its blocks in the reuse tree as they are: ``releaseBlocks`` →
``storeBlocksForReuse`` stores every full block of ``tokens[:-1]``, computed or not
(NVIDIA/TensorRT-LLM ``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``; the reference engine
harness models it). The engine's next request with that prefix then reuses blocks nobody computed.
That much is TensorRT-LLM's own, on one engine; a connector that registered that next request as a
donor would copy the same garbage into every engine of the fleet.

:class:`UnverifiedBlocks` remembers, per engine, the content keys (namespace + token prefix: the
identity TensorRT-LLM's own reuse matches on) of the prompt blocks an abandoned prefill left behind
— from the first block its last report had not computed yet (``computed_position``) to the last
whole prompt block. A request is taken for abandoned mid-prefill when ``request_finished`` comes
before its prefill completed (executors that call it on every exit), when a scheduled iteration's
report leaves it out while its prefill was under way (the others: the executor freed it), or when
the orphan reaper releases it. A request seen again clears what it left (a context request the
scheduler merely skipped for an iteration). A finishing request whose DEVICE-REUSED blocks (matched
in TensorRT-LLM's tree, ``num_computed_tokens`` at its lookup) include such a key is not registered
as a donor (``semkv_donors_not_registered_total{reason="unverified_blocks"}``); its own computed and
connector-loaded blocks are not in question.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["MAX_ABANDONED_REQUESTS", "UnverifiedBlocks"]

MAX_ABANDONED_REQUESTS = 4096
"""Abandoned prefills remembered at most (oldest forgotten first); each holds its keys (16 bytes
per block)."""


class UnverifiedBlocks:
    """Content keys of blocks abandoned prefills left in the engine's reuse tree (module docstring).
    Thread-safe (the orphan reaper runs on the connector's ledger thread)."""

    def __init__(self, max_requests: int = MAX_ABANDONED_REQUESTS) -> None:
        self._by_request: OrderedDict[Any, frozenset[bytes]] = OrderedDict()
        self._counts: dict[bytes, int] = {}
        self._max = max_requests
        self._lock = threading.Lock()

    def abandoned(self, request_id: Any, keys: Iterable[bytes]) -> None:
        """``request_id``'s prefill ended before computing the blocks of ``keys``."""
        keys = frozenset(keys)
        if not keys:
            return
        with self._lock:
            self._forget(request_id)
            self._by_request[request_id] = keys
            for key in keys:
                self._counts[key] = self._counts.get(key, 0) + 1
            while len(self._by_request) > self._max:
                self._forget(next(iter(self._by_request)))

    def seen_again(self, request_id: Any) -> None:
        """``request_id`` is alive after all (skipped for an iteration): its blocks are its own to compute."""
        if request_id in self._by_request:
            with self._lock:
                self._forget(request_id)

    def touches(self, keys: Sequence[bytes], num_blocks: int) -> bool:
        """Is any of the first ``num_blocks`` of ``keys`` a block an abandoned prefill left behind?"""
        if not self._counts or num_blocks <= 0:
            return False
        with self._lock:
            return any(keys[i] in self._counts for i in range(min(num_blocks, len(keys))))

    def __len__(self) -> int:
        return len(self._by_request)

    def _forget(self, request_id: Any) -> None:
        """Under the lock."""
        for key in self._by_request.pop(request_id, ()):
            left = self._counts[key] - 1
            if left:
                self._counts[key] = left
            else:
                del self._counts[key]
