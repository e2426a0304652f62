"""Another process holding the SQLite ledger's write lock (a migration, a replay into the live file,
a long transaction), or lease writes failing, must neither stall the engine nor break a promise
(DESIGN §2 rules 3, 4 and 7).

* TensorRT-LLM (binding promises): promises go on, loaded from their secured bytes; while the
  connector's ledger thread is backed up or backing off a failed write, leases are skipped (a
  counted freshness signal) rather than queued behind the lock; a donor's registration waits for
  the lock on the connector's ledger thread (at most ``register_lock_wait_s``), and the worker
  publishes its bytes only once it is in.
* vLLM (retractable promises): lookups miss (``ledger_busy``) once the ledger thread is backed up
  or after a failed write, with a back-off that doubles, instead of promising leases that would
  break one after another.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import torch

from connector._trtllm import RequestData, SchedulerOutput
from connector.harness import KvCacheConfig, LlmRequest
from connector.plan import LoadPlan
from connector.scheduler import SemKvScheduler
from ledger.errors import PersistenceError
from tools.harness.fleet import MODEL, Engine, Fleet, shared_model, close_connector, doc_tokens
from tests.connector.test_negative_controls import DOC, QUESTION, donor_on_a

TPB = MODEL.tokens_per_block
NEW_DONOR = DOC + doc_tokens(2 * TPB, seed=13)  # two blocks more than A's donor: a donor of its own


def recipient(fleet: Fleet, **overrides: Any) -> Engine:
    """Engine B without its own prefix reuse, so every request of DOC is the connector's to serve."""
    kvc = KvCacheConfig(tokens_per_block=TPB, max_tokens=4 * MODEL.max_context, enable_block_reuse=False)
    b = fleet.engine("B", kv_cache_config=kvc, **overrides)
    b.scheduler.flush()
    return b


@contextmanager
def write_lock_held(fleet: Fleet) -> Iterator[None]:
    """Hold the ledger file's write lock from another connection, as another process would."""
    holder = sqlite3.connect(fleet.db.removeprefix("sqlite:///"), timeout=10, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def cold_logits(engine: Engine, tokens: list[int], result: Any) -> torch.Tensor:
    return shared_model(engine.llm.model_config).forward_dense(tokens)[result.prefill_start:]


def wait_for(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def wait_until_writable(scheduler: SemKvScheduler) -> None:
    wait_for(scheduler.promises.backoff.writable)


# ---------------------------------------------------------------------------- TensorRT-LLM
def donor_states(fleet: Fleet) -> list[str]:
    """Every donor's state in the ledger, oldest first."""
    with sqlite3.connect(fleet.db.removeprefix("sqlite:///")) as db:
        return [row[0] for row in db.execute("SELECT state FROM donors ORDER BY registered_seq")]


def test_on_trtllm_a_held_write_lock_neither_stalls_the_engine_nor_breaks_a_promise(fleet: Fleet) -> None:
    """A promise writes nothing to the ledger (it holds its donor's secured file), so a held write
    lock cannot reach it; a finishing donor's registration waits for the lock on the connector's
    ledger thread, not the engine's, and goes in once the lock is let go (before, the engine's thread
    gave up after a quarter of a second and the donor was lost)."""
    donor_on_a(fleet)
    b = recipient(fleet)
    assert b.scheduler.settings.register_lock_wait_s == 5.0  # the default: longer than the lock is held here
    with write_lock_held(fleet):
        started = time.monotonic()
        for question in (QUESTION, QUESTION[:10]):
            got = b.llm.generate(DOC + question, 1)
            assert got.num_connector_tokens == len(DOC)
            assert torch.allclose(got.prefill_logits, cold_logits(b, DOC + question, got), rtol=1e-4, atol=1e-4)
        new = b.llm.generate(NEW_DONOR, 1)  # a new donor: its registration is queued behind the lock
        assert new.num_connector_tokens == len(DOC)
        assert time.monotonic() - started < b.scheduler.settings.register_lock_wait_s  # nothing waited for the lock
        time.sleep(0.5)  # the queued registration has waited longer than a lease may (the ledger thread is busy)
        again = b.llm.generate(NEW_DONOR[:-3] + QUESTION, 1)  # another donor: queued behind it all the same
        assert again.num_connector_tokens == len(DOC)
        assert b.metrics.value("semkv_donors_not_registered_total", reason="ledger_busy") == 0
        assert b.metrics.value("semkv_exact_materialized_total") == 4 and b.llm.stopped is None
        assert donor_states(fleet) == ["live"]  # A's only, so far
    b.settle()
    assert donor_states(fleet) == ["live", "live", "live"]  # B's new donors: registered, then saved
    assert b.metrics.value("semkv_donors_registered_total") == 2
    assert b.metrics.value("semkv_donor_saves_total", outcome="saved") == 2
    assert fleet.leases_written() == 0
    b.scheduler.sync_view()
    assert 0 <= b.metrics.value("semkv_donor_view_age_seconds") < 1


def test_on_trtllm_a_registration_the_lock_outlasts_publishes_no_bytes(fleet: Fleet, monkeypatch) -> None:
    """The write lock held past ``register_lock_wait_s``: the registration fails on the ledger thread
    (counted ``ledger_busy``), the engine released the blocks once copied as always, and the worker's
    store writer, waiting for the registration, gives up and publishes nothing: no orphan bytes, no
    ``donor_saved`` for a donor the ledger does not know."""
    monkeypatch.setattr("connector.worker._REGISTRATION_SLACK_S", 0.3)
    donor_on_a(fleet)
    b = recipient(fleet, register_lock_wait_s=0.2)
    entries = sorted(fleet.store_dir.iterdir())  # A's donor's
    with write_lock_held(fleet):
        new = b.llm.generate(NEW_DONOR, 1)
        assert new.num_connector_tokens == len(DOC) and b.llm.stopped is None
        b.llm.wait_for_pending_transfers()  # the blocks were released: the copy is done
        assert b.worker.flush(timeout_s=5)  # the store writer gave up waiting for the registration
        assert b.metrics.value("semkv_donor_saves_total", outcome="not_registered") == 1
        b.scheduler.flush()
        assert b.metrics.value("semkv_donors_not_registered_total", reason="ledger_busy") == 1
    b.settle()
    assert donor_states(fleet) == ["live"]  # A's only
    assert b.metrics.value("semkv_donors_registered_total") == 0
    assert sorted(fleet.store_dir.iterdir()) == entries  # B published nothing


def test_on_trtllm_a_failing_ledger_is_a_signal_the_promise_survives(fleet: Fleet) -> None:
    """Every statement of the worker's ledger client fails after the promise: the revalidation is a
    signal, asked once per plan (each call would wait on the engine's thread), and the secured
    bytes are loaded."""
    donor_on_a(fleet)
    b = recipient(fleet)
    calls = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise PersistenceError("OperationalError: unable to open database file")

    b.worker.ledger.donor_freshness = failing  # type: ignore[method-assign]
    got = b.llm.generate(DOC + QUESTION, 1)
    assert got.num_connector_tokens == len(DOC) and b.llm.stopped is None
    assert torch.allclose(got.prefill_logits, cold_logits(b, DOC + QUESTION, got), rtol=1e-4, atol=1e-4)
    assert b.metrics.value("semkv_stale_after_promise_total", reason="ledger_error") == 1
    assert len(calls) == 1  # not once per layer
    b.settle()
    assert fleet.held_leases() == 0 and b.metrics.value("semkv_leases_held") == 0


# ---------------------------------------------------------------------------- vLLM
def promise_and_ship(scheduler: SemKvScheduler, rid: int, doc: list[int] = DOC,
                     question: list[int] = QUESTION, *, finish: bool = True) -> LoadPlan:
    """One request of ``doc + question`` (``doc`` a donor's) through lookup, allocation and
    metadata, as vLLM runs them, then (``finish``) finished."""
    prompt = doc + question
    request = LlmRequest(rid, prompt, 1)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (len(doc), False)
    block_ids = list(range(len(prompt) // TPB + 1))
    scheduler.update_state_after_alloc(request, block_ids)
    data = RequestData(request_id=rid, new_tokens=prompt, new_block_ids=block_ids, computed_position=0,
                       num_scheduled_tokens=len(prompt))
    [plan] = scheduler.build_connector_meta(SchedulerOutput(new_requests=[data])).loads
    if finish:
        scheduler.request_finished(request, [])
    return plan


def vllm_scheduler(fleet: Fleet, **overrides: Any) -> tuple[Any, Any]:
    llm_args = fleet.engine("B", connector=False).llm.llm_args
    scheduler, worker = fleet.vllm_connector("B", llm_args, **overrides)
    scheduler.flush()
    return scheduler, worker


def test_on_vllm_a_held_write_lock_makes_lookups_miss_instead_of_promising(fleet: Fleet) -> None:
    donor_on_a(fleet)
    scheduler, worker = vllm_scheduler(fleet, lease_confirm_timeout_s=0.2)
    try:
        with write_lock_held(fleet):
            # the ledger thread was idle: this promise is made, and its lease cannot be written in time
            assert promise_and_ship(scheduler, 601).failed
            assert scheduler.metrics.value("semkv_promises_broken_total", reason="late") == 1
            assert scheduler.metrics.value("semkv_ledger_backlog_seconds") > 0.1  # what an operator sees
            missed = LlmRequest(602, DOC + QUESTION, 1)  # the lease write still waits: no promise
            assert scheduler.get_num_new_matched_tokens(missed, 0) == (0, False)
            scheduler.request_finished(missed, [])
            assert scheduler.metrics.misses_by_reason() == {"ledger_busy": 1}
        scheduler.flush()
        assert fleet.held_leases() == 0  # the late lease was written after the lock, then released
        wait_until_writable(scheduler)
        assert promise_and_ship(scheduler, 603).failed is None  # the lock is gone: promises again
        scheduler.flush()
        assert fleet.held_leases() == 0
    finally:
        close_connector(scheduler, worker)


def test_on_vllm_a_failed_lease_write_pauses_promises_with_a_growing_back_off(fleet: Fleet) -> None:
    """A lease write that fails (PostgreSQL's statement timeout behind a lock, a lost connection)
    breaks its promise; the next lookups miss (``ledger_busy``) for a back-off that doubles with
    each failure in a row, instead of each breaking a promise in turn; a write that succeeds ends it."""
    donor_on_a(fleet)
    scheduler, worker = vllm_scheduler(fleet)
    take_lease = scheduler.ledger.take_lease

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise PersistenceError("QueryCanceled: canceling statement due to statement timeout")

    try:
        scheduler.ledger.take_lease = failing  # type: ignore[method-assign]
        assert promise_and_ship(scheduler, 701).failed
        assert scheduler.metrics.value("semkv_promises_broken_total", reason="error") == 1
        missed = LlmRequest(702, DOC + QUESTION, 1)
        assert scheduler.get_num_new_matched_tokens(missed, 0) == (0, False)
        scheduler.request_finished(missed, [])
        assert scheduler.metrics.misses_by_reason() == {"ledger_busy": 1}
        wait_until_writable(scheduler)
        assert promise_and_ship(scheduler, 703).failed  # failed again: the next pause is twice as long
        assert scheduler.promises.backoff._backoff_s == 4.0
        scheduler.ledger.take_lease = take_lease  # type: ignore[method-assign]
        wait_until_writable(scheduler)
        assert promise_and_ship(scheduler, 704).failed is None
        assert scheduler.promises.backoff._backoff_s == 1.0
        scheduler.flush()
        assert fleet.held_leases() == 0
    finally:
        close_connector(scheduler, worker)


@pytest.fixture
def pg_fleet(tmp_path: Path, postgres_db: str) -> Iterator[Fleet]:
    """The fleet on a scratch PostgreSQL ledger (the real server)."""
    fleet = Fleet(tmp_path, ("A", "B"), db=postgres_db).start()
    try:
        yield fleet
    finally:
        fleet.stop()


def test_on_vllm_a_lease_release_the_ledger_refuses_is_retried_until_it_goes_in(pg_fleet: Fleet) -> None:
    """A release refused (another session holds the leases table past the connector's statement
    timeout) would leave the lease held until its TTL (DESIGN §2 rule 7): it is tried again every
    second on the connector's ledger thread, and goes in once the lock is let go."""
    fleet = pg_fleet
    donor_on_a(fleet)
    scheduler, worker = vllm_scheduler(fleet, ledger_statement_timeout_s=0.3)
    try:
        assert promise_and_ship(scheduler, 1001, finish=False).failed is None
        scheduler.flush()
        assert fleet.held_leases() == 1
        with psycopg.connect(fleet.db) as holder:
            holder.execute("LOCK TABLE leases IN EXCLUSIVE MODE")  # reads go on, writes wait
            scheduler.request_finished(LlmRequest(1001, DOC + QUESTION, 1), [])
            scheduler.flush()  # the release waited 0.3 s for the lock and was cancelled
            time.sleep(1.5)  # its retry too
            assert fleet.held_leases() == 1
        wait_for(lambda: fleet.held_leases() == 0, timeout_s=5)
    finally:
        close_connector(scheduler, worker)
