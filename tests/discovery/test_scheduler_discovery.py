"""Donor discovery inside the connector's :class:`SemKvScheduler` on reference-harness engines.

It never changes KV, promises or materialization counts; a provider that raises or hangs, or a
serving-layer text callback that raises, never changes ``get_num_new_matched_tokens``'s answer nor
raises into the engine; on the scheduler path it never delays the engine beyond the deadline plus a
small bound (DESIGN §2 rules 2 and 4). With ``[discovery] enabled = true`` the scheduler builds,
feeds and closes its own service; by default it has none. Donors are indexed off the scheduler path
with the generation they were registered in, and registrations gone stale meanwhile are dropped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from connector.discovery.service import DiscoveryService
from connector.discovery.types import DonorRecord, Match, Query
from connector.harness import LlmRequest
from ledger.client import LedgerClient
from ledger.types import FreshnessPolicy, StaleReason
from tools.harness.fleet import MODEL, Engine, Fleet, doc_tokens
from tests.connector.conftest import fleet  # noqa: F401  (fixture)
from tests.connector.test_two_engines import native_engine
from tests.discovery.conftest import settings, wait_until
from tools.harness.discovery_fleet import discovering_engine
from tests.discovery.test_service import Broken, Sleepy
from tools.workloads import Workload

TPB = MODEL.tokens_per_block


@pytest.fixture
def fleet4(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path, ("A", "B", "C", "D")).start()
    try:
        yield f
    finally:
        f.stop()


class Recorder:
    """A provider by import path (``tests.discovery.test_scheduler_discovery:Recorder``, built by the
    service from ``[discovery] providers``) that keeps every record handed to it for indexing and,
    while ``gate`` is set to an unset event, holds the indexer thread inside ``index``."""

    name, generation, needs_text = "recorder", 1, False
    records: ClassVar[list[DonorRecord]] = []
    gate: ClassVar[threading.Event | None] = None

    def __init__(self, settings: Any, *, db: str | None = None) -> None:
        self.closed = False

    def index(self, donor: DonorRecord) -> None:
        Recorder.records.append(donor)
        if Recorder.gate is not None:
            Recorder.gate.wait(20)

    def candidates(self, query: Query, limit: int) -> list[Match]:
        return []

    def forget(self, donor_id: str) -> None: ...
    def prepare(self, query: Query) -> None: ...
    def flush(self, force: bool = True) -> None: ...

    def close(self) -> None:
        self.closed = True


RECORDER = "tests.discovery.test_scheduler_discovery:Recorder"


def test_discovery_changes_no_kv_promise_or_materialization(fleet4: Fleet, workload: Workload) -> None:
    service = DiscoveryService(settings(providers=("chunks", "minhash")), db=fleet4.db)
    try:
        a = discovering_engine(fleet4, "A", service, mode="exact_equivalent")
        for scenario in ("rag_reordered", "agent_tools"):
            donor = next(lab.donor for lab in workload.labels if lab.scenario == scenario)
            a.generate(list(workload.prompt(donor).tokens))
        fleet4.sync()
        service.flush()
        assert service.indexed() == {"chunks": 2, "minhash": 2}  # A's donors, indexed off the path
        # B, C, D register no donors of their own, so each sees exactly A's donors in the ledger
        plain = fleet4.engine("B", mode="exact_equivalent", min_donor_blocks=10_000)  # discovery off (default)
        hooked = discovering_engine(fleet4, "C", service, mode="exact_equivalent", min_donor_blocks=10_000)
        telemetry = discovering_engine(fleet4, "D", service, mode="discovery_only", min_donor_blocks=10_000)
        assert plain.scheduler.discovery is None
        for scenario in ("rag_reordered", "agent_tools"):
            target = list(workload.prompt(next(lab.target for lab in workload.labels
                                               if lab.scenario == scenario)).tokens)
            got_plain, got_hooked = plain.generate(target, 2), hooked.generate(target, 2)
            got_telemetry = telemetry.generate(target, 2)
            native = native_engine()
            reference = native.generate(target, 2)
            assert got_hooked.num_connector_tokens == got_plain.num_connector_tokens
            assert torch.equal(got_hooked.prefill_logits, got_plain.prefill_logits)
            assert got_hooked.token_ids == got_plain.token_ids == reference.token_ids
            blocks = len(target) // TPB
            assert torch.equal(hooked.llm.kv_cache[got_hooked.block_ids[:blocks]],
                               plain.llm.kv_cache[got_plain.block_ids[:blocks]])
            assert got_telemetry.num_connector_tokens == 0  # discovery_only: (0, False), always
            assert torch.equal(got_telemetry.prefill_logits, reference.prefill_logits)
            assert torch.equal(telemetry.llm.kv_cache[got_telemetry.block_ids[:blocks]],
                               native.kv_cache[reference.block_ids[:blocks]])
        for name in ("semkv_promises_total", "semkv_exact_materialized_total", "semkv_materialized_tokens_total"):
            assert hooked.metrics.value(name) == plain.metrics.value(name)
        assert plain.metrics.value("semkv_exact_materialized_total") == 1  # rag: the system prompt prefix
        assert telemetry.metrics.value("semkv_exact_materialized_total") == 0
        assert telemetry.metrics.value("semkv_promises_total") == 0
        assert telemetry.metrics.value("semkv_experimental_materialized_total") == 0
        for engine in (hooked, telemetry):
            engine.scheduler.flush()
        m = service.metrics
        assert m.value("semkv_discovery_lookups_total", path="background") == 6  # A's 2 + C's 2 + D's 2
        assert m.value("semkv_semantic_placement_total", provider="chunks") >= 2  # C and D on agent_tools
        assert hooked.metrics.value("semkv_semantic_lookups_total") == 2
        assert plain.metrics.value("semkv_semantic_lookups_total") == 0
        assert fleet4.held_leases() == 0
    finally:
        service.close()


def _answer(engine: Engine, rid: int, tokens: list[int]) -> tuple[int, bool]:
    """The scheduler's answer for a new request; its lease is released (as on finish) afterwards."""
    request = LlmRequest(rid, list(tokens), 1)
    answer = engine.scheduler.get_num_new_matched_tokens(request, 0)
    engine.scheduler.request_finished(request, [])  # prefill never ran: released, not registered
    return answer


def test_failing_or_hung_discovery_never_changes_the_answer(fleet4: Fleet) -> None:  # noqa: F811
    """Providers that raise or never answer (inline, under the deadline, and queued), and a serving
    layer's text callback that raises: the answer is the one without discovery, the exact load
    materializes bit-identically, nothing raises, no lease is left behind."""
    doc, question = doc_tokens(15 * TPB, seed=11), doc_tokens(40, seed=12)
    a = fleet4.engine("A")
    a.generate(doc)
    fleet4.sync()
    plain = fleet4.engine("B", mode="exact_equivalent", min_donor_blocks=10_000)
    target = doc + question
    expected = _answer(plain, 1, target)
    assert expected == (len(doc), False)  # a real promise: 15 blocks of A's donor
    reference = plain.generate(target, 2)  # once: a second run would be B's own device reuse
    assert reference.num_connector_tokens == len(doc)

    def broken_text(request: Any) -> str:
        raise RuntimeError("serving layer bug")

    hung, broken, hung_async = Sleepy(), Broken(), Sleepy()
    inline = DiscoveryService(settings(inline=True, lookup_timeout_s=0.002, provider_queue_max=64),
                              db=fleet4.db, providers=[broken, hung])
    queued = DiscoveryService(settings(lookup_queue_max=1, provider_queue_max=1, background_timeout_s=0.01),
                              db=fleet4.db, providers=[hung_async])
    texting = DiscoveryService(settings(inline=True, allow_prompt_text=True, providers=("exact", "chunks")),
                               db=fleet4.db)
    try:
        for service, text_of in ((inline, None), (queued, None), (texting, broken_text)):
            hooked = discovering_engine(fleet4, "C", service, mode="exact_equivalent", min_donor_blocks=10_000,
                                        text_of=text_of)
            for rid in range(10, 13):
                started = time.perf_counter()
                assert _answer(hooked, rid, target) == expected
                # lookup_timeout_s 1.0 (fleet) + a loaded machine's slack, well short of the hung providers' 10 s
                assert time.perf_counter() - started < 5.0
            got = hooked.generate(target, 2)
            assert got.num_connector_tokens == reference.num_connector_tokens
            assert torch.equal(got.prefill_logits, reference.prefill_logits)
            assert got.token_ids == reference.token_ids
            blocks = len(doc) // TPB
            assert torch.equal(hooked.llm.kv_cache[got.block_ids[:blocks]],
                               plain.llm.kv_cache[reference.block_ids[:blocks]])
            m = hooked.metrics
            assert m.value("semkv_promises_total") == 4 and m.value("semkv_exact_materialized_total") == 1
            assert m.value("semkv_lookup_misses_total", reason="error") == 0
            assert m.value("semkv_semantic_lookups_total") == (4 if text_of is None else 0)
            hooked.scheduler.flush(5)
        assert fleet4.held_leases() == 0
        im = inline.metrics
        # the raising provider is counted every time: as an error, or as a timeout when a loaded
        # machine let the 2 ms inline deadline pass before it ran
        broken_errors = im.value("semkv_discovery_outcomes_total", provider="broken", outcome="error")
        assert broken_errors >= 1
        assert broken_errors + im.value("semkv_discovery_outcomes_total", provider="broken", outcome="timeout") == 4
        assert im.value("semkv_discovery_outcomes_total", provider="sleepy", outcome="timeout") == 4
        assert queued.metrics.value("semkv_discovery_lookups_dropped_total") >= 1  # bounded queue, not blocking
        assert texting.metrics.value("semkv_discovery_lookups_total", path="inline") == 0  # failed before it
    finally:
        hung.release.set()
        hung_async.release.set()
        for service in (inline, queued, texting):
            service.close()


def test_inline_discovery_never_delays_the_scheduler_past_its_deadline(fleet: Fleet,  # noqa: F811
                                                                       workload: Workload) -> None:
    sleepy = Sleepy()
    deadline_s = 0.002
    service = DiscoveryService(settings(inline=True, lookup_timeout_s=deadline_s, provider_queue_max=64),
                               db=fleet.db, providers=[sleepy])
    try:
        engine = discovering_engine(fleet, "A", service, mode="discovery_only")
        scheduler = engine.scheduler
        tokens = list(workload.prompt(workload.donors[0]).tokens)
        answers, worst = [], 0.0
        for rid in range(100, 110):
            started = time.perf_counter()
            answers.append(scheduler.get_num_new_matched_tokens(LlmRequest(rid, tokens, 1), 0))
            worst = max(worst, time.perf_counter() - started)
        assert answers == [(0, False)] * 10
        # the provider hangs for 10 s: the scheduler came back with the deadline, not with it (how close
        # to 2 ms is the benchmark's to report; a loaded 2-core CI machine can take > 100 ms here)
        assert worst < 1.0
        assert service.metrics.value("semkv_discovery_outcomes_total", provider="sleepy", outcome="timeout") == 10
        assert service.metrics.value("semkv_discovery_lookups_total", path="inline") == 10
    finally:
        sleepy.release.set()
        service.close()


def test_scheduler_builds_indexes_and_closes_its_own_service_from_settings(fleet: Fleet,  # noqa: F811
                                                                          workload: Workload) -> None:
    Recorder.records, Recorder.gate = [], None
    a = fleet.engine("A", discovery={"enabled": True, "providers": [RECORDER, "chunks"]})
    service = a.scheduler.discovery
    assert isinstance(service, DiscoveryService) and [p.name for p in service.providers] == ["recorder", "chunks"]
    off = fleet.engine("B")
    assert off.scheduler.discovery is None  # default: no service, no discovery thread
    keys = [next(lab.donor for lab in workload.labels if lab.scenario == s) for s in ("rag_reordered", "agent_tools")]
    for key in keys:
        a.generate(list(workload.prompt(key).tokens))
    off.generate(list(workload.prompt(keys[0]).tokens))
    a.scheduler.flush()
    assert service.indexed() == {"recorder": 0, "chunks": 2}
    # discovery counts on the connector's registry (one /metrics)
    assert a.metrics.value("semkv_discovery_index_total", outcome="indexed") == 2
    assert a.metrics.value("semkv_discovery_lookups_total", path="background") == 2
    assert off.metrics.value("semkv_semantic_lookups_total") == 0
    ledger = LedgerClient(fleet.db)
    try:
        generation = ledger.engine("A").generation
        for record, key in zip(Recorder.records, keys, strict=True):
            tokens = list(workload.prompt(key).tokens)
            assert record.engine_id == "A" and record.generation == generation
            assert record.token_ids.tolist() == tokens[: len(tokens) // TPB * TPB]
            assert record.text is None  # prompt text not allowed (default)
            assert ledger.donor_freshness(record.donor_id, namespace=record.namespace, num_blocks=0,
                                          policy=FreshnessPolicy.STORE) in (None, StaleReason.NOT_SAVED)

        # a registration whose donor went stale before the indexer got to it is dropped
        Recorder.gate = gate = threading.Event()
        first, second = doc_tokens(6 * TPB, seed=21), doc_tokens(6 * TPB, seed=22)
        a.llm.generate(first, 1)  # not Engine.generate: its flush would wait for the held indexer
        wait_until(lambda: len(Recorder.records) == 3)  # the indexer thread is held inside Recorder.index
        a.llm.generate(second, 1)  # its registration waits in the queue
        assert ledger.record_engine_start("A")  # a new connector process: A's donors are quarantined
        gate.set()
        a.settle()
    finally:
        Recorder.gate = None
        ledger.close()
    assert len(Recorder.records) == 3  # the stale registration never reached a provider
    assert service.indexed() == {"recorder": 0, "chunks": 3}
    dropped = (a.metrics.value("semkv_discovery_index_total", outcome="stale")
               + a.metrics.value("semkv_discovery_index_total", outcome="generation_mismatch"))
    assert dropped == 1
    fleet.close_engine(fleet.engines.pop("A"))
    assert not service.flush(1)  # closed with the scheduler that built it
    assert all(p.closed for p in service.providers if isinstance(p, Recorder))
