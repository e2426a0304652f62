"""Load-aware placement advice (issue #22): when the caller gives every engine's load, engines are
ranked by Dynamo's routing cost with the ledger's evidence as the overlap; otherwise by evidence,
with a warning naming the engines without load. Real SQLite ledger, in process and over HTTP."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from connector.block_keys import dynamo_block_hashes
from connector.placement.advice import EngineLoad, PlacementAdvisor
from connector.placement.http import create_app
from tests.discovery.conftest import append
from tests.discovery.test_placement_schemes import described
from tools.harness.builders import batch, stored

TPB = 16
PROMPT = [(11 * i + 5) % 50_000 for i in range(8 * TPB)]  # 8 full blocks


@pytest.fixture
def advisor(sqlite_db: str):
    """hot holds 6 of PROMPT's 8 blocks, warm 2, cold none (a block of another prompt)."""
    hashes = dynamo_block_hashes(PROMPT, TPB)
    other = dynamo_block_hashes([t + 1 for t in PROMPT], TPB)
    for engine_id, blocks in (("hot", hashes[:6]), ("warm", hashes[:2]), ("cold", other[:1])):
        append(sqlite_db, described(batch(0, stored(*blocks, num_tokens=TPB, type_name="BlockStored"),
                                          engine_id=engine_id), "dynamo"))
    advisor = PlacementAdvisor(sqlite_db, tokens_per_block=TPB)
    yield advisor
    advisor.close()


def order(advice) -> list[str]:
    return [a.engine_id for a in advice.engines]


def test_without_load_the_ranking_is_by_evidence(advisor: PlacementAdvisor) -> None:
    advice = advisor.advise(PROMPT)
    assert order(advice) == ["hot", "warm", "cold"] and not advice.load_aware
    assert {a.cost for a in advice.engines} == {None}


def test_every_engines_load_ranks_by_dynamos_cost(advisor: PlacementAdvisor) -> None:
    idle = {e: EngineLoad() for e in ("hot", "warm", "cold")}
    advice = advisor.advise(PROMPT, engine_load=idle)
    # idle everywhere: the cost is prefill blocks left + the request's 8 decode blocks
    assert advice.load_aware and order(advice) == ["hot", "warm", "cold"]
    assert [a.cost for a in advice.engines] == [2 + 8, 6 + 8, 8 + 8]
    # hot is busy: 20 blocks held by running requests outweigh the 4 blocks of prefill it saves over warm
    busy = {**idle, "hot": EngineLoad(active_blocks=20)}
    advice = advisor.advise(PROMPT, engine_load=busy)
    assert order(advice) == ["warm", "cold", "hot"] and advice.engines[-1].cost == 2 + 8 + 20
    # a queue of prefill tokens counts as prefill blocks (64 tokens: 4 blocks) times the weight
    queued = {**idle, "hot": EngineLoad(prefill_tokens=5 * TPB)}
    assert order(advisor.advise(PROMPT, engine_load=queued)) == ["warm", "hot", "cold"]


def test_the_overlap_weight_trades_reuse_for_spread(sqlite_db: str, advisor: PlacementAdvisor) -> None:
    load = {"hot": EngineLoad(active_blocks=3), "warm": EngineLoad(), "cold": EngineLoad()}
    assert order(advisor.advise(PROMPT, engine_load=load))[0] == "hot"  # 1 × 2 + 8 + 3 < 1 × 6 + 8
    spread = PlacementAdvisor(sqlite_db, tokens_per_block=TPB, overlap_weight=0.25)
    try:
        assert order(spread.advise(PROMPT, engine_load=load))[0] == "warm"  # 0.25 × 6 + 8 < 0.25 × 2 + 8 + 3
    finally:
        spread.close()


def test_load_for_some_engines_only_is_said_and_not_used(advisor: PlacementAdvisor) -> None:
    advice = advisor.advise(PROMPT, engine_load={"hot": EngineLoad(active_blocks=100)})
    assert not advice.load_aware and order(advice) == ["hot", "warm", "cold"]
    assert any("engine_load not given for 2 engine(s) (warm, cold)" in w for w in advice.warnings)


def test_no_evidence_but_load_is_a_ranking(advisor: PlacementAdvisor) -> None:
    unseen = [49_999 - t for t in PROMPT]
    advice = advisor.advise(unseen, engine_load={"hot": EngineLoad(3), "warm": EngineLoad(1), "cold": EngineLoad(2)})
    assert order(advice) == ["warm", "cold", "hot"] and not advice.informed
    assert not any("engine_id order" in w for w in advice.warnings)


def test_http_takes_engine_load_and_refuses_bad_load(advisor: PlacementAdvisor) -> None:
    with TestClient(create_app(advisor)) as client:
        load = {"hot": {"active_blocks": 20}, "warm": {}, "cold": {"prefill_tokens": 0}}
        body = client.post("/v1/placement", json={"token_ids": PROMPT, "engine_load": load}).json()
        assert body["load_aware"] and [e["engine_id"] for e in body["engines"]] == ["warm", "cold", "hot"]
        assert [e["cost"] for e in body["engines"]] == [14.0, 16.0, 30.0]
        for bad in ({"hot": {"active_blocks": -1}}, {"hot": {"queue": 1}}, {"hot": 3}):
            response = client.post("/v1/placement", json={"token_ids": PROMPT, "engine_load": bad})
            assert response.status_code == 422, bad


def test_an_engine_of_unknown_overlap_is_ranked_by_its_cost_with_no_reuse(sqlite_db: str,
                                                                          advisor: PlacementAdvisor) -> None:
    # an engine nobody described (maps tagged BlockStored): its hashes cannot be computed, its overlap is unknown
    append(sqlite_db, batch(0, stored(*dynamo_block_hashes(PROMPT, TPB)[:1], num_tokens=TPB, type_name="BlockStored"),
                            engine_id="mystery"))
    busy = {"hot": EngineLoad(10_000), "warm": EngineLoad(10_000), "cold": EngineLoad(10_000), "mystery": EngineLoad()}
    advice = advisor.advise(PROMPT, engine_load=busy)
    assert advice.load_aware and order(advice)[0] == "mystery"  # 8 + 8 (no reuse assumed) beats any 10,000
    assert advice.engines[0].overlap == "unknown" and advice.engines[0].cost == 16
    assert any("overlap unknown" in w and "mystery" in w for w in advice.warnings)


def test_load_for_engines_the_ledger_does_not_know_is_said(advisor: PlacementAdvisor) -> None:
    loads = {e: EngineLoad() for e in ("hot", "warm", "cold", "ghost")}
    advice = advisor.advise(PROMPT, engine_load=loads)
    assert advice.load_aware and any("does not know (ghost)" in w for w in advice.warnings)


@pytest.mark.parametrize("weight", [float("inf"), float("nan"), -1.0, 1e7])
def test_an_overlap_weight_that_orders_nothing_is_refused(sqlite_db: str, weight: float) -> None:
    with pytest.raises(ValueError, match="overlap_weight"):
        PlacementAdvisor(sqlite_db, tokens_per_block=TPB, overlap_weight=weight)


@pytest.mark.parametrize("load", [EngineLoad(float("nan")), EngineLoad(1.5), EngineLoad(0, -1), EngineLoad(2**41)])
def test_a_load_that_is_not_a_count_is_refused(advisor: PlacementAdvisor, load: EngineLoad) -> None:
    with pytest.raises(ValueError, match="engine_load"):
        advisor.advise(PROMPT, engine_load={"hot": load, "warm": EngineLoad(), "cold": EngineLoad()})
