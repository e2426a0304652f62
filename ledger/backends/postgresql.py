"""PostgreSQL, the shared fleet ledger (DESIGN §5 "Backends").

* Async writes through asyncpg (the consumer's writer), sync reads and connector writes through
  psycopg 3 on autocommit connections: READ COMMITTED gives every statement its own snapshot, so
  reads need no transaction; writes emit ``BEGIN``.
* Writers of the log serialise on ``LOCK TABLE log IN SHARE ROW EXCLUSIVE MODE`` so that a reader
  tailing the log never skips a seq that commits later (eventsourcing ``postgres.py``
  ``_lock_table`` does the same).
* Bulk statements: ONE statement per table per transaction (``INSERT … SELECT FROM unnest(array,
  …)``, ``DELETE … USING unnest``): asyncpg's and psycopg's executemany send one statement per row
  (pipelined, but planned and executed row by row), which held the writer at 1.6–4k block events/s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import BigInteger, ColumnElement, Connection, Engine, Float, LargeBinary, bindparam, create_engine, delete, func, literal, select, text, true
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from ledger.backends.base import Backend, KeysDelete, RowsWrite
from ledger.prepared import Prepared
from ledger.schema import BlockRow

if TYPE_CHECKING:
    from ledger.db import Sql

_MIGRATION_LOCK_KEY = 0x73656D6B765F6D67  # b"semkv_mg": one advisory lock key for every semkv-ledger migrate

PG_WRITER_PLAN_CACHE_MODE = "force_custom_plan"
"""The consumer's writer (asyncpg) plans every statement with its parameters. asyncpg keeps
server-side prepared statements per connection, and PostgreSQL switches one to a cached generic
plan after five executions; a generic plan made while ``blocks`` was small (a fresh ledger) stays
in use as it grows: the block load then used ``ix_blocks_engine_state`` and filtered every block
of the engine per hash (2.5 s for 256 hashes at 50k blocks). Writer at 64 events/txn: 1.3k block
events/s with cached plans, 7.4k with custom ones; no difference at 1024/txn (planning is
amortised over the batch). NOT for the connector's psycopg reads: planning its 3-table point
joins costs ~0.6 ms per query (a binary search makes ~10), against 0.1 ms with cached plans."""

_BLOCKS = BlockRow.__table__
_HASHES = func.unnest(bindparam("hashes", type_=postgresql.ARRAY(BigInteger()))).table_valued("h").render_derived()
_PER_HASH = (select(_BLOCKS).where(_BLOCKS.c.engine_id == bindparam("engine_id"),
                                   _BLOCKS.c.attention_dp_rank == bindparam("attention_dp_rank"),
                                   _BLOCKS.c.window_size == bindparam("window_size"),
                                   _BLOCKS.c.block_hash == _HASHES.c.h).offset(0).lateral())
_BLOCKS_BY_HASHES = Prepared(select(_PER_HASH).select_from(_HASHES).join(_PER_HASH, true()))
"""One primary-key probe per hash, whatever the planner's statistics say. The plainer
``block_hash = ANY($4)`` got a generic plan that used only the (engine, rank, window) prefix of the
key and filtered every block of the engine (308 ms per 1000 hashes on a fresh, un-ANALYZEd
ledger; 2 ms with this form). ``OFFSET 0`` keeps the subquery from being flattened into a join."""


class PostgreSQLBackend(Backend):
    name = "postgresql"

    def sync_engine(self, url: URL, *, writer: bool, create: bool, pool_size: int,
                    statement_timeout_s: float | None) -> Engine:
        """``statement_timeout_s``: the server cancels any statement running longer
        (``statement_timeout``, lock waits included); connecting gives up after as long
        (``connect_timeout``, at least 2 s: libpq's minimum); and the client drops a connection
        whose sent data goes unacknowledged that long (``tcp_user_timeout``) or whose idle peer
        stops answering keepalives (~11 s), so a network partition fails a call instead of hanging
        it. A peer that acknowledges but never answers (a frozen proxy) is not detected."""
        connect_args = {}
        if statement_timeout_s is not None:
            ms = max(1, round(statement_timeout_s * 1000))
            connect_args = {"options": f"-c statement_timeout={ms}", "tcp_user_timeout": ms,
                            "connect_timeout": max(2, math.ceil(statement_timeout_s)),
                            "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3}
        return create_engine(url.set(drivername="postgresql+psycopg"), pool_size=pool_size, pool_pre_ping=True,
                             connect_args=connect_args)

    def async_engine(self, url: URL) -> AsyncEngine:
        return create_async_engine(url.set(drivername="postgresql+asyncpg"), pool_pre_ping=True,
                                   connect_args={"server_settings": {"plan_cache_mode": PG_WRITER_PLAN_CACHE_MODE}})

    def contains_bytes(self, column: ColumnElement[bytes], needle: bytes) -> ColumnElement[bool]:
        # position(bytea IN bytea) (postgresql.org/docs/15/functions-binarystring.html)
        return func.position(literal(needle, LargeBinary).op("IN")(column)) > 0

    def prepare_client_connection(self, dbapi_connection: Any) -> None:
        dbapi_connection.autocommit = True  # reads see the latest commit; writes BEGIN

    def lock_wait(self, ms: int) -> tuple[str, str]:
        # session level (the client's connections are autocommit): SET LOCAL would end with the first COMMIT
        return f"SET lock_timeout = {ms}", "RESET lock_timeout"

    def serialize_migrations(self, conn: Connection) -> None:
        # A transaction-level advisory lock (released at COMMIT or ROLLBACK; postgresql.org/docs/15/
        # functions-admin.html "Advisory Lock Functions"): two migrates of an empty database both
        # created alembic_version otherwise, and the second failed on pg_type's unique index.
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK_KEY})

    def lock_log(self, sql: Sql) -> bool:
        sql.driver("LOCK TABLE log IN SHARE ROW EXCLUSIVE MODE")
        return True

    def blocks_by_hashes(self, sql: Sql, stream: dict[str, Any], hashes: set[int]) -> list[tuple]:
        return sql.all(_BLOCKS_BY_HASHES, {**stream, "hashes": list(hashes)})

    def write_rows(self, sql: Sql, spec: RowsWrite, rows: Sequence[tuple]) -> None:
        if not rows:
            return
        prepared, names, floats = self._shape(spec, lambda: _insert(spec))
        arrays = dict(zip(names, map(list, zip(*rows))))
        for name in floats:
            arrays[name] = [None if v is None else float(v) for v in arrays[name]]
        sql.run(prepared, arrays)

    def delete_keys(self, sql: Sql, spec: KeysDelete, keys: Sequence[tuple]) -> int:
        if not keys:
            return 0
        prepared, names = self._shape(spec, lambda: _delete(spec))
        return sql.run(prepared, dict(zip(names, map(list, zip(*keys)))))


def _insert(spec: RowsWrite) -> tuple[Prepared, list[str], set[str]]:
    table = spec.table
    names = [c.name for c in table.columns]
    keys = [c.name for c in table.primary_key.columns]
    # psycopg refuses arrays mixing int and float (``now=1000`` in tests): floats are made float
    floats = {c.name for c in table.columns if isinstance(c.type, Float)}
    arrays = [bindparam(c.name, type_=postgresql.ARRAY(c.type)) for c in table.columns]
    source = func.unnest(*arrays).table_valued(*names).render_derived()
    stmt = postgresql.insert(table).from_select(names, select(*[source.c[n] for n in names]))
    if spec.conflict == "update":
        stmt = stmt.on_conflict_do_update(index_elements=keys, set_={
            n: stmt.excluded[n] for n in names if n not in keys})
    elif spec.conflict == "add":
        stmt = stmt.on_conflict_do_update(index_elements=keys, set_={"value": table.c.value + stmt.excluded.value})
    elif spec.conflict == "ignore":
        stmt = stmt.on_conflict_do_nothing(index_elements=keys)
    return Prepared(stmt), names, floats


def _delete(spec: KeysDelete) -> tuple[Prepared, list[str]]:
    table = spec.table
    names = [c.name for c in table.primary_key.columns]
    arrays = [bindparam(n, type_=postgresql.ARRAY(table.c[n].type)) for n in names]
    keys = func.unnest(*arrays).table_valued(*names).render_derived()
    return Prepared(delete(table).where(*[table.c[n] == keys.c[n] for n in names], *spec.where)), names
