"""Data migrations on both backends: a ledger written by an earlier revision, upgraded in place."""

from __future__ import annotations

import pytest
from alembic import command
from sqlalchemy import insert, select

from ledger.db import sync_engine
from ledger.migrate import alembic_config, upgrade
from ledger.schema import BlockRow, EngineRow

_BLOCKS = BlockRow.__table__


def _block(block_hash: int, state: str) -> dict:
    return {"engine_id": "engine-a", "attention_dp_rank": 0, "window_size": 0, "block_hash": block_hash,
            "block_hash_ext": b"", "parent_hash": None, "parent_hash_ext": None, "num_tokens": 16,
            "tokens_digest": 7, "cache_level": 0, "priority": None, "cache_salt": None, "lora_id": None,
            "state": state, "generation": 1, "store_count": 1, "stored_seq": 2, "updated_seq": 3}


def _downgrade(db: str, revision: str) -> None:
    engine = sync_engine(db, writer=True)
    try:
        with engine.begin() as conn:
            config = alembic_config()
            config.attributes["connection"] = conn
            command.downgrade(config, revision)
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_0003_deletes_the_rows_of_removed_blocks_and_keeps_the_others(backend, request):
    db = request.getfixturevalue(f"{backend}_db" if backend == "sqlite" else "postgres_db")
    _downgrade(db, "0002")
    engine = sync_engine(db, writer=True)
    try:
        with engine.begin() as conn:
            conn.execute(insert(EngineRow.__table__).values(engine_id="engine-a", generation=1, status="active",
                                                            registered_seq=1, generation_seq=1, last_seq=3))
            conn.execute(insert(_BLOCKS), [_block(1, "live"), _block(2, "removed"), _block(3, "quarantined")])
        assert upgrade(db) == ("0002", "0003")
        with engine.connect() as conn:
            rows = conn.execute(select(_BLOCKS.c.block_hash, _BLOCKS.c.state).order_by(_BLOCKS.c.block_hash)).all()
    finally:
        engine.dispose()
    assert [tuple(r) for r in rows] == [(1, "live"), (3, "quarantined")]


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


def test_0003_makes_blocks_one_btree_on_sqlite_and_downgrades(sqlite_db):
    path = sqlite_db.removeprefix("sqlite:///")

    def blocks_sql() -> list[str]:
        import sqlite3

        with sqlite3.connect(path) as conn:
            return [r[0] or "" for r in conn.execute("SELECT sql FROM sqlite_master WHERE tbl_name = 'blocks'")]

    assert len(blocks_sql()) == 1 and "WITHOUT ROWID" in blocks_sql()[0]  # no index, no autoindex
    _downgrade(sqlite_db, "0002")
    assert "WITHOUT ROWID" not in blocks_sql()[0] and any("ix_blocks_engine_state" in s for s in blocks_sql())
    assert upgrade(sqlite_db) == ("0002", "0003")
