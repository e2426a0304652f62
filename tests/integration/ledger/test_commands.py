"""The audit commands refuse bad arguments with a clear message and a usage exit code (real CLI process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ledger", *args], capture_output=True, text=True, timeout=60,
                          env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})


def test_inspect_block_accepts_hash_notations_and_refuses_garbage(sqlite_db: str) -> None:
    assert cli("inspect", "block", "0x10", "--db", sqlite_db).returncode == 1  # a valid hash with no history
    refused = cli("inspect", "block", "zzz", "--db", sqlite_db)
    assert refused.returncode == 2
    assert "'zzz' is not a block hash" in refused.stderr and "Traceback" not in refused.stderr


@pytest.mark.parametrize("args", [("replay", "--until", "-3"), ("inspect", "engine", "e", "--limit", "0")])
def test_negative_or_empty_ranges_are_usage_errors(sqlite_db: str, args: tuple[str, ...]) -> None:
    result = cli(*args, "--db", sqlite_db)
    assert result.returncode == 2, result.stdout + result.stderr


def test_block_history_keeps_an_engine_that_removed_the_block(sqlite_db: str) -> None:
    # engine-a stores and removes block 5 (its row is gone); engine-b still holds it.
    import asyncio

    from ledger.db import sync_engine
    from ledger.stats import block_history
    from ledger.writer import LedgerWriter
    from tools.harness.builders import batch, removed, stored

    async def feed() -> None:
        writer = await LedgerWriter.open(sqlite_db)
        try:
            await writer.append([batch(0, stored(5), engine_id="engine-a"), batch(0, stored(5), engine_id="engine-b")])
            await writer.append([batch(1, removed(5), engine_id="engine-a")])
        finally:
            await writer.close()

    asyncio.run(feed())
    engine = sync_engine(sqlite_db)
    try:
        with engine.connect() as conn:
            history = [(row["engine_id"], row["kind"]) for row in block_history(conn, 5)]
    finally:
        engine.dispose()
    assert sorted(history) == [("engine-a", "block_removed"), ("engine-a", "block_stored"),
                               ("engine-b", "block_stored")]


@pytest.mark.parametrize("ledger", ["sqlite_db", "postgres_db"])
@pytest.mark.parametrize("window_seqs, page_rows", [(100_000, 5_000), (2, 1)])
def test_block_history_finds_64_bit_and_wide_hashes_and_only_events_naming_them(ledger: str, window_seqs: int,
                                                                                page_rows: int, request,
                                                                                monkeypatch) -> None:
    # The database prefilters log rows by the hash's msgpack bytes; a body holding those bytes
    # elsewhere (here as a parent_hash) must not be reported, and the newest `limit` rows are kept,
    # whatever the search's windows and pages.
    from ledger import stats
    from ledger.db import sync_engine
    from ledger.stats import block_history
    from tools.harness.builders import batch, record, removed, stored

    monkeypatch.setattr(stats, "BLOCK_HISTORY_WINDOW_SEQS", window_seqs)
    monkeypatch.setattr(stats, "BLOCK_HISTORY_PAGE_ROWS", page_rows)

    db = request.getfixturevalue(ledger)
    big, wide, other = 0xFEDCBA9876543210, bytes(range(32)), 0x0123456789ABCDEF

    record(db, [batch(0, stored(big, wide), engine_id="engine-a")],
           [batch(1, stored(other, parent=big), engine_id="engine-a")],
           [batch(0, stored(wide), engine_id="engine-b")], [batch(2, removed(big, wide), engine_id="engine-a")])
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            big_rows = [(row["engine_id"], row["kind"]) for row in block_history(conn, big)]
            wide_rows = [(row["engine_id"], row["kind"]) for row in block_history(conn, wide)]
            newest = [(row["engine_id"], row["kind"]) for row in block_history(conn, wide, limit=1)]
            assert block_history(conn, 0x1111) == []
    finally:
        engine.dispose()
    assert big_rows == [("engine-a", "block_stored"), ("engine-a", "block_removed")]
    assert wide_rows == [("engine-a", "block_stored"), ("engine-b", "block_stored"), ("engine-a", "block_removed")]
    assert newest == [("engine-a", "block_removed")]


@pytest.mark.parametrize("json_out", [True, False])
def test_output_piped_into_a_reader_that_stops_early_is_no_ledger_error(sqlite_db: str, json_out: bool) -> None:
    # `semkv-ledger inspect … | head` once printed "error: --db …: cannot open the ledger database:
    # broken pipe" and exited 2; then exited 1, which inspect means as "nothing found" (and replay as
    # "projections differ"): now the shell's status for SIGPIPE, 141
    from ledger.views import BROKEN_PIPE_STATUS
    from tools.harness.builders import batch, record, stored

    record(sqlite_db, *([batch(seq, stored(*range(seq * 50 + 1, seq * 50 + 51)))] for seq in range(400)))
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: every write fails with EPIPE
    proc = subprocess.Popen([sys.executable, "-m", "ledger", "inspect", "engine", "engine-a", "--limit", "100000",
                             *(["--json"] if json_out else []), "--db", sqlite_db],
                            stdout=write_end, stderr=subprocess.PIPE)
    os.close(write_end)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == BROKEN_PIPE_STATUS == 141 and stderr == b"", stderr


def test_an_item_with_no_history_says_so_and_where_to_look(sqlite_db: str) -> None:
    from ledger.migrate import upgrade

    upgrade(sqlite_db)
    result = cli("inspect", "engine", "nope", "--db", sqlite_db)
    assert result.returncode == 1
    assert result.stderr.strip() == ("no log row names engine 'nope': `semkv-ledger stats --db …` lists the engines, "
                                     "donors and counts this ledger holds")
    quiet = cli("inspect", "engine", "nope", "--db", sqlite_db, "--json")
    assert quiet.returncode == 1 and quiet.stderr == "" and json.loads(quiet.stdout)["rows"] == []
    wide = cli("inspect", "block", "0x" + bytes(range(32)).hex(), "--db", sqlite_db)  # a wide hash written with 0x
    assert wide.returncode == 1 and "is not a block hash" not in wide.stderr and "outside" not in wide.stderr


def test_a_signed_block_hash_is_an_argument_not_an_option(sqlite_db: str) -> None:
    # The ledger shows 64-bit hashes as signed integers (SQLite's INTEGER); pasting one back
    # (`inspect block -81985529216486896`) was refused as "No such option: -8".
    from tools.harness.builders import batch, record, stored

    big = 0xFEDCBA9876543210
    record(sqlite_db, [batch(0, stored(big), engine_id="engine-a")])
    found = cli("inspect", "block", str(big - 2**64), "--db", sqlite_db, "--json")
    assert found.returncode == 0, found.stderr
    assert [row["kind"] for row in json.loads(found.stdout)["rows"]] == ["block_stored"]
    typo = cli("inspect", "block", "0x10", "--dbx", sqlite_db)
    assert typo.returncode == 2 and "--dbx" in typo.stderr


@pytest.mark.parametrize("args", [("inspect", "engine", "e", "--limit", "99999999999999999999"),
                                  ("inspect", "block", "0", "--limit", "9223372036854775808"),
                                  ("replay", "--until", "99999999999999999999")])
def test_integers_past_64_bits_are_usage_errors_not_tracebacks(sqlite_db: str, args: tuple[str, ...]) -> None:
    result = cli(*args, "--db", sqlite_db)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr


def test_a_postgres_scheme_url_is_read_as_postgresql(postgres_db: str) -> None:
    """``postgres://`` is libpq's own URI scheme (and what many hosted databases hand out)."""
    assert postgres_db.startswith("postgresql://")
    result = cli("stats", "--json", "--db", "postgres://" + postgres_db.removeprefix("postgresql://"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["log_rows"] == 0  # the scratch ledger, migrated and empty


def test_inspect_says_when_older_rows_than_limit_exist(sqlite_db: str) -> None:
    """``inspect engine X`` showed the newest 200 rows titled "200 log row(s)", nothing said more exist."""
    from tools.harness.builders import batch, record, stored

    record(sqlite_db, *([batch(seq, stored(seq * 10 + 1))] for seq in range(5)))
    everything = json.loads(cli("inspect", "engine", "engine-a", "--json", "--db", sqlite_db).stdout)
    assert everything["truncated"] is False and len(everything["rows"]) > 2
    newest = json.loads(cli("inspect", "engine", "engine-a", "--limit", "2", "--json", "--db", sqlite_db).stdout)
    assert newest["truncated"] is True and newest["rows"] == everything["rows"][-2:]
    exact = json.loads(cli("inspect", "engine", "engine-a", "--limit", str(len(everything["rows"])), "--json",
                           "--db", sqlite_db).stdout)
    assert exact["truncated"] is False and exact["rows"] == everything["rows"]
    table = cli("inspect", "engine", "engine-a", "--limit", "2", "--db", sqlite_db).stdout
    assert "engine engine-a: the newest 2 log rows (older ones: --limit)" in table


@pytest.mark.parametrize("json_out", [True, False])
def test_a_reader_that_leaves_while_the_output_waits_on_a_full_pipe_is_141(sqlite_db: str, json_out: bool) -> None:
    # `inspect … | (sleep 2; head -c 10)` exited 0 (newcomer finding 2): the write blocked on the full
    # pipe came back short when the reader left, and Python's buffered stdout dropped the rest
    # without an error; output cut short by its reader is 141 however the cut happens
    from ledger.views import BROKEN_PIPE_STATUS
    from tools.harness.builders import batch, record, stored

    record(sqlite_db, *([batch(seq, stored(*range(seq * 50 + 1, seq * 50 + 51)))] for seq in range(400)))
    read_end, write_end = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "ledger", "inspect", "engine", "engine-a", "--limit", "100000",
                             *(["--json"] if json_out else []), "--db", sqlite_db],
                            stdout=write_end, stderr=subprocess.PIPE)
    os.close(write_end)
    assert len(os.read(read_end, 10)) > 0  # the command writes (far more than a pipe holds) ...
    os.close(read_end)  # ... and the reader leaves
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == BROKEN_PIPE_STATUS and stderr == b"", stderr
