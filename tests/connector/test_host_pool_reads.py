"""vLLM's CPU attention keeps each layer's blocks one after another in host memory, so the worker reads
a donor layer straight into the target blocks and verifies its checksum there (one copy instead of
file → buffer → pool; ``SemKvWorker._read_into_pool``). What must not change: the blocks hold the
same bytes as the buffered path, and a layer whose bytes fail their check fails the whole plan
before that layer is released to attention (DESIGN §2 rules 3, 8; vLLM recomputes the plan's
blocks). Engine B's connector is built as the vLLM adapter builds it and driven in vLLM's call
order (tests/connector/test_failure_injection.py ``VllmOrder``), over per-layer contiguous views
like ``connector.vllm_connector.layer_views`` makes of vLLM's CPU tensors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from connector.namespace import KvLayout
from connector.worker import SemKvLoadError
from tests.connector.test_failure_injection import DOC, PROMPT, VllmOrder, donor_file
from tools.harness.fleet import MODEL, Fleet

TPB = MODEL.tokens_per_block


class HostPoolOrder(VllmOrder):
    """:class:`VllmOrder` over one contiguous ``[num_blocks, kv_factor, block_elems]`` tensor per
    layer (vLLM's CPU layout) instead of the harness's stacked pool; :attr:`in_place` records, per
    layer waited on, whether the plan was read straight into the pool."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(fleet)
        pool = self.pool.kv_cache  # [num_blocks, num_layers, kv_factor, block_elems]
        self.views = [torch.zeros_like(pool[:, layer]).contiguous() for layer in range(pool.shape[1])]
        self.worker.register_layer_views(self.views, KvLayout(pool.shape[1], pool.shape[2], pool.shape[3],
                                                              str(pool.dtype).removeprefix("torch.")))
        self.in_place: list[bool] = []
        original = self.wait

        def wait(layer: int, stream: Any) -> None:
            self.in_place.append(bool(self.worker._active) and self.worker._active[0].into_pool)
            original(layer, stream)

        self.wait = wait  # type: ignore[assignment]


@pytest.fixture
def donor(fleet: Fleet) -> Fleet:
    fleet.engine("A").generate(DOC)
    fleet.sync()
    return fleet


@pytest.fixture
def host_pool(donor: Fleet) -> Iterator[HostPoolOrder]:
    order = HostPoolOrder(donor)
    try:
        yield order
    finally:
        order.close()


@pytest.mark.parametrize("block_ids", [
    list(range(100, 100 + len(PROMPT) // TPB + 1)),  # one run of consecutive blocks
    [7, 8, 3, 40, 41, 42, 90, 12, 13, 60, 61, 30],  # fragmented: one read scattered over 6 runs
], ids=["one-run", "scattered"])
def test_a_host_pool_is_read_in_place_and_holds_the_bytes_the_buffered_path_copies(
        donor: Fleet, host_pool: HostPoolOrder, block_ids: list[int]) -> None:
    assert host_pool.run(block_ids=block_ids) == list(range(MODEL.num_layers))
    assert host_pool.in_place == [True] * MODEL.num_layers
    assert host_pool.worker.metrics.value("semkv_exact_materialized_total") == 1
    buffered = VllmOrder(donor)  # the harness's stacked pool: a layer's blocks are strided, read via a buffer
    try:
        assert buffered.run(rid=2, block_ids=block_ids) == list(range(MODEL.num_layers))
        assert buffered.worker.metrics.value("semkv_exact_materialized_total") == 1
        targets = block_ids[: len(DOC) // TPB]  # the DOC's blocks
        for layer, view in enumerate(host_pool.views):
            expected = buffered.pool.kv_cache[targets, layer]
            assert expected.abs().sum() > 0  # real K/V, not zeros on both sides
            assert torch.equal(view[targets], expected)
        untouched = [b for b in range(host_pool.views[0].shape[0]) if b not in targets]
        assert all(not view[untouched].any() for view in host_pool.views)  # nothing written past the targets
    finally:
        buffered.close()


def test_a_layer_changed_in_the_file_after_the_open_fails_the_plan_before_its_release(
        donor: Fleet, host_pool: HostPoolOrder) -> None:
    """A write into the entry in place (same inode, same size) after the plan shipped: layer 0 is
    intact and released, layer 1's bytes land in the target blocks and fail their checksum there,
    so layer 1 is never released and the plan fails (vLLM recomputes its blocks)."""
    path = donor_file(donor)

    def corrupt_layer_1() -> None:
        data_offset = _data_offset(path)
        layer_bytes = (path.stat().st_size - data_offset) // MODEL.num_layers
        offset = data_offset + layer_bytes + 3  # inside layer 1's first donor block
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))

    released: list[int] = []
    original = host_pool.wait

    def wait(layer: int, stream: Any) -> None:
        original(layer, stream)
        released.append(layer)

    host_pool.wait = wait  # type: ignore[assignment]
    with pytest.raises(SemKvLoadError, match="checksum_mismatch") as caught:
        host_pool.run(after_meta=corrupt_layer_1)
    assert caught.value.layer_idx == 1 and released == [0]
    assert host_pool.in_place == [True, True]  # layer 1 was read in place, then refused
    host_pool.assert_failed("checksum_mismatch")


def _data_offset(path: Path) -> int:
    """Where an entry's data starts: magic, header length (u32 LE), header, zero padding to 4096."""
    raw = path.read_bytes()[:12]
    header_len = int.from_bytes(raw[8:12], "little")
    return -(-(12 + header_len) // 4096) * 4096
