"""Fixtures and helpers shared by the SQLite writer tests (thread and process)."""

from __future__ import annotations

import sqlite3
import threading

import pytest
from sqlalchemy import func, select

from ledger.db import sync_engine
from ledger.schema import LogRow


def log_rows(db: str) -> int:
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            return conn.execute(select(func.count()).select_from(LogRow.__table__)).scalar_one()
    finally:
        engine.dispose()


@pytest.fixture
def lock_holder(sqlite_db: str):
    """Another writer's connection; ``hold()`` takes the write lock, ``release_after(s)`` commits later."""
    conn = sqlite3.connect(sqlite_db.removeprefix("sqlite:///"), isolation_level=None, check_same_thread=False)

    class Holder:
        def hold(self) -> None:
            conn.execute("BEGIN IMMEDIATE")

        def release_after(self, seconds: float) -> threading.Timer:
            timer = threading.Timer(seconds, conn.execute, args=("COMMIT",))
            timer.start()
            return timer

        def release(self) -> None:
            conn.execute("COMMIT")

    yield Holder()
    conn.close()
