"""The live index's numpy block table (``ledger.block_table.BlockKeyTable``) answers as a dict of
sets would, through random adds, removals and slot clears: keys crowded into few rows (a table
started at 8 rows, so long probe runs, deleted rows to probe past, rebuilds and growth), the
extreme int64 values, slots past the first 64-bit word. And ``ledger.live_index._leading_counts`` (each
slot's run of leading keys) equals a walk key by key."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.block_table import BlockKeyTable
from ledger.live_index import _leading_counts

_POOL = [-(2**63), -(2**63) + 1, -1, 0, 1, 2**63 - 1] + [1024 * i for i in range(1, 40)] + list(range(2, 30))
# the table's own state, not a reserved key, marks empty rows: every int64 value must be storable
_KEYS = st.lists(st.sampled_from(_POOL), max_size=24)
_SLOTS = st.sampled_from([0, 1, 2, 63, 64, 130])
_OPS = st.lists(st.tuples(st.sampled_from(["add", "remove", "clear"]), _SLOTS, _KEYS), max_size=40)


def _masks(held: dict[int, set[int]], keys: list[int], words: int) -> np.ndarray:
    out = np.zeros((len(keys), words), dtype=np.uint64)
    for i, key in enumerate(keys):
        for slot in held.get(key, ()):
            out[i, slot // 64] |= np.uint64(1 << (slot % 64))
    return out


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_the_table_holds_what_a_dict_of_sets_holds(ops: list[tuple[str, int, list[int]]]) -> None:
    table, held = BlockKeyTable(capacity=8), {}
    for op, slot, keys in ops:
        array = np.array(keys, dtype=np.int64)
        if op == "add":
            table.add(array, slot)
            for key in keys:
                held.setdefault(key, set()).add(slot)
        elif op == "remove":
            table.remove(array, slot)
            for key in keys:
                held.get(key, set()).discard(slot)
        else:
            table.clear(slot)
            for slots in held.values():
                slots.discard(slot)
        found = table.masks_of(np.array(_POOL, dtype=np.int64))
        assert (found == _masks(held, _POOL, found.shape[1])).all()
        for s in (0, 1, 2, 63, 64, 130):
            assert table.count(s) == sum(s in slots for slots in held.values())
    assert (table.state == 1).sum() == sum(bool(slots) for slots in held.values())  # emptied keys deleted


def test_growth_keeps_every_key() -> None:
    table = BlockKeyTable()
    keys = np.random.default_rng(5).integers(-(2**63), 2**63 - 1, size=50_000, dtype=np.int64)
    table.add(keys[:30_000], 3)
    table.add(keys[20_000:], 70)
    assert table.capacity >= 2 * 50_000
    masks = table.masks_of(keys)
    assert (masks[:20_000, 0] == 1 << 3).all() and (masks[:20_000, 1] == 0).all()
    assert (masks[20_000:30_000, 0] == 1 << 3).all() and (masks[20_000:30_000, 1] == 1 << 6).all()
    assert (masks[30_000:, 0] == 0).all() and (masks[30_000:, 1] == 1 << 6).all()
    assert (table.count(3), table.count(70), table.total()) == (30_000, 30_000, 60_000)
    absent = np.setdiff1d(np.arange(-5_000, 5_000, dtype=np.int64), keys)
    assert (table.find(absent) == -1).all()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0, 1, 5, 63, 64, 100]), max_size=6), max_size=30))
def test_leading_counts_equal_a_walk(rows: list[list[int]]) -> None:
    masks = np.zeros((len(rows), 2), dtype=np.uint64)
    for i, slots in enumerate(rows):
        for slot in slots:
            masks[i, slot // 64] |= np.uint64(1 << (slot % 64))
    walked = {}
    for slot in {s for slots in rows for s in slots}:
        run = 0
        while run < len(rows) and slot in rows[run]:
            run += 1
        if run:
            walked[slot] = run
    assert _leading_counts(masks) == walked
