"""Discovery hooked into the connector's scheduler (``DiscoveringScheduler``) on reference-harness
engines: it never changes KV, promises or materialization counts, and on the scheduler path it never
delays the engine beyond the deadline plus a small bound (DESIGN §2 rules 2 and 4)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from connector.discovery.service import DiscoveryService
from connector.harness import LlmRequest
from tests.connector.conftest import MODEL, Fleet, fleet  # noqa: F401  (fixture)
from tests.connector.test_two_engines import native_engine
from tests.discovery.conftest import settings
from tests.discovery.fleet import discovering_engine
from tests.discovery.test_service import Sleepy
from tools.workloads import Workload

TPB = MODEL.tokens_per_block


@pytest.fixture
def fleet4(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path, ("A", "B", "C", "D")).start()
    try:
        yield f
    finally:
        f.stop()


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
        plain = fleet4.engine("B", mode="exact_equivalent", min_donor_blocks=10_000)  # SemKvScheduler
        hooked = discovering_engine(fleet4, "C", service, mode="exact_equivalent", min_donor_blocks=10_000)
        telemetry = discovering_engine(fleet4, "D", service, mode="discovery_only", min_donor_blocks=10_000)
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
        assert fleet4.held_leases() == 0
    finally:
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
        assert worst < deadline_s + 0.1  # loose on a 2-core VM; the benchmark reports the measured bound
        assert service.metrics.value("semkv_discovery_outcomes_total", provider="sleepy", outcome="timeout") == 10
        assert service.metrics.value("semkv_discovery_lookups_total", path="inline") == 10
    finally:
        sleepy.release.set()
        service.close()
