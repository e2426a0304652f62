"""blocks: removed blocks leave the projection; one B-tree per block

From this revision a ``removed`` event deletes the block's row (ledger/apply.py): the projection
holds live and quarantined blocks only, bounded by the engines' KV capacity. Rows an earlier
version kept in state ``removed`` are deleted here, so that ``semkv-ledger replay`` (which rebuilds
the projection with the new rule) agrees with the live table; the log, which holds every removal,
is untouched. ``ix_blocks_engine_state`` is dropped (every reader finds blocks by primary key) and,
on SQLite, the table is rebuilt ``WITHOUT ROWID`` so that a block is one B-tree entry instead of
three (ledger/schema.py ``BlockRow``).

Downgrade restores the table's shape, not the deleted rows: they are derived data, and
``semkv-ledger replay`` under the older version rebuilds them from the log.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 05:30:00
"""
from alembic import op


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("DELETE FROM blocks WHERE state = 'removed'")
    sqlite = op.get_bind().dialect.name == "sqlite"
    with op.batch_alter_table('blocks', recreate='always' if sqlite else 'auto',
                              table_kwargs={'sqlite_with_rowid': False}) as batch_op:
        batch_op.drop_index('ix_blocks_engine_state')


def downgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    with op.batch_alter_table('blocks', recreate='always' if sqlite else 'auto',
                              table_kwargs={'sqlite_with_rowid': True}) as batch_op:
        batch_op.create_index('ix_blocks_engine_state', ['engine_id', 'state'], unique=False)
