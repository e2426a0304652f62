"""The Dynamo routing hint (issue #22, :mod:`connector.placement.dynamo_hint`): a worker is named only
when the ledger's advice singles out one fresh engine by a margin and the engine maps to a Dynamo
instance; ties, no evidence, unknown overlaps, load-aware rankings and unmapped engines are left to
Dynamo's router. Real SQLite ledger and advisor; the fleet-level check is in tests/dynamo_cpu."""

from __future__ import annotations

import pytest

from connector.block_keys import dynamo_block_hashes
from connector.placement.advice import EngineLoad, PlacementAdvisor
from connector.placement.dynamo_hint import DynamoHint, dynamo_hint, frontend_engine_load, nvext_hint
from tests.discovery.conftest import append
from tests.discovery.test_placement_schemes import described
from tools.harness.builders import batch, stored

TPB = 16
PROMPT = [(13 * i + 7) % 50_000 for i in range(8 * TPB)]  # 8 full blocks
INSTANCES = {"hot": 101, "warm": 102, "twin": 103, "cold": 104}


def instances(*engine_ids: str) -> dict[str, int]:
    return {e: INSTANCES[e] for e in engine_ids}


def ledger_with(sqlite_db: str, holdings: dict[str, int], scheme: str = "dynamo") -> PlacementAdvisor:
    """Each engine holds the first N blocks of PROMPT (N=0: one block of another prompt)."""
    hashes = dynamo_block_hashes(PROMPT, TPB)
    other = dynamo_block_hashes([t + 1 for t in PROMPT], TPB)
    for engine_id, n in holdings.items():
        blocks = hashes[:n] if n else other[:1]
        append(sqlite_db, described(batch(0, stored(*blocks, num_tokens=TPB, type_name="BlockStored"),
                                          engine_id=engine_id), scheme))
    return PlacementAdvisor(sqlite_db, tokens_per_block=TPB)


def test_one_engine_singled_out_is_named_with_its_instance(sqlite_db: str) -> None:
    advisor = ledger_with(sqlite_db, {"hot": 6, "warm": 2, "cold": 0})
    fleet = instances("hot", "warm", "cold")
    try:
        advice = advisor.advise(PROMPT)
        hint = dynamo_hint(advice, fleet)
        assert hint == DynamoHint("hot", 101, 6, 2, advice.ledger_seq)
        assert nvext_hint(hint) == {"backend_instance_id": 101}
        assert dynamo_hint(advice, fleet, min_margin_blocks=4) == DynamoHint("hot", 101, 6, 2, advice.ledger_seq)
        assert dynamo_hint(advice, fleet, min_margin_blocks=5) is None  # a lead of 4 blocks is not enough
    finally:
        advisor.close()


def test_a_tie_at_the_top_is_left_to_dynamo(sqlite_db: str) -> None:
    advisor = ledger_with(sqlite_db, {"hot": 6, "twin": 6, "warm": 2})
    try:
        assert dynamo_hint(advisor.advise(PROMPT), instances("hot", "twin", "warm")) is None
    finally:
        advisor.close()


def test_no_evidence_names_nobody(sqlite_db: str) -> None:
    advisor = ledger_with(sqlite_db, {"cold": 0, "warm": 0})
    try:
        advice = advisor.advise(PROMPT)
        assert not advice.informed
        assert dynamo_hint(advice, instances("cold", "warm")) is None and nvext_hint(None) == {}
    finally:
        advisor.close()


def test_an_engine_without_a_dynamo_instance_is_never_named(sqlite_db: str) -> None:
    advisor = ledger_with(sqlite_db, {"hot": 6, "warm": 2})
    try:
        assert dynamo_hint(advisor.advise(PROMPT), {"warm": 102}) is None  # hot leads but has no instance
    finally:
        advisor.close()


def test_an_engine_of_unknown_overlap_blocks_the_hint(sqlite_db: str) -> None:
    """vLLM hashes are not computed here: that engine might hold more than the best one we see."""
    advisor = ledger_with(sqlite_db, {"hot": 6, "warm": 2})
    append(sqlite_db, described(batch(0, stored(*dynamo_block_hashes(PROMPT, TPB)[:1], num_tokens=TPB,
                                                type_name="BlockStored"), engine_id="cold"), "vllm"))
    try:
        advice = advisor.advise(PROMPT)
        assert {a.engine_id: a.overlap for a in advice.engines}["cold"] == "unknown"
        assert dynamo_hint(advice, instances("hot", "warm", "cold")) is None
    finally:
        advisor.close()


def test_a_load_aware_ranking_is_not_turned_into_a_hint(sqlite_db: str) -> None:
    advisor = ledger_with(sqlite_db, {"hot": 6, "warm": 2})
    try:
        advice = advisor.advise(PROMPT, engine_load={"hot": EngineLoad(), "warm": EngineLoad()})
        assert advice.load_aware
        assert dynamo_hint(advice, instances("hot", "warm")) is None
    finally:
        advisor.close()


def test_the_margin_must_be_positive(sqlite_db: str) -> None:
    advisor = ledger_with(sqlite_db, {"hot": 6})
    try:
        with pytest.raises(ValueError, match="min_margin_blocks"):
            dynamo_hint(advisor.advise(PROMPT), instances("hot"), min_margin_blocks=0)
    finally:
        advisor.close()


def test_by_cost_names_the_one_engine_of_lowest_cost(sqlite_db: str) -> None:
    """hot holds 6 of 8 blocks but is busy; warm holds 2 and is idle: Dynamo's cost prefers warm."""
    advisor = ledger_with(sqlite_db, {"hot": 6, "warm": 2})
    try:
        fleet = instances("hot", "warm")
        idle = advisor.advise(PROMPT, engine_load={"hot": EngineLoad(), "warm": EngineLoad()})
        assert dynamo_hint(idle, fleet, by_cost=True) == DynamoHint("hot", 101, 6, 2, idle.ledger_seq)
        busy = advisor.advise(PROMPT, engine_load={"hot": EngineLoad(active_blocks=40), "warm": EngineLoad()})
        assert dynamo_hint(busy, fleet, by_cost=True) == DynamoHint("warm", 102, 2, 6, busy.ledger_seq)
        assert dynamo_hint(advisor.advise(PROMPT), fleet, by_cost=True) is None  # no load: not by cost
        tie = advisor.advise(PROMPT, engine_load={"hot": EngineLoad(active_blocks=4), "warm": EngineLoad()})
        assert [a.cost for a in tie.engines][0] == [a.cost for a in tie.engines][1]
        assert dynamo_hint(tie, fleet, by_cost=True) is None
    finally:
        advisor.close()


def test_frontend_engine_load_reads_dynamos_per_worker_gauges() -> None:
    """Lines as the 1.6.1 frontend writes them (seen on its /metrics with --router-mode kv)."""
    text = "\n".join([
        "# HELP dynamo_frontend_worker_active_decode_blocks Active decode blocks",
        'dynamo_frontend_worker_active_decode_blocks{dp_rank="0",worker_id="17003120243840178517",worker_type="decode"} 120',
        'dynamo_frontend_worker_active_decode_blocks{dp_rank="1",worker_id="17003120243840178517",worker_type="decode"} 5',
        'dynamo_frontend_worker_active_prefill_tokens{dp_rank="0",worker_id="17003120243840178517",worker_type="decode"} 64',
        'dynamo_frontend_worker_active_decode_blocks{dp_rank="0",worker_id="42",worker_type="decode"} 0',
        'dynamo_frontend_worker_active_decode_blocks{dp_rank="0",worker_id="99",worker_type="decode"} 7',
        'dynamo_frontend_inflight_requests{model="tiny"} 2',
    ])
    loads = frontend_engine_load(text, {17003120243840178517: "dynamo-1", 42: "dynamo-0"})
    assert loads == {"dynamo-1": EngineLoad(active_blocks=125, prefill_tokens=64), "dynamo-0": EngineLoad()}
    assert frontend_engine_load("", {42: "dynamo-0"}) == {}


def test_a_worker_the_ledger_has_not_heard_from_blocks_the_hint(sqlite_db: str) -> None:
    """twin has a Dynamo instance but never published: its overlap (and cost) are not known, and an
    idle new worker would never be chosen by cost if it were left out."""
    advisor = ledger_with(sqlite_db, {"hot": 6, "warm": 2})
    try:
        advice = advisor.advise(PROMPT)
        assert dynamo_hint(advice, instances("hot", "warm")) is not None
        assert dynamo_hint(advice, instances("hot", "warm", "twin")) is None
        loaded = advisor.advise(PROMPT, engine_load={"hot": EngineLoad(active_blocks=40), "warm": EngineLoad(),
                                                     "twin": EngineLoad()})
        assert dynamo_hint(loaded, instances("hot", "warm", "twin"), by_cost=True) is None
    finally:
        advisor.close()
