"""Property test (issue #20): every reader of donor freshness agrees with the one rule.

On random ledgers (engines of any generation and status, donors of any state, namespace, expiry and
generation, some of engines the ledger does not know, holding prefixes of one chain of content keys
or of another) the answers of

1. the SQL condition itself (:func:`ledger.freshness.fresh_donor_clause`),
2. the worker's revalidation (:meth:`LedgerClient.donor_freshness`, policy ``store``),
3. the lookup's ledger read (:meth:`LedgerClient.find_donor_span`, block liveness aside),
4. the in-memory donor view (:meth:`DonorView.longest_span` after :meth:`LedgerClient.refresh_view`),
5. placement (:meth:`LedgerClient.placement`: per engine, the longest fresh donor span)

equal what :func:`ledger.freshness.stale_reason` says of each donor's facts. Before the one rule,
placement alone refused donors of an engine resynchronising after lost events (case
``engine_resyncing`` below). Runs on SQLite and PostgreSQL; each example replaces the projection
rows the reads look at.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete, insert, select

from ledger.db import sync_engine
from ledger.donor_view import DonorView
from ledger.freshness import DonorFacts, fresh_donor_clause, stale_reason
from ledger.client import LedgerClient
from ledger.schema import DonorBlockRow, DonorRow, EngineRow
from ledger.types import DonorState, EngineStatus, FreshnessPolicy, StaleReason
from tests.conftest import scratch_pg_ledger

NOW = 1_000_000.0
NAMESPACE = "ns-request"
CHAIN = [bytes([i]) * 16 for i in range(1, 11)]
"""The request's chained content keys (10 blocks)."""
OTHER_CHAIN = [bytes([100 + i]) * 16 for i in range(10)]
_E, _D, _DB = EngineRow.__table__, DonorRow.__table__, DonorBlockRow.__table__
ENGINES = ("engine-a", "engine-b", "engine-c")


@dataclasses.dataclass(frozen=True)
class Donor:
    donor_id: str
    engine_id: str
    namespace: str
    state: str
    expires_at: float | None
    generation: int
    blocks: int
    on_request_chain: bool


engine_strategy = st.tuples(st.integers(1, 3), st.sampled_from(list(EngineStatus)))


@st.composite
def ledgers(draw: st.DrawFn) -> tuple[dict[str, tuple[int, str]], list[Donor]]:
    """``({engine_id: (generation, status)}, donors)``: engine-c is sometimes unknown."""
    known = draw(st.lists(st.sampled_from(ENGINES), min_size=1, max_size=3, unique=True))
    engines = {engine_id: draw(engine_strategy) for engine_id in known}
    donors = [Donor(f"donor-{i}", draw(st.sampled_from(ENGINES)), draw(st.sampled_from([NAMESPACE, "ns-other"])),
                    draw(st.sampled_from(list(DonorState))), draw(st.sampled_from([None, NOW - 1.0, NOW, NOW + 60.0])),
                    draw(st.integers(1, 3)), draw(st.integers(1, len(CHAIN))), draw(st.booleans()))
              for i in range(draw(st.integers(0, 8)))]
    return engines, donors


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def ledger_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from ledger.migrate import upgrade

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('freshness') / 'ledger.db'}"
        upgrade(url)
        yield url
        return
    with scratch_pg_ledger() as pg_url:
        yield pg_url


def write(url: str, engines: dict[str, tuple[int, str]], donors: list[Donor]) -> None:
    """Replace the engines, donors and donor_blocks projections with this ledger."""
    engine = sync_engine(url)
    try:
        with engine.begin() as conn:
            for table in (_DB, _D, _E):
                conn.execute(delete(table))
            for engine_id, (generation, status) in engines.items():
                conn.execute(insert(_E).values(engine_id=engine_id, generation=generation, status=str(status),
                                               registered_seq=0, generation_seq=0, last_seq=0))
            for i, d in enumerate(donors):
                chain = CHAIN if d.on_request_chain else OTHER_CHAIN
                conn.execute(insert(_D).values(
                    donor_id=d.donor_id, namespace=d.namespace, engine_id=d.engine_id, attention_dp_rank=0,
                    window_size=0, generation=d.generation, num_tokens=d.blocks * 4, num_blocks=d.blocks,
                    tokens_per_block=4, provider_generation=0, expires_at=d.expires_at, state=str(d.state),
                    store_ref=f"store/{d.donor_id}", checksum="sum", size_bytes=1, registered_seq=i,
                    updated_seq=0))
                for position in range(d.blocks):
                    conn.execute(insert(_DB).values(donor_id=d.donor_id, position=position,
                                                    content_key=chain[position], block_hash=1000 * i + position,
                                                    block_hash_ext=b""))
    finally:
        engine.dispose()


def rule(engines: dict[str, tuple[int, str]], donor: Donor) -> StaleReason | None:
    generation, status = engines.get(donor.engine_id, (None, None))
    return stale_reason(DonorFacts(donor.namespace, donor.state, donor.expires_at, donor.generation, generation,
                                   status), namespace=NAMESPACE, now=NOW)


def expected_spans(engines: dict[str, tuple[int, str]], donors: list[Donor]) -> dict[str, int]:
    """Per engine, the most leading request keys a donor the rule calls fresh holds."""
    spans: dict[str, int] = {}
    for d in donors:
        if d.on_request_chain and rule(engines, d) is None:
            spans[d.engine_id] = max(spans.get(d.engine_id, 0), d.blocks)
    return spans


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ledger=ledgers())
def test_every_reader_agrees_with_the_one_freshness_rule(ledger_url: str, ledger) -> None:
    engines, donors = ledger
    write(ledger_url, engines, donors)
    spans = expected_spans(engines, donors)
    longest = max(spans.values(), default=0)
    client = LedgerClient(ledger_url)
    try:
        # 1. the SQL condition
        engine = sync_engine(ledger_url)
        try:
            with engine.connect() as conn:
                fresh_sql = set(conn.execute(select(_D.c.donor_id).select_from(
                    _D.join(_E, _E.c.engine_id == _D.c.engine_id)).where(
                    fresh_donor_clause(_D, _E, namespace=NAMESPACE, now=NOW))).scalars())
        finally:
            engine.dispose()
        assert fresh_sql == {d.donor_id for d in donors if rule(engines, d) is None}
        # 2. revalidation
        for d in donors:
            assert client.donor_freshness(d.donor_id, namespace=NAMESPACE, num_blocks=0,
                                          policy=FreshnessPolicy.STORE, now=NOW) == rule(engines, d), d
        # 3. the lookup's read
        span = client.find_donor_span(NAMESPACE, CHAIN, now=NOW, check_blocks=False)
        assert (span.num_blocks if span else 0) == longest
        if span is not None:
            assert rule(engines, next(d for d in donors if d.donor_id == span.donor_id)) is None
        # 4. the donor view
        view = DonorView()
        client.refresh_view(view)
        found = view.longest_span(NAMESPACE, CHAIN, now=NOW, check_blocks=False)
        assert (found[1] if found else 0) == longest
        # 5. placement
        snapshot = client.placement([], NAMESPACE, CHAIN, now=NOW)
        assert {e.engine_id: e.donor_blocks for e in snapshot.engines if e.donor_blocks} == spans
        assert {e.engine_id for e in snapshot.engines} == set(engines)
    finally:
        client.close()


def test_a_donor_of_a_resynchronising_engine_is_stale_everywhere(ledger_url: str) -> None:
    """The case the readers disagreed on: placement refused it, the lookup and the view served it."""
    engines = {"engine-a": (2, EngineStatus.RESYNCING)}
    donor = Donor("donor-0", "engine-a", NAMESPACE, DonorState.LIVE, None, 2, 4, True)
    write(ledger_url, engines, [donor])
    client = LedgerClient(ledger_url)
    try:
        assert client.donor_freshness("donor-0", namespace=NAMESPACE, num_blocks=0, policy=FreshnessPolicy.STORE,
                                      now=NOW) == StaleReason.ENGINE_RESYNCING
        assert client.find_donor_span(NAMESPACE, CHAIN, now=NOW, check_blocks=False) is None
        view = DonorView()
        client.refresh_view(view)
        assert view.longest_span(NAMESPACE, CHAIN, now=NOW, check_blocks=False) is None
        assert [e.donor_blocks for e in client.placement([], NAMESPACE, CHAIN, now=NOW).engines] == [0]
    finally:
        client.close()
