"""DESIGN §2 safety rules owned by the connector. Rules 3, 6, 8, 9 are also covered by
test_two_engines, test_failure_injection and test_negative_controls (see their rule_N names)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from sqlalchemy import func, select

from connector.harness import ExecutorStopped, HarnessLLM, KvCacheConfig, KvCacheConnectorConfig, LlmRequest
from connector.metrics import ConnectorMetrics
from connector.scheduler import SemKvScheduler
from connector.settings import ConnectorConfigError, load_connector_settings
from ledger.db import sync_engine
from ledger.errors import PersistenceError
from ledger.schema import LeaseRow
from tools.harness.fleet import MODEL, Fleet, shared_model, close_connector, doc_tokens
from tests.connector.test_ledger_busy import promise_and_ship
from tests.connector.test_two_engines import native_engine

TPB = MODEL.tokens_per_block
DOC = doc_tokens(12 * TPB, seed=41)
QUESTION = doc_tokens(30, seed=42)


def test_rule_1_engine_reuse_runs_first_connector_adds_only_past_it(fleet: Fleet) -> None:
    b = fleet.engine("B")
    b.generate(DOC[: 8 * TPB] + [5])  # B's own cache now holds 8 blocks of D (no donor exists yet)
    a = fleet.engine("A")
    a.generate(DOC)
    fleet.sync()
    got = b.generate(DOC + QUESTION)
    assert got.num_reused_tokens == 8 * TPB  # TensorRT-LLM's own reuse first
    assert got.num_connector_tokens == 4 * TPB  # only the blocks past num_computed_tokens
    native = native_engine()
    native.generate(DOC, 1)
    reference = native.generate(DOC + QUESTION, 1)
    assert torch.equal(got.prefill_logits, reference.prefill_logits)


def test_rule_2_only_exact_equivalent_kv_is_materialized(fleet: Fleet) -> None:
    a = fleet.engine("A")
    a.generate(DOC)
    fleet.sync()
    near = list(DOC)
    near[5 * TPB + 3] = (near[5 * TPB + 3] + 1) % MODEL.vocab_size  # "semantically" the same document
    b = fleet.engine("B")
    got = b.generate(near + QUESTION)
    assert got.num_connector_tokens == 5 * TPB  # the exact prefix only, never the similar rest
    cold = shared_model(MODEL).forward_dense(near + QUESTION)
    assert torch.allclose(got.prefill_logits, cold[got.prefill_start:], rtol=1e-4, atol=1e-4)
    assert b.metrics.value("semkv_experimental_materialized_total") == 0


def test_rule_4_errors_timeouts_and_unknown_fields_are_counted_misses(fleet: Fleet) -> None:
    a = fleet.engine("A")
    a.generate(DOC)
    fleet.sync()
    # without the donor view every lookup reads the ledger, under the deadline
    b = fleet.engine("B", lookup_timeout_s=0.01, donor_view_refresh_s=0)
    ledger = b.scheduler.ledger
    answer = ledger.find_donor_span

    calls = []

    def slow_ledger(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        # the lookup's read never ends on its own: only the deadline can stop it (on SQLite the
        # lookup runs on the engine's thread and the ledger interrupts its statements); later
        # calls (the finished request's donor registration) answer normally
        calls.append(1)
        if len(calls) == 1:
            ledger._connections.read(lambda sql: sql.driver(
                "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"))
        return answer(*args, **kwargs)

    ledger.find_donor_span = slow_ledger  # type: ignore[method-assign]
    started = time.perf_counter()
    assert b.generate(DOC + QUESTION).num_connector_tokens == 0
    assert time.perf_counter() - started < 5
    assert b.misses() == {"timeout": 1}
    assert b.metrics.value("semkv_provider_timeout_total") == 1
    assert ledger.engine("A") is not None  # the interrupted connection still serves reads on this thread

    def unreachable(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise PersistenceError("connection refused")

    # with the donor view, a ledger that stops answering takes the view out of use after
    # max_staleness_s; lookups then read the ledger and miss with its error
    b = fleet.engine("B")
    b.scheduler.flush()
    view = b.scheduler.spans.view
    deadline = time.monotonic() + 10
    while not view.ready:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    b.scheduler.ledger.refresh_view = unreachable  # type: ignore[method-assign]
    b.scheduler.ledger.find_donor_span = unreachable  # type: ignore[method-assign]
    view.max_staleness_s = view.max_failing_s = 0.05
    deadline = time.monotonic() + 10  # a catch-up already under way may still succeed once
    while view.ready:
        assert time.monotonic() < deadline, "the view stayed in use while the ledger does not answer"
        time.sleep(0.01)
    assert b.generate(DOC + QUESTION).num_connector_tokens == 0
    assert b.misses() == {"error": 1}

    # a namespace field the connector cannot know (KV dtype "auto" everywhere) -> never materialize
    llm_args = dataclasses.replace(b.llm.llm_args, dtype="auto")
    metrics = ConnectorMetrics()
    scheduler = SemKvScheduler(llm_args, settings=b.settings, metrics=metrics)
    try:
        request = LlmRequest(99, DOC + QUESTION, 1)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        assert metrics.misses_by_reason() == {"unknown_namespace_field": 1}
        assert metrics.value("semkv_backend_declined_total", reason="unknown_namespace_field") == 1
    finally:
        scheduler.close()


def test_rule_5_experimental_mode_is_refused_at_start_up(fleet: Fleet, monkeypatch) -> None:
    with pytest.raises(ConnectorConfigError, match="experimental.*rule 5"):
        load_connector_settings({"mode": "experimental"}, environ={})
    monkeypatch.setenv("TRTLLM_SEMKV_MODE", "experimental")
    spec = KvCacheConnectorConfig(connector_module="connector", connector_scheduler_class="SemKvScheduler",
                                  connector_worker_class="SemKvWorker")
    with pytest.raises(ConnectorConfigError, match="TRTLLM_SEMKV_MODE"):
        HarnessLLM(MODEL, kv_cache_config=KvCacheConfig(tokens_per_block=TPB), kv_connector=spec,
                   model=shared_model(MODEL))


def test_rule_6_every_layer_is_revalidated_against_the_ledger(fleet: Fleet) -> None:
    a = fleet.engine("A")
    a.generate(DOC)
    fleet.sync()
    b = fleet.engine("B")
    assert b.generate(DOC + QUESTION).num_connector_tokens == len(DOC)
    # once after allocation (before the first copy), then before each of the model's layers
    assert b.metrics.value("semkv_revalidation_seconds_count") == 1 + MODEL.num_layers


def test_rule_7_no_lease_or_pin_survives_finish_failure_or_timeout(fleet: Fleet) -> None:
    """Every promise ends released: at finish (TensorRT-LLM: its pin and secured file; it writes no
    ledger lease); a vLLM lease behind a take that came late (the plan failed); a lease taken in
    the lookup after its deadline; and a promise whose load stopped TensorRT-LLM's executor, by the
    orphan reaper. Cancels and forward errors: test_trtllm_lifecycle."""
    a = fleet.engine("A")
    a.generate(DOC)
    fleet.sync()
    b = fleet.engine("B")
    assert b.generate(DOC + QUESTION).num_connector_tokens > 0  # finished: released
    assert b.metrics.value("semkv_leases_held") == 0 and b.scheduler.store.handed_over() == 0

    def slow(take_lease):  # noqa: ANN001, ANN202
        def slow_take(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            lease = take_lease(*args, **kwargs)
            time.sleep(0.3)  # the lease is written, but the plan stopped waiting for it long ago
            return lease
        return slow_take

    scheduler, worker = fleet.vllm_connector("B", b.llm.llm_args, lease_confirm_timeout_s=0.05)
    try:  # vLLM: a lease not confirmed in time fails the plan; the late lease is released behind it
        scheduler.ledger.take_lease = slow(scheduler.ledger.take_lease)  # type: ignore[method-assign]
        scheduler.flush()
        assert promise_and_ship(scheduler, 801, DOC, QUESTION).failed
        assert scheduler.metrics.value("semkv_promises_broken_total", reason="late") == 1
        scheduler.flush()
        assert scheduler.metrics.value("semkv_leases_released_total", reason="lease_late") == 1
    finally:
        close_connector(scheduler, worker)
    # lease_before_answer: the engine stops waiting at the deadline; the late lease is released
    sync = fleet.engine("B", lease_in_lookup_timeout_s=0.05, lease_before_answer=True)
    sync.scheduler.ledger.take_lease = slow(sync.scheduler.ledger.take_lease)  # type: ignore[method-assign]
    assert sync.generate(DOC + QUESTION).num_connector_tokens == 0
    deadline = time.monotonic() + 10
    while sync.metrics.value("semkv_leases_released_total", reason="lookup_timeout") < 1:  # the late job's cleanup
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sync.misses() == {"timeout": 1}
    stopped = fleet.engine("B", request_orphan_timeout_s=0.3)  # a load that stops TensorRT-LLM's executor
    stopped.worker._begin = lambda plan: (_ for _ in ()).throw(RuntimeError("injected"))  # type: ignore[method-assign]
    with pytest.raises(ExecutorStopped):
        stopped.llm.generate(DOC + QUESTION)
    assert stopped.metrics.value("semkv_load_failures_total", reason="internal_error") == 1
    deadline = time.monotonic() + 10
    while stopped.metrics.value("semkv_leases_held") > 0:  # no hook comes any more: the reaper releases it
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert stopped.metrics.value("semkv_leases_released_total", reason="orphaned") == 1
    assert stopped.scheduler.store.handed_over() == 0 and not stopped.scheduler.store._pins
    engine = sync_engine(fleet.db)
    with engine.connect() as conn:
        states = dict(conn.execute(select(LeaseRow.__table__.c.state, func.count())
                                   .group_by(LeaseRow.__table__.c.state)).all())
    engine.dispose()
    assert states == {"released": 2}  # vLLM's and the lookup's; TensorRT-LLM's promises wrote none
    assert fleet.held_leases() == 0
