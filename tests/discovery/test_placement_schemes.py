"""Placement advice knows each engine's block hashes (issue #22), on real ledgers.

A mixed fleet in one ledger: a Dynamo worker (scheme configured, its hashes Dynamo's xxh3 chain),
a TensorRT-LLM engine (LLM-API events: ``trtllm_v1`` inferred), a vLLM engine (scheme configured;
its hashes cannot be computed here) and an engine nobody described (maps tagged ``BlockStored``:
the dialect does not tell). Advice computes each engine's hashes its way, answers the last two as
``unknown`` (never fresh with zero blocks), takes the caller's own hashes when given, and says so
when no engine has any evidence instead of ranking by ``engine_id`` as if informed. The consumer
daemon logs a source's configured scheme, and advice then finds a Dynamo worker's blocks.
"""

from __future__ import annotations

import json
import random

import msgspec
import pytest
from fastapi.testclient import TestClient

from connector.block_keys import block_hash_chain, dynamo_block_hashes
from connector.placement.advice import PlacementAdvisor
from connector.placement.http import create_app
from tests.discovery.conftest import append
from tests.integration.consumer.daemon_support import DaemonRun, FaultPublisher, settings_for, subscribed, wait_until
from tools.harness.builders import batch, removed, stored

TPB = 16
PROMPT = [(7 * i + 3) % 50_000 for i in range(6 * TPB + 5)]  # 6 full blocks and a partial one
VLLM_HASHES = [0x1111_0000 + i for i in range(6)]  # what a vLLM engine published for PROMPT (its own chain)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db(request) -> str:
    return request.getfixturevalue("sqlite_db" if request.param == "sqlite" else "postgres_db")


def described(item, scheme: str):
    return msgspec.structs.replace(item, block_key_scheme=scheme)


@pytest.fixture
def fleet(db: str) -> str:
    """dyn holds 4 blocks of PROMPT, trt 2, vllm 5 (by its own hashes), mystery 3 (Dynamo's, undescribed)."""
    dyn, v1 = dynamo_block_hashes(PROMPT, TPB), block_hash_chain(PROMPT, TPB)
    append(db, described(batch(0, stored(*dyn[:4], num_tokens=TPB, type_name="BlockStored"), engine_id="dyn"),
                         "dynamo"),
         batch(0, stored(*v1[:2], num_tokens=TPB), engine_id="trt"),
         described(batch(0, stored(*VLLM_HASHES[:5], num_tokens=TPB, type_name="BlockStored"), engine_id="vllm"),
                   "vllm"),
         batch(0, stored(*dyn[:3], num_tokens=TPB, type_name="BlockStored"), engine_id="mystery"))
    return db


def by_engine(advice) -> dict:
    return {a.engine_id: (a.overlap, a.live_blocks, a.fresh, a.block_key_scheme) for a in advice.engines}


def test_each_engine_is_answered_by_its_own_scheme_and_unknown_ones_say_so(fleet: str) -> None:
    advisor = PlacementAdvisor(fleet, tokens_per_block=TPB)
    try:
        advice = advisor.advise(PROMPT)
    finally:
        advisor.close()
    assert by_engine(advice) == {"dyn": ("known", 4, True, "dynamo"), "trt": ("known", 2, True, "trtllm_v1"),
                                 "vllm": ("unknown", None, False, "vllm"), "mystery": ("unknown", None, False, None)}
    assert [a.engine_id for a in advice.engines] == ["dyn", "trt", "mystery", "vllm"]  # unknown last
    assert advice.informed and any("mystery" in w and "vllm" in w for w in advice.warnings)
    assert advice.engines[0].live_tokens == 4 * TPB and advice.engines[2].live_tokens is None


def test_the_callers_own_block_hashes_are_used_for_every_engine(fleet: str) -> None:
    advisor = PlacementAdvisor(fleet, tokens_per_block=TPB)
    try:
        advice = advisor.advise(PROMPT, block_hashes=VLLM_HASHES)
        signed = [h - 2**64 if h >= 2**63 else h for h in dynamo_block_hashes(PROMPT, TPB)]  # as Dynamo sends them
        mystery = advisor.advise(PROMPT, block_hashes=signed)
    finally:
        advisor.close()
    assert by_engine(advice)["vllm"] == ("known", 5, True, "vllm")
    assert advice.engines[0].engine_id == "vllm" and {a.live_blocks for a in advice.engines[1:]} == {0}
    assert by_engine(mystery)["mystery"] == ("known", 3, True, None) and by_engine(mystery)["dyn"][1] == 4


def test_no_evidence_is_not_presented_as_a_ranking(fleet: str) -> None:
    advisor = PlacementAdvisor(fleet, tokens_per_block=TPB)
    try:
        advice = advisor.advise([49_999 - t for t in PROMPT])
    finally:
        advisor.close()
    assert not advice.informed
    assert any("engine_id order, not evidence" in w for w in advice.warnings)
    assert {a.live_blocks for a in advice.engines if a.overlap == "known"} == {0}


def test_http_takes_block_hashes_and_refuses_malformed_ones(fleet: str) -> None:
    advisor = PlacementAdvisor(fleet, tokens_per_block=TPB)
    try:
        with TestClient(create_app(advisor)) as client:
            body = client.post("/v1/placement", json={"token_ids": PROMPT, "block_hashes": VLLM_HASHES}).json()
            assert body["engines"][0]["engine_id"] == "vllm" and body["engines"][0]["live_blocks"] == 5
            plain = client.post("/v1/placement", json={"token_ids": PROMPT}).json()
            vllm = next(e for e in plain["engines"] if e["engine_id"] == "vllm")
            assert (vllm["overlap"], vllm["live_blocks"], vllm["fresh"]) == ("unknown", None, False)
            assert plain["informed"] and plain["warnings"]
            for bad in (["zz"], [2**64], [-(2**63) - 1], "x"):
                response = client.post("/v1/placement", content=json.dumps({"token_ids": [1], "block_hashes": bad}))
                assert response.status_code == 422, bad
            # more hashes than the prompt has whole blocks: an overlap longer than the request
            response = client.post("/v1/placement", json={"token_ids": PROMPT[:TPB - 1], "block_hashes": VLLM_HASHES})
            assert response.status_code == 422 and "whole blocks" in response.json()["detail"]
    finally:
        advisor.close()


async def test_the_consumer_logs_a_sources_configured_scheme_and_advice_uses_it(sqlite_db: str) -> None:
    dyn = dynamo_block_hashes(PROMPT, TPB)
    payload = msgspec.msgpack.encode([1.0, [
        {"type": "BlockStored", "block_hashes": [h - 2**64 if h >= 2**63 else h for h in dyn[:5]],
         "parent_block_hash": None, "token_ids": PROMPT[:5 * TPB], "block_size": TPB, "lora_id": None,
         "medium": "GPU"}], 0])
    with FaultPublisher(replay_topic=False) as pub:
        source = {"engine_id": "worker-7", "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
                  "block_key_scheme": "dynamo"}
        async with DaemonRun(settings_for(sqlite_db, source)) as run:
            await subscribed(pub, run)
            pub.publish(0, payload)
            await wait_until(lambda: run.daemon.stats.batches == 1, 10, "the batch")
            await run.stop()
    advisor = PlacementAdvisor(sqlite_db, tokens_per_block=TPB)
    try:
        assert by_engine(advisor.advise(PROMPT)) == {"worker-7": ("known", 5, True, "dynamo")}
    finally:
        advisor.close()


@pytest.mark.parametrize("asked_every", [1, 7])
def test_the_live_index_answers_as_the_ledger_does_through_stores_removals_and_bumps(db: str, asked_every: int) -> None:
    """Seeded random traffic on three engines (stores of prompt prefixes, removals, lost batches
    that bump the generation, a stream of another attention-DP rank): after every transaction (or
    every 7th: one catch-up then folds several, a bump among them, stores and removals of one key)
    the in-memory index and the ledger's own tables give the same overlaps for every prompt."""
    rng = random.Random(22 + asked_every)
    prompts = [[rng.randrange(1000) for _ in range(8 * TPB)] for _ in range(4)]
    chains = [block_hash_chain(p, TPB) for p in prompts]
    indexed = PlacementAdvisor(db, tokens_per_block=TPB)
    direct = PlacementAdvisor(db, tokens_per_block=TPB, live_index=False)
    seqs = {"a": 0, "b": 0, "c": 0}
    try:
        for step in range(60 * asked_every):
            engine = rng.choice("abc")
            chain = rng.choice(chains)
            n = rng.randrange(1, 9)
            if rng.random() < 0.6:
                event = stored(*chain[:n], num_tokens=TPB, dp_rank=rng.choice((0, 0, 1)))
            else:
                event = removed(*rng.sample(chain, n), dp_rank=rng.choice((0, 0, 1)))
            seqs[engine] += 2 if rng.random() < 0.1 else 1  # now and then a lost batch: a gap, a bump
            append(db, batch(seqs[engine], event, engine_id=engine))
            if step % asked_every:
                continue
            for prompt in prompts:
                assert by_engine(indexed.advise(prompt)) == by_engine(direct.advise(prompt)), step
        assert indexed.index is not None and indexed.index.blocks() > 0
    finally:
        indexed.close()
        direct.close()
