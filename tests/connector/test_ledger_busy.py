"""Another process holding the SQLite ledger's write lock (a migration, a replay into the live file,
a long transaction), or lease writes failing, must neither stall the engine nor keep breaking
promises: lookups miss (``ledger_busy``) once the connector's ledger thread is backed up or after a
failed write, and ``request_finished`` gives up on registering a donor after
``register_lock_wait_s`` (DESIGN §2 rules 4 and 7)."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from connector._trtllm import RequestData, SchedulerOutput
from connector.harness import LlmRequest
from connector.harness.connector_driver import ConnectorWorkerError
from connector.plan import LoadPlan
from ledger.errors import PersistenceError
from tests.connector.conftest import MODEL, Engine, Fleet, _shared_model, doc_tokens
from tests.connector.test_negative_controls import DOC, QUESTION, donor_on_a


@contextmanager
def write_lock_held(fleet: Fleet) -> Iterator[None]:
    """Hold the ledger file's write lock from another connection, as another process would."""
    holder = sqlite3.connect(fleet.db.removeprefix("sqlite:///"), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def cold_logits(engine: Engine, tokens: list[int], result) -> torch.Tensor:  # noqa: ANN001
    return _shared_model(engine.llm.model_config).forward_dense(tokens)[result.prefill_start:]


def test_a_held_write_lock_makes_lookups_miss_instead_of_promising(fleet: Fleet) -> None:
    donor_on_a(fleet)
    b = fleet.engine("B", lease_confirm_timeout_s=0.2, register_lock_wait_s=0.05)
    b.scheduler.flush()
    with write_lock_held(fleet):
        # the ledger thread was idle: this promise is made, and its lease cannot be written
        # (b.llm.generate: Engine.generate would wait for the ledger thread, which waits for the lock)
        with pytest.raises(ConnectorWorkerError, match="not committed"):
            b.llm.generate(DOC + QUESTION, 1)
        assert b.metrics.value("semkv_promises_broken_total", reason="late") == 1
        # the lease write is still waiting for the lock: the next lookup does not promise
        assert b.metrics.value("semkv_ledger_backlog_seconds") > 0.1  # what an operator sees
        started = time.monotonic()
        longer = DOC + doc_tokens(2 * MODEL.tokens_per_block, seed=13)  # two blocks more than A's donor: a new donor
        result = b.llm.generate(longer, 1)
        assert result.num_connector_tokens == 0 and b.metrics.misses_by_reason() == {"ledger_busy": 1}
        assert torch.allclose(result.prefill_logits, cold_logits(b, longer, result), rtol=1e-4, atol=1e-4)
        # computed cold and finished; its registration gave up on the lock instead of stalling
        assert time.monotonic() - started < 5
        assert b.metrics.value("semkv_donors_not_registered_total", reason="ledger_busy") == 1
        # the next finishing request does not wait for the lock again (a batch would stall in turn)
        started = time.monotonic()
        b.llm.generate(DOC + doc_tokens(3 * MODEL.tokens_per_block, seed=14), 1)
        assert b.metrics.value("semkv_donors_not_registered_total", reason="ledger_busy") == 2
        assert b.metrics.value("semkv_lookup_misses_total", reason="ledger_busy") == 2
        assert time.monotonic() - started < 0.04  # register_lock_wait_s is 0.05 here
        assert b.metrics.value("semkv_promises_total") == 1
    b.scheduler.flush()
    assert fleet.held_leases() == 0  # the late lease was written after the lock, then released
    b.scheduler.sync_view()
    assert 0 <= b.metrics.value("semkv_donor_view_age_seconds") < 1
    wait_until_writable(b)  # the registration's lock timeout paused writes for a second
    again = LlmRequest(777, DOC + QUESTION, 1)  # the lock is gone: the lookup promises again
    assert b.scheduler.get_num_new_matched_tokens(again, 0) == (len(DOC), False)
    b.scheduler.request_finished(again, [])
    b.scheduler.flush()
    assert fleet.held_leases() == 0


def wait_until_writable(b: Engine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not b.scheduler._ledger_writable():
        assert time.monotonic() < deadline, "the ledger back-off never ended"
        time.sleep(0.01)


def promise_and_ship(b: Engine, rid: int) -> LoadPlan:
    """One request through lookup, allocation and metadata, as the engine runs them."""
    request = LlmRequest(rid, DOC + QUESTION, 1)
    assert b.scheduler.get_num_new_matched_tokens(request, 0) == (len(DOC), False)
    block_ids = list(range(len(DOC + QUESTION) // MODEL.tokens_per_block + 1))
    b.scheduler.update_state_after_alloc(request, block_ids)
    data = RequestData(request_id=rid, new_tokens=DOC + QUESTION, new_block_ids=block_ids, computed_position=0,
                       num_scheduled_tokens=len(DOC + QUESTION))
    [plan] = b.scheduler.build_connector_meta(SchedulerOutput(new_requests=[data])).loads
    b.scheduler.request_finished(request, [])
    return plan


def test_a_failed_lease_write_pauses_promises_with_a_growing_back_off(fleet: Fleet) -> None:
    """A lease write that fails (PostgreSQL's statement timeout behind a lock, a lost connection)
    breaks its promise; the next lookups miss (``ledger_busy``) for a back-off that doubles with
    each failure in a row, instead of each breaking a promise in turn; a write that succeeds ends it."""
    donor_on_a(fleet)
    b = fleet.engine("B")
    b.scheduler.flush()
    take_lease = b.scheduler.ledger.take_lease

    def failing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise PersistenceError("QueryCanceled: canceling statement due to statement timeout")

    b.scheduler.ledger.take_lease = failing  # type: ignore[method-assign]
    assert promise_and_ship(b, 701).failed
    assert b.metrics.value("semkv_promises_broken_total", reason="error") == 1
    missed = LlmRequest(702, DOC + QUESTION, 1)
    assert b.scheduler.get_num_new_matched_tokens(missed, 0) == (0, False)
    b.scheduler.request_finished(missed, [])
    assert b.metrics.misses_by_reason() == {"ledger_busy": 1}
    wait_until_writable(b)
    assert promise_and_ship(b, 703).failed  # failed again: the next pause is twice as long
    assert b.scheduler._ledger_backoff_s == 4.0
    b.scheduler.ledger.take_lease = take_lease  # type: ignore[method-assign]
    wait_until_writable(b)
    assert promise_and_ship(b, 704).failed is None
    assert b.scheduler._ledger_backoff_s == 1.0
    b.scheduler.flush()
    assert fleet.held_leases() == 0
