"""log_no_truncate: TRUNCATE is refused on the log of a PostgreSQL ledger, as UPDATE and DELETE are

0001's trigger fires per row (``BEFORE UPDATE OR DELETE ... FOR EACH ROW``), which ``TRUNCATE`` never
fires: ``TRUNCATE log`` emptied a PostgreSQL ledger's log (found by a newcomer's try; ``replay`` then
reported the projections differ from the empty log). A statement-level ``BEFORE TRUNCATE`` trigger on the
same function refuses it (PostgreSQL documentation, CREATE TRIGGER: "TRUNCATE ... statement-level
triggers"). SQLite has no TRUNCATE statement: its ``DELETE FROM log`` without a WHERE clause still fires
0001's triggers (SQLite skips its truncate optimization for tables with triggers), so nothing changes
there. Projection snapshots taken at 0006 are not used at 0007 (``ledger.snapshot``: a snapshot serves its
own revision); take a new one with ``semkv-ledger snapshot``.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05 18:05:00
"""
from alembic import op


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("CREATE TRIGGER log_no_truncate BEFORE TRUNCATE ON log "
                   "FOR EACH STATEMENT EXECUTE FUNCTION semkv_log_append_only()")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS log_no_truncate ON log")
