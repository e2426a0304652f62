"""REFERENCE ENGINE HARNESS tests: ``HarnessLLM`` without a connector — reuse, logits, events,
batching, capacity, cancel."""

from __future__ import annotations

import threading

import pytest
import torch

from connector.harness import (
    HarnessLLM,
    KvCacheCapacityError,
    KvCacheConfig,
    KvCacheRetentionConfig,
    ModelConfig,
    TokenRangeRetentionConfig,
)
from connector.block_keys import block_hash_chain

CFG = ModelConfig(vocab_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=64, tokens_per_block=8, max_context=512)
CHUNK = 32


def _engine(**kv) -> HarnessLLM:
    kvc = KvCacheConfig(tokens_per_block=8, max_tokens=1024, event_buffer_max_size=1000, **kv)
    return HarnessLLM(CFG, kv_cache_config=kvc, max_num_tokens=CHUNK)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_native_reuse_gives_bit_identical_logits_to_recomputing_the_same_chunks() -> None:
    prefix = _prompt(2 * CHUNK, seed=1)  # reuse boundary = 2 chunks: chunk grids line up
    first, second = prefix + _prompt(11, seed=2), prefix + _prompt(21, seed=3)
    warm = _engine()
    warm.generate(first, max_new_tokens=2)
    reused = warm.generate(second, max_new_tokens=4)
    assert reused.num_reused_tokens == len(prefix) == reused.prefill_start
    cold = _engine(enable_block_reuse=False).generate(second, max_new_tokens=4)
    assert cold.num_reused_tokens == 0 and cold.prefill_logits.shape[0] == len(second)
    assert torch.equal(reused.prefill_logits, cold.prefill_logits[len(prefix):])
    assert reused.token_ids == cold.token_ids


def test_generate_matches_dense_reference_and_reports_timing() -> None:
    llm = _engine()
    prompt = _prompt(70, seed=4)
    result = llm.generate(prompt, max_new_tokens=3)
    dense = llm.model.forward_dense(prompt + result.token_ids)
    torch.testing.assert_close(result.prefill_logits, dense[: len(prompt)], atol=1e-4, rtol=1e-4)
    assert result.token_ids == [int(t) for t in dense[len(prompt) - 1 : -1].argmax(-1)]
    assert result.prefill_seconds > 0 and result.num_connector_tokens == 0
    assert result.last_logits.shape == (CFG.vocab_size,)


def test_partial_reuse_copies_the_leading_tokens_of_a_partly_matching_block() -> None:
    """TensorRT-LLM's ``enable_partial_reuse``: 3 full blocks and 5 tokens of the 4th are reused
    (``num_computed_tokens`` unaligned), and the prompt's logits still equal a dense forward."""
    llm = _engine(enable_partial_reuse=True)
    first = _prompt(4 * 8 + 2, seed=40)
    llm.generate(first, max_new_tokens=1)
    second = first[: 3 * 8 + 5] + _prompt(20, seed=41)
    second[3 * 8 + 5] = (first[3 * 8 + 5] + 1) % CFG.vocab_size  # the 4th block differs from its 6th token
    got = llm.generate(second, max_new_tokens=2)
    assert got.num_reused_tokens == 3 * 8 + 5 == got.prefill_start
    dense = llm.model.forward_dense(second + got.token_ids)
    torch.testing.assert_close(got.prefill_logits, dense[got.prefill_start: len(second)], atol=1e-4, rtol=1e-4)
    full_only = _engine()
    full_only.generate(first, max_new_tokens=1)
    assert full_only.generate(second, max_new_tokens=1).num_reused_tokens == 3 * 8  # off: whole blocks only


def test_partial_last_block_is_stored_at_finish_and_never_matched() -> None:
    llm = _engine()
    prompt = _prompt(13, seed=5)  # prompt[:-1] = 12 tokens: one full block of 8 at context end
    result = llm.generate(prompt, max_new_tokens=2)
    stored = [e for e in llm.get_kv_cache_events(0) if e["data"]["type"] == "stored"]
    context, release = stored
    assert [len(b["tokens"]) for b in context["data"]["blocks"]] == [8]
    # at finish: prompt + 2 generated - 1 = 14 tokens -> the partial block of 6 tokens
    assert [len(b["tokens"]) for b in release["data"]["blocks"]] == [6]
    assert release["data"]["parent_hash"] == context["data"]["blocks"][0]["block_hash"]
    tail = [t["token_id"] for t in release["data"]["blocks"][0]["tokens"]]
    assert tail == prompt[8:] + result.token_ids[:1]
    assert llm.generate(prompt, max_new_tokens=1).num_reused_tokens == 8


def test_salt_and_lora_isolation_through_generate_and_event_hashes() -> None:
    llm = _engine()
    prompt = _prompt(33, seed=6)
    llm.generate(prompt, cache_salt="tenant-A")
    assert llm.generate(prompt, cache_salt="tenant-B").num_reused_tokens == 0
    assert llm.generate(prompt, lora_task_id=3).num_reused_tokens == 0
    assert llm.generate(prompt, cache_salt="tenant-A").num_reused_tokens == 32
    # max_new_tokens=1 finishes in the context iteration: one stored event at release, 4 full
    # blocks of prompt + first token minus one, then the 1-token partial block
    first_stored = next(e for e in llm.get_kv_cache_events(0) if e["data"]["type"] == "stored")
    hashes = [b["block_hash"] for b in first_stored["data"]["blocks"]]
    assert hashes[:4] == block_hash_chain(prompt[:32], 8, cache_salt="tenant-A")
    assert len(first_stored["data"]["blocks"][4]["tokens"]) == 1


def test_retention_priorities_reach_stored_events() -> None:
    llm = _engine()
    retention = KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 8, 90)])
    llm.generate(_prompt(25, seed=7), kv_cache_retention_config=retention)
    stored = next(e for e in llm.get_kv_cache_events(0) if e["data"]["type"] == "stored")
    assert [b["priority"] for b in stored["data"]["blocks"]] == [90, 35, 35, 35]


def test_two_engines_share_nothing_but_compute_the_same_kv() -> None:
    a, b = _engine(), _engine()
    prompt = _prompt(40, seed=8)
    ra = a.generate(prompt, max_new_tokens=2)
    assert a.generate(prompt).num_reused_tokens == 32
    rb = b.generate(prompt, max_new_tokens=2)
    assert rb.num_reused_tokens == 0 and torch.equal(ra.prefill_logits, rb.prefill_logits)
    assert [e["event_id"] for e in b.get_kv_cache_events(0)] == [0, 1, 2]


def test_events_can_be_drained_from_another_thread() -> None:
    llm = _engine()
    llm.get_kv_cache_events(0)
    received: list[dict] = []
    reader = threading.Thread(target=lambda: received.extend(llm.get_kv_cache_events(timeout=5)))
    reader.start()
    llm.generate(_prompt(20, seed=9))
    reader.join(timeout=10)
    assert received and received[0]["data"]["type"] == "stored"


def test_input_validation() -> None:
    llm = _engine()
    with pytest.raises(ValueError):
        llm.generate([])
    with pytest.raises(ValueError):
        llm.generate([CFG.vocab_size])
    with pytest.raises(ValueError):
        llm.generate([1] * 510, max_new_tokens=5)
    with pytest.raises(ValueError):
        HarnessLLM(CFG, max_num_tokens=12)


def test_requests_beyond_max_batch_size_wait_their_turn_fifo() -> None:
    llm = HarnessLLM(CFG, kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=1024),
                     max_num_tokens=CHUNK, max_batch_size=2)
    ids = [llm.submit(_prompt(20, seed=30 + i), max_new_tokens=3) for i in range(3)]
    assert llm.active_request_ids() == []  # nothing runs before step()
    assert llm.step() and llm.active_request_ids() == ids[:2]
    llm.run_until_idle()
    assert llm.active_request_ids() == [] and llm.step() is False
    for i, request_id in enumerate(ids):
        alone = _engine().generate(_prompt(20, seed=30 + i), max_new_tokens=3)
        assert torch.equal(llm.result(request_id).prefill_logits, alone.prefill_logits)


def test_a_request_waits_for_blocks_and_one_the_pool_can_never_hold_fails() -> None:
    llm = HarnessLLM(CFG, kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=80,
                                                        enable_block_reuse=False), max_num_tokens=CHUNK)
    first, second = llm.submit(_prompt(60, seed=40), 4), llm.submit(_prompt(60, seed=41), 4)
    llm.step()
    assert llm.active_request_ids() == [first, second]  # both active, only the first scheduled
    assert llm.kv_cache_manager.num_available_blocks() == 10 - 8
    llm.run_until_idle()
    assert llm.result(second).token_ids == _engine().generate(_prompt(60, seed=41), 4).token_ids
    with pytest.raises(KvCacheCapacityError):
        llm.generate(_prompt(100, seed=42))


def test_cancel_and_result_api() -> None:
    llm = _engine()
    request_id = llm.submit(_prompt(70, seed=43), max_new_tokens=5)
    with pytest.raises(RuntimeError, match="not done"):
        llm.result(request_id)
    llm.step()  # first chunk of three
    llm.cancel(request_id)
    llm.run_until_idle()
    result = llm.result(request_id)
    assert result.finish_reason == "cancelled" and result.token_ids == []
    assert (result.prefill_start, result.prefill_logits.shape[0]) == (0, 2 * CHUNK)  # cancelled mid-prefill
    assert llm.kv_cache_manager.num_available_blocks() == 128
    llm.cancel(request_id)  # finished: no-op
    llm.cancel(12345)  # unknown: no-op
    with pytest.raises(KeyError):
        llm.result(12345)
    assert llm.step() is False
