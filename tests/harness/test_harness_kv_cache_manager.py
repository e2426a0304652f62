"""REFERENCE ENGINE HARNESS tests: KV cache manager semantics (reuse, eviction, offload, events).

These drive :class:`KVCacheManager` directly (no model), the way TensorRT-LLM's own
``test_kv_cache_event_data_serialization`` drives ``add_sequence`` / ``free_resources``.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from connector.block_keys import block_hash_chain
from connector.harness.kv_cache_manager import KVCacheManager, KvCacheCapacityError
from connector.harness.retention import KvCacheRetentionConfig, TokenRangeRetentionConfig


def _manager(**kw) -> KVCacheManager:
    args = dict(num_layers=1, num_kv_heads=1, head_dim=2, tokens_per_block=4, num_blocks=8,
                event_buffer_max_size=1000)
    args.update(kw)
    return KVCacheManager(**args)


def _run(mgr: KVCacheManager, request_id: int, prompt: list[int], **kw):
    """Admit, store the context blocks, release (no generated token), flush: one request's life."""
    seq, _ = mgr.add_sequence(request_id, prompt, **kw)
    mgr.store_context_blocks(seq)
    mgr.remove_sequence(seq)
    mgr.flush_iteration_events()
    return seq


def _priority(p: int) -> KvCacheRetentionConfig:
    return KvCacheRetentionConfig([TokenRangeRetentionConfig(0, None, p)], decode_retention_priority=p)


def _types(events) -> list[str]:
    return [e["data"]["type"] for e in events]


def test_created_first_with_event_id_zero_and_pool_sizes() -> None:
    mgr = _manager(host_num_blocks=3)
    events = mgr.events.get_events(0)
    assert events[0]["event_id"] == 0
    assert events[0]["data"] == {"type": "created", "num_blocks_per_cache_level": [8, 3]}
    assert events[0]["window_size"] == 32 and "attention_dp_rank" not in events[0]
    assert mgr.kv_cache.shape == (8, 1, 2, 1 * 2 * 4)
    assert mgr.host_kv_cache.shape == (3, 1, 2, 8)


def test_five_token_prompt_with_64_tokens_per_block_stores_one_block_of_four() -> None:
    mgr = _manager(tokens_per_block=64)
    mgr.events.get_events(0)
    seq, _ = mgr.add_sequence(0, [1, 2, 3, 4, 5])
    mgr.store_context_blocks(seq)  # no full block of prompt[:-1]: nothing stored yet
    mgr.flush_iteration_events()
    assert mgr.events.get_events(0) == []
    mgr.remove_sequence(seq)
    mgr.flush_iteration_events()
    (stored,) = mgr.events.get_events(0)
    assert stored["data"]["parent_hash"] is None
    (block,) = stored["data"]["blocks"]
    assert [t["token_id"] for t in block["tokens"]] == [1, 2, 3, 4]
    assert block["tokens"][0] == {"type": "unique_token", "token_id": 1, "token_extra_id": 0}
    assert block["cache_level"] == 0 and block["priority"] == 35
    assert block["cache_salt"] is None and block["mm_keys"] == []
    again, _ = mgr.add_sequence(1, [1, 2, 3, 4, 5])
    assert again.num_reused_tokens == 0  # a partial block is never matched


def test_reuse_by_chain_full_blocks_of_prompt_minus_last_token() -> None:
    mgr = _manager(num_blocks=16)
    a, b, c, d = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]
    _run(mgr, 0, a + b + c + [99])
    assert mgr.add_sequence(1, a + b + c + [98])[0].num_reused_tokens == 12
    assert mgr.add_sequence(2, a + b + c)[0].num_reused_tokens == 8  # last token never reused
    assert mgr.add_sequence(3, a + d + c + [1])[0].num_reused_tokens == 4
    assert mgr.add_sequence(4, d + b + c + [1])[0].num_reused_tokens == 0  # b only as a's child


def test_no_reuse_across_salts_or_lora_ids_and_hashes_match_the_chain() -> None:
    mgr = _manager(num_blocks=32)
    prompt = list(range(1, 14))
    _run(mgr, 0, prompt, cache_salt="tenant-A")
    assert mgr.add_sequence(1, prompt, cache_salt="tenant-B")[0].num_reused_tokens == 0
    assert mgr.add_sequence(2, prompt)[0].num_reused_tokens == 0
    assert mgr.add_sequence(3, prompt, cache_salt="tenant-A")[0].num_reused_tokens == 12
    _run(mgr, 4, prompt, lora_task_id=7)
    assert mgr.add_sequence(5, prompt, lora_task_id=8)[0].num_reused_tokens == 0
    assert mgr.add_sequence(6, prompt, lora_task_id=7)[0].num_reused_tokens == 12
    stored = [e for e in mgr.events.get_events(0) if e["data"]["type"] == "stored"]
    salted = [b["block_hash"] for b in stored[0]["data"]["blocks"]]
    assert salted == block_hash_chain(prompt[:12], 4, cache_salt="tenant-A")
    assert {b["cache_salt"] for b in stored[0]["data"]["blocks"]} == {"tenant-A"}
    lora = [b["block_hash"] for b in stored[1]["data"]["blocks"]]
    assert lora == block_hash_chain(prompt[:12], 4, lora_task_id=7)


def test_eviction_takes_lowest_priority_first_then_lru() -> None:
    mgr = _manager(num_blocks=6)
    hashes = {}
    for request_id, priority in ((0, 50), (1, 10), (2, 10), (3, 50)):
        prompt = [100 * (request_id + 1) + i for i in range(5)]
        _run(mgr, request_id, prompt, retention=_priority(priority))
        hashes[request_id] = block_hash_chain(prompt[:4], 4)[0]
    mgr.events.get_events(0)
    assert mgr.num_stored_blocks() == 4 and mgr.num_available_blocks() == 6
    mgr.add_sequence(10, list(range(1000, 1013)))  # 4 blocks: 2 free + 2 evicted
    mgr.flush_iteration_events()
    (removed,) = mgr.events.get_events(0)
    assert removed["data"] == {"type": "removed", "block_hashes": [hashes[1], hashes[2]]}
    mgr.add_sequence(11, list(range(2000, 2004)))  # 1 more block: the LRU of priority 50
    mgr.flush_iteration_events()
    assert mgr.events.get_events(0)[0]["data"]["block_hashes"] == [hashes[0]]
    with pytest.raises(KvCacheCapacityError):
        mgr.add_sequence(12, list(range(3000, 3013)))


def test_offload_to_host_and_onboard_on_reuse_with_updated_events() -> None:
    mgr = _manager(num_blocks=3, host_num_blocks=2, secondary_offload_min_priority=30)
    keep = list(range(1, 6))       # priority 35 (default): offloaded
    drop = list(range(11, 16))     # priority 10: dropped
    _run(mgr, 0, keep)
    _run(mgr, 1, drop, retention=_priority(10))
    level, slot = mgr.stored_block_location(block_hash_chain(keep[:4], 4)[0])
    mgr.kv_cache[slot].fill_(7.0)  # stand-in for computed KV
    mgr.events.get_events(0)
    seq, _ = mgr.add_sequence(2, list(range(20, 29)))  # 3 blocks: evicts both cached blocks
    mgr.flush_iteration_events()
    events = mgr.events.get_events(0)
    keep_hash, drop_hash = block_hash_chain(keep[:4], 4)[0], block_hash_chain(drop[:4], 4)[0]
    assert [e["data"] for e in events] == [
        {"type": "removed", "block_hashes": [drop_hash]},
        {"type": "updated", "block_hash": keep_hash, "priority": None,
         "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0}},
    ]
    assert mgr.stored_block_location(keep_hash)[0] == 1
    mgr.remove_sequence(seq, store_for_reuse=False)
    again, _ = mgr.add_sequence(3, keep)
    mgr.flush_iteration_events()
    assert again.num_reused_tokens == 4
    (onboard,) = mgr.events.get_events(0)
    assert onboard["data"]["cache_level"] == {"type": "event_diff", "new_value": 0, "old_value": 1}
    assert torch.all(mgr.kv_cache[again.block_ids[0]] == 7.0)


def test_event_buffer_drops_oldest_and_event_ids_stay_consecutive() -> None:
    mgr = _manager(num_blocks=64, event_buffer_max_size=3)
    for request_id in range(5):
        _run(mgr, request_id, [request_id * 10 + i for i in range(9)])
    events = mgr.events.get_events(0)
    assert [e["event_id"] for e in events] == [3, 4, 5]  # created + 5 stored, oldest 3 dropped
    assert mgr.events.num_dropped == 3
    unbounded = _manager(num_blocks=4)
    for request_id in range(6):
        _run(unbounded, request_id, [request_id * 10 + i for i in range(9)])
    events = unbounded.events.get_events(0)
    assert [e["event_id"] for e in events] == list(range(len(events)))
    assert _types(events)[0] == "created" and "removed" in _types(events)


def test_removed_events_are_coalesced_within_an_iteration() -> None:
    mgr = _manager(num_blocks=4)
    _run(mgr, 0, list(range(13)))  # 3 stored blocks
    mgr.events.get_events(0)
    mgr.add_sequence(1, list(range(100, 116)))  # needs all 4 blocks
    mgr.flush_iteration_events()
    (removed,) = mgr.events.get_events(0)
    assert len(removed["data"]["block_hashes"]) == 3


def test_attention_dp_rank_and_12_shape() -> None:
    mgr = _manager(attention_dp_rank=2, event_shape="1.2")
    _run(mgr, 0, list(range(9)))
    created, stored = mgr.events.get_events(0)
    assert created["attention_dp_rank"] == 2 and "hash_algo" not in created
    assert "cache_salt" not in stored["data"]["blocks"][0]
    newer = _manager()
    assert newer.events.get_events(0)[0]["hash_algo"] == "v1_block_key"


def test_get_events_timeout_and_disabled_buffer() -> None:
    assert _manager(event_buffer_max_size=0).events.get_events(0.01) == []
    mgr = _manager()
    assert len(mgr.events.get_events(0.01)) == 1
    assert mgr.events.get_events(0.01) == []


async def test_async_iterator_drains_then_ends_and_nonblocking_raises_queue_empty() -> None:
    mgr = _manager()
    _run(mgr, 0, list(range(9)))
    collected = [event async for event in mgr.events.aiter(timeout=0.05)]
    assert _types(collected) == ["created", "stored"]
    with pytest.raises(asyncio.QueueEmpty):
        await mgr.events.aiter(timeout=0).__anext__()
