"""The donor view's lag (ledger/donor_view.py): a donor that goes stale after the scheduler's view
last caught up is still promised, and the ledger lease, written once the blocks are allocated,
refuses it. On TensorRT-LLM that is a freshness signal: the promise holds its secured bytes, which
are still exactly the KV of those tokens, and is kept. On vLLM the plan ships failed and vLLM
recomputes it. With ``lease_before_answer`` it is a plain miss. Never a wrong load, never a leaked
lease (DESIGN §2 rules 3, 6 and 7)."""

from __future__ import annotations

import time

import torch

from tools.harness.fleet import Engine, Fleet, close_connector
from tests.connector.test_ledger_busy import promise_and_ship
from tests.connector.test_negative_controls import DOC, QUESTION, assert_missed, donor_on_a
from tests.connector.test_two_engines import native_engine


def _stale_after_the_view(fleet: Fleet, **b_kw) -> Engine:
    """B's view shows A's fresh donor; then A restarts and the ledger learns it, but B's view has
    not caught up yet (its tick is an hour): B promises, and the lease must refuse."""
    donor_on_a(fleet)
    b = fleet.engine("B", donor_view_refresh_s=3600, **b_kw)
    assert b.scheduler.spans.view.ready and b.scheduler.spans.view.stats()["donors"] == 1
    _restart_a_behind_the_view(fleet)
    return b


def _restart_a_behind_the_view(fleet: Fleet) -> None:
    fleet.restart("A")
    for engine in fleet.engines.values():
        fleet.pump(engine)
    engine = fleet.ledger()
    try:
        deadline = time.monotonic() + 20
        while engine.engine("A").generation < 2:  # the ledger knows; B's view does not
            assert time.monotonic() < deadline
            time.sleep(0.005)
    finally:
        engine.close()


def test_on_trtllm_a_promise_the_ledger_then_refuses_is_kept_from_its_secured_bytes(fleet: Fleet) -> None:
    b = _stale_after_the_view(fleet)
    result = b.generate(DOC + QUESTION)
    assert b.metrics.value("semkv_promises_total") == 1  # promised from the view ...
    assert b.metrics.value("semkv_stale_after_promise_total", reason="donor_quarantined") >= 1  # ... a signal
    assert result.num_connector_tokens == len(DOC) and b.llm.stopped is None
    native = native_engine()
    native.generate(DOC, 1)
    assert torch.equal(result.prefill_logits, native.generate(DOC + QUESTION, 1).prefill_logits)
    assert fleet.held_leases() == 0
    b.scheduler.sync_view()  # caught up: the next lookup misses
    assert b.generate(DOC + QUESTION[:5]).num_connector_tokens == 0


def test_on_vllm_a_promise_the_ledger_refuses_ships_failed_for_vllm_to_recompute(fleet: Fleet) -> None:
    donor_on_a(fleet)
    llm_args = fleet.engine("B", connector=False).llm.llm_args
    scheduler, worker = fleet.vllm_connector("B", llm_args, donor_view_refresh_s=3600)
    try:
        assert scheduler.spans.view.ready and scheduler.spans.view.stats()["donors"] == 1
        _restart_a_behind_the_view(fleet)
        plan = promise_and_ship(scheduler, 901)
        assert plan.failed and "went stale before its lease" in plan.failed
        assert scheduler.metrics.value("semkv_promises_broken_total", reason="donor_quarantined") == 1
        scheduler.flush()
        assert fleet.held_leases() == 0
    finally:
        close_connector(scheduler, worker)


def test_lease_before_answer_turns_that_stale_donor_into_a_miss(fleet: Fleet) -> None:
    """``lease_before_answer``: the lease is written before the answer, so the same stale view gives
    a counted miss, no promise, and the request computes normally."""
    b = _stale_after_the_view(fleet, lease_before_answer=True)
    assert_missed(b, b.generate(DOC + QUESTION), "donor_quarantined")
    assert b.metrics.value("semkv_promises_broken_total", reason="donor_quarantined") == 0
    b.scheduler.flush()
    assert fleet.held_leases() == 0


def test_the_view_checksums_new_donors_off_the_engines_path(fleet: Fleet) -> None:
    """A donor entering the view is verified in the background, so its first lookup does not read
    and checksum the entry on the engine's thread; a corrupt entry found that way is evicted."""
    donor_on_a(fleet)
    b = fleet.engine("B")
    b.scheduler.flush()
    [donor] = b.scheduler.spans.view._donors.values()
    assert b.scheduler.store.verified(donor.store_ref, donor.checksum)  # before any lookup
    assert b.generate(DOC + QUESTION).num_connector_tokens == len(DOC)


def test_lease_before_answer_has_its_own_deadline_long_enough_for_a_lease_write(fleet: Fleet) -> None:
    """A lease write takes milliseconds (more on PostgreSQL): under the 2 ms lookup deadline every
    hit would be a timeout. With ``lease_before_answer`` the lookup runs under
    ``lease_in_lookup_timeout_s`` instead, whatever ``lookup_timeout_s`` says."""
    a = fleet.engine("A")
    a.generate(DOC)
    fleet.sync()
    b = fleet.engine("B", lease_before_answer=True, lookup_timeout_s=1e-6)
    assert b.generate(DOC + QUESTION).num_connector_tokens == len(DOC)
    b.scheduler.flush()
    assert fleet.held_leases() == 0
