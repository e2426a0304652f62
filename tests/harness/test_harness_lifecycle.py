"""REFERENCE ENGINE HARNESS tests: request lifecycles as each modelled TensorRT-LLM version runs them.

Which exits call ``request_finished``; which hook exceptions stop the executor and which fail the
active requests; that an idle engine calls nothing; metadata only on scheduled iterations; chunked
prefill; concurrent requests; the all-ranks rule of ``get_finished``.
"""

from __future__ import annotations

import pytest
import torch

from connector.harness import TRTLLM_VERSIONS, ConnectorWorkerError, ExecutorStopped
from connector.block_keys import block_hash_chain
from connector.harness.recording_connector import RecordingPlan
from tests.harness.helpers import FORWARD, NUM_BLOCKS, calls, cold, connected, donor, plain, prompt
from tests.harness.helpers import stored_hashes

PROMPT = prompt(45, seed=11)
OTHER = prompt(40, seed=14)
VERSIONS = pytest.mark.parametrize("version", TRTLLM_VERSIONS, ids=lambda v: v.name)


def _finished_ids(plan: RecordingPlan) -> list[int]:
    return [c[1] for c in calls(plan, "request_finished")]


def _hooks_per_iteration(llm, plan: RecordingPlan) -> list[list[str]]:
    """Step until the loop blocks; the connector calls of each iteration."""
    iterations = []
    while True:
        before = len(plan.calls)
        if not llm.step():
            assert len(plan.calls) == before  # a blocked loop calls nothing
            return iterations
        iterations.append(plan.hooks()[before:])


# ------------------------------------------------------------------ (a) exits calling request_finished
@VERSIONS
def test_completion_calls_request_finished_once_with_the_block_ids(version) -> None:
    plan = RecordingPlan()
    llm = connected(plan, version=version)
    result = llm.generate(PROMPT, max_new_tokens=3)
    assert calls(plan, "request_finished") == [("request_finished", result.request_id, result.block_ids)]
    assert llm.kv_cache_manager.num_available_blocks() == NUM_BLOCKS


@VERSIONS
def test_an_error_inside_the_forward_calls_request_finished_only_where_termination_does(version) -> None:
    """A 2-request batch plus a parked request: all three fail; only the terminate-era executor tells
    the connector (for each request with a KV sequence, the parked one included)."""
    parked = prompt(48, seed=15)
    plan = RecordingPlan(promise=lambda req, n: 32 if req.prompt_len == 48 else 0, load_async=True,
                         async_ready_after=10**9, fail_hook="wait_for_layer_load", fail_layer=1)
    llm = connected(plan, version=version)
    ids = [llm.submit(PROMPT, 2), llm.submit(OTHER, 2), llm.submit(parked, 2)]
    llm.run_until_idle()
    for request_id in ids:
        with pytest.raises(ConnectorWorkerError, match="wait_for_layer_load layer 1") as failure:
            llm.result(request_id)
        assert (failure.value.hook, failure.value.layer_idx) == ("wait_for_layer_load", 1)
    expected = ids if version.request_finished_on_every_termination else []
    assert sorted(_finished_ids(plan)) == expected
    assert llm.stopped is None and llm.kv_cache_manager.num_available_blocks() == NUM_BLOCKS


@VERSIONS
def test_cancel_calls_request_finished_only_where_termination_does(version) -> None:
    plan = RecordingPlan()
    llm = connected(plan, version=version)
    request_id = llm.submit(PROMPT, max_new_tokens=8)
    llm.step()
    llm.step()  # the prefill is done: one token
    llm.cancel(request_id)
    assert llm.step() and llm.step() is False  # applied after the next forward
    result = llm.result(request_id)
    assert result.finish_reason == "cancelled" and len(result.token_ids) == 2
    assert _finished_ids(plan) == ([request_id] if version.request_finished_on_every_termination else [])
    assert llm.kv_cache_manager.num_available_blocks() == NUM_BLOCKS


@VERSIONS
def test_a_request_cancelled_while_waiting_just_leaves(version) -> None:
    plan = RecordingPlan()
    llm = connected(plan, version=version, max_batch_size=1)
    first, waiting = llm.submit(PROMPT, 2), llm.submit(OTHER, 2)
    llm.cancel(waiting)
    llm.run_until_idle()
    assert llm.result(waiting).finish_reason == "cancelled" and llm.result(waiting).token_ids == []
    assert llm.result(first).finish_reason == "length"
    touched = {c[1] for c in plan.calls if c[0] in ("get_num_new_matched_tokens", "request_finished")}
    assert touched == {first}


# ------------------------------------------------------------------ (b) exceptions
STOPPING_HOOKS = ["get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                  "start_load_kv", "request_finished", "get_finished"]


@VERSIONS
@pytest.mark.parametrize("hook", STOPPING_HOOKS)
def test_an_exception_outside_the_forward_stops_the_executor(version, hook) -> None:
    plan = RecordingPlan(fail_hook=hook)
    llm = connected(plan, version=version, max_batch_size=2)
    ids = [llm.submit(PROMPT, 1), llm.submit(OTHER, 1), llm.submit(prompt(20, seed=16), 1)]  # one waits
    with pytest.raises(ExecutorStopped) as stop:
        llm.run_until_idle()
    assert stop.value.hook == hook and "injected failure" in str(stop.value.__cause__)
    assert plan.hooks()[-1] == hook  # the failing call is the last call, ever
    # terminate-era: request_finished runs after _handle_responses enqueued the finished requests'
    # responses; those requests keep their results
    answered = 2 if hook == "request_finished" and version.request_finished_on_every_termination else 0
    assert [llm.result(request_id).finish_reason for request_id in ids[:answered]] == ["length"] * answered
    for request_id in ids[answered:]:
        with pytest.raises(ExecutorStopped) as failed:
            llm.result(request_id)
        assert failed.value.hook == hook and failed.value.__cause__ is stop.value.__cause__
    calls_at_stop = len(plan.calls)
    with pytest.raises(ExecutorStopped) as later:
        llm.generate(PROMPT)
    assert later.value.__cause__ is stop.value.__cause__
    with pytest.raises(ExecutorStopped):
        llm.step()
    assert llm.active_request_ids() == [] and len(plan.calls) == calls_at_stop
    assert llm.stopped is stop.value


@pytest.mark.parametrize("case", ["never_passed_in", "returned_twice"])
def test_a_worker_returning_an_id_not_pending_stops_the_executor(case) -> None:
    plan = RecordingPlan(save_async=True)
    llm = connected(plan)
    done = llm.generate(PROMPT)  # its save is reported in the same iteration
    assert llm.pending_transfers() == []
    plan.extra_finished = ([10**6], []) if case == "never_passed_in" else ([done.request_id], [])
    with pytest.raises(ExecutorStopped, match="not pending") as stop:
        llm.generate(OTHER)
    assert stop.value.hook == "get_finished" and isinstance(stop.value.__cause__, KeyError)


@VERSIONS
@pytest.mark.parametrize("hook", ["wait_for_layer_load", "save_kv_layer", "wait_for_save"])
def test_an_exception_inside_the_forward_fails_the_batch_stores_its_blocks_and_the_loop_goes_on(
        version, hook) -> None:
    plan = RecordingPlan(fail_hook=hook, fail_layer=None if hook == "wait_for_save" else 1)
    llm = connected(plan, version=version)
    a, b = llm.submit(PROMPT, 2), llm.submit(OTHER, 2)
    llm.run_until_idle()
    for request_id in (a, b):
        with pytest.raises(ConnectorWorkerError, match=hook):
            llm.result(request_id)
    stored = stored_hashes(llm)  # released with store_for_reuse: full blocks of the first chunk
    assert set(block_hash_chain(PROMPT[:32], 8)) <= stored and set(block_hash_chain(OTHER[:32], 8)) <= stored
    assert llm.stopped is None
    again = llm.generate(prompt(30, seed=17), max_new_tokens=2)
    assert again.token_ids == cold(prompt(30, seed=17)).token_ids


def test_blocks_stored_after_a_layer_failure_are_reused_with_their_unwritten_layers() -> None:
    """The danger TensorRT-LLM's release path carries: layer 1 of the failed first chunk was never
    computed, nor any layer of the second chunk, yet every full block of ``tokens[:-1]`` is in the
    reuse tree and the next request reads them."""
    plan = RecordingPlan(fail_hook="wait_for_layer_load", fail_layer=1)
    llm = connected(plan)
    with pytest.raises(ConnectorWorkerError):
        llm.generate(PROMPT, max_new_tokens=2)
    again = llm.generate(PROMPT, max_new_tokens=2)
    assert again.num_reused_tokens == 40  # 5 full blocks of the 44 tokens before the last
    assert not torch.equal(again.prefill_logits, cold(PROMPT).prefill_logits[40:])


# ------------------------------------------------------------------ (c) an idle engine
@VERSIONS
def test_an_idle_engine_calls_nothing_so_a_later_save_report_waits_for_the_next_request(version) -> None:
    plan = RecordingPlan(save_async=True, save_ready_after=3)
    llm = connected(plan, version=version)
    result = llm.generate(PROMPT, max_new_tokens=2)
    rid, calls_when_done = result.request_id, len(plan.calls)
    assert llm.pending_transfers() == [rid]
    held = NUM_BLOCKS - len(result.block_ids)
    assert llm.kv_cache_manager.num_available_blocks() == held
    # stored (and pinned) when the save starts, or only when it ends (terminate era)
    assert llm.kv_cache_manager.num_stored_blocks() == (5 if version.request_finished_on_every_termination else 6)
    with pytest.raises(TimeoutError, match=f"\\[{rid}\\].*idle engine"):
        llm.wait_for_pending_transfers(timeout_s=5)
    assert llm.step() is False
    llm.shutdown()
    assert len(plan.calls) == calls_when_done and llm.pending_transfers() == [rid]
    assert llm.kv_cache_manager.num_available_blocks() == held
    plan.save_async = False
    llm.generate(OTHER, max_new_tokens=3)  # its iterations' get_finished report the save
    assert llm.pending_transfers() == [] and llm.kv_cache_manager.num_available_blocks() == NUM_BLOCKS
    assert llm.kv_cache_manager.num_stored_blocks() >= 6
    passed = [c for c in calls(plan, "get_finished") if c[1]]
    assert [c[1] for c in passed] == [[rid]]  # the id is passed exactly once
    llm.wait_for_pending_transfers(timeout_s=0)  # nothing pending: returns at once


# ------------------------------------------------------------------ (d) metadata on scheduled iterations
@VERSIONS
def test_metadata_and_loads_only_in_iterations_that_schedule(version) -> None:
    plan = RecordingPlan(promise=32, load_async=True, async_ready_after=3, donor=donor(PROMPT))
    llm = connected(plan, version=version)
    request_id = llm.submit(PROMPT, max_new_tokens=1)
    iterations = _hooks_per_iteration(llm, plan)
    assert iterations == [
        ["get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "bind_connector_meta", "start_load_kv", "get_finished"],  # parked: the forward is skipped
        ["get_finished"],
        ["get_finished"],  # every worker reported the load
        [*FORWARD, "request_finished", "get_finished"],
    ]
    assert torch.equal(llm.result(request_id).prefill_logits, cold(PROMPT, 1).prefill_logits[32:])


# ------------------------------------------------------------------ (e) chunked prefill
def test_chunked_prefill_asks_once_and_excludes_connector_tokens_on_the_first_report_only() -> None:
    tokens = prompt(100, seed=18)
    plan = RecordingPlan(promise=32, donor=donor(tokens))
    llm = connected(plan)
    result = llm.generate(tokens, max_new_tokens=2)
    assert len(calls(plan, "get_num_new_matched_tokens")) == 1
    assert len(calls(plan, "update_state_after_alloc")) == 1
    reports = [(kind, d.computed_position, d.num_scheduled_tokens, len(d.new_tokens), len(d.new_block_ids))
               for o in plan.scheduler_outputs
               for kind, batch in (("new", o.new_requests), ("cached", o.cached_requests)) for d in batch]
    assert reports == [("new", 0, 32, 100, 13),  # chunk [32, 64): 32 - the connector's 32
                       ("cached", 64, 32, 0, 0),  # chunk [64, 96)
                       ("cached", 96, 4, 0, 0),   # chunk [96, 100)
                       ("cached", 100, 1, 1, 0)]  # the decode step
    assert torch.equal(result.prefill_logits, cold(tokens).prefill_logits[32:])


# ------------------------------------------------------------------ (f) concurrent requests
def test_two_concurrent_requests_share_each_forward_and_give_their_sequential_logits() -> None:
    a, b = prompt(70, seed=21), PROMPT
    sequential = plain()
    expected = [sequential.generate(a, 3), sequential.generate(b, 3)]
    plan = RecordingPlan()
    llm = connected(plan, workers=2)
    seen_batches: list[list[int]] = []
    llm.add_forward_observer(lambda event, layer, ids: seen_batches.append(ids)
                             if event == "attention_read" and layer == 0 else None)
    ids = [llm.submit(a, 3), llm.submit(b, 3)]
    llm.run_until_idle()
    for request_id, want in zip(ids, expected):
        got = llm.result(request_id)
        assert torch.equal(got.prefill_logits, want.prefill_logits) and got.token_ids == want.token_ids
    assert seen_batches[0] == ids  # one forward for both requests
    per_forward = len(calls(plan, "wait_for_save"))
    assert len(calls(plan, "wait_for_layer_load")) == per_forward * 2  # 2 layers, once per layer per rank


# ------------------------------------------------------------------ (g) the all-ranks rule
def test_a_save_is_acted_on_only_when_every_worker_reported_it() -> None:
    plan = RecordingPlan(save_async=lambda request: request.prompt_len == len(PROMPT),
                         save_worker_delays=[1, 3])
    llm = connected(plan, workers=2)
    saving, busy = llm.submit(PROMPT, 1), llm.submit(OTHER, 6)  # `busy` keeps the loop awake
    pending_after = []
    while llm.step():
        pending_after.append(llm.pending_transfers())
    assert pending_after[:4] == [[], [saving], [saving], []]  # finished at iteration 2
    reports = [(c[5], i) for i, c in enumerate(plan.calls) if c[0] == "get_finished" and saving in c[3]]
    assert [rank for rank, _ in reports] == [0, 1]
    passed = [(c[1], c[5]) for c in calls(plan, "get_finished") if c[1]]
    assert passed == [([saving], 0), ([saving], 1)]  # once per rank
    assert llm.result(busy).finish_reason == "length"


# ------------------------------------------------------------------ lifecycle observers
def test_lifecycle_points_come_in_iteration_order() -> None:
    plan = RecordingPlan(promise=32, donor=donor(PROMPT))
    llm = connected(plan)
    points: list[tuple[str, list[int]]] = []
    llm.add_lifecycle_observer(lambda point, ids: points.append((point, ids)))
    rid = llm.generate(PROMPT, max_new_tokens=2).request_id
    forward = [("after_build_connector_meta", [rid]), ("after_start_load_kv", [rid]), ("after_forward", [rid])]
    assert points == [("after_get_num_new_matched_tokens", [rid]), ("after_update_state_after_alloc", [rid]),
                      *forward, ("after_get_finished", []),
                      *forward, ("after_request_finished", [rid]), ("after_get_finished", [])]


def test_an_observer_exception_propagates_unchanged_and_is_no_engine_event() -> None:
    plan = RecordingPlan()
    llm = connected(plan)

    def broken(point: str, ids: list[int]) -> None:
        if point == "after_start_load_kv":
            raise LookupError("a bug in the test")

    llm.add_lifecycle_observer(broken)
    with pytest.raises(LookupError, match="a bug in the test"):
        llm.generate(PROMPT)
    assert llm.stopped is None
