"""REFERENCE ENGINE HARNESS — KV-cache events in TensorRT-LLM's LLM-API dict shapes.

Test and demo infrastructure only; never an engine for serving. Reproduces, per KV cache manager:

- event ids assigned at enqueue time, consecutive from 0 (the ``created`` event);
- one per-iteration queue, flushed into a bounded buffer at the end of each iteration;
  consecutive ``removed`` events of one iteration are coalesced into one;
- the bounded buffer drops the OLDEST events when full (a jump in ``event_id`` means lost state);
- ``get_events(timeout)`` waits up to ``timeout`` seconds for at least one event, then drains all.

Sources (NVIDIA/TensorRT-LLM): ``cpp/tensorrt_llm/batch_manager/kvCacheEventManager.cpp``
(``enqueueCreatedEvent``/``enqueueStoredEvent``/``enqueueRemovedEvent``/``enqueueUpdatedEvent``,
``flush``, ``worker``: drop oldest, ``getEvents``: wait then exchange); serializer
``KVCacheEventSerializer`` in ``tensorrt_llm/_utils.py``; shapes in WIRE.md §A. The async iterator
follows ``IterationResult.__anext__`` in ``tensorrt_llm/executor/result.py`` and ``AsyncQueue.get``
in ``tensorrt_llm/llmapi/utils.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Literal

__all__ = ["EventShape", "KvEventBuffer", "KvEventIterator", "unique_tokens"]

EventShape = Literal["1.2", "newer"]


def unique_tokens(token_ids: list[int] | tuple[int, ...]) -> list[dict[str, Any]]:
    """``unique_token`` dicts for a block's tokens (``token_extra_id`` 0: text only)."""
    return [{"type": "unique_token", "token_id": int(t), "token_extra_id": 0} for t in token_ids]


class KvEventBuffer:
    """Event queue of one KV cache manager (one attention window).

    Args:
        max_size: ``event_buffer_max_size``; 0 disables events (nothing is recorded).
        window_size: attention window reported as ``window_size`` in every event (tokens).
        attention_dp_rank: when not None, every event carries ``attention_dp_rank``.
        shape: ``"1.2"`` (no ``cache_salt``/``mm_keys`` per block, no ``hash_algo``) or ``"newer"``
            (adds ``cache_salt``, ``mm_keys`` per stored block and ``layer_group_id``/``hash_algo``
            at top level).

    Thread-safe: the engine thread enqueues and flushes, any thread drains.
    """

    def __init__(
        self,
        max_size: int,
        window_size: int,
        *,
        attention_dp_rank: int | None = None,
        shape: EventShape = "newer",
    ) -> None:
        if max_size < 0:
            raise ValueError("event_buffer_max_size must be >= 0")
        self.max_size = max_size
        self.window_size = window_size
        self.attention_dp_rank = attention_dp_rank
        self.shape: EventShape = shape
        self._next_event_id = 0
        self._iteration: list[dict[str, Any]] = []
        self._events: deque[dict[str, Any]] = deque()
        self._cond = threading.Condition()
        self.num_dropped = 0

    @property
    def enabled(self) -> bool:
        """Whether events are recorded (``event_buffer_max_size > 0``)."""
        return self.max_size > 0

    # ---------------------------------------------------------------- enqueue (engine thread)
    def _wrap(self, data: dict[str, Any]) -> dict[str, Any]:
        event: dict[str, Any] = {"event_id": self._next_event_id, "data": data}
        self._next_event_id += 1
        event["window_size"] = self.window_size
        if self.attention_dp_rank is not None:
            event["attention_dp_rank"] = self.attention_dp_rank
        if self.shape == "newer":
            event["layer_group_id"] = 0
            event["hash_algo"] = "v1_block_key"
        return event

    def enqueue_created(self, num_blocks_per_cache_level: list[int]) -> None:
        """``created`` with ``[n_gpu_blocks, n_host_blocks]``; the manager's first event (id 0)."""
        if self.enabled:
            data = {"type": "created", "num_blocks_per_cache_level": list(num_blocks_per_cache_level)}
            self._iteration.append(self._wrap(data))

    def enqueue_stored(self, parent_hash: int | None, blocks: list[dict[str, Any]]) -> None:
        """``stored``: ``blocks`` form a chain whose first block's parent is ``parent_hash``.

        Each block dict needs ``block_hash``, ``token_ids``, ``cache_level``, ``priority`` and
        ``cache_salt`` (str | None).
        """
        if not self.enabled or not blocks:
            return
        out = []
        for block in blocks:
            stored = {
                "type": "stored_block",
                "block_hash": block["block_hash"],
                "tokens": unique_tokens(block["token_ids"]),
                "cache_level": block["cache_level"],
                "priority": block["priority"],
            }
            if self.shape == "newer":
                stored["mm_keys"] = []
                stored["cache_salt"] = block["cache_salt"]
            out.append(stored)
        self._iteration.append(
            self._wrap({"type": "stored", "parent_hash": parent_hash, "blocks": out})
        )

    def enqueue_removed(self, block_hash: int) -> None:
        """``removed``; coalesced into the previous event of this iteration when that is ``removed``."""
        if not self.enabled:
            return
        if self._iteration and self._iteration[-1]["data"]["type"] == "removed":
            self._iteration[-1]["data"]["block_hashes"].append(block_hash)
            return
        self._iteration.append(self._wrap({"type": "removed", "block_hashes": [block_hash]}))

    def enqueue_updated(
        self,
        block_hash: int,
        *,
        cache_level: tuple[int, int] | None = None,
        priority: tuple[int, int] | None = None,
    ) -> None:
        """``updated``; ``cache_level``/``priority`` are ``(old, new)`` pairs or None (unchanged)."""
        if not self.enabled:
            return

        def diff(pair: tuple[int, int] | None) -> dict[str, Any] | None:
            if pair is None:
                return None
            return {"type": "event_diff", "new_value": pair[1], "old_value": pair[0]}

        data = {
            "type": "updated",
            "block_hash": block_hash,
            "cache_level": diff(cache_level),
            "priority": diff(priority),
        }
        self._iteration.append(self._wrap(data))

    def flush(self) -> None:
        """End of iteration: move this iteration's events into the buffer, dropping the oldest."""
        if not self._iteration:
            return
        batch, self._iteration = self._iteration, []
        with self._cond:
            overflow = len(self._events) + len(batch) - self.max_size
            while overflow > 0 and self._events:
                self._events.popleft()
                self.num_dropped += 1
                overflow -= 1
            if overflow > 0:
                self.num_dropped += overflow
                batch = batch[overflow:]
            self._events.extend(batch)
            self._cond.notify_all()

    # ---------------------------------------------------------------- drain (any thread)
    def get_events(self, timeout: float | None = 2.0) -> list[dict[str, Any]]:
        """Wait up to ``timeout`` seconds (None: forever) for an event, then drain everything.

        Returns ``[]`` when events are disabled or none arrived in time.
        """
        if not self.enabled:
            return []
        with self._cond:
            if not self._events and timeout != 0:
                self._cond.wait_for(lambda: bool(self._events), timeout=timeout)
            drained = list(self._events)
            self._events.clear()
        return drained

    def pop_one(self) -> dict[str, Any] | None:
        """Remove and return the oldest buffered event, or None when empty."""
        with self._cond:
            return self._events.popleft() if self._events else None

    def aiter(self, timeout: float | None = 2.0) -> "KvEventIterator":
        """Async iterator over events; see :class:`KvEventIterator` for the empty-queue behaviour."""
        return KvEventIterator(self, timeout)


class KvEventIterator(AsyncIterator[dict[str, Any]]):
    """``async for ev in llm.get_kv_cache_events_async(timeout)``, as TensorRT-LLM behaves.

    - ``timeout > 0``: waits up to ``timeout`` seconds for the next event; when none arrives the
      iteration ends (``StopAsyncIteration``) and stays ended (``IterationResult._done``).
    - ``timeout`` 0 or negative and the queue is empty: raises ``asyncio.QueueEmpty`` out of
      ``__anext__`` (``AsyncQueue.get`` non-blocking path; older releases raised ``IndexError``).
    - ``timeout`` None: waits for ever.

    Polls the thread-safe buffer every millisecond, so the engine may run on another thread.
    """

    _POLL_S = 0.001

    def __init__(self, buffer: KvEventBuffer, timeout: float | None) -> None:
        self._buffer = buffer
        self._timeout = timeout
        self._done = False

    def __aiter__(self) -> "KvEventIterator":
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._done:
            raise StopAsyncIteration
        event = self._buffer.pop_one()
        if event is not None:
            return event
        if self._timeout is not None and self._timeout <= 0:
            raise asyncio.QueueEmpty()
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        while deadline is None or time.monotonic() < deadline:
            await asyncio.sleep(self._POLL_S)
            event = self._buffer.pop_one()
            if event is not None:
                return event
        self._done = True
        raise StopAsyncIteration
