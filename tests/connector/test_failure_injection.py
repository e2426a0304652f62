"""Failures between the promise and the copy that are not in the TensorRT-LLM fault matrix
(test_trtllm_fault_matrix.py), and the same faults on an engine that recomputes (vLLM).

TensorRT-LLM cannot retract a promise: a failure the bytes themselves cannot explain away (a device
copy error, an allocation that disagrees with the promise) stops its executor in ``start_load_kv``
before attention reads anything, and nothing is stored for reuse. vLLM recomputes a failed plan:
there every failure — the ledger's staleness included — fails the WHOLE plan before the layer it
concerns is released to attention, and nothing counts as materialized (DESIGN §2 rules 3, 6-8). The
vLLM cases drive the same scheduler and worker core the vLLM adapter wraps, in vLLM's call order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from connector._trtllm import RequestData, SchedulerOutput
from connector.harness import ExecutorStopped, LlmRequest
from connector.harness.connector_driver import HarnessStream
from connector.plan import ConnectorMetadata
from connector.worker import SemKvLoadError, SemKvWorker
from tools.harness.fleet import MODEL, Engine, Fleet, shared_model, close_connector, doc_tokens

TPB = MODEL.tokens_per_block
DOC = doc_tokens(10 * TPB, seed=21)
PROMPT = DOC + doc_tokens(20, seed=22)


def setup(fleet: Fleet, **b_settings: Any) -> tuple[Engine, list[tuple[str, int]]]:
    a = fleet.engine("A")
    a.generate(DOC)
    fleet.sync()
    b = fleet.engine("B", **b_settings)
    reads: list[tuple[str, int]] = []
    b.llm.add_forward_observer(lambda event, layer, ids: reads.append((event, layer)))
    return b, reads


def fail_copy_at(worker: SemKvWorker, failing_layer: int) -> None:
    """The worker raises when it copies ``failing_layer`` (an injected device copy error)."""
    copy_layer = worker._copy_layer

    def failing(load: Any, layer_idx: int) -> None:
        if layer_idx == failing_layer:
            raise RuntimeError("injected: device copy failed")
        copy_layer(load, layer_idx)

    worker._copy_layer = failing  # type: ignore[method-assign]


def assert_stopped_before_any_read(b: Engine, reads: list[tuple[str, int]], stop: pytest.ExceptionInfo,
                                   reason: str) -> None:
    assert stop.value.hook == "start_load_kv" and not reads  # no layer ran, nothing was read
    assert reason in str(stop.value.__cause__)
    assert b.metrics.value("semkv_load_failures_total", reason=reason) == 1
    assert b.metrics.value("semkv_exact_materialized_total") == 0
    assert b.llm.kv_cache_manager.stored_block_hashes() == []  # nothing entered the reuse tree


# ------------------------------------------------------------------------------ TensorRT-LLM
def test_on_trtllm_a_device_copy_error_stops_the_executor_before_attention_reads(fleet: Fleet) -> None:
    b, reads = setup(fleet)
    fail_copy_at(b.worker, 1)
    with pytest.raises(ExecutorStopped) as stop:
        b.llm.generate(PROMPT)
    assert_stopped_before_any_read(b, reads, stop, "copy_error")
    restarted = fleet.restart("B")  # the operator restarts the engine: it serves the prompt right
    got = restarted.generate(PROMPT)
    cold = shared_model(MODEL).forward_dense(PROMPT)
    assert torch.allclose(got.prefill_logits, cold[got.prefill_start:], rtol=1e-4, atol=1e-4)


def test_on_trtllm_an_allocation_that_disagrees_with_the_promise_stops_the_executor(fleet: Fleet) -> None:
    """update_state_after_alloc gets fewer blocks than promised (TensorRT-LLM's C++ path allocates
    the whole prompt, so this is a broken engine): never a compute on blocks nobody filled."""
    b, reads = setup(fleet)
    original = b.scheduler.update_state_after_alloc
    b.scheduler.update_state_after_alloc = lambda request, block_ids: original(request, block_ids[:2])
    with pytest.raises(ExecutorStopped) as stop:
        b.llm.generate(PROMPT)
    assert "allocation gave 2 target blocks" in str(stop.value.__cause__)
    assert b.metrics.value("semkv_leases_released_total", reason="alloc_mismatch") == 1
    assert_stopped_before_any_read(b, reads, stop, "plan_failed")


# ------------------------------------------------------------------------------ vLLM
class VllmOrder:
    """Engine B's connector as the vLLM adapter builds it, driven in vLLM's call order over B's
    real KV pool: lookup, allocation, metadata, ``start_load_kv``, ``wait_for_layer_load`` per
    layer (through :attr:`wait`, which a test may replace), ``wait_for_save``."""

    def __init__(self, fleet: Fleet, **overrides: Any) -> None:
        self.fleet = fleet
        self.pool = fleet.engine("B", connector=False).llm
        self.scheduler, self.worker = fleet.vllm_connector("B", self.pool.llm_args, **overrides)
        self.worker.register_kv_caches(self.pool.kv_cache)
        self.wait: Callable[[int, Any], None] = self.worker.wait_for_layer_load

    def run(self, rid: int = 1, after_meta: Callable[[], None] | None = None,
            block_ids: list[int] | None = None) -> list[int]:
        """One promised request (allocated ``block_ids``, by default 100, 101, ...); returns the
        layers whose wait returned (released to attention)."""
        request = LlmRequest(rid, PROMPT, 1)
        n, _ = self.scheduler.get_num_new_matched_tokens(request, 0)
        assert n == len(DOC)
        block_ids = block_ids or list(range(100, 100 + len(PROMPT) // TPB + 1))
        self.scheduler.update_state_after_alloc(request, block_ids)
        data = RequestData(request_id=rid, new_tokens=PROMPT, new_block_ids=block_ids, computed_position=0,
                           num_scheduled_tokens=len(PROMPT))
        meta: ConnectorMetadata = self.scheduler.build_connector_meta(SchedulerOutput(new_requests=[data]))
        if after_meta is not None:
            after_meta()
        released: list[int] = []
        try:
            self.worker.bind_connector_meta(meta)
            self.worker.start_load_kv(HarnessStream())
            for layer in range(MODEL.num_layers):
                self.wait(layer, HarnessStream())
                released.append(layer)
            self.worker.wait_for_save(HarnessStream())
        finally:
            self.scheduler.request_finished(request, block_ids)  # vLLM finishes (or recomputes) it
            self.scheduler.flush()
        return released

    def assert_failed(self, reason: str) -> None:
        metrics = self.worker.metrics
        assert metrics.value("semkv_load_failures_total", reason=reason) == 1
        assert metrics.value("semkv_exact_materialized_total") == 0
        assert [plan.request_id for plan in self.worker.failed_plans] == [1]  # reported: vLLM recomputes it
        assert metrics.value("semkv_leases_held") == 0 and self.fleet.held_leases() == 0

    def close(self) -> None:
        close_connector(self.scheduler, self.worker)


@contextlib.contextmanager
def vllm_order(fleet: Fleet) -> Iterator[VllmOrder]:
    """A's donor of DOC in the ledger and the store; B's connector over B's pool."""
    fleet.engine("A").generate(DOC)
    fleet.sync()
    order = VllmOrder(fleet)
    try:
        yield order
    finally:
        order.close()


@pytest.fixture
def vllm(fleet: Fleet) -> Iterator[VllmOrder]:
    with vllm_order(fleet) as order:
        yield order


def donor_file(fleet: Fleet) -> Path:
    [entry] = Path(fleet.store_dir).glob("*.kv")
    return entry


def test_on_vllm_the_plan_of_a_donor_gone_stale_after_the_promise_fails(fleet: Fleet, vllm: VllmOrder) -> None:
    with pytest.raises(SemKvLoadError, match="ledger_quarantined"):
        vllm.run(after_meta=lambda: (fleet.restart("A"), fleet.sync()))  # A restarts: generation bump
    vllm.assert_failed("ledger_quarantined")


def test_on_vllm_a_store_entry_vanishing_fails_the_plan(fleet: Fleet, vllm: VllmOrder) -> None:
    with pytest.raises(SemKvLoadError, match="store_missing"):
        vllm.run(after_meta=lambda: donor_file(fleet).unlink())
    vllm.assert_failed("store_missing")


def test_on_vllm_a_copy_error_at_layer_k_releases_no_layer_from_k_on(vllm: VllmOrder) -> None:
    fail_copy_at(vllm.worker, 1)
    released: list[int] = []
    original = vllm.wait
    vllm.wait = lambda layer, stream: (original(layer, stream), released.append(layer))  # type: ignore[assignment]
    with pytest.raises(SemKvLoadError, match="copy_error"):
        vllm.run()
    assert released == [0]  # layer 0 was copied and released; layer 1 never
    vllm.assert_failed("copy_error")


def test_on_vllm_the_ledger_turning_stale_after_layer_0_fails_the_plan(fleet: Fleet, vllm: VllmOrder) -> None:
    original = vllm.wait
    ledger = fleet.ledger()

    def evict_after_layer_0(layer: int, stream: Any) -> None:
        original(layer, stream)
        if layer == 0:
            ledger.evict_donor(vllm.worker._active[0].plan.donor_id, "test")

    vllm.wait = evict_after_layer_0  # type: ignore[assignment]
    try:
        with pytest.raises(SemKvLoadError, match="ledger_evicted"):
            vllm.run()
    finally:
        ledger.close()
    vllm.assert_failed("ledger_evicted")


def test_on_vllm_an_engine_that_skips_a_layers_wait_fails_the_plan(vllm: VllmOrder) -> None:
    """An engine that never waits on layer 0 (attention then read it unloaded) and asks for layer 1:
    the worker sees the skip, fails the plan, and nothing counts as materialized (rule 8)."""
    original = vllm.wait
    vllm.wait = lambda layer, stream: original(layer, stream) if layer != 0 else None  # type: ignore[assignment]
    with pytest.raises(SemKvLoadError, match="layer_skipped"):
        vllm.run()
    vllm.assert_failed("layer_skipped")


def test_on_vllm_an_engine_that_never_waits_on_the_last_layer_fails_the_plan(vllm: VllmOrder) -> None:
    """The mirror case: no later layer is asked for, so the forward's end (``wait_for_save``) is
    where the worker sees the last layer was never loaded."""
    original, last = vllm.wait, MODEL.num_layers - 1
    vllm.wait = lambda layer, stream: original(layer, stream) if layer != last else None  # type: ignore[assignment]
    with pytest.raises(SemKvLoadError, match="layer_skipped"):
        vllm.run()
    vllm.assert_failed("layer_skipped")


def test_on_vllm_a_plan_loads_layer_by_layer_and_materializes(vllm: VllmOrder) -> None:
    """The control: without a fault the same order materializes, each layer copied before its wait returns."""
    assert not vllm.worker.load_before_forward
    assert vllm.run() == list(range(MODEL.num_layers))
    assert vllm.worker.metrics.value("semkv_exact_materialized_total") == 1
    assert vllm.worker.metrics.value("semkv_revalidation_seconds_count") == 1 + MODEL.num_layers
