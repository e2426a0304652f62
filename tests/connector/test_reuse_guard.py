"""The reuse guard's bookkeeping (connector/reuse_guard.py) on real content keys; what it prevents on
the engine is in test_trtllm_lifecycle.py (abandoned prefills, partial hits)."""

from __future__ import annotations

import struct

from connector.namespace import PrefixKeys
from connector.reuse_guard import UnverifiedBlocks

TPB = 4


def keys_of(tokens: list[int], seed: bytes = b"ns") -> PrefixKeys:
    n = len(tokens) // TPB
    return PrefixKeys(seed, memoryview(struct.pack(f"<{n * TPB}q", *tokens[: n * TPB])), TPB * 8, n)


PROMPT = keys_of(list(range(40)))  # 10 blocks


def test_whole_blocks_are_known_by_key_and_a_partial_hit_by_its_parent() -> None:
    guard = UnverifiedBlocks()
    guard.abandoned("r1", PROMPT, 4, 9)
    assert not guard.touches(PROMPT, 4 * TPB, TPB)  # the computed blocks 0-3
    assert guard.touches(PROMPT, 4 * TPB + 1, TPB)  # a partial hit under block 3: a child of it was left
    assert guard.touches(PROMPT, 5 * TPB, TPB)
    other = keys_of(list(range(16)) + [99] * 24)  # same blocks 0-3, then its own
    assert not guard.touches(other, 4 * TPB, TPB) and guard.touches(other, 4 * TPB + 2, TPB)
    assert not guard.touches(keys_of(list(range(40)), seed=b"other namespace"), 10 * TPB, TPB)


def test_a_block_0_partial_hit_is_known_by_the_namespace_root() -> None:
    guard = UnverifiedBlocks()
    guard.abandoned("r1", PROMPT, 0, 9)
    assert guard.touches(keys_of([0, 1] + [7] * 10), 2, TPB)
    assert not guard.touches(keys_of([0, 1] + [7] * 10, seed=b"other"), 2, TPB)


def test_seen_again_clears_but_a_request_freed_and_back_keeps_what_it_left() -> None:
    guard = UnverifiedBlocks()
    guard.abandoned("skipped", PROMPT, 4, 9)
    guard.seen_again("skipped")  # reported again without a new lookup: merely skipped
    assert not guard.touches(PROMPT, 10 * TPB, TPB) and len(guard) == 0
    guard.abandoned("paused", PROMPT, 4, 9)
    guard.keep("paused")  # looked up again: it was freed, its blocks stored
    guard.seen_again("paused")
    guard.abandoned("paused", PROMPT, 8, 9)  # and abandoned again later
    guard.seen_again("paused")
    assert guard.touches(PROMPT, 5 * TPB, TPB) and len(guard) == 1


def test_only_the_oldest_beyond_the_bound_are_forgotten() -> None:
    guard = UnverifiedBlocks(max_requests=2)
    first, second, third = keys_of([1] * 8), keys_of([2] * 8), keys_of([3] * 8)
    for request_id, keys in (("a", first), ("b", second), ("c", third)):
        guard.abandoned(request_id, keys, 0, 1)
    assert not guard.touches(first, 2 * TPB, TPB)
    assert guard.touches(second, 2 * TPB, TPB) and guard.touches(third, 2 * TPB, TPB)
    assert len(guard) == 2


def test_a_partial_last_block_alone_is_still_known_by_its_parent() -> None:
    """Abandoned with only the partial block past the whole ones uncomputed: no whole block is held,
    only its parent."""
    guard = UnverifiedBlocks()
    prompt = keys_of(list(range(11)))  # 2 whole blocks; tokens[:-1] stores a partial block 2 (tokens 8, 9)
    guard.abandoned("r1", prompt, 2, 2)
    assert len(guard) == 1
    assert guard.touches(prompt, 2 * TPB + 2, TPB)


def test_a_refused_request_s_own_blocks_from_its_partial_hit_on_are_held() -> None:
    guard = UnverifiedBlocks()
    guard.abandoned("a", PROMPT, 4, 9)
    refused = keys_of(list(range(18)) + [5] * 22)  # a partial hit 2 tokens into block 4, then its own
    assert guard.touches(refused, 4 * TPB + 2, TPB)
    guard.refused("b", refused, 4 * TPB + 2, TPB)
    assert guard.touches(refused, 6 * TPB, TPB)  # its block 4 whole, by its own key
    short = keys_of(list(range(18)))  # its prompt ends inside block 4: generated tokens fill it later
    guard.refused("c", short, 4 * TPB + 2, TPB)
    assert guard.touches(keys_of(list(range(16)) + [9] * 8), 5 * TPB, TPB)  # any child of block 3, whole
