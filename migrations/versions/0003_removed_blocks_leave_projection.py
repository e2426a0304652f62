"""blocks: removed blocks leave the projection; one B-tree per block; projections rebuilt

From this revision a ``removed`` event deletes the block's row and a generation bump drops the
blocks an earlier bump quarantined (ledger/apply.py): the projection holds live and quarantined
blocks only. Counters change with it (a double removal is ``removed_unknown``, no longer
``removed_not_live``; an update of a removed block ``updated_unknown``). So that ``semkv-ledger
replay`` agrees with the live tables afterwards, this revision rebuilds every projection from the
log, exactly as replay does (``ledger.replay.rebuild`` + ``ledger.recorder.write_projection``); the log is
untouched. It takes as long as a replay of the log (tools/results/: ~50k log rows/s); to audit the
old projections, run ``semkv-ledger replay`` with the previous version before upgrading.

``ix_blocks_engine_state`` is dropped (every reader finds blocks by primary key) and, on SQLite,
the table is rebuilt ``WITHOUT ROWID`` so that a block is one B-tree entry instead of three
(ledger/schema.py ``BlockRow``).

Downgrade restores the table's shape only: the projections stay as this revision's rules made them,
which the older version's ``semkv-ledger replay`` reports as differences (it compares, it does not
rewrite; no older command rebuilds projections in place).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 05:30:00
"""
from alembic import op

from ledger.migrate import migration_progress
from ledger.recorder import write_projection
from ledger.replay import rebuild
from ledger.schema import PROJECTION_TABLES


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    bind = op.get_bind()
    sqlite = bind.dialect.name == "sqlite"
    with migration_progress("emptying the projections"):
        for table in reversed(PROJECTION_TABLES):  # children before parents
            bind.execute(table.delete())
    with op.batch_alter_table('blocks', recreate='always' if sqlite else 'auto',
                              table_kwargs={'sqlite_with_rowid': False}) as batch_op:
        batch_op.drop_index('ix_blocks_engine_state')
    # The projection code of the installed version: if a later revision changes a projection
    # table, this step must keep writing the tables as they are at this revision.
    with migration_progress("rebuilding projections from the log") as progress:
        projection, _, _ = rebuild(bind, progress=progress)
    with migration_progress("writing the rebuilt projections"):
        write_projection(bind, projection)


def downgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    with op.batch_alter_table('blocks', recreate='always' if sqlite else 'auto',
                              table_kwargs={'sqlite_with_rowid': True}) as batch_op:
        batch_op.create_index('ix_blocks_engine_state', ['engine_id', 'state'], unique=False)
