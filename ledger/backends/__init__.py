"""The ledger's backends, one module each (:mod:`ledger.backends.sqlite`,
:mod:`ledger.backends.postgresql`), behind :class:`~ledger.backends.base.Backend`."""

from __future__ import annotations

from sqlalchemy.engine import URL

from ledger.backends.base import Backend, KeysDelete, RowsWrite
from ledger.backends.postgresql import PostgreSQLBackend
from ledger.backends.sqlite import SQLiteBackend
from ledger.errors import LedgerError

__all__ = ["Backend", "KeysDelete", "RowsWrite", "backend_for", "backend_named"]

_BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (SQLiteBackend(), PostgreSQLBackend())}


def backend_named(name: str) -> Backend:
    """The backend of a SQLAlchemy dialect or URL backend name.

    Raises:
        LedgerError: not a backend the ledger supports.
    """
    backend = _BACKENDS.get(name)
    if backend is None:
        raise LedgerError(f"unsupported ledger database {name!r}: use a SQLite file or postgresql://")
    return backend


def backend_for(url: URL) -> Backend:
    """The backend of a ledger URL (raises LedgerError like :func:`backend_named`)."""
    return backend_named(url.get_backend_name())
