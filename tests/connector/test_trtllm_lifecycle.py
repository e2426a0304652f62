"""The connector through TensorRT-LLM's executor as its source says it runs, per version.

Each scenario runs on every version model of the reference engine harness
(:mod:`connector.harness.trtllm_versions`): the 1.x module with its AsyncTransferManager-era
executor, the 2026 main module with the newest executor (both call ``request_finished`` only on
normal completion), and the earlier executor that calls it on every exit. The harness stops the
executor on any exception from a hook TensorRT-LLM calls outside the forward's try, so every test
here that completes also shows the connector raised into none of them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from connector.harness import KvCacheConfig, LlmRequest, block_hash_chain
from connector.harness.trtllm_versions import TRTLLM_VERSIONS, TrtllmVersion
from connector._trtllm import SchedulerOutput
from connector.namespace import content_keys, prefix_keys
from connector.promises import RequestState
from ledger.client import LedgerClient
from tools.harness.fleet import MODEL, Engine, Fleet, doc_tokens
from tests.connector.test_two_engines import native_engine

TPB = MODEL.tokens_per_block
DOC = doc_tokens(10 * TPB, seed=61)  # 320 tokens: the donor's prefill runs in 2 chunks of at most 256
PROMPT = DOC + doc_tokens(20, seed=62)
ORPHAN_TIMEOUT_S = 2.0
"""``request_orphan_timeout_s`` of the recipient in the leak scenarios (released within 1.25x it):
long enough that a loaded machine does not reach it between one request's hooks (0.4 s left little margin)."""


@pytest.fixture(params=TRTLLM_VERSIONS, ids=lambda v: v.name)
def version(request: pytest.FixtureRequest) -> TrtllmVersion:
    return request.param


@pytest.fixture
def fleet(tmp_path) -> Iterator[Fleet]:  # noqa: ANN001
    """A, B and C: C a second recipient."""
    f = Fleet(tmp_path, ("A", "B", "C")).start()
    try:
        yield f
    finally:
        f.stop()


def reference_logits(prompt: list[int]) -> torch.Tensor:
    """The prompt's prefill logits with the engine's own reuse of DOC (bit-identical target)."""
    native = native_engine()
    native.generate(DOC, 1)
    return native.generate(prompt, 1).prefill_logits


def donor(fleet: Fleet, version: TrtllmVersion) -> Engine:
    a = fleet.engine("A", version=version)
    a.generate(DOC)
    fleet.sync()
    return a


def nothing_held(fleet: Fleet, engine: Engine) -> bool:
    """No promise, pin, secured entry, ledger lease or request state left in the engine's connector."""
    engine.scheduler.flush()
    return (engine.metrics.value("semkv_leases_held") == 0 and fleet.held_leases() == 0
            and not engine.scheduler.promises.requests and engine.scheduler.store.handed_over() == 0
            and not engine.scheduler.store._pins)


def wait_until(condition, timeout_s: float) -> float:  # noqa: ANN001
    """Seconds until ``condition()`` held; fails past ``timeout_s``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "condition not reached in time"
        time.sleep(0.02)
    return time.monotonic() - started


def test_a_chunked_donor_materializes_bit_identical_and_nothing_stays_held(fleet: Fleet, version) -> None:
    donor(fleet, version)
    b = fleet.engine("B", version=version)
    got = b.generate(PROMPT)
    assert got.num_connector_tokens == len(DOC) and b.llm.stopped is None
    assert torch.equal(got.prefill_logits, reference_logits(PROMPT))
    assert b.metrics.value("semkv_exact_materialized_total") == 1
    assert b.metrics.value("semkv_stale_after_promise_total", reason="ledger_error") == 0
    assert nothing_held(fleet, b)


def test_an_idle_engine_saves_its_donor_without_another_request(fleet: Fleet, version) -> None:
    """TensorRT-LLM calls no hook once its last request finished (its loop blocks): the donor is
    gathered in the ``get_finished`` of the iteration that finished the request."""
    a = fleet.engine("A", version=version)
    a.llm.generate(DOC)  # and then nothing: the engine is idle
    assert a.llm.pending_transfers() == [] and a.llm.active_request_ids() == []
    assert a.llm.step() is False  # blocked: no iteration, no connector call
    assert a.worker.flush()  # the background writer, not an engine iteration
    ledger = LedgerClient(fleet.db)
    try:
        [saved] = ledger.donors_for_key(a.scheduler.namespace.for_request(_request(DOC)).digest, _first_key(a, DOC))
        assert saved.store_ref is not None
    finally:
        ledger.close()
    fleet.sync()
    assert fleet.engine("B", version=version).generate(PROMPT).num_connector_tokens == len(DOC)


def test_a_request_cancelled_after_its_promise_releases_everything(fleet: Fleet, version) -> None:
    donor(fleet, version)
    b = fleet.engine("B", version=version, request_orphan_timeout_s=ORPHAN_TIMEOUT_S)
    rid = b.llm.submit(PROMPT, max_new_tokens=8)
    b.llm.add_lifecycle_observer(
        lambda point, ids: b.llm.cancel(rid) if point == "after_build_connector_meta" and rid in ids else None)
    b.llm.run_until_idle()
    assert b.llm.result(rid).finish_reason == "cancelled" and b.llm.stopped is None
    assert b.metrics.value("semkv_exact_materialized_total") == 1, b.misses()  # loaded before the forward it was cancelled after
    if version.request_finished_on_every_termination:
        assert nothing_held(fleet, b)  # request_finished released it at once
        return
    assert b.metrics.value("semkv_leases_held") == 1  # the executor dropped it without a word ...
    took = wait_until(lambda: nothing_held(fleet, b), 30.0)  # ... the reaper did not
    assert took <= 1.25 * ORPHAN_TIMEOUT_S + 1.5  # the reaper runs every quarter timeout (+ a loaded machine's slack)
    assert b.metrics.value("semkv_orphaned_requests_total") == 1


def test_a_forward_error_fails_the_batch_and_nothing_leaks(fleet: Fleet, version) -> None:
    """A failure inside the forward that is not the connector's (``_handle_errors`` fails every
    active request): the connector's blocks held verified bytes, and what the request held is
    released — by ``request_finished`` where the executor calls it, else by the reaper."""
    donor(fleet, version)
    b = fleet.engine("B", version=version, request_orphan_timeout_s=ORPHAN_TIMEOUT_S)
    forward, failures = b.llm.model.forward_paged_batch, []

    def failing_forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if not failures:
            failures.append(1)
            raise RuntimeError("injected: CUDA error in the forward")
        return forward(*args, **kwargs)

    b.llm.model.forward_paged_batch = failing_forward  # type: ignore[method-assign]
    other = b.llm.submit(doc_tokens(3 * TPB, seed=63), max_new_tokens=2)
    with pytest.raises(Exception, match="injected"):
        b.generate(PROMPT)
    with pytest.raises(Exception, match="injected"):
        b.llm.result(other)  # every active request of the batch failed
    assert b.llm.stopped is None
    wait_until(lambda: nothing_held(fleet, b), 30.0)
    # the failed request's blocks went into the reuse tree (TensorRT-LLM stores them on release);
    # the connector's are verified donor bytes, equal to the engine's own computation of DOC
    native = native_engine()
    native.generate(DOC, 1)
    native.generate(PROMPT, 1)
    doc_hashes = block_hash_chain(DOC, TPB)
    assert set(doc_hashes) <= set(b.llm.kv_cache_manager.stored_block_hashes())
    for block_hash in doc_hashes:
        assert torch.equal(b.llm.kv_cache_manager.read_stored_block(block_hash),
                           native.kv_cache_manager.read_stored_block(block_hash))
    assert b.generate(PROMPT).num_reused_tokens == len(DOC)  # and the engine goes on


def test_two_requests_in_one_batch_one_materialized_one_cold(fleet: Fleet, version) -> None:
    donor(fleet, version)
    b = fleet.engine("B", version=version)
    cold_prompt = doc_tokens(5 * TPB + 3, seed=64)
    hit, cold = b.llm.submit(PROMPT), b.llm.submit(cold_prompt)
    b.llm.run_until_idle()
    assert b.llm.result(hit).num_connector_tokens == len(DOC) and b.llm.result(cold).num_connector_tokens == 0
    assert torch.equal(b.llm.result(hit).prefill_logits, reference_logits(PROMPT))
    dense = b.llm.model.forward_dense(cold_prompt)
    assert torch.allclose(b.llm.result(cold).prefill_logits, dense, rtol=1e-4, atol=1e-4)
    assert nothing_held(fleet, b)


ABANDONED = doc_tokens(12 * TPB + 5, seed=65)


def abandon_prefill(fleet: Fleet, version: TrtllmVersion, how: str, *, partial_reuse: bool = False) -> Engine:
    """Engine A, whose prefill of ``ABANDONED`` (3 chunks of 4 blocks) ends after its first chunk:
    cancelled after that forward, or failed by an exception in the second forward."""
    kvc = KvCacheConfig(tokens_per_block=TPB, event_buffer_max_size=4096, max_tokens=4 * MODEL.max_context,
                        enable_partial_reuse=partial_reuse)
    a = fleet.engine("A", version=version, max_num_tokens=4 * TPB, kv_cache_config=kvc)
    rid = a.llm.submit(ABANDONED, max_new_tokens=2)
    forwards: list[int] = []
    if how == "cancelled":
        a.llm.add_lifecycle_observer(lambda at, ids: (forwards.append(1), a.llm.cancel(rid))
                                     if at == "after_forward" and rid in ids and not forwards else None)
    else:
        forward = a.llm.model.forward_paged_batch

        def second_chunk_fails(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            forwards.append(1)
            if len(forwards) == 2:
                raise RuntimeError("injected: CUDA error in the forward")
            return forward(*args, **kwargs)

        a.llm.model.forward_paged_batch = second_chunk_fails  # type: ignore[method-assign]
    a.llm.run_until_idle()
    if how == "cancelled":
        assert a.llm.result(rid).finish_reason == "cancelled"
    else:
        with pytest.raises(RuntimeError, match="injected"):
            a.llm.result(rid)
        a.llm.model.forward_paged_batch = forward  # type: ignore[method-assign]
    return a


def assert_nothing_spread(fleet: Fleet, version: TrtllmVersion, a: Engine, prompt: list[int],
                          verified_tokens: int = 0) -> None:
    """Engine C, after A's donors reached the ledger, gets from A at most the ``verified_tokens`` of
    ``prompt`` a real donor computed, and its prompt's logits equal a dense forward's."""
    a.settle()
    fleet.sync()
    c = fleet.engine("C", version=version)
    full = prompt + doc_tokens(30, seed=66)
    got = c.generate(full)
    assert got.num_connector_tokens == verified_tokens
    dense = c.llm.model.forward_dense(full)
    assert torch.allclose(got.prefill_logits, dense[got.prefill_start:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("partial_reuse", [False, True], ids=["whole_blocks", "partial_reuse"])
@pytest.mark.parametrize("how", ["cancelled", "forward_error"])
def test_blocks_an_abandoned_prefill_left_uncomputed_never_become_a_donor(fleet: Fleet, version, how: str,
                                                                          partial_reuse: bool) -> None:
    """TensorRT-LLM stores a request's blocks for reuse when it ends mid-prefill, computed or not; its
    engine's next request with that prefix reuses them (TensorRT-LLM's own doing, on that engine).
    That request must not become a donor, or the garbage would reach every engine of the fleet. With
    partial reuse (TensorRT-LLM's default) the stored partial last block is reused too: the device
    match is not block-aligned."""
    a = abandon_prefill(fleet, version, how, partial_reuse=partial_reuse)
    again = a.llm.generate(ABANDONED)  # TensorRT-LLM reuses the blocks the abandoned prefill stored
    assert again.num_reused_tokens == (len(ABANDONED) - 1 if partial_reuse else 12 * TPB)
    assert a.metrics.value("semkv_donors_not_registered_total", reason="unverified_blocks") == 1
    assert_nothing_spread(fleet, version, a, ABANDONED)


def test_a_partial_hit_on_a_block_an_abandoned_prefill_left_is_no_donor(fleet: Fleet, version) -> None:
    """Partial reuse copies the leading tokens of the CHILD that matches best, whose key is not the
    new request's: the guard knows it by its parent. A request whose whole-block reuse stops at the
    computed chunk is a donor as usual."""
    a = abandon_prefill(fleet, version, "forward_error", partial_reuse=True)  # blocks 0-3 computed
    computed_only = ABANDONED[: 4 * TPB] + doc_tokens(5 * TPB, seed=67)
    assert a.llm.generate(computed_only).num_reused_tokens == 4 * TPB
    assert a.metrics.value("semkv_donors_not_registered_total", reason="unverified_blocks") == 0
    into_garbage = ABANDONED[: 4 * TPB + 3] + doc_tokens(5 * TPB, seed=68)  # 3 tokens into block 4
    assert a.llm.generate(into_garbage).num_reused_tokens == 4 * TPB + 3
    assert a.metrics.value("semkv_donors_not_registered_total", reason="unverified_blocks") == 1
    assert_nothing_spread(fleet, version, a, into_garbage, verified_tokens=4 * TPB)  # computed_only's blocks


def _request(tokens: list[int]) -> LlmRequest:
    return LlmRequest(0, list(tokens), 1)


def _first_key(engine: Engine, tokens: list[int]) -> bytes:
    ns = engine.scheduler.namespace.for_request(_request(tokens))
    return content_keys(ns, tokens, TPB, 1)[0]


def test_a_block_built_on_a_partial_hit_of_garbage_never_becomes_a_donor(fleet: Fleet, version) -> None:
    """A partial hit copies the garbage leading tokens of an abandoned block into a block of the
    request's OWN, stored under its own key when it ends. That request is refused as a donor, and so
    is a later one that reuses its blocks whole (a key no abandoned prefill had)."""
    a = abandon_prefill(fleet, version, "forward_error", partial_reuse=True)  # blocks 0-3 computed
    into_garbage = ABANDONED[: 4 * TPB + 3] + doc_tokens(5 * TPB, seed=68)  # 3 tokens into block 4
    assert a.llm.generate(into_garbage).num_reused_tokens == 4 * TPB + 3
    assert a.metrics.value("semkv_donors_not_registered_total", reason="unverified_blocks") == 1
    on_top = into_garbage + doc_tokens(2 * TPB, seed=69)
    assert a.llm.generate(on_top).num_reused_tokens >= 9 * TPB  # into_garbage's blocks, block 4 included
    assert a.metrics.value("semkv_donors_not_registered_total", reason="unverified_blocks") == 2
    assert_nothing_spread(fleet, version, a, on_top)


def test_a_partial_hit_on_an_abandoned_partial_last_block_alone_is_no_donor(fleet: Fleet, version) -> None:
    """The prefill fails in its LAST chunk (blocks 0-11 computed): all it leaves uncomputed is the
    partial block 12 (of ``tokens[:-1]``), known only by its parent; a partial hit on it is no donor."""
    kvc = KvCacheConfig(tokens_per_block=TPB, event_buffer_max_size=4096, max_tokens=4 * MODEL.max_context,
                        enable_partial_reuse=True)
    a = fleet.engine("A", version=version, max_num_tokens=4 * TPB, kv_cache_config=kvc)
    rid = a.llm.submit(ABANDONED, max_new_tokens=2)
    forwards: list[int] = []
    forward = a.llm.model.forward_paged_batch

    def last_chunk_fails(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        forwards.append(1)
        if len(forwards) == 4:
            raise RuntimeError("injected: CUDA error in the forward")
        return forward(*args, **kwargs)

    a.llm.model.forward_paged_batch = last_chunk_fails  # type: ignore[method-assign]
    a.llm.run_until_idle()
    with pytest.raises(RuntimeError, match="injected"):
        a.llm.result(rid)
    a.llm.model.forward_paged_batch = forward  # type: ignore[method-assign]
    into_garbage = ABANDONED[: 12 * TPB + 3] + doc_tokens(5 * TPB, seed=70)  # 3 tokens into block 12
    assert a.llm.generate(into_garbage).num_reused_tokens == 12 * TPB + 3
    assert a.metrics.value("semkv_donors_not_registered_total", reason="unverified_blocks") == 1


def test_a_request_freed_before_its_first_report_is_taken_for_abandoned(fleet: Fleet, version) -> None:
    """Allocated, then freed before any iteration reported it (an executor that drops it without
    ``request_finished``): its report was due in the next scheduled iteration, so that one's absence
    says its blocks — none computed — are in the tree."""
    scheduler = fleet.engine("A", version=version).scheduler
    freed = LlmRequest(900, ABANDONED, 1)
    assert scheduler.get_num_new_matched_tokens(freed, 0) == (0, False)
    scheduler.update_state_after_alloc(freed, list(range(14)))
    scheduler.build_connector_meta(SchedulerOutput())  # a scheduled iteration without it
    later = RequestState(901, reuse_keys=prefix_keys(scheduler.namespace.for_request(freed), ABANDONED, TPB),
                         reused_tokens=12 * TPB)
    assert scheduler.saves._reused_unverified(later)
