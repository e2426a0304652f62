"""The caller's block hashes to live-index keys in one pass (connector.placement.advice.engine_hash_keys)
equal the two-pass form (canonical hashes, then index keys) and refuse what it refuses."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.placement.advice import canonical_hashes, engine_hash_keys
from ledger.live_index import index_keys

_HASH = st.one_of(st.integers(min_value=-(2**63), max_value=2**64 - 1),
                  st.binary(min_size=32, max_size=32).map(bytes.hex),
                  st.binary(min_size=32, max_size=32))


@settings(deadline=None)  # Hypothesis' default 200 ms per example fails on a loaded CI machine
@given(st.lists(_HASH, max_size=64))
def test_one_pass_equals_canonical_then_index_keys(hashes: list) -> None:
    keys = engine_hash_keys(hashes)
    assert [k if isinstance(k, tuple) else int(k) for k in keys] == index_keys(canonical_hashes(hashes))


@pytest.mark.parametrize("bad", [2**64, -(2**63) - 1, True, False, "zz", "ab" * 31, b"\x00" * 31, 1.5])
def test_refuses_what_canonical_hashes_refuses(bad: object) -> None:
    with pytest.raises(ValueError):
        canonical_hashes([bad])
    for others in ([1], [2**63], [-5]):  # every fast path: unsigned, signed
        with pytest.raises(ValueError):
            engine_hash_keys([*others, bad])



@settings(deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=64))
def test_a_64_bit_array_equals_the_list_of_its_hashes_and_other_arrays_are_refused(hashes: list[int]) -> None:
    unsigned = np.array(hashes, dtype="<u8")
    expected = index_keys(canonical_hashes(hashes))
    for array in (unsigned, unsigned.view("<i8"), unsigned.astype(">u8")):
        assert canonical_hashes(array) == canonical_hashes(hashes)
        assert engine_hash_keys(array).tolist() == expected
    for bad in (unsigned.astype(np.uint32), unsigned.astype(np.float64), unsigned.reshape(1, -1)):
        with pytest.raises(ValueError):
            engine_hash_keys(bad)
        with pytest.raises(ValueError):
            canonical_hashes(bad)
