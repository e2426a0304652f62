"""Schema migrations (Alembic) and the schema-version gate.

The Alembic scripts live in the repository's ``migrations/`` folder (``alembic.ini`` points developers
there) and are installed as the package ``ledger.migrations`` (``pyproject.toml`` maps one onto the
other), so a wheel or a plain ``pip install`` carries them. Every command that opens a ledger calls
:func:`check_schema`, which refuses a database that is not at the head revision with
:class:`~ledger.errors.SchemaOutOfDate` naming ``semkv-ledger migrate``.

Progress of long migrations. A revision that works through the log or a projection (0003 rebuilds
every projection: 42 s on a 2.7M-row ledger) reports how far it is with :func:`migration_progress`,
one ``with`` block per step::

    from ledger.migrate import migration_progress

    def upgrade() -> None:
        bind = op.get_bind()
        total = bind.execute(select(func.count()).select_from(log)).scalar_one()
        with migration_progress("backfilling the index from the log", total) as progress:
            done = 0
            for page in pages_of_the_log(bind):
                ...                          # the step's work on one page of rows
                done += len(page)
                progress(done)               # rows done so far: a position, not an increment

``progress(done, total=None)`` takes the units done so far in the step's own units (log rows above)
and, optionally, a total learnt late; a step with no total shows elapsed time only. Whoever runs the
upgrade chooses how it is shown (:func:`upgrade`'s ``progress``: ``semkv-ledger migrate`` draws a
bar on stderr when stderr is a terminal); when nobody listens (plain ``alembic upgrade``, the tests,
``consume --migrate``) the step costs one context-variable read and ``progress`` does nothing.
Report at most every few thousand rows: the call is cheap, the drawing is not free.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from sqlalchemy import Connection, text
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.exc import SQLAlchemyError

from ledger.db import backend_of, normalize_url, sync_engine, write_refusal
from ledger.errors import LedgerError, SchemaOutOfDate, persistence_error, url_for_humans

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS_PACKAGE = "ledger.migrations"

HEAD_REVISION = "0007"
"""The newest revision in ``migrations/versions`` (tests/integration/ledger/test_migrations.py holds it
equal to Alembic's head). Every command's schema check compares with it, so only ``migrate`` and a
ledger at another revision import Alembic: ~110 ms of each command's start-up otherwise."""
_VERSION_TABLE = "alembic_version"  # Alembic's default version table (env.py keeps the default)


class StepProgress(Protocol):
    """How far one migration step is: ``done`` units so far (a position), ``total`` when learnt
    late (None: unchanged)."""

    def __call__(self, done: int, total: int | None = None) -> None: ...


MigrationListener = Callable[[str, "int | None"], contextlib.AbstractContextManager[StepProgress]]
"""What shows progress: called with a step's description and total (None: unknown) when the step
begins; the context it returns is left when the step ends."""

_listener: ContextVar[MigrationListener | None] = ContextVar("semkv_migration_listener", default=None)


@contextlib.contextmanager
def migration_progress(description: str, total: int | None = None) -> Iterator[StepProgress]:
    """One step of a migration whose progress is worth showing (see the module docstring); yields
    ``progress(done, total=None)``, a no-op when nobody listens.

    Args:
        description: what the step does, for people (``rebuilding projections from the log``).
        total: units the step will do (log rows, blocks), None when unknown.
    """
    listener = _listener.get()
    if listener is None:
        yield _nobody_listens
        return
    with listener(description, total) as progress:
        yield progress


def _nobody_listens(done: int, total: int | None = None) -> None:
    """Progress nobody shows."""


@cache
def migrations_dir() -> Path:
    """The folder holding the Alembic scripts (``env.py``, ``script.py.mako``, ``versions/``).

    Found through the import system as the package ``ledger.migrations``: ``site-packages/ledger/
    migrations`` when installed from a wheel or ``pip install .``, the checkout's ``migrations/`` with
    ``pip install -e .``. A checkout used through ``PYTHONPATH`` without being installed (the vLLM
    engine processes of ``tests/vllm_cpu``) has no such package; there the folder is the checkout's
    ``migrations/``, recognised by the ``alembic.ini`` beside it.

    Raises:
        LedgerError: no folder with ``env.py`` was found (an installation without its migrations).
    """
    spec = importlib.util.find_spec(MIGRATIONS_PACKAGE)
    candidates = [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "alembic.ini").is_file():
        candidates.append(checkout / "migrations")
    for candidate in candidates:
        if (candidate / "env.py").is_file():
            return candidate
    raise LedgerError(f"this installation of semkv-ledger ({Path(__file__).resolve().parent}) lacks its schema "
                      f"migrations (package {MIGRATIONS_PACKAGE}); reinstall it as docs/deploy.md says")


def alembic_config() -> Config:
    """An Alembic config pointing at :func:`migrations_dir`.

    Raises:
        LedgerError: the migrations are missing (see :func:`migrations_dir`).
    """
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    return config


def head_revision() -> str:
    return HEAD_REVISION


def current_revision(conn: Connection) -> str | None:
    """The revision the ledger's schema is at (Alembic's version table), None when it has none
    (a new database, or not a ledger).

    Read with plain SQL, as Alembic's ``MigrationContext.get_current_revision`` reads it, without
    importing Alembic (see :data:`HEAD_REVISION`).

    Raises:
        LedgerError: the version table holds several revisions (branches this project never makes).
    """
    if not sa_inspect(conn).has_table(_VERSION_TABLE):
        return None
    revisions = conn.execute(text(f"SELECT version_num FROM {_VERSION_TABLE}")).scalars().all()
    if len(revisions) > 1:
        raise LedgerError(f"the ledger's {_VERSION_TABLE} table holds several revisions ({', '.join(revisions)}): "
                          "not a schema semkv-ledger wrote")
    return revisions[0] or None if revisions else None  # a blank version (a damaged table): none


def upgrade(db: str, revision: str = "head", *,
            progress: MigrationListener | None = None) -> tuple[str | None, str]:
    """Upgrade the ledger at ``db`` to ``revision``; returns (revision before, revision after).

    Args:
        progress: shown each step a revision reports through :func:`migration_progress`; None:
            nothing is shown.

    Raises:
        LedgerError: an unsupported URL, a SQLite path in a missing directory, or a SQLite ledger
            this process cannot write (a read-only mount, another user's file): refused before
            it is opened.
        SchemaOutOfDate: the database is at a revision this installation does not know (newer).
        PersistenceError: the database cannot be reached or written.
    """
    refusal = write_refusal(db)
    if refusal is not None:
        raise LedgerError(f"cannot migrate the ledger {url_for_humans(db)}: it cannot be written here ({refusal})")
    engine = sync_engine(db, writer=True)
    listening = _listener.set(progress)
    try:
        with engine.begin() as conn:  # one transaction: a migrate run beside this one waits, then finds the head
            backend_of(db).serialize_migrations(conn)
            before = current_revision(conn)
            if before is None:
                _refuse_foreign_tables(conn, db)
            if before is not None and not _known(before):
                raise SchemaOutOfDate(db, before, head_revision(), unknown=True)
            from alembic import command

            config = alembic_config()
            config.attributes["connection"] = conn
            command.upgrade(config, revision)
        with engine.connect() as conn:
            return before, current_revision(conn) or ""
    except SQLAlchemyError as exc:
        raise persistence_error(exc) from exc
    finally:
        engine.dispose()
        _listener.reset(listening)


def check_schema(conn: Connection, db: str, *, cannot_write: str | None = None) -> None:
    """Raise :class:`SchemaOutOfDate` unless the database is at the head revision (``unknown`` when
    its revision is none this installation has: a newer semkv-ledger migrated it). ``cannot_write``:
    why this process cannot write the ledger (a read-only audit), so the advice is not ``migrate``."""
    current = current_revision(conn)
    if current is None:  # tables but no revision: not SchemaOutOfDate, `migrate` cannot make it a ledger
        _refuse_foreign_tables(conn, db)
    if current != head_revision():
        raise SchemaOutOfDate(db, current, head_revision(), unknown=current is not None and not _known(current),
                              cannot_write=cannot_write)


def _refuse_foreign_tables(conn: Connection, db: str) -> None:
    """Refuse a database without a ledger revision that holds tables: a ``replay --out`` file
    (projections only), another application's database, or a ledger whose version table was lost.
    ``migrate`` creates a ledger only in an empty database (all migrations run in one transaction,
    so a failed one leaves no tables behind).

    Raises:
        LedgerError: naming the tables found.
    """
    tables = sorted(sa_inspect(conn).get_table_names())
    if not tables:
        return
    where = url_for_humans(db)
    if "blocks" in tables and "log" not in tables:
        raise LedgerError(f"{where} holds projection tables and no log (a `replay --out` file?): it is not a ledger "
                          "and cannot be migrated into one; read it with sqlite3")
    shown = ", ".join(tables[:4]) + (f" and {len(tables) - 4} more" if len(tables) > 4 else "")
    raise LedgerError(f"{where} holds tables ({shown}) and no ledger schema version: semkv-ledger creates a ledger "
                      "only in an empty database; give a new file or database")


@cache
def _known_revisions() -> frozenset[str]:
    from alembic.script import ScriptDirectory

    return frozenset(script.revision for script in ScriptDirectory.from_config(alembic_config()).walk_revisions())


def _known(revision: str) -> bool:
    return revision in _known_revisions()


def refuse_missing_ledger_file(db: str) -> None:
    """Refuse a SQLite ledger path that names no file before anything opens it: SQLite would create
    an empty file, which is no ledger (the schema check refuses it) and would stay behind the
    refusal (``consume`` without ``--migrate``; ``migrate`` creates the file on purpose).

    Raises:
        SchemaOutOfDate: no file there (run ``semkv-ledger migrate``, or start with ``--migrate``).
        LedgerError: its directory does not exist either (a mistyped path), or the URL is unsupported.
    """
    if not backend_of(db).ledger_exists(normalize_url(db)):
        raise SchemaOutOfDate(db, None, head_revision())
