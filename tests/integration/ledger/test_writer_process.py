"""LedgerWriter on SQLite in a child process (ledger/writer_process.py): the daemon's default.

What the process adds over the writer thread (test_writer_sqlite.py): a real second process,
errors that cross it with their retry classification, a child that dies (killed, crashed) failing
only the transaction in flight and replaced on the next call, a child that never outlives its
parent (even a SIGKILLed one) and that ignores the process group's SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import ledger.backends.sqlite
from ledger import events as ev
from ledger.errors import PersistenceError, is_transient
from ledger.types import DeadLetterReason, GenerationReason
from ledger.writer import LedgerWriter
from ledger.sqlite_writer import SQLiteWriterConnection
from ledger.writer_process import MAX_CONSECUTIVE_DEATHS, _run, decode_append, encode_append
from tools.harness.builders import batch, stored
from tests.integration.ledger.conftest import log_rows


def child_of(writer: LedgerWriter) -> subprocess.Popen:
    child = writer._runner.child  # type: ignore[union-attr]
    assert child is not None
    return child.process


def wait_exit(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


def test_every_input_type_crosses_the_process_boundary_in_order():
    dead = ev.DeadLetter(source_id="s", engine_id="e", reason=DeadLetterReason.MALFORMED_MSGPACK, detail="x", raw=b"\x01",
                         seq=3)
    gap = ev.GapReport(source_id="s", engine_id="e", from_seq=4, to_seq=9, reason=GenerationReason.SEQ_GAP)
    items = [batch(1, stored(1, 2)), dead, batch(2, stored(3, parent=2)), gap, dead]
    assert decode_append(encode_append(items, 12.5)) == (items, 12.5)
    assert decode_append(encode_append([], None)) == ([], None)


async def test_transactions_commit_in_a_child_process_that_close_ends(sqlite_db):
    writer = await LedgerWriter.open(sqlite_db, process=True)
    child = child_of(writer)
    assert child.pid != os.getpid() and child.poll() is None  # started by open, not by the first append
    try:
        items = [batch(seq, stored(seq + 1)) for seq in range(3)]
        results = [await writer.append([item]) for item in items]
        assert [(r.batches, r.events_applied) for r in results] == [(1, 1)] * 3
        assert [p.last_seq for p in (await writer.source_positions()).values()] == [2]
        assert (await writer.append([items[2]])).duplicate_batches == 1
    finally:
        await writer.close()
    assert child.returncode == 0
    assert log_rows(sqlite_db) > 0
    await writer.close()  # idempotent


async def test_a_locked_database_crosses_as_a_transient_error_and_the_same_child_commits_after(
        sqlite_db, monkeypatch, lock_holder):
    monkeypatch.setattr(ledger.backends.sqlite, "SQLITE_BUSY_TIMEOUT_MS", 50)  # handed to the child at its start
    writer = await LedgerWriter.open(sqlite_db, process=True)
    try:
        child = child_of(writer)
        lock_holder.hold()
        with pytest.raises(PersistenceError, match="locked") as caught:
            await writer.append([batch(0, stored(1))])
        assert is_transient(caught.value)  # the daemon retries it
        lock_holder.release()
        assert (await writer.append([batch(0, stored(1))])).batches == 1
        assert child_of(writer) is child
    finally:
        await writer.close()


async def test_a_child_killed_mid_transaction_fails_it_transiently_and_the_next_call_starts_another(
        sqlite_db, lock_holder):
    writer = await LedgerWriter.open(sqlite_db, process=True)
    try:
        first = child_of(writer)
        lock_holder.hold()  # the child's transaction waits for the lock (busy timeout 30 s)
        item = batch(0, stored(1, 2, 3))
        pending = asyncio.create_task(writer.append([item]))
        await asyncio.sleep(0.3)
        first.send_signal(signal.SIGKILL)
        with pytest.raises(PersistenceError, match="exited") as caught:
            await pending
        assert is_transient(caught.value)
        lock_holder.release()
        result = await writer.append([item])  # the retry: the killed transaction left nothing
        assert (result.batches, result.duplicate_batches) == (1, 0)
        assert child_of(writer).pid != first.pid and first.returncode == -signal.SIGKILL
    finally:
        await writer.close()


async def test_a_child_that_dies_on_every_try_makes_the_error_permanent(sqlite_db, lock_holder):
    """A batch that kills the writer each time must stop the daemon, not restart children forever."""
    writer = await LedgerWriter.open(sqlite_db, process=True)
    try:
        lock_holder.hold()  # every child's transaction waits for the lock: then it is killed
        item = batch(0, stored(1))
        killed: set[int] = set()
        for _ in range(MAX_CONSECUTIVE_DEATHS):
            pending = asyncio.create_task(writer.append([item]))
            deadline = time.monotonic() + 20
            while writer._runner.child is None or child_of(writer).pid in killed:  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "no new writer process"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            killed.add(child_of(writer).pid)
            child_of(writer).send_signal(signal.SIGKILL)
            with pytest.raises(PersistenceError, match="exited") as caught:
                await pending
            assert is_transient(caught.value)
        with pytest.raises(PersistenceError, match="died 3 times in a row") as caught:
            await writer.append([item])
        assert not is_transient(caught.value)
    finally:
        lock_holder.release()
        await writer.close()


def test_a_request_the_child_cannot_run_is_a_permanent_error(sqlite_db):
    writer = SQLiteWriterConnection(sqlite_db)
    try:
        reply = _run(writer, b"not a request")
    finally:
        writer.close()
    assert reply.result is None and reply.error.startswith("ValidationError") and not reply.transient


async def test_sigint_and_sigterm_to_the_process_group_do_not_stop_the_child(sqlite_db):
    writer = await LedgerWriter.open(sqlite_db, process=True)
    try:
        child = child_of(writer)
        child.send_signal(signal.SIGINT)
        child.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        assert child.poll() is None
        assert (await writer.append([batch(0, stored(1))])).batches == 1
    finally:
        await writer.close()


async def test_close_waits_for_the_childs_transaction_in_flight(sqlite_db, lock_holder):
    writer = await LedgerWriter.open(sqlite_db, process=True)
    child = child_of(writer)
    lock_holder.hold()
    timer = lock_holder.release_after(0.5)
    pending = asyncio.create_task(writer.append([batch(0, stored(1, 2))]))
    await asyncio.sleep(0.1)
    await writer.close()
    assert pending.done() and pending.result().batches == 1
    assert child.returncode == 0
    timer.join()


async def test_a_cancelled_close_kills_the_child_so_the_daemon_can_exit(sqlite_db, lock_holder):
    """The daemon's shutdown timeout cancels close while a transaction waits: the child is killed
    (its transaction rolls back) instead of holding the process until the reply deadline."""
    writer = await LedgerWriter.open(sqlite_db, process=True)
    child = child_of(writer)
    lock_holder.hold()
    try:
        pending = asyncio.create_task(writer.append([batch(0, stored(1))]))
        await asyncio.sleep(0.2)
        closing = asyncio.create_task(writer.close())
        await asyncio.sleep(0.1)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert child.wait(5) == -signal.SIGKILL
        with pytest.raises(PersistenceError, match="exited"):
            await asyncio.wait_for(pending, 5)
    finally:
        lock_holder.release()
    assert log_rows(sqlite_db) == 0  # the killed transaction left nothing


PARENT = textwrap.dedent("""
    import asyncio, sys, time
    from ledger.writer import LedgerWriter
    from tools.harness.builders import batch, stored

    async def main():
        writer = await LedgerWriter.open(sys.argv[1], process=True)
        await writer.append([batch(0, stored(1))])
        print(writer._runner.child.process.pid, flush=True)
        time.sleep(60)

    asyncio.run(main())
""")


def test_the_child_exits_when_its_parent_is_killed_with_sigkill(sqlite_db, tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, sqlite_db], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    try:
        child_pid = int(parent.stdout.readline())  # type: ignore[union-attr]
        parent.kill()
        parent.wait(10)
        assert wait_exit(child_pid, 10), "the writer process outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
    conn = sqlite3.connect(sqlite_db.removeprefix("sqlite:///"))
    try:
        assert conn.execute("SELECT last_seq FROM sources").fetchall() == [(0,)]
    finally:
        conn.close()


async def test_a_child_that_cannot_start_fails_open_with_a_persistence_error(sqlite_db, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the child exits at once
    with pytest.raises(PersistenceError, match="exited"):
        await LedgerWriter.open(sqlite_db, process=True)
    assert not [t for t in threading.enumerate() if t.name.startswith("semkv-ledger-writer")]
