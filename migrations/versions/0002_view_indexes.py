"""indexes for the connector's donor view: donors by updated_seq, log by (kind, seq)

The scheduler's in-memory donor view (ledger/donor_view.py) polls what changed since the log seq it
reflects: donors whose ``updated_seq`` moved, and the removal rows of the log. On SQLite an index on
``kind`` already ends in the rowid (``seq``); PostgreSQL needs ``seq`` in the index itself.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 00:25:00
"""
from alembic import op


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('donors', schema=None) as batch_op:
        batch_op.create_index('ix_donors_updated_seq', ['updated_seq'], unique=False)
    with op.batch_alter_table('log', schema=None) as batch_op:
        batch_op.drop_index('ix_log_kind')
        batch_op.create_index('ix_log_kind_seq', ['kind', 'seq'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('log', schema=None) as batch_op:
        batch_op.drop_index('ix_log_kind_seq')
        batch_op.create_index('ix_log_kind', ['kind'], unique=False)
    with op.batch_alter_table('donors', schema=None) as batch_op:
        batch_op.drop_index('ix_donors_updated_seq')
