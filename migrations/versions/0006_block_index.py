"""block_index: block hash → log seq, kept behind the log by a follower, so that ``inspect block`` does not search the log

Two tables (ledger/schema.py ``BlockIndexRow``, ``IndexWatermarkRow``): ``block_index`` (one B-tree
of (bucket = seq >> 16, block_hash, seq) on SQLite, WITHOUT ROWID) and ``index_watermarks`` with the row
``('block_index', 0)``: nothing indexed yet. Nothing is backfilled here, so the upgrade takes no
time whatever the log's size (backfilling a 2M-row log inside a migration took 5 min 47 s at load
~11: tools/results/ledger-replay-2026-12-05.md §4): the follower of ``semkv-ledger consume`` and
``semkv-ledger index`` fill it from the log, and ``inspect block`` searches the log past the
watermark meanwhile, so its answers do not change. The writer is untouched.

Downgrade drops both tables.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05 06:00:00
"""
import sqlalchemy as sa
from alembic import op

from ledger.migrate import migration_progress


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with migration_progress("creating the block index (filled behind the log: semkv-ledger index)"):
        op.create_table(
            'block_index',
            sa.Column('bucket', sa.Integer(), autoincrement=False, nullable=False),
            sa.Column('block_hash', sa.BigInteger(), autoincrement=False, nullable=False),
            sa.Column('seq', sa.BigInteger(), autoincrement=False, nullable=False),
            sa.PrimaryKeyConstraint('bucket', 'block_hash', 'seq', name=op.f('pk_block_index')),
            sqlite_with_rowid=False,
        )
        watermarks = op.create_table(
            'index_watermarks',
            sa.Column('name', sa.String(length=40), nullable=False),
            sa.Column('seq', sa.BigInteger(), nullable=False),
            sa.PrimaryKeyConstraint('name', name=op.f('pk_index_watermarks')),
        )
        op.bulk_insert(watermarks, [{"name": "block_index", "seq": 0}])


def downgrade() -> None:
    op.drop_table('index_watermarks')
    op.drop_table('block_index')
