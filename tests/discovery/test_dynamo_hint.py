"""The Dynamo routing hint (issue #22, :mod:`connector.placement.dynamo_hint`): a worker is named only
when the ledger's advice singles out one fresh engine by a margin and the engine maps to a Dynamo
instance; ties, no evidence, unknown overlaps, load-aware rankings and unmapped engines are left to
Dynamo's router. Real SQLite ledger and advisor; the fleet-level check is in tests/dynamo_cpu."""

from __future__ import annotations

import pytest

from connector.block_keys import dynamo_block_hashes
from connector.placement.advice import EngineLoad, PlacementAdvisor
from connector.placement.dynamo_hint import DynamoHint, dynamo_hint, nvext_hint
from tests.discovery.conftest import append
from tests.discovery.test_placement_schemes import described
from tools.harness.builders import batch, stored

TPB = 16
PROMPT = [(13 * i + 7) % 50_000 for i in range(8 * TPB)]  # 8 full blocks
INSTANCES = {"hot": 101, "warm": 102, "twin": 103, "cold": 104}


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
    try:
        advice = advisor.advise(PROMPT)
        hint = dynamo_hint(advice, INSTANCES)
        assert hint == DynamoHint("hot", 101, 6, 2, advice.ledger_seq)
        assert nvext_hint(hint) == {"backend_instance_id": 101}
        assert dynamo_hint(advice, INSTANCES, min_margin_blocks=4) == DynamoHint("hot", 101, 6, 2, advice.ledger_seq)
        assert dynamo_hint(advice, INSTANCES, min_margin_blocks=5) is None  # a lead of 4 blocks is not enough
    finally:
        advisor.close()


def test_a_tie_at_the_top_is_left_to_dynamo(sqlite_db: str) -> None:
    advisor = ledger_with(sqlite_db, {"hot": 6, "twin": 6, "warm": 2})
    try:
        assert dynamo_hint(advisor.advise(PROMPT), INSTANCES) is None
    finally:
        advisor.close()


def test_no_evidence_names_nobody(sqlite_db: str) -> None:
    advisor = ledger_with(sqlite_db, {"cold": 0, "warm": 0})
    try:
        advice = advisor.advise(PROMPT)
        assert not advice.informed
        assert dynamo_hint(advice, INSTANCES) is None and nvext_hint(None) == {}
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
        assert dynamo_hint(advice, INSTANCES) is None
    finally:
        advisor.close()


def test_a_load_aware_ranking_is_not_turned_into_a_hint(sqlite_db: str) -> None:
    advisor = ledger_with(sqlite_db, {"hot": 6, "warm": 2})
    try:
        advice = advisor.advise(PROMPT, engine_load={"hot": EngineLoad(), "warm": EngineLoad()})
        assert advice.load_aware
        assert dynamo_hint(advice, INSTANCES) is None
    finally:
        advisor.close()


def test_the_margin_must_be_positive(sqlite_db: str) -> None:
    advisor = ledger_with(sqlite_db, {"hot": 6})
    try:
        with pytest.raises(ValueError, match="min_margin_blocks"):
            dynamo_hint(advisor.advise(PROMPT), INSTANCES, min_margin_blocks=0)
    finally:
        advisor.close()
