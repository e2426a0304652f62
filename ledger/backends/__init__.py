"""The ledger's backends, one module each (:mod:`ledger.backends.sqlite`,
:mod:`ledger.backends.postgresql`), behind :class:`~ledger.backends.base.Backend`."""

from __future__ import annotations

import importlib
from functools import cache
from typing import TYPE_CHECKING

from ledger.backends.base import Backend, KeysDelete, RowsWrite
from ledger.errors import LedgerError

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

__all__ = ["Backend", "KeysDelete", "RowsWrite", "backend_for", "backend_named"]

_BACKEND_CLASSES = {"sqlite": ("ledger.backends.sqlite", "SQLiteBackend"),
                    "postgresql": ("ledger.backends.postgresql", "PostgreSQLBackend")}
"""Dialect name -> (module, class), imported on first use: PostgreSQL's module and SQLAlchemy's
dialects under it are ~50 ms of every command's start-up, for nothing on a SQLite ledger."""


def backend_named(name: str) -> Backend:
    """The backend of a SQLAlchemy dialect or URL backend name.

    Raises:
        LedgerError: not a backend the ledger supports.
    """
    if name not in _BACKEND_CLASSES:
        raise LedgerError(f"unsupported ledger database {name!r}: use a SQLite file or postgresql://")
    return _backend(name)


@cache
def _backend(name: str) -> Backend:
    """One backend object per dialect, for the life of the process (they hold no connection)."""
    module, cls = _BACKEND_CLASSES[name]
    return getattr(importlib.import_module(module), cls)()


def backend_for(url: URL) -> Backend:
    """The backend of a ledger URL (raises LedgerError like :func:`backend_named`)."""
    return backend_named(url.get_backend_name())
