"""Alembic revisions (``ledger.migrations.versions`` when installed); Alembic skips this file."""
