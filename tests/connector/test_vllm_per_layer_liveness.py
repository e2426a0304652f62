"""vLLM loads layer by layer, so the forward runs between two layers' copies: a donor block removed
on its engine meanwhile makes the donor stale under policy ``engine``, and with vLLM's DEFAULT
settings the next layer's revalidation must see it and fail the plan, which the adapter reports so
vLLM recomputes the request (issue #18, defect 6: with ``per_layer_block_check`` off by default,
10 of 10 such plans materialized a donor the policy calls stale).

Engine A's donor of DOC, engine B's connector built as the vLLM adapter builds it, driven in
vLLM's call order over B's real KV pool (tests/connector/test_failure_injection.py ``VllmOrder``);
the removal is A's own ``removed`` event through the consumer daemon into the ledger."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from connector.engine_contract import VLLM
from connector.harness import block_hash_chain
from connector.worker import SemKvLoadError, SemKvWorker
from tools.harness.fleet import MODEL, Fleet
from tests.connector.test_failure_injection import DOC, VllmOrder

TPB = MODEL.tokens_per_block


def remove_a_donor_block_on_its_engine(fleet: Fleet, index: int = 3) -> None:
    events = fleet.engines["A"].llm.kv_cache_manager.events
    events.enqueue_removed(block_hash_chain(DOC, TPB)[index])
    events.flush()
    fleet.sync()  # in the ledger now


def removing_after_layer(fleet: Fleet, order: VllmOrder, layer_k: int, released: list[int]) -> None:
    original = order.wait

    def wait(layer: int, stream: Any) -> None:
        original(layer, stream)
        released.append(layer)  # released to attention
        if layer == layer_k:
            remove_a_donor_block_on_its_engine(fleet)

    order.wait = wait  # type: ignore[assignment]


class VllmOrderWith(VllmOrder):
    """:class:`VllmOrder` with connector settings overridden."""

    def __init__(self, fleet: Fleet, **overrides: Any) -> None:
        self.fleet = fleet
        self.pool = fleet.engine("B", connector=False).llm
        self.scheduler, self.worker = fleet.vllm_connector("B", self.pool.llm_args, **overrides)
        self.worker.register_kv_caches(self.pool.kv_cache)
        self.wait = self.worker.wait_for_layer_load


@pytest.fixture(params=["sqlite", "postgresql"])
def any_fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fleet]:
    """The fleet on a SQLite ledger, and on PostgreSQL (127.0.0.1:5432)."""
    db = request.getfixturevalue("postgres_db") if request.param == "postgresql" else ""
    # the scheduler's lease may take its time to commit: on a loaded CI machine PostgreSQL's took over the
    # 0.5 s default once, and the plan failed (closed) before the layer these tests are about
    fleet = Fleet(tmp_path, ("A", "B"), db=db, connector_defaults={"lease_confirm_timeout_s": 10.0}).start()
    try:
        yield fleet
    finally:
        fleet.stop()


def test_with_vllms_defaults_a_block_removed_between_layers_fails_the_plan(any_fleet: Fleet) -> None:
    fleet = any_fleet
    fleet.engine("A").generate(DOC)
    fleet.sync()
    order = VllmOrderWith(fleet)  # vLLM's defaults
    try:
        assert not {"per_layer_block_check", "load_before_forward"} & order.worker.settings.model_fields_set
        assert not order.worker.load_before_forward  # layer by layer
        released: list[int] = []
        removing_after_layer(fleet, order, 0, released)
        with pytest.raises(SemKvLoadError, match="ledger_blocks_not_live") as caught:
            order.run()
        assert caught.value.layer_idx == 1 and released == [0]  # layer 1 was never released to attention
        order.assert_failed("ledger_blocks_not_live")  # reported: the adapter names its blocks, vLLM recomputes
    finally:
        order.close()


def test_turned_off_the_same_removal_materializes(fleet: Fleet) -> None:
    """The opt-out, as documented: only layer 0's check reads block liveness."""
    fleet.engine("A").generate(DOC)
    fleet.sync()
    order = VllmOrderWith(fleet, per_layer_block_check=False)
    try:
        released: list[int] = []
        removing_after_layer(fleet, order, 0, released)
        assert order.run() == released == list(range(MODEL.num_layers))
        assert order.worker.metrics.value("semkv_exact_materialized_total") == 1
    finally:
        order.close()


@pytest.mark.parametrize(("engine", "load_before_forward", "setting", "expected"), [
    (VLLM, None, None, True),  # layer by layer: on
    (VLLM, True, None, False),  # every layer copied before the forward: layer 0's check covers the load
    (None, None, None, False),  # TensorRT-LLM: always before the forward
    (VLLM, None, False, False),
    (None, None, True, True),
])
def test_the_default_follows_how_the_worker_loads(fleet: Fleet, engine, load_before_forward, setting,
                                                 expected) -> None:
    pool = fleet.engine("B", connector=False).llm
    overrides = {"load_before_forward": load_before_forward, "per_layer_block_check": setting}
    settings = fleet.connector_settings("B", **{k: v for k, v in overrides.items() if v is not None})
    worker = SemKvWorker(pool.llm_args, settings=settings, **({"engine": engine} if engine else {}))
    try:
        assert worker.per_layer_block_check is expected
    finally:
        worker.close()


def test_an_unchanged_ledger_is_one_counter_read_per_layer_and_a_removal_between_layers_is_still_read(
        any_fleet: Fleet) -> None:
    """The per-layer check after the first is answered by the ledger's change counter while nothing
    committed (SQLite ``PRAGMA data_version``; PostgreSQL reads every time): a first request loads
    with one full read and a counter read per layer; in a second, A's block removed after layer 0,
    committed by the consumer's own connection, moves the counter, so layer 1's check reads the
    ledger and fails the plan before layer 1 is released."""
    fleet = any_fleet
    sqlite = not fleet.db.startswith("postgresql")
    fleet.engine("A").generate(DOC)
    fleet.sync()
    order = VllmOrderWith(fleet)
    try:
        metrics = order.worker.metrics
        assert order.run() == list(range(MODEL.num_layers))
        assert metrics.value("semkv_exact_materialized_total") == 1
        assert metrics.value("semkv_revalidations_total", answer="read") == (1 if sqlite else 1 + MODEL.num_layers)
        assert metrics.value("semkv_revalidations_total", answer="unchanged") == (MODEL.num_layers if sqlite else 0)
        released: list[int] = []
        removing_after_layer(fleet, order, 0, released)
        with pytest.raises(SemKvLoadError, match="ledger_blocks_not_live") as caught:
            order.run(rid=2)
        assert caught.value.layer_idx == 1 and released == [0]
        assert metrics.value("semkv_revalidations_total", answer="read") == (3 if sqlite else 1 + MODEL.num_layers + 3)
        assert metrics.value("semkv_revalidations_total", answer="unchanged") == (
            MODEL.num_layers + 1 if sqlite else 0)  # the second load's layer 0 was unchanged, its layer 1 was read
    finally:
        order.close()
