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
