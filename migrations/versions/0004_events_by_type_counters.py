"""counters: engine events by type name, so that ``stats`` does not scan the log

From this revision the fold counts each engine event under ``events_type:<type_name>`` beside
``events_logged`` (ledger/apply.py ``EVENTS_OF_TYPE``), and ``semkv-ledger stats`` reads its events
by type from those counters instead of grouping the whole log (3.5 s on a 2M-row ledger). This
revision writes the counters for the log so far with one grouped query over the log's engine events
(the rows the fold counts: an engine id and one of the engine event kinds); counters of that prefix
already there (a rebuild by revision 0003, which runs the installed fold) are replaced, so both
paths leave the same rows. The log is untouched.

Downgrade deletes the counters of that prefix.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 18:10:00
"""
import sqlalchemy as sa
from alembic import op

from ledger.migrate import migration_progress


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

PREFIX = "events_type:"
# The engine event kinds the fold counts (ledger/apply.py _ENGINE_BODIES), as this revision knows them.
ENGINE_EVENT_KINDS = ("engine_created", "block_stored", "block_removed", "block_updated", "all_blocks_cleared")

log = sa.table("log", sa.column("engine_id", sa.String), sa.column("kind", sa.String),
               sa.column("type_name", sa.String))
counters = sa.table("counters", sa.column("engine_id", sa.String), sa.column("name", sa.String),
                    sa.column("value", sa.BigInteger))


def upgrade() -> None:
    bind = op.get_bind()
    with migration_progress("counting the log's engine events by type"):
        bind.execute(counters.delete().where(counters.c.name.startswith(PREFIX, autoescape=True)))
        by_type = (sa.select(log.c.engine_id, sa.literal(PREFIX) + log.c.type_name, sa.func.count())
                   .where(log.c.engine_id.is_not(None), log.c.kind.in_(ENGINE_EVENT_KINDS))
                   .group_by(log.c.engine_id, log.c.type_name))
        bind.execute(counters.insert().from_select(["engine_id", "name", "value"], by_type))


def downgrade() -> None:
    op.get_bind().execute(counters.delete().where(counters.c.name.startswith(PREFIX, autoescape=True)))
