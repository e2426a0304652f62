"""projection_snapshots: the fold's state at a log seq, so that time travel starts from it

A table of snapshots (ledger/snapshot.py): ``semkv-ledger snapshot`` writes one, ``replay --until``
starts from the newest usable one. Empty at first; nothing else changes.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 18:40:00
"""
import sqlalchemy as sa
from alembic import op


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'projection_snapshots',
        sa.Column('seq', sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column('revision', sa.String(length=32), nullable=False),
        sa.Column('taken_at', sa.Float(), nullable=False),
        sa.Column('body', sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint('seq', 'revision', name=op.f('pk_projection_snapshots')),
    )


def downgrade() -> None:
    op.drop_table('projection_snapshots')
