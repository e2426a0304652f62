"""The route join (issue #22): route records made from real advice on a real SQLite ledger, their
JSONL file, the join's Prometheus counters and ``semkv-ledger route-report`` (a real process).
The Dynamo group (tests/dynamo_cpu) runs the same join on a real fleet's routes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from connector.block_keys import dynamo_block_hashes
from connector.placement.advice import Advice, PlacementAdvisor
from connector.placement.route_join import RouteJoinLog, RouteRecord, read_records, route_totals
from tests.discovery.conftest import append
from tools.harness.builders import batch, stored

TPB = 16
PROMPT = [(11 * i + 5) % 40_000 for i in range(5 * TPB + 3)]  # 5 full blocks and a partial one


@pytest.fixture
def advice(sqlite_db: str) -> Advice:
    """dyn-a holds 4 blocks of PROMPT, dyn-b 4 (a tie: both top), dyn-c 1, mystery 3 (scheme unknown)."""
    hashes = dynamo_block_hashes(PROMPT, TPB)

    def dynamo(engine_id: str, blocks: int, scheme: str | None = "dynamo"):
        item = batch(0, stored(*hashes[:blocks], num_tokens=TPB, type_name="BlockStored"), engine_id=engine_id)
        return msgspec.structs.replace(item, block_key_scheme=scheme) if scheme else item

    append(sqlite_db, dynamo("dyn-a", 4), dynamo("dyn-b", 4), dynamo("dyn-c", 1), dynamo("mystery", 3, None))
    advisor = PlacementAdvisor(sqlite_db, tokens_per_block=TPB)
    try:
        return advisor.advise(PROMPT)
    finally:
        advisor.close()


def record(advice: Advice, engine_id: str | None, delivered: int, n: int = 0) -> RouteRecord:
    return RouteRecord.from_advice(f"r{n}", advice, routed_engine=engine_id, router_worker=f"w-{engine_id}",
                                   delivered_tokens=delivered, prompt_tokens=len(PROMPT))


def test_a_record_says_what_was_available_routed_and_delivered(advice: Advice) -> None:
    top = record(advice, "dyn-b", 4 * TPB)
    assert (top.available_tokens, top.top_engines, top.routed_tokens, top.to_top) == \
        (4 * TPB, ["dyn-a", "dyn-b"], 4 * TPB, True)
    assert top.ledger_seq == advice.ledger_seq and top.prompt_tokens == len(PROMPT)
    low = record(advice, "dyn-c", TPB)
    assert (low.routed_tokens, low.to_top) == (TPB, False)
    unknown = record(advice, "mystery", 3 * TPB)  # the ledger cannot say what this engine holds
    assert (unknown.routed_tokens, unknown.to_top, unknown.top_engines) == (None, False, ["dyn-a", "dyn-b"])
    assert record(advice, None, 0).routed_tokens is None  # a worker the ledger does not know


def test_the_log_the_report_and_the_metrics_agree(advice: Advice, tmp_path: Path) -> None:
    records = [record(advice, "dyn-a", 4 * TPB, 0), record(advice, "dyn-c", 0, 1), record(advice, "mystery", 48, 2)]
    join = RouteJoinLog(tmp_path / "routes.jsonl")
    try:
        for r in records:
            join.record(r)
    finally:
        join.close()
    assert read_records(join.path) == records
    totals = route_totals(records)
    assert totals.to_dict() == {"requests": 3, "same_events": 3, "prompt_tokens": 3 * len(PROMPT),
                                "available_tokens": 3 * 4 * TPB, "routed_tokens": 4 * TPB + TPB,
                                "delivered_tokens": 4 * TPB + 48, "routed_to_top": 1, "delivered_as_advised": 1,
                                "routed_unknown": 1}
    sample = join.registry.get_sample_value
    assert [sample("semkv_route_tokens_total", {"kind": k}) for k in ("available", "routed", "delivered")] == \
        [totals.available_tokens, totals.routed_tokens, totals.delivered_tokens]
    assert (sample("semkv_route_requests_total", {"to_top": "yes"}),
            sample("semkv_route_requests_total", {"to_top": "no"})) == (1, 2)

    done = route_report(join.path, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == totals.to_dict()
    table = route_report(join.path)
    assert table.returncode == 0 and "1/3" in table.stdout and "1/2" in table.stdout, table.stdout
    piped = route_report(join.path, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})  # no COLUMNS: rich's 80
    assert "routed to top set" in piped.stdout and "delivered = ledger" in piped.stdout, piped.stdout


def test_a_bad_line_is_one_error_naming_it(advice: Advice, tmp_path: Path) -> None:
    path = tmp_path / "routes.jsonl"
    path.write_bytes(msgspec.json.encode(record(advice, "dyn-a", 64)) + b'\n\n{"request_id": "x"}\n')
    with pytest.raises(ValueError, match=r"routes.jsonl:3: not a route record"):
        read_records(path)
    done = route_report(path)
    assert done.returncode == 2 and done.stderr.startswith("error: route-report:") and ":3:" in done.stderr
    missing = route_report(tmp_path / "none.jsonl")
    assert missing.returncode == 2, missing.stderr


def route_report(path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ledger", "route-report", str(path), *args],
                          capture_output=True, text=True, timeout=60, env=env or dict(os.environ, COLUMNS="200"))
