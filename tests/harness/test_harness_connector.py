"""REFERENCE ENGINE HARNESS tests: connector call order, scheduler outputs and the runtime's checks,
with a recording connector (one request at a time; concurrent and per-version lifecycles are in
``test_harness_lifecycle.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from connector.harness import (
    TRTLLM_1X,
    TRTLLM_VERSIONS,
    AttentionOrderError,
    ConnectorContractError,
    ExecutorStopped,
    KvCacheRetentionConfig,
    LlmRequest,
    TokenRangeRetentionConfig,
)
from connector.block_keys import block_hash_chain
from connector.harness.executor import _ForwardHooks
from connector.harness.recording_connector import RecordingPlan
from tests.harness.helpers import FORWARD, NUM_BLOCKS, calls, cold, connected, donor, prompt

PROMPT = prompt(45, seed=11)


@pytest.mark.parametrize("version", TRTLLM_VERSIONS, ids=lambda v: v.name)
def test_call_order_lock_and_materialized_kv_is_bit_identical_to_cold_prefill(version) -> None:
    plan = RecordingPlan(promise=32, donor=donor(PROMPT))
    llm = connected(plan, version=version)
    result = llm.generate(PROMPT, max_new_tokens=2)
    assert plan.hooks() == [
        "scheduler_init", "register_kv_caches",
        "get_num_new_matched_tokens", "update_state_after_alloc",
        *FORWARD, "get_finished",                       # the one context chunk [32, 45)
        *FORWARD, "request_finished", "get_finished",   # one decode step, then finish
    ]
    (query,) = calls(plan, "get_num_new_matched_tokens")
    assert query[1:] == (result.request_id, 0, 32, True)  # under the manager's lock
    (alloc,) = calls(plan, "update_state_after_alloc")
    assert alloc[3] is False and len(alloc[2]) == 6  # lock released; ceil(45 / 8) blocks
    assert calls(plan, "register_kv_caches")[0][1] == (NUM_BLOCKS, 2, 2, 2 * 16 * 8)
    assert (result.num_reused_tokens, result.num_connector_tokens, result.prefill_start) == (0, 32, 32)
    reference = cold(PROMPT)
    assert torch.equal(result.prefill_logits, reference.prefill_logits[32:])
    assert result.token_ids == reference.token_ids and result.finish_reason == "length"


def test_scheduler_output_fields_new_then_cached() -> None:
    retention = KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 8, 90)])
    plan = RecordingPlan(promise=32, donor=donor(PROMPT, cache_salt="tenant-A"))
    llm = connected(plan)
    result = llm.generate(PROMPT, max_new_tokens=2, cache_salt="tenant-A",
                          kv_cache_retention_config=retention)
    first, decode = plan.scheduler_outputs
    (new,) = first.new_requests
    assert first.cached_requests == [] and first.attention_dp_rank is None
    assert new.request_id == result.request_id and new.new_tokens == PROMPT
    assert new.new_block_ids == result.block_ids
    assert new.computed_position == 0  # connector tokens excluded on the first report
    assert new.num_scheduled_tokens == 13
    assert new.block_hashes == block_hash_chain(PROMPT, 8, cache_salt="tenant-A")
    assert new.cache_salt == "tenant-A" and new.priorities == [90, 35, 35, 35, 35, 35]
    (cached,) = decode.cached_requests
    assert decode.new_requests == [] and cached.new_tokens == result.token_ids[:1]
    assert cached.new_block_ids == [] and cached.priorities == []
    assert (cached.computed_position, cached.num_scheduled_tokens) == (45, 1)
    assert torch.equal(result.prefill_logits, cold(PROMPT, cache_salt="tenant-A").prefill_logits[32:])


def test_1x_request_data_has_only_the_five_fields_of_its_module() -> None:
    plan = RecordingPlan(promise=0)
    llm = connected(plan, version=TRTLLM_1X, attention_dp_rank=1)
    llm.generate(PROMPT, cache_salt="tenant-A")
    output = plan.scheduler_outputs[0]
    (new,) = output.new_requests
    assert [f.name for f in dataclasses.fields(new)] == list(TRTLLM_1X.request_data_fields)
    assert not hasattr(new, "block_hashes") and not hasattr(new, "cache_salt")
    assert not hasattr(output, "attention_dp_rank")
    assert type(new).__name__ == "RequestData"


def test_main_2026_reports_the_attention_dp_rank() -> None:
    plan = RecordingPlan(promise=0)
    llm = connected(plan, attention_dp_rank=1)
    llm.generate(PROMPT)
    assert plan.scheduler_outputs[0].attention_dp_rank == 1


def test_connector_only_adds_tokens_past_device_reuse() -> None:
    tokens = PROMPT[:16] + prompt(40, seed=12)
    plan = RecordingPlan(promise=16, donor=donor(tokens))
    llm = connected(plan)
    plan.promise = 0
    llm.generate(PROMPT[:16] + prompt(9, seed=13))  # caches the shared 16-token prefix
    plan.promise = 16
    result = llm.generate(tokens, max_new_tokens=3)
    assert calls(plan, "get_num_new_matched_tokens")[-1][2] == 16
    assert (result.num_reused_tokens, result.num_connector_tokens) == (16, 16)
    loads = plan.scheduler_outputs[-3].new_requests[0]
    assert loads.computed_position == 16  # device reuse only: the connector's 16 are excluded
    reference = cold(tokens, max_new_tokens=3)
    assert torch.equal(result.prefill_logits, reference.prefill_logits[32:])
    assert result.token_ids == reference.token_ids


@pytest.mark.parametrize(("promise", "force_async", "match"), [
    (0, True, "load_kv_async must be False when num_tokens is 0!"),
    (12, None, "whole blocks"),
    (48, None, "at least one uncomputed token"),
    (-8, None, "< 0"),
])
def test_a_contract_violation_in_the_lookup_stops_the_executor(promise, force_async, match) -> None:
    plan = RecordingPlan(promise=promise, force_async_flag=force_async)
    llm = connected(plan)
    with pytest.raises(ExecutorStopped) as stop:
        llm.generate(PROMPT[:40] if promise == 48 else PROMPT)
    assert stop.value.hook == "get_num_new_matched_tokens"
    assert isinstance(stop.value.__cause__, ConnectorContractError)
    assert match in str(stop.value.__cause__)
    assert plan.hooks()[-1] == "get_num_new_matched_tokens"  # nothing after it, ever
    assert llm.stopped is not None and llm.stopped.hook == "get_num_new_matched_tokens"
    with pytest.raises(ExecutorStopped):
        llm.generate(PROMPT)
    assert plan.hooks()[-1] == "get_num_new_matched_tokens"


def test_a_generation_only_request_stops_the_executor_before_the_connector_is_asked() -> None:
    plan = RecordingPlan()
    llm = connected(plan)
    request = LlmRequest(99, PROMPT, 1, is_generation_only_request=True)
    with pytest.raises(ExecutorStopped, match="generation-only") as stop:
        llm.connector.get_num_new_matched_tokens(request, 0)
    assert isinstance(stop.value.__cause__, RuntimeError)
    assert not calls(plan, "get_num_new_matched_tokens")


def test_async_load_parks_the_request_until_every_worker_reports_it() -> None:
    plan = RecordingPlan(promise=32, load_async=True, worker_delays=[1, 3], donor=donor(PROMPT))
    llm = connected(plan, workers=2)
    result = llm.generate(PROMPT, max_new_tokens=1)
    rid = result.request_id
    first_wait = plan.hooks().index("wait_for_layer_load")
    reports = [(i, c) for i, c in enumerate(plan.calls) if c[0] == "get_finished" and rid in c[4]]
    assert [c[5] for _, c in reports] == [0, 1]  # rank 0 first, the slow rank 1 two rounds later
    (i0, _), (i1, _) = reports
    assert i0 < i1 < first_wait  # no forward while any worker still loads
    started = [c for c in plan.calls if c[0] == "get_finished" and c[2]]
    assert [(c[2], c[5]) for c in started] == [([rid], 0), ([rid], 1)]  # each id passed once per rank
    # metadata only in iterations that schedule something: the parking one (empty output) and the
    # one after the load; none while the request was parked
    assert [(len(o.new_requests), len(o.cached_requests)) for o in plan.scheduler_outputs] == [(0, 0), (1, 0)]
    assert plan.scheduler_outputs[1].new_requests[0].computed_position == 32  # loads already done
    assert torch.equal(result.prefill_logits, cold(PROMPT, max_new_tokens=1).prefill_logits[32:])


def test_an_async_load_never_reported_fails_the_request_after_the_harness_timeout() -> None:
    plan = RecordingPlan(promise=32, load_async=True, async_ready_after=10**9, donor=donor(PROMPT))
    llm = connected(plan, connector_timeout_s=0.05)
    with pytest.raises(ConnectorContractError, match="not reported by every worker"):
        llm.generate(PROMPT)
    assert llm.active_request_ids() == [] and llm.kv_cache_manager.num_available_blocks() == NUM_BLOCKS
    assert llm.stopped is None


def test_attention_never_reads_a_layer_before_its_wait_returned() -> None:
    plan = RecordingPlan(promise=32, donor=donor(PROMPT), layerwise=True)
    llm = connected(plan, workers=2)
    llm.add_forward_observer(lambda event, layer, ids: plan.record(event, layer))
    llm.generate(PROMPT, max_new_tokens=2)
    trace = [(c[0], c[1]) for c in plan.calls if c[0] in (
        "wait_for_layer_load", "wait_for_layer_load_returned", "attention_read", "save_kv_layer")]
    per_layer = [("wait_for_layer_load", 0), ("wait_for_layer_load", 0),
                 ("wait_for_layer_load_returned", 0), ("attention_read", 0), ("save_kv_layer", 0),
                 ("save_kv_layer", 0), ("wait_for_layer_load", 1), ("wait_for_layer_load", 1),
                 ("wait_for_layer_load_returned", 1), ("attention_read", 1), ("save_kv_layer", 1),
                 ("save_kv_layer", 1)]
    assert trace == per_layer * 2  # context chunk, one decode step
    hooks = _ForwardHooks(None, [1], [])
    with pytest.raises(AttentionOrderError):
        hooks.before_attention_read(0)
