"""DiscoveryService against a real SQLite ledger: fresh-only answers, counted drops, the hard
deadline, policy denials and the indexing rules (DESIGN §2 rules 2 and 4)."""

from __future__ import annotations

import threading
import time

import pytest
import structlog

from connector.discovery.chunks import BlockChunkProvider
from connector.discovery.service import DiscoveryService
from connector.discovery.types import Match, Query
from ledger.client import LedgerClient
from tests.discovery.conftest import (
    MODEL_ID,
    NS,
    NS_OTHER,
    TPB,
    bump_generation,
    record,
    seed_donor,
    seed_workload,
    settings,
    wait_until,
)
from tools.workloads import Workload


def lookup(service: DiscoveryService, workload: Workload, target: str, **kw) -> Match | None:
    """The service's answer for ``target``'s prompt. Without an explicit ``deadline_s`` (a test of
    the deadline), a generous one, and a provider that still timed out fails the test: a timeout
    also answers None, which would let an "is None" assertion pass without the check it is about."""
    if "deadline_s" in kw:
        return service.lookup(workload.prompt(target).tokens, None, MODEL_ID, NS, **kw)
    timeouts = _timeouts(service)
    match = service.lookup(workload.prompt(target).tokens, None, MODEL_ID, NS, deadline_s=10.0, **kw)
    assert _timeouts(service) == timeouts, "a provider timed out; the answer says nothing"
    return match


def _timeouts(service: DiscoveryService) -> float:
    return sum(n for (_, outcome), n in service.metrics.outcome_counts().items() if outcome == "timeout")


def test_labelled_pairs_found_negative_controls_never_hits(service: DiscoveryService, workload: Workload) -> None:
    for lab in workload.labels:
        match = lookup(service, workload, lab.target)
        if lab.negative:
            assert match is None, lab.scenario
        elif lab.expected_providers & {"exact", "chunks", "minhash"}:
            assert match is not None and match.donor_id == lab.donor, lab.scenario
            if "exact" in lab.expected_providers:  # the exact span wins over any semantic candidate
                assert match.match_type == "exact_equivalent"
                assert match.reusable_token_count == lab.exact_prefix_tokens // TPB * TPB
    m = service.metrics
    assert m.value("semkv_discovery_dropped_total", provider="minhash", reason="namespace_mismatch") >= 1  # other_salt
    assert m.value("semkv_discovery_exact_hits_total") >= 5
    assert m.value("semkv_semantic_placement_total", provider="chunks") >= 1  # agent_tools: no exact prefix


def test_stale_and_quarantined_donors_are_dropped_and_counted(sqlite_db: str, workload: Workload) -> None:
    lab = next(lab for lab in workload.labels if lab.scenario == "agent_tools")
    with DiscoveryService(settings(providers=("chunks", "minhash")), db=sqlite_db) as svc:
        seed_donor(sqlite_db, lab.donor, workload.prompt(lab.donor).tokens)
        svc.register_donor(record(lab.donor, workload.prompt(lab.donor).tokens))
        assert svc.flush()
        assert lookup(svc, workload, lab.target).donor_id == lab.donor
        bump_generation(sqlite_db)  # AllBlocksCleared: A's donors are quarantined, its generation bumped
        assert lookup(svc, workload, lab.target) is None
        assert svc.metrics.value("semkv_discovery_dropped_total", provider="chunks", reason="stale") == 1
        assert svc.metrics.value("semkv_discovery_outcomes_total", provider="chunks", outcome="miss") == 1
        seed_donor(sqlite_db, "fresh-copy", workload.prompt(lab.donor).tokens)
        svc.register_donor(record("fresh-copy", workload.prompt(lab.donor).tokens))
        assert svc.flush()
        assert lookup(svc, workload, lab.target).donor_id == "fresh-copy"
        client = LedgerClient(sqlite_db)
        client.evict_donor("fresh-copy", "capacity")
        client.close()
        assert lookup(svc, workload, lab.target) is None
        assert svc.metrics.value("semkv_discovery_dropped_total", provider="chunks", reason="stale") >= 3


def test_cross_salt_candidate_is_a_namespace_mismatch(sqlite_db: str, workload: Workload) -> None:
    lab = next(lab for lab in workload.labels if lab.scenario == "agent_tools")
    tokens = workload.prompt(lab.donor).tokens
    with DiscoveryService(settings(providers=("chunks",)), db=sqlite_db) as svc:
        seed_donor(sqlite_db, "salted", tokens, namespace=NS_OTHER)
        svc.register_donor(record("salted", tokens, namespace=NS_OTHER))
        assert svc.flush()
        assert lookup(svc, workload, lab.target) is None
        assert svc.metrics.value("semkv_discovery_dropped_total", provider="chunks", reason="namespace_mismatch") == 1


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_ledger_checks_read_through_the_ledger_client_on_both_backends(backend: str, request, workload: Workload
                                                                       ) -> None:
    """The exact provider (``find_donor_span``, donor state only) and the freshness check of every
    candidate and registration (``donor_freshness`` without blocks) on SQLite and PostgreSQL."""
    db = request.getfixturevalue("sqlite_db" if backend == "sqlite" else "postgres_db")
    exact = next(lab for lab in workload.labels if lab.scenario == "system_prompt")
    moved = next(lab for lab in workload.labels if lab.scenario == "agent_tools")
    with DiscoveryService(settings(providers=("exact", "chunks")), db=db) as svc:
        for lab in (exact, moved):
            tokens = workload.prompt(lab.donor).tokens
            generation = seed_donor(db, lab.donor, tokens)
            svc.register_donor(record(lab.donor, tokens, generation=generation))
        seed_donor(db, "salted", workload.prompt(moved.donor).tokens, namespace=NS_OTHER)
        svc.register_donor(record("salted", workload.prompt(moved.donor).tokens, namespace=NS_OTHER))
        assert svc.flush()
        assert svc.indexed() == {"exact": 0, "chunks": 3}
        hit = lookup(svc, workload, exact.target)
        assert (hit.donor_id, hit.match_type) == (exact.donor, "exact_equivalent")
        assert hit.reusable_token_count == exact.exact_prefix_tokens // TPB * TPB
        hit = lookup(svc, workload, moved.target)
        assert (hit.donor_id, hit.match_type) == (moved.donor, "semantic_candidate")
        assert svc.metrics.value("semkv_discovery_dropped_total", provider="chunks", reason="namespace_mismatch") >= 1
        bump_generation(db)  # A's donors are quarantined
        assert lookup(svc, workload, exact.target) is None
        assert lookup(svc, workload, moved.target) is None
        assert svc.metrics.value("semkv_discovery_dropped_total", provider="chunks", reason="stale") >= 1
        svc.register_donor(record(moved.donor, workload.prompt(moved.donor).tokens, generation=generation))
        assert svc.flush()
        assert svc.metrics.value("semkv_discovery_index_total", outcome="stale") == 1


class Sleepy:
    """A provider that blocks until released (a hung index, a slow remote store …)."""

    name, generation, needs_text = "sleepy", 1, False

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def candidates(self, query: Query, limit: int) -> list[Match]:
        self.calls += 1
        self.release.wait(10)
        return []

    def index(self, donor) -> None: ...
    def forget(self, donor_id: str) -> None: ...
    def prepare(self, query: Query) -> None: ...
    def flush(self, force: bool = True) -> None: ...
    def close(self) -> None:
        self.release.set()


class Broken(Sleepy):
    name = "broken"

    def candidates(self, query: Query, limit: int) -> list[Match]:
        raise RuntimeError("index corrupted")


def test_deadline_timeout_is_a_counted_miss_and_bounds_the_caller(sqlite_db: str, workload: Workload) -> None:
    sleepy, chunks = Sleepy(), BlockChunkProvider(settings())
    lab = next(lab for lab in workload.labels if lab.scenario == "rag_reordered")
    with DiscoveryService(settings(provider_queue_max=1), db=sqlite_db, providers=[sleepy, chunks, Broken()]) as svc:
        seed_workload(sqlite_db, workload, svc)
        assert svc.flush()
        lookup(svc, workload, lab.target, deadline_s=0.002)  # warm-up: the first ledger read opens connections
        worst = 0.0
        for _ in range(5):
            started = time.perf_counter()
            match = lookup(svc, workload, lab.target, deadline_s=0.002)
            worst = max(worst, time.perf_counter() - started)
        # the provider hangs for 10 s: the callers came back with the deadline, not with it (how close to
        # 2 ms is tools/bench_discovery.py's to measure; CI once saw > 100 ms here with both cores busy)
        assert worst < 1.0
        # its lane is full: later lookups skip it at once (the one call queued may start late on a busy VM:
        # CI once found it not yet started here)
        started = time.monotonic()
        while sleepy.calls == 0 and time.monotonic() - started < 10.0:
            time.sleep(0.01)
        assert sleepy.calls == 1
        m = svc.metrics
        assert m.value("semkv_discovery_outcomes_total", provider="sleepy", outcome="timeout") == 6
        # the other providers still answer; under load the 2 ms lookups above may still occupy the
        # chunk provider's one-slot lane (skipped, counted as timeout), so ask until it is free
        deadline, full = time.monotonic() + 10.0, None
        while full is None and time.monotonic() < deadline:
            full = lookup(svc, workload, lab.target, deadline_s=0.5)
        assert full is not None and full.donor_id == lab.donor
        # a raising provider is a counted error, never an exception (under load the 2 ms lookups above
        # may all have ended before its lane ran, so this is checked after the long ones)
        assert m.value("semkv_discovery_outcomes_total", provider="broken", outcome="error") >= 1
        assert match is None or match.donor_id == lab.donor
        sleepy.release.set()


class TextOnly(Sleepy):
    name, needs_text = "text-only", True

    def candidates(self, query: Query, limit: int) -> list[Match]:
        self.calls += 1
        return []


def test_policy_denials_are_counted_and_text_is_used_only_when_allowed(sqlite_db: str) -> None:
    tokens = list(range(1, 200))
    text_provider = TextOnly()
    with DiscoveryService(settings(allowed_models=(MODEL_ID,)), db=sqlite_db, providers=[text_provider]) as svc:
        assert svc.lookup(tokens, "a prompt", MODEL_ID, NS) is None  # text not allowed: stripped, denied
        assert svc.lookup(tokens, None, MODEL_ID, "not-a-digest") is None
        assert svc.lookup(tokens, None, "other-model", NS) is None
        assert text_provider.calls == 0
        assert svc.metrics.value("semkv_discovery_outcomes_total", provider="text-only",
                                 outcome="policy_denied") == 3
    allowing = settings(allow_prompt_text=True)
    with DiscoveryService(allowing, db=sqlite_db, providers=[text_provider]) as svc:
        assert svc.lookup(tokens, "a prompt", MODEL_ID, NS) is None
        assert text_provider.calls == 1
        assert svc.metrics.value("semkv_discovery_outcomes_total", provider="text-only", outcome="miss") == 1


def test_indexing_drops_stale_registrations_and_bounds_its_queue(sqlite_db: str, workload: Workload) -> None:
    key = workload.donors[0]
    tokens = workload.prompt(key).tokens
    with DiscoveryService(settings(providers=("chunks",), max_indexed_donors=2), db=sqlite_db) as svc:
        generation = seed_donor(sqlite_db, key, tokens)
        svc.register_donor(record(key, tokens, generation=generation + 1))  # not the engine's generation
        seed_donor(sqlite_db, "evicted", tokens)
        LedgerClient(sqlite_db).evict_donor("evicted", "capacity")
        svc.register_donor(record("evicted", tokens))
        svc.register_donor(record("unknown-to-ledger", tokens))
        assert svc.flush()
        m = svc.metrics
        assert m.value("semkv_discovery_index_total", outcome="generation_mismatch") == 1
        assert m.value("semkv_discovery_index_total", outcome="stale") == 2
        assert svc.indexed() == {"chunks": 0}
        for i in range(3):
            seed_donor(sqlite_db, f"d{i}", tokens)
            svc.register_donor(record(f"d{i}", tokens, generation=generation))
        assert svc.flush()
        assert svc.indexed() == {"chunks": 2}  # max_indexed_donors: the oldest was forgotten
    blocker, gate = Sleepy(), threading.Event()
    blocker.index = lambda donor: gate.wait(10)  # type: ignore[method-assign]
    with DiscoveryService(settings(index_queue_max=2), db=sqlite_db, providers=[blocker]) as svc:
        results = [svc.register_donor(record(f"d{i % 3}", tokens)) for i in range(6)]
        assert results.count(False) >= 3
        assert svc.metrics.value("semkv_discovery_index_total", outcome="queue_full") == results.count(False)
        gate.set()


def test_background_lookups_and_the_structured_log_line(service: DiscoveryService, workload: Workload) -> None:
    lab = next(lab for lab in workload.labels if lab.scenario == "rag_reordered")
    with structlog.testing.capture_logs() as logs:
        assert service.lookup_async(workload.prompt(lab.target).tokens, None, MODEL_ID, NS, request_id="r1")
        assert service.flush()
    assert service.metrics.value("semkv_discovery_lookups_total", path="background") == 1
    line = next(entry for entry in logs if entry["event"] == "semkv.discovery.lookup")
    assert line["request_id"] == "r1" and line["donor_id"] == lab.donor and line["path"] == "background"
    assert line["match_type"] == "exact_equivalent" and line["outcomes"]["chunks"] == "hit"
    wait_until(lambda: service.metrics.value("semkv_discovery_index_queue_depth") == 0)


@pytest.mark.parametrize("bad", [[-1, 2, 3], [[1, 2], [3, 4]]])
def test_malformed_tokens_raise_value_error_to_direct_callers(service: DiscoveryService, bad) -> None:
    with pytest.raises(ValueError):
        service.lookup(bad, None, MODEL_ID, NS)
