"""REFERENCE ENGINE HARNESS tests: attention data parallelism as TensorRT-LLM 2026 main runs it — one
harness engine per rank, each with its own scheduler, worker and KV pool; the rank in its KV events
and in every ``SchedulerOutput``; ``llm_args`` saying ``enable_attention_dp`` with
``tensor_parallel_size`` = the number of ranks; a connector that does not opt in refused at
bring-up (``KvCacheConnectorManager.validate_attention_dp``, NVIDIA/TensorRT-LLM
``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py`` @ 035ab91cad04)."""

from __future__ import annotations

import pytest
import torch

from connector._trtllm import KvCacheConnectorScheduler, KvCacheConnectorWorker
from connector.harness import TRTLLM_1X, HarnessLLM
from connector.harness.recording_connector import RecordingPlan, make_recording_connector
from tests.harness.helpers import CFG, CHUNK, cold, connected, donor, kvc, prompt

PROMPT = prompt(45, seed=41)


def rank(plan: RecordingPlan, r: int, size: int = 2, **kw) -> HarnessLLM:  # noqa: ANN003
    return connected(plan, attention_dp_rank=r, attention_dp_size=size, **kw)


def test_each_rank_is_its_own_scheduler_pool_and_event_stream() -> None:
    plans = [RecordingPlan(promise=0), RecordingPlan(promise=0)]
    ranks = [rank(plans[r], r) for r in (0, 1)]
    for llm in ranks:
        assert llm.llm_args.enable_attention_dp and llm.llm_args.tensor_parallel_size == 2
    ranks[0].generate(PROMPT)
    # only rank 0's scheduler saw the request; rank 1's pool and reuse tree are untouched
    assert "get_num_new_matched_tokens" in plans[0].hooks() and "get_num_new_matched_tokens" not in plans[1].hooks()
    assert ranks[0].kv_cache_manager.stored_block_hashes() and not ranks[1].kv_cache_manager.stored_block_hashes()
    assert ranks[0].kv_cache.data_ptr() != ranks[1].kv_cache.data_ptr()
    assert all(o.attention_dp_rank == 0 for o in plans[0].scheduler_outputs)
    # the same prompt on rank 1 is not a device hit there: each rank reuses its own blocks only
    assert ranks[1].generate(PROMPT).num_reused_tokens == 0
    assert all(o.attention_dp_rank == 1 for o in plans[1].scheduler_outputs)
    events = {r: ranks[r].get_kv_cache_events(0) for r in (0, 1)}
    assert {e["attention_dp_rank"] for e in events[0]} == {0} and {e["attention_dp_rank"] for e in events[1]} == {1}
    assert [e["data"]["type"] for e in events[1]][:2] == ["created", "stored"]


def test_a_rank_materializes_bit_identically_to_cold_prefill() -> None:
    plan = RecordingPlan(promise=32, donor=donor(PROMPT))
    llm = rank(plan, 1)
    result = llm.generate(PROMPT, max_new_tokens=2)
    assert (result.num_connector_tokens, result.prefill_start) == (32, 32)
    reference = cold(PROMPT)
    assert torch.equal(result.prefill_logits, reference.prefill_logits[32:])
    assert result.token_ids == reference.token_ids


@pytest.mark.parametrize("missing", ["scheduler", "worker"])
def test_a_connector_that_does_not_opt_in_is_refused_at_bring_up(missing: str) -> None:
    scheduler_cls, worker_cls = make_recording_connector(RecordingPlan(promise=0))
    refused = {"supports_attention_dp": False}
    if missing == "scheduler":
        scheduler_cls = type("NoAdpScheduler", (scheduler_cls,), refused)
    else:
        worker_cls = type("NoAdpWorker", (worker_cls,), refused)
    with pytest.raises(NotImplementedError, match="supports_attention_dp=True"):
        HarnessLLM(CFG, kv_cache_config=kvc(), kv_connector=(scheduler_cls, worker_cls), max_num_tokens=CHUNK,
                   attention_dp_rank=0, attention_dp_size=2)
    # without attention DP the same classes are fine, and so are the ABCs' defaults (False)
    HarnessLLM(CFG, kv_cache_config=kvc(), kv_connector=(scheduler_cls, worker_cls), max_num_tokens=CHUNK)
    assert getattr(KvCacheConnectorScheduler, "supports_attention_dp", False) is False
    assert getattr(KvCacheConnectorWorker, "supports_attention_dp", False) is False


def test_1x_has_no_attention_dp_rank_to_report() -> None:
    plan = RecordingPlan(promise=0)
    rank(plan, 1, version=TRTLLM_1X).generate(PROMPT)
    assert not hasattr(plan.scheduler_outputs[0], "attention_dp_rank")


def test_a_rank_outside_the_ranks_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="attention_dp_rank=2 is not one of 2"):
        rank(RecordingPlan(promise=0), 2, size=2)
