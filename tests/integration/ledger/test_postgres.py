"""The recorder contract on the real PostgreSQL server, plus concurrent writers."""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy import func, select

from ledger.db import sync_engine
from ledger.schema import BlockRow, LogRow
from ledger.writer import LedgerWriter
from tools.harness.builders import batch, stored
from tests.integration.ledger.suite import RecorderContract, assert_replay_equal

pytestmark = pytest.mark.postgres


class TestPostgresRecorder(RecorderContract):
    @pytest.fixture
    def db(self, postgres_db: str) -> str:
        return postgres_db


def test_concurrent_writers_for_different_engines_lose_nothing(postgres_db: str) -> None:
    engines, batches_each, blocks_each = 4, 30, 8

    async def writer_for(engine_id: str) -> None:
        writer = await LedgerWriter.open(postgres_db)
        try:
            for seq in range(batches_each):
                base = seq * blocks_each
                await writer.append([batch(seq, stored(*range(base, base + blocks_each)), engine_id=engine_id)])
        finally:
            await writer.close()

    async def main() -> None:
        await asyncio.gather(*(writer_for(f"engine-{i}") for i in range(engines)))

    asyncio.run(main())
    engine = sync_engine(postgres_db)
    try:
        with engine.connect() as conn:
            seqs = list(conn.execute(select(LogRow.__table__.c.seq).order_by(LogRow.__table__.c.seq)).scalars())
            live = conn.execute(select(func.count()).select_from(BlockRow.__table__)).scalar_one()
    finally:
        engine.dispose()
    assert seqs == list(range(1, len(seqs) + 1))  # no holes, no duplicates in the global sequence
    assert live == engines * batches_each * blocks_each
    assert_replay_equal(postgres_db)


def test_a_transaction_reports_its_wait_for_the_log_lock(postgres_db: str, sqlite_db: str) -> None:
    """``AppendResult.log_lock_wait_s``: how long the transaction waited behind another writer's
    commit (here a session holding ``LOCK TABLE log`` for 0.5 s after the append began); None on
    SQLite (no log lock)."""
    import threading

    import psycopg

    locked, release = threading.Event(), threading.Event()

    def holder() -> None:
        with psycopg.connect(postgres_db) as conn:
            conn.execute("LOCK TABLE log IN SHARE ROW EXCLUSIVE MODE")
            locked.set()
            release.wait(60)

    def lock_requested() -> None:
        """Until the writer's transaction waits for the log lock (on a loaded machine the append
        may take longer than the sleep below to get there)."""
        with psycopg.connect(postgres_db, autocommit=True) as conn:
            deadline = time.monotonic() + 30
            while not conn.execute("SELECT count(*) FROM pg_locks WHERE relation = 'log'::regclass "
                                   "AND NOT granted").fetchone()[0]:
                assert time.monotonic() < deadline, "the append never asked for the log lock"
                time.sleep(0.01)

    async def main(db: str) -> tuple[float | None, float | None]:
        writer = await LedgerWriter.open(db)
        try:
            alone = (await writer.append([batch(0, stored(1), engine_id="engine-a")])).log_lock_wait_s
            if db != postgres_db:
                return alone, None
            thread = threading.Thread(target=holder)
            thread.start()
            try:
                await asyncio.to_thread(locked.wait, 10)
                behind = asyncio.create_task(writer.append([batch(1, stored(2), engine_id="engine-a")]))
                await asyncio.to_thread(lock_requested)
                await asyncio.sleep(0.5)
            finally:
                release.set()
                await asyncio.to_thread(thread.join)
            return alone, (await behind).log_lock_wait_s
        finally:
            await writer.close()

    alone, behind = asyncio.run(main(postgres_db))
    assert alone is not None and alone < 0.5
    assert behind is not None and behind >= 0.4
    assert asyncio.run(main(sqlite_db)) == (None, None)
