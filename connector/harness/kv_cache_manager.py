"""REFERENCE ENGINE HARNESS — a paged KV cache manager with TensorRT-LLM's reuse semantics.

Test and demo infrastructure only; never an engine for serving. What it reproduces, each behaviour
from NVIDIA/TensorRT-LLM ``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp`` unless noted:

- **Pools.** ``kv_cache``: one tensor ``[num_blocks, num_layers, kv_factor=2, block_elems]`` with
  ``block_elems = num_kv_heads * head_dim * tokens_per_block`` (the tensor ``register_kv_caches``
  receives); ``kv_cache[block_id]`` is one whole block across all layers. Optional ``host_kv_cache``
  of the same trailing shape (cache level 1). Token layout inside a block: NHD
  (``[tokens_per_block, num_kv_heads, head_dim]``).
- **Reuse.** A radix tree keyed per parent by ``(tokens, lora_task_id, cache_salt_id)``; each stored
  block carries its ``v1_block_key`` hash (:mod:`connector.block_keys`). ``add_sequence`` matches the FULL
  blocks of ``prompt[:-1]`` (the last prompt token's KV is never reused: ``addSequence`` chops
  ``inputLength - 1`` tokens) and allocates the rest of the context blocks, then calls the connector
  callback with ``num_computed_tokens`` while still holding :attr:`lock` (``getNumNewMatchedTokens``).
- **Storing.** ``store_context_blocks`` (after the last context chunk) stores the full blocks of
  ``prompt[:-1]``; ``remove_sequence`` stores every block of ``tokens[:-1]`` including a partial last
  one (``storeBlocksForReuse``, ``chopVectorIntoBlocks(..., allowPartial=true)``). So a 5-token prompt
  with 64 tokens per block ends up as one stored block of 4 tokens (WIRE.md §A).
- **Eviction.** Unreferenced stored blocks wait in per-(cache level, priority) LRU queues; a free slot
  is taken first, then the least recently released block of the LOWEST priority
  (``LRUEvictionPolicy::getFreeBlock``). A GPU victim with priority ``>=
  secondary_offload_min_priority`` is offloaded to the host pool when one is configured (a host
  victim is evicted to make room); ``updated`` cache_level 0→1. Otherwise it is removed with its
  subtree (``removed``). A matched host block is onboarded back (``updated`` 1→0).
- **Events** through :class:`.events.KvEventBuffer` (``created`` first, event ids consecutive).

- **Release.** ``remove_sequence`` (``free_resources`` → ``removeSequence`` → ``releaseBlocks``)
  stores the sequence's blocks for reuse whatever ended the request — completion, cancel, or an
  error inside the forward — without checking that its prefill completed: blocks of a request that
  failed mid-prefill (or while a connector was still filling them) enter the reuse tree as they
  are. ``store_blocks_for_reuse`` stores without releasing (``storeBlocksForReuse(..., pin)``: the
  sequence's references keep the blocks from eviction until it is removed).

- **Partial reuse** (``enable_partial_reuse``; off by default here, on by default in TensorRT-LLM's
  ``KvCacheConfig``): where the full-block walk stops, the child of the last matched block whose
  tokens share the longest leading run with the prompt's next chunk (of ``prompt[:-1]``) is copied
  into the request's next block and that many tokens count as reused, so ``num_computed_tokens`` is
  not block-aligned (``KVCacheBlock::findMatchingBlock`` and ``loadOrAllocateBlocks``'s partial hit).

Deviations (deliberate, documented): a partial hit is always copied (copy-on-partial-reuse; TensorRT-LLM
may instead take an unreferenced leaf itself, detaching it from the tree); no ``duration_ms`` expiry.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from connector.block_keys import cache_salt_id as compute_cache_salt_id
from connector.block_keys import chop_into_blocks, v1_block_key, v1_block_keys
from .events import EventShape, KvEventBuffer
from .retention import DEFAULT_RETENTION_PRIORITY, KvCacheRetentionConfig, per_block_priorities

__all__ = ["KVBlock", "KVCacheManager", "KVSequence", "KvCacheCapacityError"]

GPU_LEVEL = 0
HOST_LEVEL = 1
BlockKey = tuple[tuple[int, ...], "int | None", "int | None"]


class KvCacheCapacityError(RuntimeError):
    """The GPU pool cannot hold the request even after evicting every unreferenced block."""


@dataclass(eq=False)
class KVBlock:
    """One allocated block: a GPU slot (``cache_level`` 0) or, once offloaded, a host slot (1).

    ``in_tree`` blocks are reusable and have ``key``/``block_hash``/``parent``; private blocks
    (still being filled, or duplicates of a stored block) are freed on release.
    """

    slot: int
    priority: int
    cache_level: int = GPU_LEVEL
    ref_count: int = 0
    in_tree: bool = False
    key: BlockKey | None = None
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    parent: "KVBlock | None" = None
    children: dict[BlockKey, "KVBlock"] = field(default_factory=dict)
    evicting: bool = False


@dataclass(eq=False)
class KVSequence:
    """KV state of one request: its blocks in order and every token (prompt + generated)."""

    request_id: int
    tokens: list[int]
    prompt_len: int
    lora_task_id: int | None
    cache_salt: str | None
    cache_salt_id: int | None
    retention: KvCacheRetentionConfig | None
    blocks: list[KVBlock] = field(default_factory=list)
    num_reused_tokens: int = 0
    released: bool = False
    committed_hashes: list[int] = field(default_factory=list)

    @property
    def block_ids(self) -> list[int]:
        """GPU block ids (indices into ``kv_cache``), in token order."""
        return [block.slot for block in self.blocks]


class KVCacheManager:
    """Paged KV cache of one attention window with block reuse, offload and KV-cache events.

    Args:
        num_layers, num_kv_heads, head_dim: model KV geometry.
        tokens_per_block: tokens per block.
        num_blocks: GPU pool size (blocks).
        host_num_blocks: host pool size (blocks); 0 disables offload.
        enable_block_reuse: False disables matching and storing (no ``stored`` events).
        enable_partial_reuse: also reuse the leading tokens of a partly matching block (module docstring).
        secondary_offload_min_priority: offload only blocks with priority >= this (default 30).
        event_buffer_max_size: bounded event buffer; 0 disables events.
        attention_dp_rank: reported in events when not None.
        window_size: attention window reported in events (tokens); default ``num_blocks *
            tokens_per_block``.
        event_shape: ``"1.2"`` or ``"newer"`` event dicts.
        dtype: KV dtype (fp32 in the harness).

    All public methods take :attr:`lock` (re-entrant), the "block manager lock" of TensorRT-LLM.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        tokens_per_block: int,
        num_blocks: int,
        host_num_blocks: int = 0,
        enable_block_reuse: bool = True,
        enable_partial_reuse: bool = False,
        secondary_offload_min_priority: int = 30,
        event_buffer_max_size: int = 0,
        attention_dp_rank: int | None = None,
        window_size: int | None = None,
        event_shape: EventShape = "newer",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if num_blocks < 1 or tokens_per_block < 1 or host_num_blocks < 0:
            raise ValueError("num_blocks and tokens_per_block must be >= 1, host_num_blocks >= 0")
        self.num_layers = num_layers
        self.tokens_per_block = tokens_per_block
        self.num_blocks = num_blocks
        self.host_num_blocks = host_num_blocks
        self.enable_block_reuse = enable_block_reuse
        self.enable_partial_reuse = enable_partial_reuse
        self.secondary_offload_min_priority = secondary_offload_min_priority
        self.block_elems = num_kv_heads * head_dim * tokens_per_block
        shape = (num_blocks, num_layers, 2, self.block_elems)
        self.kv_cache = torch.zeros(shape, dtype=dtype)
        self.host_kv_cache: torch.Tensor | None = (
            torch.zeros((host_num_blocks, *shape[1:]), dtype=dtype) if host_num_blocks else None
        )
        self.lock = threading.RLock()
        self._free = {GPU_LEVEL: deque(range(num_blocks)), HOST_LEVEL: deque(range(host_num_blocks))}
        self._queues: dict[int, dict[int, OrderedDict[KVBlock, None]]] = {GPU_LEVEL: {}, HOST_LEVEL: {}}
        self._root: dict[BlockKey, KVBlock] = {}
        self._by_hash: dict[int, KVBlock] = {}
        self._owner: dict[int, list[KVBlock | None]] = {
            GPU_LEVEL: [None] * num_blocks,
            HOST_LEVEL: [None] * host_num_blocks,
        }
        window_size = window_size or tokens_per_block * num_blocks
        self.events = KvEventBuffer(
            event_buffer_max_size, window_size, attention_dp_rank=attention_dp_rank, shape=event_shape
        )
        self.events.enqueue_created([num_blocks, host_num_blocks])
        self.events.flush()

    # ================================================================ public API
    def add_sequence(
        self,
        request_id: int,
        prompt: list[int],
        *,
        max_new_tokens: int = 1,
        lora_task_id: int | None = None,
        cache_salt: str | None = None,
        retention: KvCacheRetentionConfig | None = None,
        on_matched: Callable[[int], int] | None = None,
    ) -> tuple[KVSequence, int]:
        """Match reusable blocks, allocate the context blocks, then ask ``on_matched``.

        ``on_matched(num_computed_tokens)`` runs under :attr:`lock` after matching and allocation and
        returns the connector's token count; if it raises, every block is released unstored.

        Returns:
            ``(sequence, connector_tokens)``; ``sequence.num_reused_tokens`` is the device match.

        Raises:
            ValueError: empty prompt.
            KvCacheCapacityError: the pool cannot hold ``len(prompt) + max_new_tokens - 1`` tokens.
        """
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        tpb = self.tokens_per_block
        with self.lock:
            needed = -(-(len(prompt) + max(max_new_tokens, 1) - 1) // tpb)
            if needed > self.num_available_blocks():
                raise KvCacheCapacityError(
                    f"request {request_id} needs {needed} blocks, {self.num_available_blocks()} available"
                )
            salt_id = compute_cache_salt_id(cache_salt) if cache_salt is not None else None
            seq = KVSequence(request_id, list(prompt), len(prompt), lora_task_id, cache_salt,
                             salt_id, retention)
            priorities = per_block_priorities(retention, tpb, len(prompt))
            matched = self._match(seq)
            try:
                self._claim_matched(seq, matched, priorities)
                for i in range(len(matched), len(priorities)):
                    self._append_private_block(seq, priorities[i])
                seq.num_reused_tokens = len(matched) * tpb + self._reuse_partial(seq, len(matched))
                connector_tokens = on_matched(seq.num_reused_tokens) if on_matched else 0
            except BaseException:
                self._release(seq, store_for_reuse=False)
                raise
            return seq, connector_tokens

    def ensure_capacity(self, seq: KVSequence, num_tokens: int) -> list[int]:
        """Allocate decode blocks until ``seq`` can hold ``num_tokens`` tokens; returns new block ids."""
        with self.lock:
            new_ids = []
            decode_priority = (
                seq.retention.decode_retention_priority if seq.retention else DEFAULT_RETENTION_PRIORITY
            )
            while len(seq.blocks) * self.tokens_per_block < num_tokens:
                new_ids.append(self._append_private_block(seq, decode_priority).slot)
            return new_ids

    def store_context_blocks(self, seq: KVSequence) -> None:
        """Make the full blocks of ``prompt[:-1]`` reusable (after the last context chunk)."""
        with self.lock:
            prompt = seq.tokens[: seq.prompt_len]
            self._store(seq, chop_into_blocks(prompt, len(prompt) - 1, self.tokens_per_block,
                                              allow_partial=False))

    def remove_sequence(self, seq: KVSequence, *, store_for_reuse: bool = True) -> None:
        """Release ``seq``'s blocks; when ``store_for_reuse``, first store ``tokens[:-1]`` (partial ok)."""
        with self.lock:
            self._release(seq, store_for_reuse=store_for_reuse)

    def store_blocks_for_reuse(self, seq: KVSequence) -> None:
        """Store ``tokens[:-1]`` of ``seq`` (partial last block included) without releasing it.

        ``storeBlocksForReuse(request, pin=True)`` when an async connector save starts: the blocks
        become reusable at once, and the sequence's references keep them from eviction until
        :meth:`remove_sequence`.
        """
        with self.lock:
            if not seq.released and seq.tokens:
                self._store(seq, chop_into_blocks(seq.tokens, len(seq.tokens) - 1, self.tokens_per_block,
                                                  allow_partial=True))

    def block_hashes(self, seq: KVSequence) -> list[int]:
        """Chained hashes of every FULL block of ``seq.tokens`` (``commit_and_get_block_hashes``).

        Committed once per block and cached on the sequence, as the C++ side sets ``mHash`` once.
        """
        tpb, done = self.tokens_per_block, seq.committed_hashes
        new_blocks = len(seq.tokens) // tpb - len(done)
        if new_blocks > 0:
            done += v1_block_keys(seq.tokens[len(done) * tpb :], tpb, new_blocks, parent_hash=done[-1] if done else 0,
                                  lora_task_id=seq.lora_task_id, cache_salt_id=seq.cache_salt_id)
        return list(done)

    def read_stored_block(self, block_hash: int) -> torch.Tensor | None:
        """A copy ``[num_layers, 2, block_elems]`` of the stored block ``block_hash`` (GPU or host).

        Returns None when no block with that hash is in the reuse tree.
        """
        with self.lock:
            block = self._by_hash.get(block_hash)
            if block is None:
                return None
            pool = self.kv_cache if block.cache_level == GPU_LEVEL else self.host_kv_cache
            return pool[block.slot].clone()

    def stored_block_location(self, block_hash: int) -> tuple[int, int] | None:
        """``(cache_level, slot)`` of the stored block ``block_hash``, or None."""
        with self.lock:
            block = self._by_hash.get(block_hash)
            return (block.cache_level, block.slot) if block is not None else None

    def get_priority_by_block_id(self, block_id: int) -> int:
        """Retention priority of the block in GPU slot ``block_id``."""
        with self.lock:
            owner = self._owner[GPU_LEVEL][block_id]
            return owner.priority if owner else DEFAULT_RETENTION_PRIORITY

    def num_available_blocks(self) -> int:
        """GPU blocks that are free or evictable (unreferenced)."""
        with self.lock:
            queued = sum(len(q) for q in self._queues[GPU_LEVEL].values())
            return len(self._free[GPU_LEVEL]) + queued

    def stored_block_hashes(self) -> list[int]:
        """Hashes of every block in the reuse tree (GPU and host), parents before children."""
        with self.lock:
            return sorted((b.block_hash for b in self._walk_tree() if b.block_hash is not None),
                          key=lambda h: self._depth(self._by_hash[h]))

    def _depth(self, block: KVBlock) -> int:
        depth = 0
        while block.parent is not None:
            block, depth = block.parent, depth + 1
        return depth

    def num_stored_blocks(self, cache_level: int | None = None) -> int:
        """Blocks currently in the reuse tree (optionally at one cache level)."""
        with self.lock:
            return sum(1 for b in self._walk_tree() if cache_level in (None, b.cache_level))

    def lock_held_by_current_thread(self) -> bool:
        """Whether the calling thread holds :attr:`lock` (tests check the connector call site)."""
        return self.lock._is_owned()  # RLock's own ownership check

    def flush_iteration_events(self) -> None:
        """End of an engine iteration: publish this iteration's events to the bounded buffer."""
        with self.lock:
            self.events.flush()

    # ================================================================ matching and allocation
    def _match(self, seq: KVSequence) -> list[KVBlock]:
        children, matched = self._root, []
        if not self.enable_block_reuse:
            return matched
        prompt = seq.tokens[: seq.prompt_len]
        for block_tokens in chop_into_blocks(prompt, len(prompt) - 1, self.tokens_per_block,
                                             allow_partial=False):
            block = children.get((tuple(block_tokens), seq.lora_task_id, seq.cache_salt_id))
            if block is None:
                break
            matched.append(block)
            children = block.children
        return matched

    def _reuse_partial(self, seq: KVSequence, index: int) -> int:
        """Partial reuse into ``seq``'s block ``index`` (after its ``index`` fully matched blocks):
        copy the stored child with the longest leading run of the prompt's next tokens; returns that
        run's length (0: none, or partial reuse off)."""
        if not (self.enable_block_reuse and self.enable_partial_reuse) or index >= len(seq.blocks):
            return 0
        tpb, usable = self.tokens_per_block, seq.prompt_len - 1
        wanted = seq.tokens[index * tpb: min((index + 1) * tpb, usable)]
        children = seq.blocks[index - 1].children if index else self._root
        best, best_len = None, 0
        for (tokens, lora_task_id, salt_id), block in children.items():
            if (lora_task_id, salt_id) != (seq.lora_task_id, seq.cache_salt_id):
                continue
            run = next((i for i, (a, b) in enumerate(zip(tokens, wanted)) if a != b), min(len(tokens), len(wanted)))
            if run > best_len:
                best, best_len = block, run
        if best is None:
            return 0
        source = self.kv_cache if best.cache_level == GPU_LEVEL else self.host_kv_cache
        self.kv_cache[seq.blocks[index].slot].copy_(source[best.slot])
        return best_len

    def _claim_matched(self, seq: KVSequence, matched: list[KVBlock],
                       priorities: list[int | None]) -> None:
        for block in matched:
            if block.ref_count == 0:
                self._dequeue(block)
            block.ref_count += 1
            seq.blocks.append(block)
        for i, block in enumerate(matched):
            if block.cache_level == HOST_LEVEL:
                self._onboard(block)
            wanted = priorities[i]
            if wanted is not None and wanted != block.priority:
                self.events.enqueue_updated(block.block_hash, priority=(block.priority, wanted))
                block.priority = wanted

    def _append_private_block(self, seq: KVSequence, priority: int | None) -> KVBlock:
        slot = self._acquire_gpu_slot()
        block = KVBlock(slot=slot, priority=DEFAULT_RETENTION_PRIORITY if priority is None else priority,
                        ref_count=1)
        self._owner[GPU_LEVEL][slot] = block
        seq.blocks.append(block)
        return block

    def _acquire_gpu_slot(self) -> int:
        if self._free[GPU_LEVEL]:
            return self._free[GPU_LEVEL].popleft()
        victim = self._pick_victim(GPU_LEVEL)
        if victim is None:
            raise KvCacheCapacityError("no free or evictable GPU block")
        slot = victim.slot
        self._dequeue(victim)
        self._owner[GPU_LEVEL][slot] = None
        victim.evicting = True
        try:
            if not self._offload(victim):
                self._drop_subtree(victim, keep_slot_of=victim)
        finally:
            victim.evicting = False
        return slot

    def _acquire_host_slot(self) -> int | None:
        if self._free[HOST_LEVEL]:
            return self._free[HOST_LEVEL].popleft()
        victim = self._pick_victim(HOST_LEVEL)
        if victim is None:
            return None
        slot = victim.slot
        self._dequeue(victim)
        self._owner[HOST_LEVEL][slot] = None
        self._drop_subtree(victim, keep_slot_of=victim)
        return slot

    def _offload(self, block: KVBlock) -> bool:
        """Move an evicted GPU block to the host pool; False when not eligible or no room."""
        if self.host_kv_cache is None or block.priority < self.secondary_offload_min_priority:
            return False
        gpu_slot = block.slot
        host_slot = self._acquire_host_slot()
        if host_slot is None:
            return False
        if not block.in_tree:  # dropped while making room (its ancestor was the host victim)
            self._free[HOST_LEVEL].append(host_slot)
            return True
        self.host_kv_cache[host_slot].copy_(self.kv_cache[gpu_slot])
        block.cache_level, block.slot = HOST_LEVEL, host_slot
        self._owner[HOST_LEVEL][host_slot] = block
        self._enqueue(block)
        self.events.enqueue_updated(block.block_hash, cache_level=(GPU_LEVEL, HOST_LEVEL))
        return True

    def _onboard(self, block: KVBlock) -> None:
        """Copy a matched (claimed) host block back into a GPU slot; ``updated`` 1→0."""
        host_slot = block.slot
        gpu_slot = self._acquire_gpu_slot()
        self.kv_cache[gpu_slot].copy_(self.host_kv_cache[host_slot])
        self._owner[HOST_LEVEL][host_slot] = None
        self._free[HOST_LEVEL].append(host_slot)
        block.cache_level, block.slot = GPU_LEVEL, gpu_slot
        self._owner[GPU_LEVEL][gpu_slot] = block
        if block.in_tree:
            self.events.enqueue_updated(block.block_hash, cache_level=(HOST_LEVEL, GPU_LEVEL))

    # ================================================================ eviction queues
    def _enqueue(self, block: KVBlock) -> None:
        queue = self._queues[block.cache_level].setdefault(block.priority, OrderedDict())
        queue[block] = None

    def _dequeue(self, block: KVBlock) -> None:
        queue = self._queues[block.cache_level].get(block.priority)
        if queue is not None and block in queue:
            del queue[block]

    def _pick_victim(self, level: int) -> KVBlock | None:
        for priority in sorted(self._queues[level]):
            queue = self._queues[level][priority]
            if queue:
                return next(iter(queue))
        return None

    def _drop_subtree(self, root: KVBlock, *, keep_slot_of: KVBlock) -> None:
        """Remove ``root`` and its descendants from the tree (``removed``); free unreferenced slots.

        The slot of ``keep_slot_of`` is handed to the caller, not freed.
        """
        stack = [root]
        while stack:
            block = stack.pop()
            stack.extend(block.children.values())
            siblings = block.parent.children if block.parent else self._root
            if siblings.get(block.key) is block:
                del siblings[block.key]
            block.children, block.parent, block.in_tree = {}, None, False
            if self._by_hash.get(block.block_hash) is block:
                del self._by_hash[block.block_hash]
            self.events.enqueue_removed(block.block_hash)
            if block.ref_count == 0 and block is not keep_slot_of and not block.evicting:
                self._dequeue(block)
                self._owner[block.cache_level][block.slot] = None
                self._free[block.cache_level].append(block.slot)

    # ================================================================ storing and release
    def _store(self, seq: KVSequence, blocks_tokens: list[list[int]]) -> None:
        """Insert ``seq``'s blocks into the tree; one ``stored`` event per contiguous new run."""
        if not self.enable_block_reuse:
            return
        children, parent, parent_hash = self._root, None, 0
        run: list[KVBlock] = []
        run_parent: int | None = None
        for i, tokens in enumerate(blocks_tokens):
            block = seq.blocks[i]
            key: BlockKey = (tuple(tokens), seq.lora_task_id, seq.cache_salt_id)
            existing = children.get(key)
            if existing is not None or block.in_tree:
                self._emit_stored(run_parent, run)
                run = []
                node = existing if existing is not None else block
                if existing is None:  # stored under another key: stop the chain here
                    return
                children, parent, parent_hash = node.children, node, node.block_hash
                continue
            block_hash = v1_block_key(tokens, parent_hash, lora_task_id=seq.lora_task_id,
                                      cache_salt_id=seq.cache_salt_id)
            block.in_tree, block.key, block.block_hash = True, key, block_hash
            block.token_ids, block.cache_salt, block.parent = tuple(tokens), seq.cache_salt, parent
            children[key] = block
            self._by_hash.setdefault(block_hash, block)
            if not run:
                run_parent = parent.block_hash if parent is not None else None
            run.append(block)
            children, parent, parent_hash = block.children, block, block_hash
        self._emit_stored(run_parent, run)

    def _emit_stored(self, parent_hash: int | None, run: list[KVBlock]) -> None:
        self.events.enqueue_stored(parent_hash, [
            {"block_hash": b.block_hash, "token_ids": b.token_ids, "cache_level": b.cache_level,
             "priority": b.priority, "cache_salt": b.cache_salt}
            for b in run
        ])

    def _release(self, seq: KVSequence, *, store_for_reuse: bool) -> None:
        if seq.released:
            return
        if store_for_reuse and seq.tokens:
            self._store(seq, chop_into_blocks(seq.tokens, len(seq.tokens) - 1, self.tokens_per_block,
                                              allow_partial=True))
        for block in reversed(seq.blocks):  # leaves first: they become the LRU victims first
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.in_tree:
                self._enqueue(block)
            else:
                self._owner[block.cache_level][block.slot] = None
                self._free[block.cache_level].append(block.slot)
        seq.blocks, seq.released = [], True

    def _walk_tree(self):
        stack = list(self._root.values())
        while stack:
            block = stack.pop()
            stack.extend(block.children.values())
            yield block
