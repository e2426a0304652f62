"""REFERENCE ENGINE HARNESS tests: ``v1_block_key`` (WIRE.md §A.1).

TensorRT-LLM's own tests check its Python replica against the C++ hasher on random inputs at run
time (``test_native_block_key_hasher_matches_python_v1``); they publish no literal vector. So this
file checks the implementation against an independent re-implementation with numpy's wrapping
uint64/uint32 arithmetic (how C++ computes), pins a few values, and checks the BLAKE3 salt id
against the BLAKE3 reference vector for the empty input.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from connector.block_keys import (
    MASK64,
    block_hash_chain,
    cache_salt_id,
    chop_into_blocks,
    mix32,
    mix64,
    request_v1_hashes,
    v1_block_key,
    v1_block_keys,
)

U64 = np.uint64


def _np_mix32(value: int, seed: int) -> int:
    v = np.array([value & 0xFFFFFFFF], dtype=np.uint32)
    v = ((v >> np.uint32(16)) ^ v) * np.uint32(0x45D9F3B)
    v = ((v >> np.uint32(16)) ^ v) * np.uint32(0x45D9F3B)
    v = (v >> np.uint32(16)) ^ v
    v = v + np.uint32(0x9E3779B9)  # uint32 + uint32 wraps at 32 bits, as in C++
    s = np.array([seed], dtype=U64)
    return int((s ^ (v.astype(U64) + (s << U64(6)) + (s >> U64(2))))[0])


def _np_mix64(value: int, seed: int) -> int:
    v = np.array([value], dtype=U64)
    v = (v ^ (v >> U64(30))) * U64(0xBF58476D1CE4E5B9)
    v = (v ^ (v >> U64(27))) * U64(0x94D049BB133111EB)
    v = v ^ (v >> U64(31))
    s = np.array([seed], dtype=U64)
    return int((s ^ (v + U64(0x9E3779B9) + (s << U64(6)) + (s >> U64(2))))[0])


def _np_hash(tokens, parent, lora=None, salt=None) -> int:
    seed = int((np.array([len(tokens)], dtype=U64) ^ (np.array([parent], dtype=U64)
                                                      * U64(0xBF58476D1CE4E5B9)))[0])
    if parent == 0 and salt is not None:
        seed = _np_mix64(salt, seed)
    for token in tokens:
        seed = _np_mix32(token, seed)
    if lora is not None:
        seed = _np_mix64(lora, seed)
    return seed


def test_mixers_match_wrapping_uint64_arithmetic() -> None:
    rng = random.Random(0)
    for _ in range(300):
        value, seed = rng.getrandbits(64), rng.getrandbits(64)
        assert mix32(value, seed) == _np_mix32(value, seed)
        assert mix64(value, seed) == _np_mix64(value, seed)


def test_v1_block_key_matches_independent_implementation() -> None:
    rng = random.Random(1)
    for _ in range(200):
        tokens = [rng.randrange(0, 300_000) for _ in range(rng.choice([1, 4, 31, 32, 33]))]
        parent = rng.choice([0, rng.getrandbits(64)])
        lora = rng.choice([None, 0, rng.getrandbits(63)])
        salt = rng.choice([None, rng.getrandbits(64)])
        assert v1_block_key(tokens, parent, lora_task_id=lora, cache_salt_id=salt) == _np_hash(
            tokens, parent, lora, salt)


def test_pinned_vectors() -> None:
    block = list(range(1, 33))
    assert v1_block_key(block) == 17831341519058834317
    assert v1_block_key(block, cache_salt_id=cache_salt_id("tenant-A")) == 16072836395141370305
    assert v1_block_key(block, lora_task_id=7) == 15744835200463573885
    assert v1_block_key([5, 6, 7, 8], 12345678901234567890) == 6327288472448447255


def test_salt_id_is_blake3_first_8_bytes_little_endian() -> None:
    blake3_empty = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    assert cache_salt_id("") == int.from_bytes(bytes.fromhex(blake3_empty)[:8], "little")


def test_salt_enters_root_only_and_propagates_through_the_chain() -> None:
    tokens = list(range(100, 164))
    salt = cache_salt_id("tenant-A")
    assert v1_block_key(tokens[32:], 99, cache_salt_id=salt) == v1_block_key(tokens[32:], 99)
    plain, salted = block_hash_chain(tokens, 32), block_hash_chain(tokens, 32, cache_salt="tenant-A")
    assert plain[0] != salted[0] and plain[1] != salted[1]
    assert salted[1] == v1_block_key(tokens[32:], salted[0])


def test_lora_zero_is_mixed_and_values_above_2_63_occur() -> None:
    assert v1_block_key([1, 2, 3]) != v1_block_key([1, 2, 3], lora_task_id=0)
    hashes = block_hash_chain(list(range(4096)), 32)
    assert all(0 <= h <= MASK64 for h in hashes) and any(h >= 2**63 for h in hashes)


def test_chop_into_blocks_partial_rule() -> None:
    assert chop_into_blocks([1, 2, 3, 4, 5], 4, 64, allow_partial=True) == [[1, 2, 3, 4]]
    assert chop_into_blocks([1, 2, 3, 4, 5], 4, 64, allow_partial=False) == []
    assert chop_into_blocks(list(range(10)), 9, 4, allow_partial=False) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError):
        chop_into_blocks([1], 2, 4, allow_partial=True)


def test_v1_block_keys_is_the_chain_of_v1_block_key() -> None:
    """The one-pass chain (token terms in numpy) equals block after block of the reference."""
    rng = random.Random(2)
    tokens = [rng.randrange(0, 300_000) for _ in range(32 * 9 + 5)]
    for lora, salt in ((None, None), (3, None), (None, cache_salt_id("tenant-A"))):
        expected, parent = [], 0
        for start in range(0, 32 * 9, 32):
            parent = _np_hash(tokens[start : start + 32], parent, lora, salt)
            expected.append(parent)
        assert v1_block_keys(tokens, 32, 9, lora_task_id=lora, cache_salt_id=salt) == expected
        assert v1_block_keys(np.asarray(tokens), 32, 9, lora_task_id=lora, cache_salt_id=salt) == expected
        assert v1_block_keys(tokens[96:], 32, 3, parent_hash=expected[2], lora_task_id=lora,
                             cache_salt_id=salt) == expected[3:6]  # a chain continued: the salt only at the root
    assert v1_block_keys(tokens, 32, 0) == []
    with pytest.raises(ValueError, match="need more than"):
        v1_block_keys(tokens[:63], 32, 2)


def test_ids_outside_int64_and_negative_ids_hash_by_their_low_32_bits() -> None:
    """C++ truncates a token id to ``uint32_t``; ids numpy cannot hold as int64 take the scalar path."""
    assert v1_block_key([2**64 + 5, 7]) == v1_block_key([5, 7]) == _np_hash([5, 7], 0)
    assert v1_block_key([-1, 7]) == _np_hash([2**32 - 1, 7], 0)


def test_partial_last_block_and_request_fallback_use_the_same_chain() -> None:
    tokens = list(range(1000, 1100))
    chain = block_hash_chain(tokens, 32, allow_partial=True)
    assert chain[:3] == block_hash_chain(tokens, 32) and chain[3] == v1_block_key(tokens[96:], chain[2])

    class Request:  # TensorRT-LLM's LlmRequest as request_v1_hashes reads it
        lora_task_id, cache_salt_id, multimodal_hashes = None, cache_salt_id("s"), None

        def get_tokens(self, beam: int) -> list[int]:
            return tokens

    assert request_v1_hashes(Request(), 32, 2) == block_hash_chain(tokens[:64], 32, cache_salt="s")
