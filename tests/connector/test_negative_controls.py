"""Negative controls: B is never promised a token of A's donor when it must not be, and each miss
is counted under its own reason (DESIGN §2 rules 4 and 9, §8). Each control also checks B's answer
is still right (its prefill matches a cold pass). The donor view's lag is covered in test_view_lag.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from connector.harness import KvCacheConfig, LlmRequest, ModelConfig
from tools.harness.fleet import MODEL, Engine, Fleet, shared_model, doc_tokens

TPB = MODEL.tokens_per_block
DOC = doc_tokens(12 * TPB, seed=11)
QUESTION = doc_tokens(24, seed=12)


@pytest.fixture(autouse=True, params=["donor_view", "ledger_reads"])
def lookup_path(request, fleet: Fleet) -> str:
    """Every control runs twice: lookups answered from the scheduler's donor view (the default) and
    from ledger reads (``donor_view_refresh_s = 0``: the path before the view is loaded)."""
    if request.param == "ledger_reads":
        fleet.connector_defaults["donor_view_refresh_s"] = 0
    return request.param


def donor_on_a(fleet: Fleet, **generate_kw) -> Engine:
    a = fleet.engine("A")
    a.generate(DOC, **generate_kw)
    fleet.sync()
    return a


def assert_missed(b: Engine, result, reason: str) -> None:
    assert result.num_connector_tokens == 0
    assert b.misses() == {reason: 1}
    assert b.metrics.value("semkv_promises_total") == 0
    cold = shared_model(b.llm.model_config).forward_dense(DOC + QUESTION)
    assert torch.allclose(result.prefill_logits, cold[result.prefill_start:], rtol=1e-4, atol=1e-4)


def test_rule_9_different_cache_salt_is_a_namespace_mismatch(fleet: Fleet) -> None:
    donor_on_a(fleet, cache_salt="tenant-a")
    b = fleet.engine("B")
    assert_missed(b, b.generate(DOC + QUESTION, cache_salt="tenant-b"), "namespace_mismatch")
    assert b.metrics.value("semkv_namespace_mismatch_total", field="cache_salt") == 1
    # control of the control: the same tenant does get the donor
    assert b.generate(DOC + QUESTION[:5], cache_salt="tenant-a").num_connector_tokens == len(DOC)


def test_rule_9_different_lora_is_a_namespace_mismatch(fleet: Fleet) -> None:
    donor_on_a(fleet, lora_task_id=1)
    b = fleet.engine("B")
    assert_missed(b, b.generate(DOC + QUESTION, lora_task_id=2), "namespace_mismatch")
    assert b.metrics.value("semkv_namespace_mismatch_total", field="lora_task_id") == 1


def test_rule_9_the_same_lora_task_id_on_another_engine_is_not_the_same_adapter(fleet: Fleet) -> None:
    """Each engine numbers its adapters: B's task 1 may be other weights than A's task 1."""
    donor_on_a(fleet, lora_task_id=1)
    b = fleet.engine("B")
    assert_missed(b, b.generate(DOC + QUESTION, lora_task_id=1), "namespace_mismatch")
    assert b.metrics.value("semkv_namespace_mismatch_total", field="lora_task_id") == 1


@pytest.mark.parametrize("change", ["tokens_per_block", "kv_dtype"])
def test_rule_9_different_layout_or_dtype_is_a_namespace_mismatch(fleet: Fleet, change: str) -> None:
    donor_on_a(fleet)
    if change == "tokens_per_block":
        model = ModelConfig(max_context=MODEL.max_context, tokens_per_block=16)
        b = fleet.engine("B", model=model, kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=8192))
    else:  # the deployment declares another KV dtype than A's (its pool is float32 all the same)
        b = fleet.engine("B", namespace={"kv_dtype": "bfloat16"})
        # the scheduler sees its own worker's pool disagree with the declared dtype: a miss of its own
        # (test_a_namespace_layout_the_engines_pool_disagrees_with_is_a_miss_not_a_stop)
        assert_missed(b, b.generate(DOC + QUESTION), "layout_mismatch")
        return
    assert_missed(b, b.generate(DOC + QUESTION), "namespace_mismatch")
    assert b.metrics.value("semkv_namespace_mismatch_total", field=change) == 1


def test_a_restarted_makes_its_donor_stale(fleet: Fleet) -> None:
    donor_on_a(fleet)
    fleet.restart("A")  # a new process on the same slot: its first event is `created`
    fleet.sync()
    b = fleet.engine("B")
    assert_missed(b, b.generate(DOC + QUESTION), "donor_restarted")
    assert b.metrics.value("semkv_stale_donor_total", reason="donor_restarted") == 1


def test_donor_blocks_removed_under_policy_engine(fleet: Fleet) -> None:
    small = KvCacheConfig(tokens_per_block=TPB, event_buffer_max_size=4096, max_tokens=24 * TPB)
    a = fleet.engine("A", kv_cache_config=small)
    a.generate(DOC)
    a.generate(doc_tokens(24 * TPB, seed=99))  # needs the whole pool: A evicts all of D (`removed`)
    fleet.sync()
    b = fleet.engine("B")
    assert_missed(b, b.generate(DOC + QUESTION), "donor_blocks_removed")
    # under policy `store` the bytes in the store are enough evidence: the same donor is usable
    b2 = fleet.engine("B", freshness_policy="store")
    assert b2.generate(DOC + QUESTION).num_connector_tokens == len(DOC)


def test_event_gap_quarantines_the_donor(fleet: Fleet) -> None:
    a = donor_on_a(fleet)
    a.llm.generate(doc_tokens(3 * TPB, seed=7), 1)  # two more `stored` events ...
    a.llm.generate(doc_tokens(3 * TPB, seed=8), 1)
    a.settle()
    fleet.pump(a, drop=1)  # ... of which TensorRT-LLM's bounded buffer lost the first: event_id jumps
    fleet.sync()
    b = fleet.engine("B")
    assert_missed(b, b.generate(DOC + QUESTION), "donor_quarantined")


def test_donor_bytes_corrupted_fail_the_checksum(fleet: Fleet, lookup_path: str) -> None:
    donor_on_a(fleet)
    [entry] = [p for p in Path(fleet.store_dir).glob("*.kv")]
    with open(entry, "r+b") as f:  # flip one byte in the last layer's data
        f.seek(os.path.getsize(entry) - 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    b = fleet.engine("B")
    if lookup_path == "donor_view":
        # the view checksums a donor when it takes it in, off the engine's path: the corrupt entry
        # is evicted before any lookup, which then finds no donor and explains why
        b.scheduler.flush()
        assert not entry.exists()
        b.scheduler.sync_view()
        assert_missed(b, b.generate(DOC + QUESTION), "donor_evicted")
        return
    assert_missed(b, b.generate(DOC + QUESTION), "checksum_mismatch")
    b.scheduler.flush()
    assert not entry.exists()  # the corrupt donor was evicted (ledger `donor_evicted`, bytes removed)


def test_lease_expired_before_the_answer(fleet: Fleet) -> None:
    donor_on_a(fleet)
    b = fleet.engine("B", lease_ttl_s=1e-9)
    assert_missed(b, b.generate(DOC + QUESTION), "lease_expired")
    b.scheduler.flush()
    assert fleet.held_leases() == 0



def test_plans_past_max_plans_per_iteration_are_a_counted_miss(fleet: Fleet) -> None:
    donor_on_a(fleet)
    b = fleet.engine("B", max_plans_per_iteration=1)
    first, second, third = (LlmRequest(rid, DOC + QUESTION, 1) for rid in (101, 102, 103))
    assert b.scheduler.get_num_new_matched_tokens(first, 0) == (len(DOC), False)
    assert b.scheduler.get_num_new_matched_tokens(second, 0) == (0, False)  # first's plan has not shipped
    assert b.misses() == {"plan_limit": 1}
    b.scheduler.request_finished(first, [])  # released before shipping: room again
    assert b.scheduler.get_num_new_matched_tokens(third, 0) == (len(DOC), False)
    for request in (second, third):
        b.scheduler.request_finished(request, [])
    b.scheduler.flush()
    assert fleet.held_leases() == 0


def test_a_namespace_layout_the_engines_pool_disagrees_with_is_a_miss_not_a_stop(fleet: Fleet) -> None:
    """``[namespace] kv_dtype``/``kv_layout`` replace what the engine reports: one that disagrees with
    the pool the engine really registered would fail every promised load in ``start_load_kv`` —
    on TensorRT-LLM an executor stop per hit. The scheduler compares it with its own worker's pool
    first, and misses (DESIGN §2 rule 4)."""
    donor_on_a(fleet)
    b = fleet.engine("B")
    b.worker.register_kv_caches(torch.zeros_like(b.llm.kv_cache, dtype=torch.float16))  # the engine's real pool
    assert_missed(b, b.generate(DOC + QUESTION), "layout_mismatch")
    assert b.llm.stopped is None and b.metrics.value("semkv_load_failures_total", reason="layout_mismatch") == 0
