"""Dynamo's block hashes (connector.block_keys.dynamo_block_hashes) against Dynamo's own reference values.

ai-dynamo/dynamo's guide "KV Events & Hashing Consistency" gives the reference test vector: tokens
``[1, 2, 3, 4]`` with ``kv_block_size = 4`` hash to ``14643705804678351452`` (xxh3-64, seed 1337,
u32 little-endian tokens). Later blocks chain as xxh3-64(le64(parent) || le64(local)), seed 1337
(the mocker's ``compute_next_sequence_hash``).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from connector.block_keys import dynamo_block_hashes


def test_dynamos_reference_vector() -> None:
    assert dynamo_block_hashes([1, 2, 3, 4], 4) == [14643705804678351452]


def test_later_blocks_chain_on_the_parents_sequence_hash_and_partial_blocks_have_none() -> None:
    tokens = list(range(1000, 1000 + 3 * 4 + 2))  # 3 full blocks and 2 tokens
    local = [xxhash.xxh3_64_intdigest(struct.pack("<4I", *tokens[i : i + 4]), 1337) for i in (0, 4, 8)]
    second = xxhash.xxh3_64_intdigest(struct.pack("<QQ", local[0], local[1]), 1337)
    third = xxhash.xxh3_64_intdigest(struct.pack("<QQ", second, local[2]), 1337)
    assert dynamo_block_hashes(tokens, 4) == [local[0], second, third]
    assert dynamo_block_hashes(tokens[:3], 4) == []


@pytest.mark.parametrize("tokens", [[-1, 2, 3, 4], [2**32, 2, 3, 4]])
def test_token_ids_outside_u32_are_refused(tokens: list[int]) -> None:
    with pytest.raises(ValueError, match="u32"):
        dynamo_block_hashes(tokens, 4)



@pytest.mark.parametrize("dtype", ["<u4", ">u4", "<i8", "<u8", "<i4", "<u2"])
def test_an_integer_array_hashes_as_the_list_of_its_ids_and_other_arrays_are_refused(dtype: str) -> None:
    tokens = [(7919 * i) % 60_000 for i in range(5 * 16 + 9)]  # 5 full blocks and a partial one
    assert dynamo_block_hashes(np.array(tokens, dtype=dtype), 16) == dynamo_block_hashes(tokens, 16)
    strided = np.array(tokens * 2, dtype=dtype)[::2]  # not contiguous: copied, same ids
    assert dynamo_block_hashes(strided, 16) == dynamo_block_hashes(tokens[::2] + tokens[1::2], 16)[: len(strided) // 16]
    assert dynamo_block_hashes(np.array([], dtype=dtype), 16) == []
    for bad in (np.array([-1, 2, 3, 4], dtype=np.int64), np.array([2**32, 2, 3, 4], dtype=np.uint64),
                np.array([1.0, 2, 3, 4]), np.array([[1, 2], [3, 4]], dtype=dtype)):
        with pytest.raises(ValueError):
            dynamo_block_hashes(bad, 4)
