"""The consumer's asynchronous ledger writer (SQLAlchemy AsyncEngine; aiosqlite or asyncpg).

One writer per database per process: on SQLite it is the only writer the consumer has (WAL lets
readers run beside it); on PostgreSQL several consumer processes may each run one, serialised by
the recorder's table lock. Each :meth:`LedgerWriter.append` is one transaction (DESIGN §5).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from ledger import recorder
from ledger.db import async_engine
from ledger.decide import AppendResult
from ledger.errors import PersistenceError
from ledger.migrate import check_schema
from ledger.schema import SourceRow


class SourcePosition(NamedTuple):
    """Where a source stands in the ledger: its epoch and last accepted ZMQ seq."""

    engine_id: str
    epoch: int
    last_seq: int


class LedgerWriter:
    """Appends consumer inputs (received batches, dead letters, gap reports) to the ledger."""

    def __init__(self, db: str) -> None:
        self.db = db
        self._engine = async_engine(db)

    @classmethod
    async def open(cls, db: str) -> LedgerWriter:
        """Open and check the schema.

        Raises:
            SchemaOutOfDate: the database is not migrated (run ``semkv-ledger migrate``).
            PersistenceError: the database cannot be reached.
        """
        writer = cls(db)
        try:
            async with writer._engine.connect() as conn:
                await conn.run_sync(check_schema, db)
        except SQLAlchemyError as exc:
            await writer.close()
            raise PersistenceError(str(exc.orig if hasattr(exc, "orig") else exc)) from exc
        except Exception:
            await writer.close()
            raise
        return writer

    async def append(self, items: Sequence[recorder.Input], *, now: float | None = None) -> AppendResult:
        """Record ``items`` and apply them to the projections in ONE transaction.

        Raises:
            PersistenceError: the transaction failed; nothing of ``items`` was recorded.
        """
        try:
            async with self._engine.begin() as conn:
                return await conn.run_sync(lambda sync_conn: recorder.append(sync_conn, items, now=now))
        except SQLAlchemyError as exc:
            raise PersistenceError(str(getattr(exc, "orig", exc))) from exc

    async def source_positions(self) -> dict[str, SourcePosition]:
        """Every known source's position (the consumer resumes from these after a restart)."""
        table = SourceRow.__table__
        async with self._engine.connect() as conn:
            rows = (await conn.execute(select(table.c.source_id, table.c.engine_id, table.c.epoch, table.c.last_seq))).all()
        return {r.source_id: SourcePosition(r.engine_id, r.epoch, r.last_seq) for r in rows}

    async def close(self) -> None:
        await self._engine.dispose()
