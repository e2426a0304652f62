"""``LedgerClient.lock_wait``: a write on a thread that must not stall gives up on the ledger's
write lock after the given time, on both backends; the thread's later writes wait as before."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from sqlalchemy.engine import make_url

from ledger.errors import LockTimeout, PersistenceError, lock_timed_out
from ledger.client import LedgerClient


@contextmanager
def write_lock_held(db: str) -> Iterator[threading.Event]:
    """Another connection holds the lock every ledger writer takes; set the event to let it go."""
    if db.startswith("sqlite:///"):
        conn = sqlite3.connect(db.removeprefix("sqlite:///"), isolation_level=None, check_same_thread=False)
        conn.execute("BEGIN IMMEDIATE")
    else:
        conn = psycopg.connect(make_url(db).set(drivername="postgresql").render_as_string(hide_password=False))
        conn.execute("LOCK TABLE log IN SHARE ROW EXCLUSIVE MODE")  # as ledger/recorder.py's writers do
    release = threading.Event()

    def let_go() -> None:
        release.wait(30)
        conn.execute("ROLLBACK")
        conn.close()

    holder = threading.Thread(target=let_go, daemon=True)
    holder.start()
    try:
        yield release
    finally:
        release.set()
        holder.join(10)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_write_gives_up_on_a_held_lock_after_lock_wait(backend: str, request: pytest.FixtureRequest) -> None:
    db = request.getfixturevalue("sqlite_db" if backend == "sqlite" else "postgres_db")
    client = LedgerClient(db)
    try:
        with write_lock_held(db) as release:
            started = time.monotonic()
            with pytest.raises(PersistenceError) as caught, client.lock_wait(0.1):
                client.record_engine_start("engine-a")
            assert lock_timed_out(caught.value) and isinstance(caught.value, LockTimeout) and caught.value.transient
            assert time.monotonic() - started < 5
            # outside lock_wait the same thread waits for the lock again (released 0.3 s later)
            threading.Timer(0.3, release.set).start()
            started = time.monotonic()
            client.record_engine_start("engine-a")
            assert time.monotonic() - started >= 0.25
    finally:
        client.close()


def test_a_statement_timeout_cancels_a_read_stuck_behind_a_migration_lock(postgres_db: str) -> None:
    """PostgreSQL: the connector's reads (the worker's revalidation runs on the engine's thread)
    are cancelled after ``statement_timeout_s`` behind an ``ACCESS EXCLUSIVE`` lock, instead of
    waiting as long as the lock is held."""
    client = LedgerClient(postgres_db, statement_timeout_s=0.2)
    params = client._connections._sql().connection.info.get_parameters()  # a partition is caught client-side too
    assert params["tcp_user_timeout"] == "200" and params["keepalives"] == "1"
    holder = psycopg.connect(make_url(postgres_db).set(drivername="postgresql").render_as_string(hide_password=False))
    try:
        holder.execute("LOCK TABLE donors IN ACCESS EXCLUSIVE MODE")  # as ALTER TABLE or VACUUM FULL would
        started = time.monotonic()
        with pytest.raises(PersistenceError, match="statement timeout"):
            client.donor_freshness("some-donor", namespace="ns")
        assert time.monotonic() - started < 5
    finally:
        holder.rollback()
        holder.close()
    assert client.donor_freshness("some-donor", namespace="ns") is not None  # unknown donor, answered
    client.close()


def test_lock_wait_on_a_broken_connection_is_a_ledger_error_and_the_next_call_reconnects(sqlite_db: str) -> None:
    client = LedgerClient(sqlite_db)
    try:
        client._connections._sql().connection.close()  # the thread's connection died under it
        with pytest.raises(PersistenceError), client.lock_wait(0.1):
            pass
        with client.lock_wait(0.1):
            client.record_engine_start("engine-a")  # a fresh connection
    finally:
        client.close()


def test_on_sqlite_a_bounded_wait_gets_in_between_a_busy_writers_transactions(sqlite_db: str) -> None:
    """A writer holding SQLite's lock 40 ms at a time with ~0.5 ms between transactions (a busy
    consumer) and a donor registration waiting up to 5 s: SQLite's own busy handler tries about
    every 100 ms and misses most gaps (it failed the wait about half the time); the client's
    1 ms tries get in (``SQLiteBackend.lock_poll_ms``)."""
    client = LedgerClient(sqlite_db)
    conn = sqlite3.connect(sqlite_db.removeprefix("sqlite:///"), isolation_level=None, check_same_thread=False)
    stop, cycles = threading.Event(), [0]

    def busy_writer() -> None:
        while not stop.is_set():
            conn.execute("BEGIN IMMEDIATE")
            time.sleep(0.04)
            conn.execute("COMMIT")
            cycles[0] += 1
            time.sleep(0.0005)

    writer = threading.Thread(target=busy_writer, daemon=True)
    writer.start()
    try:
        while cycles[0] < 2:  # the writer is cycling
            time.sleep(0.01)
        with client.lock_wait(5.0):
            assert client.record_engine_start("engine-a") is False  # written (an unknown engine: nothing to bump)
        assert writer.is_alive()  # it got in while the writer kept going
    finally:
        stop.set()
        writer.join(10)
        conn.close()
        client.close()
