"""Another process holding the SQLite ledger's write lock (a migration, a replay into the live file,
a long transaction) must neither stall the engine nor break promises: lookups miss
(``ledger_busy``) once the connector's ledger thread is backed up, and ``request_finished`` gives
up on registering a donor after ``register_lock_wait_s`` (DESIGN §2 rules 4 and 7)."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from connector.harness import LlmRequest
from connector.harness.connector_driver import ConnectorWorkerError
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
    again = LlmRequest(777, DOC + QUESTION, 1)  # the lock is gone: the lookup promises again
    assert b.scheduler.get_num_new_matched_tokens(again, 0) == (len(DOC), False)
    b.scheduler.request_finished(again, [])
    b.scheduler.flush()
    assert fleet.held_leases() == 0
