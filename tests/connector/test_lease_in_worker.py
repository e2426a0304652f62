"""``lease_confirm_in_worker`` (vLLM): a plan ships while its ledger lease is still being written, and
the worker confirms the lease in the ledger before its first copy. Nothing is read into the pool
before the ledger shows the lease held; a lease that never commits in time, or one refused because
the donor went stale, fails the plan (vLLM recomputes) and leaves no lease or pin behind
(DESIGN §2 rules 3, 6, 7)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from connector.worker import _LEASE_BLOCK_CHECK_EVERY, SemKvLoadError
from tests.connector.test_failure_injection import DOC, VllmOrder
from tests.connector.test_vllm_per_layer_liveness import remove_a_donor_block_on_its_engine
from tools.harness.fleet import MODEL, Fleet


def delayed(take_lease: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    """``take_lease`` starting ``seconds`` late (the ledger thread busy or the write lock held)."""
    def take(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return take_lease(*args, **kwargs)
    return take


class LeaseInWorker(VllmOrder):
    """B's vLLM connector with ``lease_confirm_in_worker`` and its lease write delayed."""

    def __init__(self, fleet: Fleet, delay_s: float, **overrides: Any) -> None:
        super().__init__(fleet, lease_confirm_in_worker=True, **overrides)
        self.scheduler.flush()
        self.scheduler.ledger.take_lease = delayed(self.scheduler.ledger.take_lease, delay_s)  # type: ignore[method-assign]
        self.held_at_first_copy: list[int] = []
        self.lease_confirm_by: list[float | None] = []
        copy_layer = self.worker._copy_layer

        def first_copy_sees(load: Any, layer_idx: int) -> None:
            if layer_idx == 0:
                self.held_at_first_copy.append(fleet.held_leases())
                self.lease_confirm_by.append(load.plan.lease_confirm_by)
            copy_layer(load, layer_idx)

        self.worker._copy_layer = first_copy_sees  # type: ignore[method-assign]


@contextlib.contextmanager
def order(fleet: Fleet, delay_s: float, **overrides: Any) -> Iterator[LeaseInWorker]:
    fleet.engine("A").generate(DOC)
    fleet.sync()
    lease_in_worker = LeaseInWorker(fleet, delay_s, **overrides)
    try:
        yield lease_in_worker
    finally:
        lease_in_worker.close()


def test_the_worker_copies_only_once_the_ledger_shows_the_lease_held(fleet: Fleet) -> None:
    with order(fleet, 0.3, lease_confirm_timeout_s=10.0) as vllm:
        assert vllm.run() == list(range(MODEL.num_layers))
        [confirm_by] = vllm.lease_confirm_by
        assert confirm_by is not None  # shipped before the lease committed: the worker confirmed it
        assert vllm.held_at_first_copy == [1]
        assert vllm.worker.metrics.value("semkv_exact_materialized_total") == 1
        assert fleet.held_leases() == 0  # released at the end as any lease


def test_a_lease_not_committed_by_the_deadline_fails_the_plan_before_any_copy(fleet: Fleet) -> None:
    with order(fleet, 1.0, lease_confirm_timeout_s=0.2) as vllm:
        with pytest.raises(SemKvLoadError, match="ledger_lease_not_held"):
            vllm.run()
        assert vllm.held_at_first_copy == []
        vllm.assert_failed("ledger_lease_not_held")


def test_a_donor_gone_stale_while_the_worker_waits_for_its_lease_fails_the_plan_at_once(fleet: Fleet) -> None:
    """A restarts while the worker waits for the lease (a generation bump: the delayed lease will be
    refused): the worker sees the donor stale in the ledger at its next try and fails the plan then,
    not at the deadline; the refusal is counted as a broken promise once the lease write ends."""
    with order(fleet, 0.5, lease_confirm_timeout_s=30.0) as vllm:
        freshness, polls = vllm.worker.ledger.donor_freshness, []

        def restart_a_at_the_first_poll(donor_id: str, **kwargs: Any) -> Any:
            if kwargs.get("memo") is None:  # the lease's tries (the checks of the load carry its memo)
                if not polls:
                    fleet.restart("A")
                    fleet.sync()
                polls.append(kwargs)
            return freshness(donor_id, **kwargs)

        vllm.worker.ledger.donor_freshness = restart_a_at_the_first_poll  # type: ignore[method-assign]
        with pytest.raises(SemKvLoadError, match="ledger_quarantined"):
            vllm.run()
        assert len(polls) == 1  # one try (the donor and the lease): stale, no second try
        assert vllm.held_at_first_copy == []
        vllm.assert_failed("ledger_quarantined")
        vllm.scheduler.flush()
        assert vllm.scheduler.metrics.value("semkv_promises_broken_total", reason="donor_quarantined") == 1


def test_a_donor_block_removed_while_the_worker_waits_for_its_lease_fails_the_plan_at_once(fleet: Fleet) -> None:
    """A's donor block removed while the worker waits (the delayed lease will be refused for it):
    the lease alone is still 'not held', and the first try that reads block liveness sees the
    removal, so the plan fails then, not at the deadline."""
    with order(fleet, 0.5, lease_confirm_timeout_s=5.0) as vllm:
        freshness, polls = vllm.worker.ledger.donor_freshness, []

        def remove_at_the_first_poll(donor_id: str, **kwargs: Any) -> Any:
            if kwargs.get("memo") is None:  # the lease's tries
                if not polls:
                    remove_a_donor_block_on_its_engine(fleet)
                polls.append(kwargs)
            return freshness(donor_id, **kwargs)

        vllm.worker.ledger.donor_freshness = remove_at_the_first_poll  # type: ignore[method-assign]
        with pytest.raises(SemKvLoadError, match="ledger_blocks_not_live"):
            vllm.run()
        every = _LEASE_BLOCK_CHECK_EVERY  # tries of the lease alone, then one that reads the blocks: the last
        assert [kwargs["lease_id"] is None for kwargs in polls] == [False] * every + [True]
        assert vllm.held_at_first_copy == []
        vllm.assert_failed("ledger_blocks_not_live")
        vllm.scheduler.flush()
        assert vllm.scheduler.metrics.value("semkv_promises_broken_total", reason="donor_blocks_removed") == 1
