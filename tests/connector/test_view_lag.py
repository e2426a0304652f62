"""The donor view's lag (ledger/donor_view.py): a donor that goes stale after the scheduler's view
last caught up is still promised; the ledger lease, written once the blocks are allocated, refuses it, and
the plan ships failed — the request is recomputed where the engine can, fails closed on TensorRT-LLM
1.2, and with ``lease_before_answer`` it is a plain miss. Never a load of the stale donor, never a
leaked lease (DESIGN §2 rules 3, 6 and 7)."""

from __future__ import annotations

import time

import pytest
import torch

from connector.harness.connector_driver import ConnectorWorkerError
from tests.connector.conftest import Engine, Fleet, _shared_model
from tests.connector.test_negative_controls import DOC, QUESTION, assert_missed, donor_on_a


def _stale_after_the_view(fleet: Fleet, **b_kw) -> Engine:
    """B's view shows A's fresh donor; then A restarts and the ledger learns it, but B's view has
    not caught up yet (its tick is an hour): B promises, and the lease must refuse."""
    donor_on_a(fleet)
    b = fleet.engine("B", donor_view_refresh_s=3600, **b_kw)
    assert b.scheduler._view.ready and b.scheduler._view.stats()["donors"] == 1
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
    return b


def test_a_promise_the_ledger_refuses_ships_failed_and_the_engine_recomputes(fleet: Fleet) -> None:
    b = _stale_after_the_view(fleet, reset_hooks=True)
    result = b.generate(DOC + QUESTION)
    assert b.metrics.value("semkv_promises_total") == 1  # promised from the view ...
    assert b.metrics.value("semkv_promises_broken_total", reason="donor_quarantined") == 1  # ... refused by the lease
    assert result.recomputed_after_load_failure and result.num_connector_tokens == 0
    assert b.metrics.value("semkv_exact_materialized_total") == 0
    cold = _shared_model(b.llm.model_config).forward_dense(DOC + QUESTION)
    assert torch.allclose(result.prefill_logits, cold[result.prefill_start:], rtol=1e-4, atol=1e-4)
    b.scheduler.flush()
    assert fleet.held_leases() == 0
    b.scheduler.sync_view()  # caught up: the next lookup misses
    assert b.generate(DOC + QUESTION[:5]).num_connector_tokens == 0


def test_a_promise_the_ledger_refuses_fails_the_request_on_trtllm_1_2(fleet: Fleet) -> None:
    b = _stale_after_the_view(fleet)
    with pytest.raises(ConnectorWorkerError, match="went stale before its lease"):
        b.generate(DOC + QUESTION)
    assert b.metrics.value("semkv_load_failures_total", reason="plan_failed") == 1
    b.scheduler.flush()
    assert fleet.held_leases() == 0


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
    [donor] = b.scheduler._view._donors.values()
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
