"""REFERENCE ENGINE HARNESS tests: connector call order and runtime rules, with a recording connector.

Bit-identity: the prefill chunk grid is ``CHUNK`` tokens from position 0, and every promise ends on
a chunk boundary, so the chunks the connector engine computes are exactly the cold engine's last
chunks, over KV computed by the same chunks in the donor engine.
"""

from __future__ import annotations

import pytest
import torch

from connector.harness import (
    AttentionOrderError,
    ConnectorContractError,
    ConnectorWorkerError,
    HarnessLLM,
    KvCacheConfig,
    KvCacheRetentionConfig,
    LlmRequest,
    ModelConfig,
    TokenRangeRetentionConfig,
)
from connector.harness.block_hash import block_hash_chain
from connector.harness.engine import _ForwardHooks
from connector.harness.recording_connector import RecordingPlan, donor_from_engine
from connector.harness.recording_connector import make_recording_connector

CFG = ModelConfig(vocab_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=64, tokens_per_block=8, max_context=512)
CHUNK = 32
NUM_BLOCKS = 128
LAYER_CYCLE = ["wait_for_layer_load", "save_kv_layer"] * CFG.num_layers


def _kvc(**kw) -> KvCacheConfig:
    return KvCacheConfig(tokens_per_block=8, max_tokens=NUM_BLOCKS * 8, event_buffer_max_size=1000, **kw)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _connected(plan: RecordingPlan, *, workers: int = 1, reset_hooks: bool = False) -> HarnessLLM:
    scheduler_cls, worker_cls = make_recording_connector(plan, with_reset_hooks=reset_hooks)
    llm = HarnessLLM(CFG, kv_cache_config=_kvc(), kv_connector=(scheduler_cls, [worker_cls] * workers),
                     max_num_tokens=CHUNK)
    plan.lock_probe = llm.kv_cache_manager.lock_held_by_current_thread
    return llm


def _cold(prompt: list[int], max_new_tokens: int = 2, **kw):
    return HarnessLLM(CFG, kv_cache_config=_kvc(enable_block_reuse=False),
                      max_num_tokens=CHUNK).generate(prompt, max_new_tokens, **kw)


def _donor(prompt: list[int], **kw):
    donor = HarnessLLM(CFG, kv_cache_config=_kvc(), max_num_tokens=CHUNK)
    donor.generate(prompt, **kw)
    return donor_from_engine(donor, prompt, **kw)


def _calls(plan: RecordingPlan, hook: str) -> list[tuple]:
    return [c for c in plan.calls if c[0] == hook]


PROMPT = _prompt(45, seed=11)


def test_call_order_lock_and_materialized_kv_is_bit_identical_to_cold_prefill() -> None:
    plan = RecordingPlan(promise=32, donor=_donor(PROMPT))
    llm = _connected(plan)
    result = llm.generate(PROMPT, max_new_tokens=2)
    forward = ["build_connector_meta", "bind_connector_meta", "start_load_kv", *LAYER_CYCLE,
               "wait_for_save"]
    assert plan.hooks() == [
        "scheduler_init", "register_kv_caches",
        "get_num_new_matched_tokens", "update_state_after_alloc",
        *forward, "get_finished",                       # the one context chunk [32, 45)
        *forward, "request_finished", "get_finished",   # one decode step, then finish
    ]
    (query,) = _calls(plan, "get_num_new_matched_tokens")
    assert query[1:] == (result.request_id, 0, 32, True)  # under the manager's lock
    (alloc,) = _calls(plan, "update_state_after_alloc")
    assert alloc[3] is False and len(alloc[2]) == 6  # lock released; ceil(45 / 8) blocks
    assert _calls(plan, "register_kv_caches")[0][1] == (NUM_BLOCKS, 2, 2, 2 * 16 * 8)
    assert (result.num_reused_tokens, result.num_connector_tokens, result.prefill_start) == (0, 32, 32)
    cold = _cold(PROMPT)
    assert torch.equal(result.prefill_logits, cold.prefill_logits[32:])
    assert result.token_ids == cold.token_ids


def test_scheduler_output_fields_new_then_cached() -> None:
    retention = KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 8, 90)])
    plan = RecordingPlan(promise=32, donor=_donor(PROMPT, cache_salt="tenant-A"))
    llm = _connected(plan)
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
    assert torch.equal(result.prefill_logits, _cold(PROMPT, cache_salt="tenant-A").prefill_logits[32:])


def test_connector_only_adds_tokens_past_device_reuse() -> None:
    prompt = PROMPT[:16] + _prompt(40, seed=12)
    plan = RecordingPlan(promise=16, donor=_donor(prompt))
    llm = _connected(plan)
    plan.promise = 0
    llm.generate(PROMPT[:16] + _prompt(9, seed=13))  # caches the shared 16-token prefix
    plan.promise = 16
    result = llm.generate(prompt, max_new_tokens=3)
    assert _calls(plan, "get_num_new_matched_tokens")[-1][2] == 16
    assert (result.num_reused_tokens, result.num_connector_tokens) == (16, 16)
    loads = plan.scheduler_outputs[-3].new_requests[0]
    assert loads.computed_position == 16
    cold = _cold(prompt, max_new_tokens=3)
    assert torch.equal(result.prefill_logits, cold.prefill_logits[32:])
    assert result.token_ids == cold.token_ids


@pytest.mark.parametrize(("promise", "force_async", "match"), [
    (0, True, "load_kv_async must be False when num_tokens is 0!"),
    (12, None, "whole blocks"),
    (48, None, "at least one uncomputed token"),
    (-8, None, "< 0"),
])
def test_contract_violations_fail_the_request_and_release_everything(promise, force_async, match) -> None:
    plan = RecordingPlan(promise=promise, force_async_flag=force_async)
    llm = _connected(plan)
    with pytest.raises(ConnectorContractError, match=match):
        llm.generate(PROMPT[:40] if promise == 48 else PROMPT)
    assert _calls(plan, "request_finished")[0][2] == []
    assert llm.kv_cache_manager.num_available_blocks() == NUM_BLOCKS
    assert not [e for e in llm.get_kv_cache_events(0) if e["data"]["type"] == "stored"]
    plan.promise, plan.force_async_flag = 0, None
    assert llm.generate(PROMPT).token_ids == _cold(PROMPT, max_new_tokens=1).token_ids


def test_generation_only_request_is_rejected_before_the_connector() -> None:
    plan = RecordingPlan()
    llm = _connected(plan)
    request = LlmRequest(99, PROMPT, 1, is_generation_only_request=True)
    with pytest.raises(RuntimeError, match="generation-only"):
        llm.connector.query(request, 0)
    assert not _calls(plan, "get_num_new_matched_tokens")


def test_async_load_parks_the_request_until_every_worker_reports_it() -> None:
    plan = RecordingPlan(promise=32, load_async=True, worker_delays=[1, 3], donor=_donor(PROMPT))
    llm = _connected(plan, workers=2)
    result = llm.generate(PROMPT, max_new_tokens=1)
    rid = result.request_id
    calls = plan.calls
    first_wait = plan.hooks().index("wait_for_layer_load")
    reports = [(i, c) for i, c in enumerate(calls) if c[0] == "get_finished" and rid in c[4]]
    assert [c[5] for _, c in reports] == [0, 1]  # rank 0 first, the slow rank 1 two rounds later
    (i0, _), (i1, _) = reports
    assert i0 < i1 < first_wait  # no forward while any worker still loads
    started = [c for c in calls if c[0] == "get_finished" and c[2]]
    assert [(c[2], c[5]) for c in started] == [([rid], 0), ([rid], 1)]  # each id passed once per rank
    reported = [o for o in plan.scheduler_outputs if o.new_requests]
    assert len(reported) == 1 and plan.scheduler_outputs.index(reported[0]) == 3
    assert reported[0].new_requests[0].computed_position == 32  # loads already recorded as done
    assert torch.equal(result.prefill_logits, _cold(PROMPT, max_new_tokens=1).prefill_logits[32:])


def test_attention_never_reads_a_layer_before_its_wait_returned() -> None:
    plan = RecordingPlan(promise=32, donor=_donor(PROMPT), layerwise=True)
    llm = _connected(plan, workers=2)
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


def test_worker_failure_fails_only_that_request() -> None:
    other = _prompt(40, seed=14)
    plan = RecordingPlan(promise=0)
    llm = _connected(plan)
    before = llm.generate(other, max_new_tokens=1)
    plan.promise, plan.donor = 32, _donor(PROMPT)
    plan.fail_hook, plan.fail_layer = "wait_for_layer_load", 1
    with pytest.raises(ConnectorWorkerError, match="wait_for_layer_load layer 1") as failure:
        llm.generate(PROMPT, max_new_tokens=2)
    assert (failure.value.hook, failure.value.layer_idx) == ("wait_for_layer_load", 1)
    failed_id = _calls(plan, "get_num_new_matched_tokens")[-1][1]
    assert _calls(plan, "request_finished")[-1][1] == failed_id
    assert llm.kv_cache_manager.num_available_blocks() == NUM_BLOCKS
    stored = {b["block_hash"] for e in llm.get_kv_cache_events(0) if e["data"]["type"] == "stored"
              for b in e["data"]["blocks"]}
    assert not stored & set(block_hash_chain(PROMPT, 8))  # nothing of the failed request stored
    plan.promise = 0
    again = llm.generate(other, max_new_tokens=1)
    assert again.num_reused_tokens == 32 and torch.equal(again.last_logits, before.last_logits)
    plan.promise = 32
    retry = llm.generate(PROMPT, max_new_tokens=2)
    assert torch.equal(retry.prefill_logits, _cold(PROMPT).prefill_logits[32:])


def test_newer_reset_hooks_recompute_a_failed_load_locally() -> None:
    plan = RecordingPlan(promise=32, donor=_donor(PROMPT), fail_hook="wait_for_layer_load", fail_layer=0)
    llm = _connected(plan, reset_hooks=True)
    result = llm.generate(PROMPT, max_new_tokens=2)
    rid = result.request_id
    assert result.recomputed_after_load_failure and result.num_connector_tokens == 0
    assert ("cancel_load", rid, 0, 32) in plan.calls and ("request_reset", rid) in plan.calls
    assert plan.scheduler_outputs[1].new_requests[0].computed_position == 0  # reported anew
    cold = _cold(PROMPT)
    assert torch.equal(result.prefill_logits, cold.prefill_logits)
    assert result.token_ids == cold.token_ids


def test_request_finished_true_keeps_blocks_until_every_worker_reports_the_save() -> None:
    plan = RecordingPlan(save_async=True, save_ready_after=3)
    llm = _connected(plan, workers=2)
    result = llm.generate(PROMPT, max_new_tokens=2)
    assert llm.kv_cache_manager.num_available_blocks() == NUM_BLOCKS - len(result.block_ids)
    llm.get_kv_cache_events(0)
    llm.wait_for_pending_transfers(timeout_s=5)
    assert llm.kv_cache_manager.num_available_blocks() == NUM_BLOCKS
    released = [e for e in llm.get_kv_cache_events(0) if e["data"]["type"] == "stored"]
    assert released and released[0]["data"]["blocks"][-1]["tokens"][-1]["token_id"] == result.token_ids[0]
    passed = [c for c in plan.calls if c[0] == "get_finished" and c[1]]
    assert [(c[1], c[5]) for c in passed] == [([result.request_id], 0), ([result.request_id], 1)]
