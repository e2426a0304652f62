"""The net under the decoder's bounds: a batch the database refuses for good is logged as dead
letters alone, its neighbours in the same transaction are logged, and the daemon keeps running
(issue 18, defect 1: before, one refused batch made ``consume`` exit 1 with the good batches of
its transaction unlogged, and the engine's replay buffer handed it back at every restart).

The refusal is the database's own: a trigger (SQLite) or a CHECK constraint (PostgreSQL) added for
the test refuses a block with priority 99, a value the decoder rightly lets through.
"""

from __future__ import annotations

import time

import pytest
from sqlalchemy import text

from ledger.db import sync_engine
from ledger.migrate import upgrade
from tests.conftest import create_pg_database, drop_pg_database, require_pg
from tests.integration.consumer.daemon_support import RunningConsumer

pytestmark = pytest.mark.slow
REFUSE = {
    "sqlite": "CREATE TRIGGER refuse_priority_99 BEFORE INSERT ON blocks WHEN NEW.priority = 99 "
              "BEGIN SELECT RAISE(ABORT, 'priority 99 refused by the test'); END",
    "postgres": "ALTER TABLE blocks ADD CONSTRAINT ck_blocks_test_refuse CHECK (priority IS DISTINCT FROM 99)",
}


def stored(event_id: int, block_hash: int, priority: int) -> dict:
    block = {"type": "stored_block", "block_hash": block_hash, "tokens": [{"token_id": 1}], "priority": priority}
    return {"event_id": event_id, "data": {"type": "stored", "parent_hash": None, "blocks": [block]}, "window_size": 32}


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_batch_the_database_refuses_is_dead_letters_alone_and_the_daemon_stays_up(backend, tmp_path):
    if backend == "sqlite":
        db, drop = f"sqlite:///{tmp_path / 'ledger.db'}", None
    else:
        require_pg()
        db = drop = create_pg_database()
    upgrade(db)
    engine = sync_engine(db)
    with engine.begin() as conn:
        conn.execute(text(REFUSE[backend]))
    engine.dispose()
    # One transaction for the three batches: they arrive within the 300 ms the writer gathers.
    consumer = RunningConsumer(db, tmp_path / "consume.log", "--batch-max-delay-ms", "300")
    try:
        first = consumer.send([stored(0, 1, 35)], 0)
        bad = consumer.send([stored(1, 2, 35), stored(2, 3, 99)], 0)
        last = consumer.send([stored(3, 4, 35)], 0)
        assert consumer.outcome(last) == ({0: "block_stored"}, {})
        assert consumer.outcome(first) == ({0: "block_stored"}, {})
        assert consumer.outcome(bad) == ({}, {0: "refused_by_ledger", 1: "refused_by_ledger"})
        time.sleep(0.5)
        after = consumer.send([stored(4, 5, 35)], 0)
        assert consumer.outcome(after) == ({0: "block_stored"}, {})
        assert consumer.proc.poll() is None
    finally:
        consumer.close()
        if drop:
            drop_pg_database(drop)
    log = (tmp_path / "consume.log").read_text()
    assert "ledger.batch_refused" in log and ("priority 99 refused" in log or "ck_blocks_test_refuse" in log)
