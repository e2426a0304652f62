"""The operator commands' output is whole when piped and machine-readable on request (real CLI processes,
stdout a pipe, a real SQLite ledger): identifiers are never cut, counts carry thousands separators,
``inspect --json`` gives every row with its full body, and ``replay --until --json`` does not claim an
equality it did not check."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from tools.harness.builders import batch, removed, stored

LONG_ENGINE = "vllm-recorded-engine-in-rack-b17-slot-3-with-a-name-longer-than-any-terminal-column"
WIDE_HASH = bytes(range(32))
BIG_HASH = 2**64 - 3
BLOCKS = 1_200


@pytest.fixture
def ledger(sqlite_db: str) -> str:
    """A ledger with one long-named engine: 1,200 blocks stored, a 64-bit and a 32-byte hash among them."""
    from ledger.writer import LedgerWriter

    hashes = [BIG_HASH, WIDE_HASH, *range(1, BLOCKS - 1)]

    async def feed() -> None:
        writer = await LedgerWriter.open(sqlite_db)
        try:
            await writer.append([batch(0, stored(*hashes), engine_id=LONG_ENGINE)])
            await writer.append([batch(1, removed(BIG_HASH), engine_id=LONG_ENGINE)])
        finally:
            await writer.close()

    asyncio.run(feed())
    return sqlite_db


def cli(*args: str, columns: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    if columns is not None:
        env["COLUMNS"] = columns
    return subprocess.run([sys.executable, "-m", "ledger", *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("columns", [None, "60"])
def test_piped_stats_keep_whole_identifiers_and_separate_thousands(ledger: str, columns: str | None) -> None:
    result = cli("stats", "--db", ledger, columns=columns)
    assert result.returncode == 0, result.stderr
    assert LONG_ENGINE in result.stdout
    assert "…" not in result.stdout
    assert f"{BLOCKS - 1:,}" in result.stdout  # 1,200 blocks stored, 1 removed: "1,199" live


@pytest.mark.parametrize("columns", [None, "60"])
def test_piped_inspect_keeps_whole_hashes(ledger: str, columns: str | None) -> None:
    result = cli("inspect", "block", str(BIG_HASH), "--db", ledger, columns=columns)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if "block_" in line]
    assert len(rows) == 2, result.stdout  # stored, then removed: one line each
    assert all(str(BIG_HASH) in line and LONG_ENGINE in line for line in rows)


def test_inspect_json_gives_every_row_with_its_full_body(ledger: str) -> None:
    result = cli("inspect", "block", WIDE_HASH.hex(), "--db", ledger, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["kind"] == "block" and report["id"] == WIDE_HASH.hex()
    [row] = report["rows"]
    assert row["engine_id"] == LONG_ENGINE and row["kind"] == "block_stored" and row["applied"] is True
    hashes = [b["block_hash"] for b in row["body"]["blocks"]]
    assert len(hashes) == BLOCKS and hashes[:2] == [BIG_HASH, WIDE_HASH.hex()]  # all of them, none elided


def test_inspect_json_of_an_unknown_item_is_empty_and_exits_1(ledger: str) -> None:
    result = cli("inspect", "engine", "nosuch", "--db", ledger, "--json")
    assert result.returncode == 1
    assert json.loads(result.stdout) == {"kind": "engine", "id": "nosuch", "truncated": False, "rows": []}


def test_replay_until_does_not_claim_equality_it_did_not_check(ledger: str) -> None:
    partial = json.loads(cli("replay", "--db", ledger, "--until", "1", "--json").stdout)
    assert partial["compared"] is False and partial["equal"] is None
    full = cli("replay", "--db", ledger, "--json")
    assert full.returncode == 0
    assert json.loads(full.stdout)["compared"] is True and json.loads(full.stdout)["equal"] is True
