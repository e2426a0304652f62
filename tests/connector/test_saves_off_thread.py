"""Donor saves off the engine's thread (issue 25): the engine's thread only queues a donor's copy
out of the KV pool; ``get_finished`` reports the request — and TensorRT-LLM frees its blocks — only
once the side worker's copy has completed; what it saved is the pool's bytes; failed, dropped and
cancelled saves hold no block; ``discovery_only`` saves only when ``save_in_discovery_only``.

The side worker is held back with a gate on its host buffers (the copy takes a buffer before it
reads a block), so these tests order events without timing them.
"""

from __future__ import annotations

import threading

import torch

from connector.harness import LlmRequest
from connector.namespace import content_keys
from connector.plan import SaveInstruction
from connector.save_copies import HostBuffers, SaveCopy, copy_blocks
from ledger.client import LedgerClient
from tools.bench_connector import _saved_donors
from tools.harness.fleet import MODEL, Engine, Fleet, doc_tokens

TPB = MODEL.tokens_per_block
DOC = doc_tokens(6 * TPB, seed=71)
OTHER = doc_tokens(3 * TPB, seed=72)


class GatedBuffers(HostBuffers):
    """Host buffers whose ``take`` (the start of every side copy) waits for ``gate``; ``fail`` makes
    it raise instead (a copy that fails)."""

    def __init__(self) -> None:
        super().__init__(pinned=False)
        self.gate, self.fail, self.taken = threading.Event(), False, 0

    def take(self, nbytes: int) -> torch.Tensor:
        self.taken += 1
        assert self.gate.wait(120), "test gate never opened"
        if self.fail:
            raise RuntimeError("injected copy failure")
        return super().take(nbytes)


def gated(engine: Engine) -> GatedBuffers:
    buffers = GatedBuffers()
    worker = engine.worker
    assert worker.copier is not None  # save_copy = "side", the default
    worker.host_buffers = worker.copier.buffers = buffers
    return buffers


def reported_ids(engine: Engine, buffers: GatedBuffers) -> list[tuple[list[int], bool]]:
    """Every ``after_get_finished`` that reported ids: the ids, and whether the gate was open then."""
    seen: list[tuple[list[int], bool]] = []
    engine.llm.add_lifecycle_observer(
        lambda point, ids: seen.append((ids, buffers.gate.is_set())) if point == "after_get_finished" and ids else None)
    return seen


def saved_layers(fleet: Fleet, engine: Engine) -> list[tuple[str, list[torch.Tensor]]]:
    """Each live donor of ``engine``: its id and the bytes its store entry holds, per layer."""
    out = []
    store = engine.worker.store
    for donor_id, ref, checksum in _saved_donors(fleet.db, engine.engine_id):
        reader = store.open(ref, checksum)
        try:
            h = reader.header
            out.append((donor_id, [torch.frombuffer(bytearray(reader.read_layer(layer)), dtype=torch.float32)
                                   .view(h.num_blocks, h.kv_factor, h.block_elems) for layer in range(h.num_layers)]))
        finally:
            reader.close()
    return out


def pool_layers(engine: Engine, block_ids: list[int]) -> list[torch.Tensor]:
    kv = engine.llm.kv_cache  # [num_blocks, num_layers, kv_factor, block_elems]
    ids = torch.tensor(block_ids, dtype=torch.long)
    return [kv[ids, layer].clone() for layer in range(kv.shape[1])]


def test_a_donor_is_reported_only_once_its_copy_completed_and_saves_the_pools_bytes(fleet: Fleet) -> None:
    a = fleet.engine("A")
    buffers = gated(a)
    seen, llm = reported_ids(a, buffers), a.llm
    donor = llm.submit(DOC, 1)
    companion = llm.submit(OTHER, 12)  # live for 11 more iterations: TensorRT-LLM calls get_finished again
    while not llm._loop.runs[donor].done:
        llm.step()
    expected = pool_layers(a, llm.result(donor).block_ids[: len(DOC) // TPB])
    for _ in range(5):  # the copy is queued, the gate shut: the engine goes on, the donor's blocks stay held
        assert llm.pending_transfers() == [donor]
        assert llm.step()
    assert buffers.taken == 1 and not buffers.gate.is_set()
    assert not any(donor in ids for ids, _ in seen)
    assert llm.active_request_ids() == [companion]
    buffers.gate.set()
    while llm.pending_transfers():
        assert llm.step(), "the companion ended before the donor's copy was reported"
    assert [gate_open for ids, gate_open in seen if donor in ids] == [True]
    assert a.worker.save_wait_seconds == 0.0  # the companion live every time: get_finished never waited
    llm.run_until_idle()
    a.settle()
    [(_, layers)] = [d for d in saved_layers(fleet, a) if d[1][0].shape[0] == len(DOC) // TPB]
    assert all(torch.equal(got, want) for got, want in zip(layers, expected, strict=True))
    assert a.metrics.value("semkv_donor_saves_total", outcome="saved") == 2  # the donor and its companion


def test_an_engine_about_to_idle_waits_for_the_copy_in_get_finished(fleet: Fleet) -> None:
    """TensorRT-LLM's loop blocks once nothing is active and calls no hook, so the last donor's copy is
    waited for in the ``get_finished`` of the iteration that finished it (``pending_transfers`` empty
    at once, the existing lifecycle test's demand); it is still reported only after the copy."""
    a = fleet.engine("A")
    buffers = gated(a)
    seen = reported_ids(a, buffers)
    opener = threading.Thread(target=buffers.gate.set)  # another thread: the engine's waits in get_finished
    a.llm.add_lifecycle_observer(lambda point, ids: opener.start() if point == "after_request_finished" else None)
    result = a.llm.generate(DOC)
    opener.join()
    assert a.llm.pending_transfers() == [] and a.llm.active_request_ids() == []
    assert seen == [([result.request_id], True)]  # reported in the iteration that finished it, once copied
    a.settle()
    [(_, layers)] = saved_layers(fleet, a)
    assert all(torch.equal(got, want) for got, want in
               zip(layers, pool_layers(a, result.block_ids[: len(DOC) // TPB]), strict=True))


def test_a_failed_copy_releases_the_blocks_and_saves_nothing(fleet: Fleet) -> None:
    a = fleet.engine("A")
    buffers = gated(a)
    buffers.fail = True
    buffers.gate.set()
    a.generate(DOC)
    assert a.llm.pending_transfers() == []
    assert a.llm.kv_cache_manager.num_available_blocks() == a.llm.kv_cache_manager.num_blocks
    assert a.metrics.value("semkv_donor_saves_total", outcome="failed") == 1
    assert a.metrics.value("semkv_donor_saves_total", outcome="saved") == 0
    assert _saved_donors(fleet.db, "A") == []


def test_saves_beyond_the_queue_are_dropped_and_release_their_blocks_at_once(fleet: Fleet) -> None:
    a = fleet.engine("A", save_queue_max=1)
    buffers = gated(a)
    llm = a.llm
    first, second = llm.submit(DOC, 1), llm.submit(doc_tokens(4 * TPB, seed=73), 1)
    companion = llm.submit(OTHER, 8)
    while not (llm._loop.runs[first].done and llm._loop.runs[second].done):
        llm.step()
    llm.step()
    assert llm.pending_transfers() == [first]  # the second found the queue full: nothing reads its blocks
    assert a.metrics.value("semkv_donor_saves_total", outcome="queue_full") == 1
    buffers.gate.set()
    llm.run_until_idle()
    a.settle()
    assert llm.pending_transfers() == [] and llm.result(companion).token_ids
    assert llm.kv_cache_manager.num_available_blocks() == llm.kv_cache_manager.num_blocks


def test_a_cancelled_donor_holds_no_block_and_leaves_no_copy(fleet: Fleet) -> None:
    a = fleet.engine("A")
    buffers = gated(a)
    llm = a.llm
    rid = llm.submit(DOC, 20)
    while not llm._loop.runs[rid].req.output_token_ids:  # prefill done, decoding
        llm.step()
    llm.cancel(rid)
    llm.run_until_idle()
    assert llm.pending_transfers() == [] and buffers.taken == 0  # no request_finished: no save, no copy
    assert llm.kv_cache_manager.num_available_blocks() == llm.kv_cache_manager.num_blocks
    assert a.worker.flush(5)
    buffers.gate.set()


def test_the_engine_thread_copy_saves_the_same_bytes(fleet: Fleet) -> None:
    a = fleet.engine("A", save_copy="engine_thread")
    assert a.worker.copier is None
    result = a.generate(DOC)
    assert a.worker.save_wait_seconds == 0.0
    [(_, layers)] = saved_layers(fleet, a)
    assert all(torch.equal(got, want) for got, want in
               zip(layers, pool_layers(a, result.block_ids[: len(DOC) // TPB]), strict=True))


def test_discovery_only_saves_only_when_set(fleet: Fleet) -> None:
    b = fleet.engine("B", mode="discovery_only")
    b.generate(DOC)
    assert b.llm.pending_transfers() == [] and _saved_donors(fleet.db, "B") == []
    ledger = LedgerClient(fleet.db)
    try:
        ns = b.scheduler.namespace.for_request(LlmRequest(0, list(DOC), 1))
        assert ledger.donors_for_key(ns.digest, content_keys(ns, DOC, TPB, 1)[0]) == []  # not even registered
    finally:
        ledger.close()
    b = fleet.engine("B", mode="discovery_only", save_in_discovery_only=True)
    result = b.generate(DOC)
    [(_, layers)] = saved_layers(fleet, b)
    assert all(torch.equal(got, want) for got, want in
               zip(layers, pool_layers(b, result.block_ids[: len(DOC) // TPB]), strict=True))


def test_copy_blocks_reads_strided_layer_views_and_buffers_are_reused() -> None:
    pool = torch.randn(16, 3, 2, 40)  # [num_blocks, num_layers, kv_factor, block_elems]: per-layer views are strided
    views = [pool[:, layer] for layer in range(3)]
    buffers = HostBuffers(pinned=False)
    instruction = SaveInstruction(request_id=1, donor_id="d", block_ids=(9, 2, 14, 5), num_blocks=3,
                                  tokens_per_block=TPB, namespace="ns", layout="l")
    first = SaveCopy(1, instruction, views, 0.0)
    copy_blocks(first, buffers)
    ids = torch.tensor([9, 2, 14])
    for layer, got in enumerate(first.layers or []):
        assert torch.equal(torch.frombuffer(bytearray(got), dtype=torch.float32).view(3, 2, 40), pool[ids, layer])
    buffers.give(first.buffer)
    second = SaveCopy(2, instruction, views, 0.0)
    copy_blocks(second, buffers)
    assert second.buffer is first.buffer and buffers.allocated == 1


def test_host_buffers_of_several_sizes_are_taken_by_fit_and_dropped_smallest_first() -> None:
    buffers = HostBuffers(pinned=False, keep=2)
    small, large = buffers.take(10), buffers.take(5 << 20)
    buffers.give(small)
    buffers.give(large)
    assert buffers.take(3 << 20) is large and buffers.take(1) is small  # the smallest that fits
    third = buffers.take(2 << 20)
    for buf in (small, large, third):
        buffers.give(buf)
    assert buffers.take(5 << 20) is large and buffers.take(2 << 20) is third and buffers.allocated == 3
