"""The recorder contract on a SQLite file, plus what is SQLite-specific (WAL, file mode)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from sqlalchemy import text

from ledger.db import sync_engine
from tests.integration.ledger.suite import RecorderContract


class TestSQLiteRecorder(RecorderContract):
    @pytest.fixture
    def db(self, sqlite_db: str) -> str:
        return sqlite_db


def test_sqlite_file_is_private_and_in_wal_mode(sqlite_db: str) -> None:
    path = Path(sqlite_db.removeprefix("sqlite:///"))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    engine = sync_engine(sqlite_db)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
    finally:
        engine.dispose()


def test_a_locked_database_is_a_persistence_error_caused_by_sqlalchemys_operational_error(sqlite_db: str,
                                                                                           monkeypatch) -> None:
    """The recorder and the connector's client run prepared SQL on the DBAPI cursor; a driver error
    must still reach callers as SQLAlchemy's type (the consumer retries OperationalError)."""
    import asyncio

    from sqlalchemy.exc import OperationalError

    import ledger.backends.sqlite
    from ledger.errors import PersistenceError
    from ledger.client import LedgerClient
    from ledger.writer import LedgerWriter
    from tools.harness.builders import batch, stored

    monkeypatch.setattr(ledger.backends.sqlite, "SQLITE_BUSY_TIMEOUT_MS", 50)
    blocker = sync_engine(sqlite_db, writer=True)
    client = LedgerClient(sqlite_db)
    try:
        with blocker.begin():  # BEGIN IMMEDIATE: holds the write lock
            with pytest.raises(PersistenceError) as caught:
                client.release_lease("nope", "x")
            assert isinstance(caught.value.__cause__, OperationalError)

            async def append() -> None:
                writer = await LedgerWriter.open(sqlite_db)
                try:
                    await writer.append([batch(0, stored(1))])
                finally:
                    await writer.close()

            with pytest.raises(PersistenceError) as caught:
                asyncio.run(append())
            assert isinstance(caught.value.__cause__, OperationalError)
        assert client.release_lease("nope", "x") is False  # the client's connection still works
    finally:
        client.close()
        blocker.dispose()


def test_a_ledger_in_a_missing_directory_is_refused_not_created(tmp_path: Path) -> None:
    """A mistyped path must not quietly start a second ledger somewhere else (migrate creates files,
    never directories)."""
    from ledger.errors import LedgerError
    from ledger.migrate import upgrade

    missing = tmp_path / "no-such-dir" / "ledger.db"
    with pytest.raises(LedgerError, match="does not exist"):
        upgrade(f"sqlite:///{missing}")
    assert not missing.parent.exists()
