"""Driver errors are translated once into the ledger's error family, with the kind the driver
reported (real SQLite files, the real PostgreSQL server): a constraint, a read-only database, a
lock wait given up, and a plain failure, on both backends."""

from __future__ import annotations

import sqlite3

import psycopg
import pytest
from sqlalchemy.engine import make_url

from ledger.errors import IntegrityFailure, LockTimeout, PersistenceError, ReadOnlyDatabase, persistence_error


def _sqlite_error(path: str, *statements: str) -> BaseException:
    conn = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY)")
        conn.execute("INSERT OR IGNORE INTO t VALUES (1)")
        for statement in statements:
            conn.execute(statement)
    except sqlite3.Error as exc:
        return exc
    finally:
        conn.close()
    raise AssertionError("no error")


def _postgres_table(db: str) -> None:
    with psycopg.connect(make_url(db).render_as_string(hide_password=False), autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY)")
        conn.execute("INSERT INTO t VALUES (1) ON CONFLICT DO NOTHING")


def _postgres_error(db: str, *statements: str) -> BaseException:
    with psycopg.connect(make_url(db).render_as_string(hide_password=False), autocommit=True) as conn:
        try:
            for statement in statements:
                conn.execute(statement)
        except psycopg.Error as exc:
            return exc
    raise AssertionError("no error")


def test_sqlite_errors_arrive_as_their_kind(tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path / "t.db")
    assert isinstance(persistence_error(_sqlite_error(path, "INSERT INTO t VALUES (1)")), IntegrityFailure)
    read_only = persistence_error(_sqlite_error(path, "PRAGMA query_only = 1", "INSERT INTO t VALUES (2)"))
    assert isinstance(read_only, ReadOnlyDatabase) and not read_only.transient
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        locked = persistence_error(_sqlite_error(path, "BEGIN IMMEDIATE"))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert isinstance(locked, LockTimeout) and locked.transient
    plain = persistence_error(_sqlite_error(path, "SELECT * FROM no_such_table"))
    assert type(plain) is PersistenceError and not plain.transient


def test_postgresql_errors_arrive_as_their_kind(postgres_db: str) -> None:
    _postgres_table(postgres_db)
    assert isinstance(persistence_error(_postgres_error(postgres_db, "INSERT INTO t VALUES (1)")), IntegrityFailure)
    read_only = persistence_error(_postgres_error(postgres_db, "SET default_transaction_read_only = on",
                                                  "INSERT INTO t VALUES (2)"))
    assert isinstance(read_only, ReadOnlyDatabase) and not read_only.transient
    with psycopg.connect(make_url(postgres_db).render_as_string(hide_password=False)) as holder:
        holder.execute("LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        locked = persistence_error(_postgres_error(postgres_db, "SET lock_timeout = 50", "SELECT * FROM t"))
    assert isinstance(locked, LockTimeout) and locked.transient
    plain = persistence_error(_postgres_error(postgres_db, "SELECT * FROM no_such_table"))
    assert type(plain) is PersistenceError and not plain.transient


def test_a_postgresql_server_that_refuses_the_connection_is_a_transient_persistence_error() -> None:
    """The connections of the connector and of ``serve`` open through the pool, which SQLAlchemy does
    not wrap: psycopg's own ``OperationalError`` escaped every ``except LedgerError`` (``serve``
    answered 500 with a traceback instead of 503)."""
    import socket

    from ledger.client import LedgerClient

    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = LedgerClient(f"postgresql://postgres@127.0.0.1:{port}/semkv", check=False)
    try:
        with pytest.raises(PersistenceError) as caught:
            client.last_seq()
    finally:
        client.close()
    assert caught.value.transient and "refused" in str(caught.value)
