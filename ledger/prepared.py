"""Prepared statements: a Core statement compiled once per dialect, run on a DBAPI cursor.

The hot paths (the recorder, :class:`~ledger.client.LedgerClient`, the backends' bulk shapes)
write each statement once in SQLAlchemy Core and run it through :class:`ledger.db.Sql`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class Prepared:
    """A Core statement compiled once per dialect into driver SQL plus a parameter binder.

    Why: building, compiling and executing a SQLAlchemy expression costs 0.5–1.3 ms per call on
    the 2-core reference machine (tools/results/connector-2026-11-29.md, before), against ~20 µs
    for the same SQL on a kept DBAPI connection. The statement is still written once, in Core;
    SQLAlchemy compiles it per dialect class and paramstyle (SQLite ``qmark``, psycopg
    ``pyformat`` with its bind casts, asyncpg ``numeric_dollar``), so the SQL lives in one place
    and stays correct on both backends. Constants bound at build time (``state == "live"``) keep
    their values; the binder from :meth:`compiled` fills in the rest by name.

    Values must already be driver-native (int, float, str, bytes, bool, None, or lists of them
    for PostgreSQL arrays): no SQLAlchemy type processing runs.
    """

    __slots__ = ("stmt", "_compiled")

    def __init__(self, stmt) -> None:  # noqa: ANN001 - any executable Core construct
        self.stmt = stmt
        self._compiled: dict[tuple[type, str], tuple[str, Any]] = {}

    def compiled(self, dialect) -> tuple[str, Any]:  # noqa: ANN001
        """``(sql, binder)`` for ``dialect``: ``binder(params)`` fills constants in and returns what
        the cursor takes."""
        key = (type(dialect), dialect.paramstyle)
        hit = self._compiled.get(key)
        if hit is None:
            hit = self._compiled[key] = _compile(self.stmt, dialect)
        return hit


def _compile(stmt, dialect) -> tuple[str, Any]:  # noqa: ANN001
    compiled = stmt.compile(dialect=dialect)
    if "POSTCOMPILE" in compiled.string:
        raise ValueError("prepared statements cannot hold expanding IN lists")
    defaults = dict(compiled.params)
    if compiled.positiontup is None:
        def binder(params: Mapping[str, Any], defaults=defaults) -> dict:  # noqa: ANN001
            return {**defaults, **params}

        return compiled.string, binder
    order = tuple(compiled.positiontup)

    def positional(params: Mapping[str, Any], order=order, defaults=defaults) -> tuple:  # noqa: ANN001
        return tuple(params[k] if k in params else defaults[k] for k in order)

    return compiled.string, positional
