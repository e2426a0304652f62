"""Data migrations on both backends: a ledger written by an earlier revision, upgraded in place."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import func, insert, select, text

from ledger.db import sync_engine
from ledger.migrate import upgrade
from ledger.replay import replay
from ledger.schema import BlockRow, CounterRow, LogRow
from ledger.writer import LedgerWriter
from tools.harness.builders import batch, created, downgrade, removed, stored, updated

_BLOCKS = BlockRow.__table__


def _block(block_hash: int, state: str) -> dict:
    return {"engine_id": "engine-a", "attention_dp_rank": 0, "window_size": 0, "block_hash": block_hash,
            "block_hash_ext": b"", "parent_hash": None, "parent_hash_ext": None, "num_tokens": 16,
            "tokens_digest": 7, "cache_level": 0, "priority": None, "cache_salt": None, "lora_id": None,
            "state": state, "generation": 1, "store_count": 1, "stored_seq": 2, "updated_seq": 3}


def _append(db: str, *batches) -> None:
    async def feed() -> None:
        writer = await LedgerWriter.open(db)
        try:
            for b in batches:
                await writer.append([b])
        finally:
            await writer.close()

    asyncio.run(feed())


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_0003_rebuilds_projections_an_earlier_version_wrote_so_that_replay_agrees(backend, request):
    db = request.getfixturevalue(f"{backend}_db" if backend == "sqlite" else "postgres_db")
    _append(db, batch(0, created(), stored(1, 2, 5, 6, event_id=1)),
            batch(1, removed(5, event_id=2)), batch(2, removed(5, event_id=3)), batch(3, updated(5, event_id=4)),
            batch(4, stored(7, event_id=9)),  # jump: 1, 2, 6 quarantined
            batch(5, stored(8, event_id=12)))  # jump: 1, 2, 6 dropped, 7 quarantined
    downgrade(db, "0002")
    # What revision 0002's code left behind for the same log: the removed row, the blocks of the first
    # quarantine, and its counters for the double removal and the update of a removed block.
    engine = sync_engine(db, writer=True)
    counters = CounterRow.__table__
    try:
        with engine.begin() as conn:
            conn.execute(insert(_BLOCKS), [_block(5, "removed"), _block(1, "quarantined"), _block(6, "quarantined")])
            for name, value in (("removed_not_live", 1), ("removed_unknown", 0), ("updated_not_live", 1),
                                ("updated_unknown", 0)):
                conn.execute(counters.update().where(counters.c.engine_id == "engine-a", counters.c.name == name)
                             .values(value=value))
        assert upgrade(db) == ("0002", "0007")
        with engine.connect() as conn:
            rows = conn.execute(select(_BLOCKS.c.block_hash, _BLOCKS.c.state).order_by(_BLOCKS.c.block_hash)).all()
    finally:
        engine.dispose()
    assert [tuple(r) for r in rows] == [(7, "quarantined"), (8, "live")]
    report = replay(db)
    assert report.equal, [(d.table, d.totals) for d in report.diffs if d.count]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_migrated_schema_is_the_models_schema(backend, request):
    """Alembic's autogenerate finds nothing to change between head and ``ledger.schema``."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from ledger.schema import Base

    db = request.getfixturevalue(f"{backend}_db" if backend == "sqlite" else "postgres_db")
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        engine.dispose()
    assert diff == []


def test_the_head_every_command_checks_is_alembics_head():
    """``HEAD_REVISION`` (what the schema check compares with, without importing Alembic) is the newest
    script in migrations/versions: a new migration must move it."""
    from alembic.script import ScriptDirectory

    from ledger.migrate import HEAD_REVISION, alembic_config

    assert ScriptDirectory.from_config(alembic_config()).get_current_head() == HEAD_REVISION


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_revision_read_without_alembic_is_alembics(backend, request):
    from alembic.migration import MigrationContext

    from ledger.migrate import current_revision

    db = request.getfixturevalue(f"{backend}_db" if backend == "sqlite" else "postgres_db")
    engine = sync_engine(db)
    try:
        for revision in ("0004", None):
            if revision is not None:
                downgrade(db, revision)
            with engine.connect() as conn:
                assert current_revision(conn) == MigrationContext.configure(conn).get_current_revision()
                assert current_revision(conn) == revision
                if revision is not None:
                    conn.execute(text("DELETE FROM alembic_version"))  # then: no revision at all
                    conn.commit()
    finally:
        engine.dispose()


def test_0003_makes_blocks_one_btree_on_sqlite_and_downgrades(sqlite_db):
    path = sqlite_db.removeprefix("sqlite:///")

    def blocks_sql() -> list[str]:
        import sqlite3

        with sqlite3.connect(path) as conn:
            return [r[0] or "" for r in conn.execute("SELECT sql FROM sqlite_master WHERE tbl_name = 'blocks'")]

    assert len(blocks_sql()) == 1 and "WITHOUT ROWID" in blocks_sql()[0]  # no index, no autoindex
    downgrade(sqlite_db, "0002")
    assert "WITHOUT ROWID" not in blocks_sql()[0] and any("ix_blocks_engine_state" in s for s in blocks_sql())
    assert upgrade(sqlite_db) == ("0002", "0007")


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_0004_counts_the_logs_events_by_type_so_that_stats_and_replay_agree(backend, request):
    from ledger.stats import ledger_stats

    db = request.getfixturevalue(f"{backend}_db" if backend == "sqlite" else "postgres_db")
    _append(db, batch(0, created(), stored(1, 2, event_id=1), stored(3, event_id=2, type_name="BlockStored")),
            batch(1, removed(1, event_id=3), updated(2, event_id=4)),
            batch(0, stored(9, event_id=1), engine_id="engine-b"),
            batch(2, stored(4, event_id=2), removed(4, event_id=1)))  # the removal is stale: logged, not applied
    downgrade(db, "0003")
    engine = sync_engine(db, writer=True)
    counters, log = CounterRow.__table__, LogRow.__table__
    try:
        with engine.connect() as conn:
            assert not [n for (n,) in conn.execute(select(counters.c.name)) if n.startswith("events_type:")]
        assert upgrade(db) == ("0003", "0007")
        with engine.connect() as conn:
            by_type = {(e, t): n for e, t, n in conn.execute(
                select(log.c.engine_id, log.c.type_name, func.count())
                .where(log.c.batch_index >= 0, log.c.kind != "event_dead_lettered")
                .group_by(log.c.engine_id, log.c.type_name))}  # what stats grouped before 0004
            stats = ledger_stats(conn)
    finally:
        engine.dispose()
    assert by_type == {("engine-a", "created"): 1, ("engine-a", "stored"): 2, ("engine-a", "BlockStored"): 1,
                       ("engine-a", "removed"): 2, ("engine-a", "updated"): 1, ("engine-b", "stored"): 1}
    assert {(e["engine_id"], t): n for e in stats["engines"] for t, n in e["events_by_type"].items()} == by_type
    assert stats["events_total"] == sum(by_type.values()) and stats["events_by_type"]["stored"] == 3
    report = replay(db)
    assert report.equal, [(d.table, d.totals) for d in report.diffs if d.count]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_0006_adds_an_empty_block_index_that_inspect_reads_like_the_log(backend, request):
    from sqlalchemy import inspect as schema_of

    from ledger.block_index import BlockIndexFollower, index_state
    from ledger.stats import find_block

    db = request.getfixturevalue(f"{backend}_db" if backend == "sqlite" else "postgres_db")
    _append(db, batch(0, created(), stored(1, 2, event_id=1)), batch(1, removed(1, event_id=2)))
    downgrade(db, "0005")
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            assert not {"block_index", "index_watermarks"} & set(schema_of(conn).get_table_names())
        assert upgrade(db) == ("0005", "0007")
        with engine.connect() as conn:
            state = index_state(conn)
            assert state.watermark == 0 and state.head > 0  # nothing indexed: inspect searches the whole log
            unindexed = [(r["seq"], r["kind"]) for r in find_block(conn, 1).rows]
        with BlockIndexFollower(db) as follower:
            assert follower.catch_up().watermark == state.head
        with engine.connect() as conn:
            found = find_block(conn, 1)
    finally:
        engine.dispose()
    assert [kind for _, kind in unindexed] == ["block_stored", "block_removed"]
    assert [(r["seq"], r["kind"]) for r in found.rows] == unindexed and found.searched_seqs == 0
