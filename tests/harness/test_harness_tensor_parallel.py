"""REFERENCE ENGINE HARNESS tests: tensor parallelism (TP = 2) in two processes, ``torch.distributed``
on gloo over 127.0.0.1 (tools/harness/tp.py), as TensorRT-LLM runs one MPI process per rank: the
model's heads and MLP split, each rank's pool holding its KV heads, the connector's scheduler on rank
0 only with every answer broadcast (``KvCacheConnectorManager._run_on_leader``, NVIDIA/TensorRT-LLM
``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py`` @ 035ab91cad04) and
``get_finished`` acting on an id only once every rank returned it (``mpi_allgather``)."""

from __future__ import annotations

import torch

from connector.harness import ExecutorStopped, HarnessLLM, TensorParallel
from connector.harness.recording_connector import RecordingPlan, make_recording_connector
from tests.harness.helpers import CFG, CHUNK, kvc, prompt
from tools.harness.tp import run_tensor_parallel

DOC = prompt(48, seed=51)
QUESTION = prompt(21, seed=52)


def _reuse_and_cold(tp: TensorParallel) -> dict:
    warm = HarnessLLM(CFG, kv_cache_config=kvc(), max_num_tokens=CHUNK, tensor_parallel=tp)
    warm.generate(DOC, 1)
    reused = warm.generate(DOC + QUESTION, 3)
    cold = HarnessLLM(CFG, kv_cache_config=kvc(enable_block_reuse=False), max_num_tokens=CHUNK,
                      tensor_parallel=tp).generate(DOC + QUESTION, 3)
    return {"pool": tuple(warm.kv_cache.shape), "reused": reused.num_reused_tokens,
            "reuse_logits": reused.prefill_logits, "cold_logits": cold.prefill_logits,
            "tokens": (reused.token_ids, cold.token_ids), "tp_size": warm.llm_args.tensor_parallel_size}


def test_tp2_splits_the_kv_heads_and_native_reuse_is_bit_identical_to_a_cold_prefill() -> None:
    ranks = run_tensor_parallel(_reuse_and_cold, 2)
    single = HarnessLLM(CFG, kv_cache_config=kvc(enable_block_reuse=False), max_num_tokens=CHUNK)
    reference = single.generate(DOC + QUESTION, 3)
    for rank in ranks:
        assert rank["tp_size"] == 2
        # each rank's pool: half the KV heads of a TP = 1 pool
        assert rank["pool"][3] * 2 == single.kv_cache.shape[3]
        assert rank["reused"] == 48
        assert torch.equal(rank["reuse_logits"], rank["cold_logits"][48:])
        assert rank["tokens"][0] == rank["tokens"][1] == reference.token_ids
        # the same model, computed split: close to TP = 1, not bit-identical (reduction order)
        assert torch.allclose(rank["cold_logits"], reference.prefill_logits, atol=1e-4)
    assert torch.equal(ranks[0]["cold_logits"], ranks[1]["cold_logits"])


def _recording(tp: TensorParallel) -> dict:
    # rank 1's worker reports the async save two get_finished calls later than rank 0's
    plan = RecordingPlan(promise=16, save_async=True, save_ready_after=1 + 2 * tp.rank)
    scheduler_cls, worker_cls = make_recording_connector(plan)
    llm = HarnessLLM(CFG, kv_cache_config=kvc(), kv_connector=(scheduler_cls, worker_cls), max_num_tokens=CHUNK,
                     tensor_parallel=tp)
    first = llm.submit(DOC, max_new_tokens=1)
    llm.step()
    llm.step()  # the first request finished: its save is pending on both ranks
    pending_after_rank0_done = []
    for _ in range(3):  # a second request keeps the executor iterating (an idle one calls nothing)
        if not pending_after_rank0_done:
            llm.submit(QUESTION + DOC, max_new_tokens=4)
        llm.step()
        pending_after_rank0_done.append(llm.pending_transfers())
    llm.run_until_idle()
    metas = [c for c in plan.calls if c[0] == "bind_connector_meta"]
    return {"scheduler": llm.connector.scheduler is not None, "hooks": plan.hooks(), "first": first,
            "binds": len(metas), "pending": pending_after_rank0_done, "done": llm.pending_transfers(),
            "loaded": llm.result(first).num_connector_tokens}


def test_the_scheduler_runs_on_rank_0_only_and_every_rank_acts_on_a_save_only_when_all_ranks_report_it() -> None:
    r0, r1 = run_tensor_parallel(_recording, 2)
    assert r0["scheduler"] and not r1["scheduler"]
    scheduler_hooks = {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                       "request_finished"}
    assert scheduler_hooks <= set(r0["hooks"]) and not scheduler_hooks & set(r1["hooks"])
    # rank 0's answer was broadcast: both ranks loaded the 16 promised tokens and bound every metadata
    assert r0["loaded"] == r1["loaded"] == 16 and r0["binds"] == r1["binds"] > 0
    # rank 0 reported the save first; neither rank released the blocks until rank 1 did too
    assert r0["pending"] == r1["pending"] and r0["pending"][0] == [r0["first"]]
    assert r0["first"] not in r0["done"] and r0["done"] == r1["done"]


def _leader_raises(tp: TensorParallel) -> dict:
    plan = RecordingPlan(promise=0, fail_hook="build_connector_meta")
    scheduler_cls, worker_cls = make_recording_connector(plan)
    llm = HarnessLLM(CFG, kv_cache_config=kvc(), kv_connector=(scheduler_cls, worker_cls), max_num_tokens=CHUNK,
                     tensor_parallel=tp)
    try:
        llm.generate(DOC, 1)
    except ExecutorStopped as stop:
        return {"hook": stop.hook, "cause": type(stop.__cause__).__name__, "message": str(stop),
                "stopped": llm.stopped is not None, "binds": plan.hooks().count("bind_connector_meta")}
    return {}


def test_the_leaders_scheduler_raising_stops_every_ranks_executor_together() -> None:
    """TensorRT-LLM broadcasts the leader's result; an exception there ends rank 0's loop, and the
    harness broadcasts it so the other ranks stop too rather than wait in the broadcast forever."""
    r0, r1 = run_tensor_parallel(_leader_raises, 2)
    assert r0["hook"] == r1["hook"] == "build_connector_meta" and r0["stopped"] and r1["stopped"]
    assert r0["cause"] == "RuntimeError" and r1["cause"] == "LeaderError"
    assert "tensor-parallel rank 0 raised" in r1["message"] and r0["binds"] == r1["binds"] == 0
