"""LedgerWriter on SQLite: the sync recorder on ONE dedicated thread (ledger/writer.py).

The recorder contract itself is pinned by ``suite.py`` through the writer; these pin what the
thread adds: one thread for every transaction, nothing recorded by a failed one, a clean close
that waits for the transaction in flight, and a health read that is not queued behind it.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path

import pytest

import ledger.backends.sqlite
from ledger import recorder
from ledger.checkpoint import BACKSTOP_PAGES
from ledger.errors import PersistenceError
from ledger.writer import LedgerWriter
from tools.harness.builders import batch, stored
from tests.integration.ledger.conftest import log_rows

THREAD_PREFIX = "semkv-ledger-writer"


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


async def test_every_transaction_runs_on_one_dedicated_thread_which_close_ends(sqlite_db, monkeypatch):
    seen: list[int] = []
    original = recorder.append

    def spy(conn, items, **kw):  # noqa: ANN001, ANN202
        seen.append(threading.get_ident())
        return original(conn, items, **kw)

    monkeypatch.setattr(recorder, "append", spy)
    writer = await LedgerWriter.open(sqlite_db)
    try:
        for seq in range(3):
            await writer.append([batch(seq, stored(seq + 1))])
        assert len(set(seen)) == 1 and seen[0] != threading.get_ident()
        assert [t.ident for t in writer_threads()] == [seen[0]]
    finally:
        await writer.close()
    assert writer_threads() == []
    await writer.close()  # idempotent


async def test_a_failed_transaction_records_nothing_and_the_writer_goes_on(sqlite_db, monkeypatch):
    original = recorder.write

    def write_then_fail(sql, proj, entries):  # noqa: ANN001, ANN202 - the rows are written, then the driver fails
        original(sql, proj, entries)
        raise sqlite3.OperationalError("disk I/O error (injected)")

    writer = await LedgerWriter.open(sqlite_db)
    try:
        monkeypatch.setattr(recorder, "write", write_then_fail)
        with pytest.raises(PersistenceError, match="injected"):
            await writer.append([batch(0, stored(1, 2, 3))])
        assert log_rows(sqlite_db) == 0
        monkeypatch.setattr(recorder, "write", original)
        result = await writer.append([batch(0, stored(1, 2, 3))])
        assert result.batches == 1 and result.events_applied == 1
    finally:
        await writer.close()
    assert log_rows(sqlite_db) > 0


async def test_a_locked_database_fails_the_transaction_then_the_same_writer_commits(sqlite_db, monkeypatch,
                                                                                    lock_holder):
    from sqlalchemy.exc import OperationalError

    monkeypatch.setattr(ledger.backends.sqlite, "SQLITE_BUSY_TIMEOUT_MS", 50)
    writer = await LedgerWriter.open(sqlite_db)
    try:
        lock_holder.hold()
        with pytest.raises(PersistenceError) as caught:
            await writer.append([batch(0, stored(1))])
        assert isinstance(caught.value.__cause__, OperationalError)  # what the daemon retries
        lock_holder.release()
        assert (await writer.append([batch(0, stored(1))])).batches == 1
    finally:
        await writer.close()


async def test_close_waits_for_the_transaction_in_flight(sqlite_db, lock_holder):
    writer = await LedgerWriter.open(sqlite_db)
    lock_holder.hold()
    timer = lock_holder.release_after(0.3)
    pending = asyncio.create_task(writer.append([batch(0, stored(1, 2))]))
    await asyncio.sleep(0.05)  # the transaction now waits for the lock on the writer thread
    await writer.close()
    assert pending.done() and pending.result().batches == 1
    assert writer_threads() == []
    timer.join()
    assert log_rows(sqlite_db) > 0


async def test_the_health_read_is_not_queued_behind_a_transaction_waiting_for_the_lock(sqlite_db, lock_holder):
    writer = await LedgerWriter.open(sqlite_db)
    try:
        await writer.append([batch(0, stored(1))])
        lock_holder.hold()  # until after the read: a read queued behind the transaction times out
        pending = asyncio.create_task(writer.append([batch(1, stored(2))]))
        await asyncio.sleep(0.05)
        positions = await asyncio.wait_for(writer.source_positions(), 10.0)  # WAL: readers do not wait
        assert [p.last_seq for p in positions.values()] == [0]
        assert not pending.done()
        lock_holder.release()
        assert (await pending).batches == 1
        assert [p.last_seq for p in (await writer.source_positions()).values()] == [1]
    finally:
        await writer.close()


async def test_a_cancelled_append_still_commits_or_rolls_back_as_a_whole(sqlite_db, lock_holder):
    """Cancelling the awaiting task (the daemon's shutdown timeout) cannot cut a transaction in two:
    it runs to its end on the writer thread, and close waits for it."""
    writer = await LedgerWriter.open(sqlite_db)
    lock_holder.hold()  # until after the cancel (a timed release could let it commit first on a loaded machine)
    item = batch(0, stored(1, 2, 3))
    pending = asyncio.create_task(writer.append([item]))
    await asyncio.sleep(0.05)
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    timer = lock_holder.release_after(0.3)  # while close waits for the transaction
    await writer.close()
    timer.join()
    reopened = await LedgerWriter.open(sqlite_db)
    try:
        assert [p.last_seq for p in (await reopened.source_positions()).values()] == [0]
        assert (await reopened.append([item])).duplicate_batches == 1  # recorded whole, exactly once
    finally:
        await reopened.close()


async def test_wal_checkpoints_run_on_their_own_thread_while_the_writer_stays_open(sqlite_db):
    """ledger/checkpoint.py: the WAL is copied into the database file by the checkpointer, not by a
    COMMIT of the writer (whose own autocheckpoint is only a backstop far above these transactions)."""
    path = Path(sqlite_db.removeprefix("sqlite:///"))
    size_before = path.stat().st_size
    writer = await LedgerWriter.open(sqlite_db)
    try:
        for seq in range(20):
            await writer.append([batch(seq, stored(*range(seq * 64 + 1, seq * 64 + 65)))])
        sqlite_writer = writer._runner.writer  # type: ignore[union-attr]
        backstop = await writer._runner.call(  # type: ignore[union-attr]
            lambda: sqlite_writer.conn.connection.driver_connection.execute("PRAGMA wal_autocheckpoint").fetchone())
        assert backstop == (BACKSTOP_PAGES,)
        deadline = time.monotonic() + 10
        while path.stat().st_size <= size_before or sqlite_writer.checkpointer.checkpoints == 0:
            assert time.monotonic() < deadline, "no checkpoint copied the WAL into the database file"
            await asyncio.sleep(0.05)
    finally:
        await writer.close()
    assert not [t for t in threading.enumerate() if t.name == "semkv-ledger-checkpoint"]
