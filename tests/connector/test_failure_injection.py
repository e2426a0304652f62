"""Failures between the promise and the copy: the request fails closed (TensorRT-LLM 1.2) or is
recomputed (engines with ``cancel_load``/``request_reset``); attention never reads a layer the
connector did not finish; no lease leaks; nothing counts as materialized (DESIGN §2 rules 3, 6-8)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from connector.harness import ConnectorWorkerError
from tests.connector.conftest import MODEL, Engine, Fleet, _shared_model, doc_tokens
from tests.connector.test_two_engines import native_engine

TPB = MODEL.tokens_per_block
DOC = doc_tokens(10 * TPB, seed=21)
PROMPT = DOC + doc_tokens(20, seed=22)


def setup(fleet: Fleet, **b_settings) -> tuple[Engine, list[tuple[str, int]]]:
    a = fleet.engine("A")
    a.generate(DOC)
    fleet.sync()
    b = fleet.engine("B", **b_settings)
    reads: list[tuple[str, int]] = []
    b.llm.add_forward_observer(lambda event, layer, ids: reads.append((event, layer)))
    return b, reads


def after_promise(b: Engine, inject: Callable[[], None]) -> None:
    """Run ``inject`` once, after B's next plan shipped (its ledger lease held) and before its worker
    copies anything: only the worker's revalidation stands between the change and the copy."""
    original = b.scheduler.build_connector_meta
    pending = [inject]

    def hooked(scheduler_output):  # noqa: ANN001, ANN202
        meta = original(scheduler_output)
        if pending and meta.loads:
            assert all(plan.failed is None for plan in meta.loads), meta.loads
            pending.pop()()
        return meta

    b.scheduler.build_connector_meta = hooked  # type: ignore[method-assign]


def assert_failed_closed(fleet: Fleet, b: Engine, reads: list[tuple[str, int]], exc: pytest.ExceptionInfo,
                         reason: str, first_unread_layer: int) -> None:
    assert "semkv connector: load of request" in str(exc.value) and reason in str(exc.value)
    read_layers = [layer for event, layer in reads if event == "attention_read"]
    assert all(layer < first_unread_layer for layer in read_layers), read_layers
    assert b.metrics.value("semkv_load_failures_total", reason=reason) == 1
    assert b.metrics.value("semkv_exact_materialized_total") == 0
    assert b.metrics.value("semkv_promises_total") == 1
    b.scheduler.flush()
    assert b.metrics.value("semkv_leases_held") == 0
    assert fleet.held_leases() == 0
    # the engine and the cache are intact: the next request is served (and right)
    again = b.generate(doc_tokens(3 * TPB, seed=23) + [1, 2, 3])
    assert again.num_connector_tokens == 0


def donor_file(fleet: Fleet) -> Path:
    [entry] = Path(fleet.store_dir).glob("*.kv")
    return entry


def test_rule_6_ledger_says_stale_between_promise_and_copy(fleet: Fleet) -> None:
    b, reads = setup(fleet)
    after_promise(b, lambda: (fleet.restart("A"), fleet.sync()))  # A restarts: generation bump
    with pytest.raises(ConnectorWorkerError) as exc:
        b.generate(PROMPT)
    assert exc.value.hook == "start_load_kv"
    assert_failed_closed(fleet, b, reads, exc, "ledger_quarantined", first_unread_layer=0)


def test_store_entry_vanishes_between_promise_and_copy(fleet: Fleet) -> None:
    b, reads = setup(fleet)
    after_promise(b, lambda: donor_file(fleet).unlink())
    with pytest.raises(ConnectorWorkerError) as exc:
        b.generate(PROMPT)
    assert_failed_closed(fleet, b, reads, exc, "store_missing", first_unread_layer=0)


def fail_copy_at(b: Engine, failing_layer: int) -> None:
    """B's worker raises when it copies ``failing_layer`` (an injected device copy error)."""
    copy_layer = b.worker._copy_layer

    def failing(load, layer_idx):  # noqa: ANN001, ANN202
        if layer_idx == failing_layer:
            raise RuntimeError("injected: device copy failed")
        copy_layer(load, layer_idx)

    b.worker._copy_layer = failing  # type: ignore[method-assign]


def test_rule_8_copy_raises_at_layer_k_nothing_counts_as_materialized(fleet: Fleet) -> None:
    b, reads = setup(fleet)
    fail_copy_at(b, 1)
    with pytest.raises(ConnectorWorkerError) as exc:
        b.generate(PROMPT)
    assert exc.value.hook == "wait_for_layer_load" and exc.value.layer_idx == 1
    assert ("attention_read", 0) in reads  # layer 0 was copied and used; layer 1 never read
    assert_failed_closed(fleet, b, reads, exc, "copy_error", first_unread_layer=1)


def test_ledger_turns_stale_after_layer_0(fleet: Fleet) -> None:
    b, reads = setup(fleet)
    ledger = fleet.ledger()

    def evict_after_layer_0(event: str, layer: int, ids: list[int]) -> None:
        if event == "wait_for_layer_load_returned" and layer == 0 and b.worker._active:
            plan = b.worker._active[0].plan
            ledger.evict_donor(plan.donor_id, "test")

    b.llm.add_forward_observer(evict_after_layer_0)
    try:
        with pytest.raises(ConnectorWorkerError) as exc:
            b.generate(PROMPT)
    finally:
        ledger.close()
    assert_failed_closed(fleet, b, reads, exc, "ledger_evicted", first_unread_layer=1)


def test_newer_engine_recomputes_a_failed_load(fleet: Fleet) -> None:
    """With cancel_load/request_reset the engine discards the load and recomputes: same bits as cold."""
    b, reads = setup(fleet, reset_hooks=True)
    after_promise(b, lambda: donor_file(fleet).unlink())
    got = b.generate(PROMPT)
    assert got.recomputed_after_load_failure and got.num_connector_tokens == 0
    cold = native_engine().generate(PROMPT, 1)
    assert torch.equal(got.prefill_logits, cold.prefill_logits)
    assert torch.allclose(got.prefill_logits, _shared_model(MODEL).forward_dense(PROMPT), rtol=1e-4, atol=1e-4)
    assert b.metrics.value("semkv_load_failures_total", reason="store_missing") == 1
    assert b.metrics.value("semkv_leases_released_total", reason="cancel_load") == 1
    assert b.metrics.value("semkv_exact_materialized_total") == 0
    b.scheduler.flush()
    assert fleet.held_leases() == 0


def test_allocation_that_does_not_match_the_promise_fails_closed(fleet: Fleet) -> None:
    """update_state_after_alloc gets fewer blocks than promised: the lease is released and the
    request fails instead of computing on blocks nobody filled."""
    b, reads = setup(fleet)
    original = b.scheduler.update_state_after_alloc
    b.scheduler.update_state_after_alloc = lambda request, block_ids: original(request, block_ids[:2])
    with pytest.raises(ConnectorWorkerError) as exc:
        b.generate(PROMPT)
    assert "allocation gave 2 target blocks" in str(exc.value)
    b.scheduler.update_state_after_alloc = original
    assert b.metrics.value("semkv_leases_released_total", reason="alloc_mismatch") == 1
    assert_failed_closed(fleet, b, reads, exc, "plan_failed", first_unread_layer=0)


def test_rule_8_an_engine_that_skips_a_layers_wait_fails_the_plan(fleet: Fleet) -> None:
    """An engine that never waits on layer 0 (attention then read it unloaded) and asks for layer 1:
    the worker sees the skip, fails the plan, and nothing counts as materialized."""
    b, _ = setup(fleet)
    worker_wait = b.worker.wait_for_layer_load

    def skip_layer_0(layer_idx: int, stream) -> None:  # noqa: ANN001
        if layer_idx != 0:
            worker_wait(layer_idx, stream)

    b.worker.wait_for_layer_load = skip_layer_0  # type: ignore[method-assign]
    with pytest.raises(ConnectorWorkerError, match="layer_skipped") as exc:
        b.generate(PROMPT)
    assert exc.value.hook == "wait_for_layer_load" and exc.value.layer_idx == 1
    assert b.metrics.value("semkv_load_failures_total", reason="layer_skipped") == 1
    assert b.metrics.value("semkv_exact_materialized_total") == 0
    b.scheduler.flush()
    assert fleet.held_leases() == 0 and b.metrics.value("semkv_leases_held") == 0


def test_rule_8_an_engine_that_never_waits_on_the_last_layer_fails_the_plan(fleet: Fleet) -> None:
    """The mirror case: no later layer is asked for, so the forward's end (``wait_for_save``) is
    where the worker sees the last layer was never loaded."""
    b, _ = setup(fleet)
    worker_wait, last = b.worker.wait_for_layer_load, MODEL.num_layers - 1

    def skip_last_layer(layer_idx: int, stream) -> None:  # noqa: ANN001
        if layer_idx != last:
            worker_wait(layer_idx, stream)

    b.worker.wait_for_layer_load = skip_last_layer  # type: ignore[method-assign]
    with pytest.raises(ConnectorWorkerError, match="layer_skipped"):
        b.generate(PROMPT)
    assert b.metrics.value("semkv_load_failures_total", reason="layer_skipped") == 1
    assert b.metrics.value("semkv_exact_materialized_total") == 0
    b.scheduler.flush()
    assert fleet.held_leases() == 0 and b.metrics.value("semkv_leases_held") == 0
