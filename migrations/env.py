"""Alembic environment for the semkv-ledger schema (SQLite and PostgreSQL from the same revisions).

Run through ``semkv-ledger migrate --db URL`` (which passes an open connection in
``config.attributes["connection"]``) or plain ``alembic -x db=URL upgrade head`` from the repo root.
SQLite gets ``render_as_batch=True`` so later ALTERs work (alembic batch.html).
"""

from __future__ import annotations

from alembic import context

from ledger.db import sync_engine
from ledger.schema import Base

target_metadata = Base.metadata
config = context.config


def _configure_and_run(connection) -> None:  # noqa: ANN001
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure_and_run(connection)
        return
    db = context.get_x_argument(as_dictionary=True).get("db") or config.get_main_option("sqlalchemy.url")
    engine = sync_engine(db, writer=True)
    try:
        with engine.connect() as conn:
            _configure_and_run(conn)
            conn.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
