"""Asynchronous loads (vLLM ``load_async``; issue 25) through the worker core: every layer copied on
the loader thread with the same checks as a synchronous load, and a failure reported by request
with nothing counted as materialized. Engine A's donor, engine B's connector built as the vLLM
adapter builds it over B's real KV pool (``test_failure_injection.VllmOrder``); the plan is the
one B's scheduler ships, marked asynchronous as the adapter marks it. The whole chain on real vLLM
engines (vLLM's ``WAITING_FOR_REMOTE_KVS``, ``failed_recving``, recompute) is
tests/vllm_cpu/test_async_loads.py."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from connector._trtllm import RequestData, SchedulerOutput
from connector.harness import LlmRequest
from connector.plan import LoadPlan
from tests.connector.test_failure_injection import (
    DOC,
    PROMPT,
    VllmOrder,
    donor_file,
    fail_copy_at,
    vllm_order,
)
from tools.harness.fleet import MODEL, Fleet

TPB = MODEL.tokens_per_block
ASYNC_TARGETS = list(range(120, 120 + len(PROMPT) // TPB + 1))
SYNC_TARGETS = list(range(100, 100 + len(PROMPT) // TPB + 1))  # VllmOrder.run's


def run_async(order: VllmOrder, rid: int, after_meta: Callable[[], None] | None = None,
              targets: list[int] = ASYNC_TARGETS) -> tuple[list, list[LoadPlan]]:
    """One promised request loaded asynchronously into ``targets``; how it ended."""
    request = LlmRequest(rid, PROMPT, 1)
    n, _ = order.scheduler.get_num_new_matched_tokens(request, 0)
    assert n == len(DOC)
    order.scheduler.update_state_after_alloc(request, targets)
    data = RequestData(request_id=rid, new_tokens=PROMPT, new_block_ids=targets, computed_position=0,
                       num_scheduled_tokens=0)  # waiting for its KV: nothing computed in this step
    [plan] = order.scheduler.build_connector_meta(SchedulerOutput(new_requests=[data])).loads
    if after_meta is not None:
        after_meta()
    try:
        order.worker.load_async([dataclasses.replace(plan, asynchronous=True)])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # vLLM asks in every step's get_finished
            ended, failed = order.worker.finished_async_loads()
            if ended:
                return ended, failed
            time.sleep(0.01)
        raise AssertionError("the asynchronous load never ended")
    finally:
        order.scheduler.request_finished(request, targets)
        order.scheduler.flush()


@pytest.fixture
def order(fleet: Fleet) -> Iterator[VllmOrder]:
    """A's donor of DOC in the ledger and the store; B's connector over B's pool (as the ``vllm``
    fixture of test_failure_injection.py)."""
    with vllm_order(fleet) as order:
        yield order


def doc_blocks(order: VllmOrder, targets: list[int]) -> torch.Tensor:
    return order.pool.kv_cache[targets[: len(DOC) // TPB]].clone()


def test_an_asynchronous_load_copies_every_layer_as_a_synchronous_one(order: VllmOrder) -> None:
    assert order.run(rid=1) == list(range(MODEL.num_layers))  # synchronous, layer by layer
    assert run_async(order, 2) == ([2], [])
    assert torch.equal(doc_blocks(order, ASYNC_TARGETS), doc_blocks(order, SYNC_TARGETS))
    assert doc_blocks(order, ASYNC_TARGETS).abs().sum() > 0  # real KV, not two untouched pools
    metrics = order.worker.metrics
    assert metrics.value("semkv_exact_materialized_total") == 2
    assert metrics.value("semkv_revalidation_seconds_count") == 2 * (1 + MODEL.num_layers)  # before every copy
    assert metrics.value("semkv_leases_held") == 0 and order.fleet.held_leases() == 0


@pytest.mark.parametrize("runs_max", [16, 1], ids=["slice-per-run", "index_copy"])
def test_scattered_targets_get_the_same_bytes(order: VllmOrder, monkeypatch, runs_max: int) -> None:
    """Targets that are not one run of consecutive blocks (a pool handing out freed blocks): copied
    run by run, or with one ``index_copy_`` beyond ``_SLICE_RUNS_MAX`` runs — the same bytes."""
    monkeypatch.setattr("connector.worker._SLICE_RUNS_MAX", runs_max)
    scattered = [140 + 3 * i for i in range(len(PROMPT) // TPB + 1)][::-1]
    order.run(rid=1)
    assert run_async(order, 5, targets=scattered) == ([5], [])
    assert torch.equal(doc_blocks(order, scattered), doc_blocks(order, SYNC_TARGETS))


def test_an_asynchronous_load_whose_entry_vanished_is_reported_failed(fleet: Fleet, order: VllmOrder) -> None:
    before = doc_blocks(order, ASYNC_TARGETS)
    ended, failed = run_async(order, 3, after_meta=lambda: donor_file(fleet).unlink())
    assert ended == [3] and [plan.request_id for plan in failed] == [3]
    assert torch.equal(doc_blocks(order, ASYNC_TARGETS), before)  # not a byte copied
    metrics = order.worker.metrics
    assert metrics.value("semkv_load_failures_total", reason="store_missing") == 1
    assert metrics.value("semkv_exact_materialized_total") == 0
    assert not order.worker.failed_plans  # reported by request (failed_recving), not as a synchronous plan's blocks
    assert metrics.value("semkv_leases_held") == 0 and order.fleet.held_leases() == 0


def test_an_asynchronous_load_failing_at_layer_1_is_reported_failed(order: VllmOrder) -> None:
    fail_copy_at(order.worker, 1)
    ended, failed = run_async(order, 4)
    assert ended == [4] and [plan.request_id for plan in failed] == [4]
    metrics = order.worker.metrics
    assert metrics.value("semkv_load_failures_total", reason="copy_error") == 1
    assert metrics.value("semkv_exact_materialized_total") == 0
    assert metrics.value("semkv_leases_held") == 0 and order.fleet.held_leases() == 0
