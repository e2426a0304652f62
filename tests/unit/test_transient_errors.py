"""ledger.errors.is_transient on real SQLite errors: what the daemon retries and what stops it.

SQLite reports "database is locked" and "attempt to write a readonly database" with the same
exception type (OperationalError); only the result code tells a retry that can succeed from one
that never will (a read-only ledger was retried every 2 s forever)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import SQLAlchemyError

from ledger.errors import PersistenceError, is_transient, persistence_error, sqlite_result_code


def raised(fn) -> BaseException:  # noqa: ANN001
    with pytest.raises(Exception) as caught:
        fn()
    return caught.value


def as_ledger_error(exc: BaseException) -> PersistenceError:
    return persistence_error(exc)  # the one translation, as the recorder and the writer make it


@pytest.fixture
def ledger_file(tmp_path: Path) -> Path:
    path = tmp_path / "x.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    return path


def test_a_locked_database_is_transient(ledger_file):
    holder = sqlite3.connect(ledger_file, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    other = sqlite3.connect(ledger_file, isolation_level=None, timeout=0)
    try:
        exc = raised(lambda: other.execute("BEGIN IMMEDIATE"))
        assert sqlite_result_code(exc) == 5  # SQLITE_BUSY
        assert is_transient(as_ledger_error(exc))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
        other.close()


def test_a_read_only_ledger_and_a_missing_table_are_not(ledger_file):
    read_only = sqlite3.connect(f"file:{ledger_file}?mode=ro", uri=True)
    try:
        exc = raised(lambda: read_only.execute("INSERT INTO t VALUES (1)"))
        assert type(exc) is sqlite3.OperationalError and sqlite_result_code(exc) == 8  # SQLITE_READONLY
        assert not is_transient(as_ledger_error(exc))
        exc = raised(lambda: read_only.execute("SELECT * FROM no_such_table"))
        assert type(exc) is sqlite3.OperationalError and not is_transient(as_ledger_error(exc))
    finally:
        read_only.close()


def test_through_sqlalchemy_the_drivers_code_decides(ledger_file):
    engine = create_engine(f"sqlite:///file:{ledger_file}?mode=ro&uri=true")
    try:
        with engine.connect() as conn:
            exc = raised(lambda: conn.execute(text("INSERT INTO t VALUES (1)")))
        assert isinstance(exc, SQLAlchemyError)
        assert not is_transient(as_ledger_error(exc))
    finally:
        engine.dispose()


def test_an_explicit_classification_wins():
    assert is_transient(PersistenceError("the ledger writer process exited", transient=True))
    assert not is_transient(PersistenceError("died 3 times in a row", transient=False))
    assert not is_transient(PersistenceError("no cause at all"))
