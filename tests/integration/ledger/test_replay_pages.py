"""Replay reads the log in windows of seqs, so each page reads its own rows and no others, whatever
PostgreSQL's planner knows about the log. Without statistics (autovacuum off, a restored dump, a
ledger just loaded) it planned ``seq > a ORDER BY seq LIMIT n`` as a scan and a sort of every row
after ``a``: a replay read the log once per page, its time growing with the square of the log."""

from __future__ import annotations

from sqlalchemy import Connection, text

from ledger.db import sync_engine
from ledger.replay import iter_log_pages, replay
from tools.harness.builders import batch, record, stored

PAGE_ROWS = 2_000
EVENTS_PER_BATCH = 100
BATCHES = 200
"""20,200 log rows: on a log of a few thousand the planner happens to pick the index without statistics."""


def _heap_rows_read(conn: Connection) -> int:
    """Rows of ``log`` read so far by every scan (sequential and through an index), as PostgreSQL's
    cumulative statistics count them."""
    conn.execute(text("SELECT pg_stat_clear_snapshot()"))
    return conn.execute(text("SELECT seq_tup_read + coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables "
                             "WHERE relname = 'log'")).scalar_one()


def test_replay_reads_each_log_row_once_on_postgresql_without_statistics(postgres_db: str) -> None:
    engine = sync_engine(postgres_db, writer=True)
    try:
        with engine.begin() as conn:  # no ANALYZE may give the planner statistics during the test
            conn.execute(text("ALTER TABLE log SET (autovacuum_enabled = false)"))
        record(postgres_db, *([batch(seq, *(stored(seq * EVENTS_PER_BATCH + i + 1) for i in range(EVENTS_PER_BATCH)))]
                              for seq in range(BATCHES)))
        with engine.connect() as stats, engine.connect() as reader:
            assert stats.execute(text("SELECT count(*) FROM pg_stats WHERE tablename = 'log'")).scalar_one() == 0
            before = _heap_rows_read(stats)
            rows = sum(len(page) for page in iter_log_pages(reader, page_rows=PAGE_ROWS))
            reader.execute(text("SELECT pg_stat_force_next_flush()"))  # flushed before the reader's next idle
            reader.rollback()
            read = _heap_rows_read(stats) - before
        assert rows > 10 * PAGE_ROWS, rows
        assert read <= rows + PAGE_ROWS, f"{read:,} log rows read to fold {rows:,}"
        assert replay(postgres_db).equal
    finally:
        engine.dispose()
