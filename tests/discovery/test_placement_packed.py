"""Token ids and block hashes as numpy arrays (in process) and packed in the HTTP body
(``token_ids_le32``, ``block_hashes_le64``: base64 of little-endian integers) give the same advice as
lists of ints, on real ledgers (issue #22: decoding a 32K-token JSON list into Python ints was ~0.7 ms
of each answer over HTTP)."""

from __future__ import annotations

import base64
import random

import numpy as np
import pytest
from fastapi.testclient import TestClient

from connector.block_keys import block_hash_chain, dynamo_block_hashes
from connector.placement.advice import PlacementAdvisor
from connector.placement.http import create_app
from tests.discovery.conftest import append
from tests.discovery.test_placement_schemes import PROMPT, TPB, VLLM_HASHES, db, described, fleet  # noqa: F401  (fixtures)
from tools.harness.builders import batch, stored


def le32(tokens: list[int]) -> str:
    return base64.b64encode(np.array(tokens, dtype="<u4").tobytes()).decode()


def le64(hashes: list[int]) -> str:
    return base64.b64encode(np.array([h % 2**64 for h in hashes], dtype="<u8").tobytes()).decode()


def same(advice: dict) -> dict:
    return {k: v for k, v in advice.items() if k != "elapsed_s"}


@pytest.fixture
def dynamo_fleet(sqlite_db: str) -> tuple[str, list[list[int]]]:
    """Four Dynamo workers, each holding two random prompts' blocks (one prompt shared by two
    workers, one worker holding only a prefix), and a TensorRT-LLM engine holding one prompt."""
    rng = random.Random(22)
    prompts = [[rng.randrange(50_000) for _ in range(40 * TPB + 3)] for _ in range(6)]
    held = {"w0": [(0, 40), (1, 40)], "w1": [(1, 40), (2, 17)], "w2": [(3, 40), (4, 3)], "w3": [(5, 40), (0, 9)]}
    for engine, spans in held.items():
        for seq, (p, n) in enumerate(spans):
            item = batch(seq, stored(*dynamo_block_hashes(prompts[p], TPB)[:n], num_tokens=TPB, type_name="BlockStored"),
                         engine_id=engine)
            append(sqlite_db, described(item, "dynamo") if seq == 0 else item)
    append(sqlite_db, batch(0, stored(*block_hash_chain(prompts[2], TPB)[:25], num_tokens=TPB), engine_id="trt"))
    return sqlite_db, prompts


def queries(prompts: list[list[int]]) -> list[list[int]]:
    rng = random.Random(7)
    out = [p[:n] + [rng.randrange(50_000) for _ in range(tail)] for p in prompts for n, tail in
           ((len(p), 0), (20 * TPB, 5), (TPB - 1, 0), (9 * TPB + 4, TPB))]
    return out + [[rng.randrange(50_000) for _ in range(3 * TPB)], PROMPT]


def test_arrays_in_process_answer_as_lists_do(dynamo_fleet: tuple[str, list[list[int]]]) -> None:
    ledger, prompts = dynamo_fleet
    advisor = PlacementAdvisor(ledger, tokens_per_block=TPB)
    try:
        overlaps = []
        for tokens in queries(prompts):
            expected = same(advisor.advise(tokens, namespace="0" * 32).to_dict())
            overlaps.append(max(e["live_blocks"] for e in expected["engines"]))
            for dtype in ("<u4", "<i8", ">u4"):
                got = advisor.advise(np.array(tokens, dtype=dtype), namespace="0" * 32)
                assert same(got.to_dict()) == expected, dtype
            hashes = dynamo_block_hashes(tokens, TPB)
            given = same(advisor.advise(tokens, block_hashes=hashes).to_dict())
            for array in (np.array(hashes, dtype="<u8"), np.array(hashes, dtype="<u8").view("<i8")):
                assert same(advisor.advise(np.array(tokens, dtype="<u4"), block_hashes=array).to_dict()) == given
        assert len(set(overlaps)) >= 5  # real evidence, of several lengths (40, 20, 17, 9, 3, 0 blocks ...)
        with pytest.raises(ValueError, match="1-D integer"):
            advisor.advise(np.array([1.0, 2.0]))
        with pytest.raises(ValueError):
            advisor.advise(np.array([-1, 2] * TPB, dtype=np.int64))  # a negative id, hashed by Dynamo's scheme
    finally:
        advisor.close()


def test_packed_http_fields_answer_as_json_lists_do(dynamo_fleet: tuple[str, list[list[int]]]) -> None:
    ledger, prompts = dynamo_fleet
    advisor = PlacementAdvisor(ledger, tokens_per_block=TPB)
    try:
        with TestClient(create_app(advisor)) as client:
            for tokens in queries(prompts):
                plain = client.post("/v1/placement", json={"token_ids": tokens, "max_semantic": 0})
                packed = client.post("/v1/placement", json={"token_ids_le32": le32(tokens), "max_semantic": 0})
                assert plain.status_code == packed.status_code == 200, packed.text
                assert same(packed.json()) == same(plain.json())
                hashes = dynamo_block_hashes(tokens, TPB)
                signed = [h - 2**64 if h >= 2**63 else h for h in hashes]
                given = client.post("/v1/placement", json={"token_ids": tokens, "block_hashes": signed})
                given_packed = client.post("/v1/placement", json={"token_ids_le32": le32(tokens),
                                                                  "block_hashes_le64": le64(hashes)})
                assert given.status_code == given_packed.status_code == 200, given_packed.text
                assert same(given_packed.json()) == same(given.json())
    finally:
        advisor.close()


def test_packed_block_hashes_reach_engines_whose_hashes_are_not_computed_here(fleet: str) -> None:  # noqa: F811
    advisor = PlacementAdvisor(fleet, tokens_per_block=TPB)
    try:
        with TestClient(create_app(advisor)) as client:
            body = client.post("/v1/placement", json={"token_ids_le32": le32(PROMPT),
                                                      "block_hashes_le64": le64(VLLM_HASHES)}).json()
            assert body["engines"][0]["engine_id"] == "vllm" and body["engines"][0]["live_blocks"] == 5
    finally:
        advisor.close()


@pytest.mark.parametrize(("body", "detail"), [
    ({"max_semantic": 0}, "exactly one"),
    ({"token_ids": [1, 2], "token_ids_le32": le32([1, 2])}, "exactly one"),
    ({"token_ids_le32": base64.b64encode(b"\x01\x00\x00\x00\x02").decode()}, "whole number"),
    ({"token_ids_le32": le32([1, 2**31])}, "2**31"),
    ({"token_ids_le32": ""}, "length >= 4"),  # no token at all
    ({"token_ids_le32": "not base64!"}, "base64"),
    ({"token_ids_le32": le32([1] * TPB), "block_hashes": [1], "block_hashes_le64": le64([1])}, "at most one"),
    ({"token_ids_le32": le32([1] * TPB), "block_hashes_le64": base64.b64encode(b"\x00" * 12).decode()}, "whole number"),
    ({"token_ids_le32": le32([1] * TPB), "block_hashes_le64": le64([1, 2])}, "whole blocks"),
])
def test_malformed_packed_fields_are_refused_with_422(fleet: str, body: dict, detail: str) -> None:  # noqa: F811
    advisor = PlacementAdvisor(fleet, tokens_per_block=TPB)
    try:
        with TestClient(create_app(advisor)) as client:
            response = client.post("/v1/placement", json=body)
            assert response.status_code == 422, response.text
            assert detail in response.json()["detail"]
    finally:
        advisor.close()
