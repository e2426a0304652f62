"""initial ledger schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-29 17:53:12.521544
"""
from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('blocks',
    sa.Column('engine_id', sa.String(length=200), nullable=False),
    sa.Column('attention_dp_rank', sa.Integer(), nullable=False),
    sa.Column('window_size', sa.Integer(), nullable=False),
    sa.Column('block_hash', sa.BigInteger(), nullable=False),
    sa.Column('block_hash_ext', sa.LargeBinary(), nullable=False),
    sa.Column('parent_hash', sa.BigInteger(), nullable=True),
    sa.Column('parent_hash_ext', sa.LargeBinary(), nullable=True),
    sa.Column('num_tokens', sa.Integer(), nullable=False),
    sa.Column('tokens_digest', sa.BigInteger(), nullable=False),
    sa.Column('cache_level', sa.Integer(), nullable=True),
    sa.Column('priority', sa.Integer(), nullable=True),
    sa.Column('cache_salt', sa.String(length=400), nullable=True),
    sa.Column('lora_id', sa.BigInteger(), nullable=True),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('generation', sa.BigInteger(), nullable=False),
    sa.Column('store_count', sa.Integer(), nullable=False),
    sa.Column('stored_seq', sa.BigInteger(), nullable=False),
    sa.Column('updated_seq', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('engine_id', 'attention_dp_rank', 'window_size', 'block_hash', 'block_hash_ext', name=op.f('pk_blocks'))
    )
    with op.batch_alter_table('blocks', schema=None) as batch_op:
        batch_op.create_index('ix_blocks_engine_state', ['engine_id', 'state'], unique=False)

    op.create_table('counters',
    sa.Column('engine_id', sa.String(length=200), nullable=False),
    sa.Column('name', sa.String(length=80), nullable=False),
    sa.Column('value', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('engine_id', 'name', name=op.f('pk_counters'))
    )
    op.create_table('dead_letters',
    sa.Column('log_seq', sa.BigInteger(), autoincrement=False, nullable=False),
    sa.Column('source_id', sa.String(length=400), nullable=False),
    sa.Column('engine_id', sa.String(length=200), nullable=False),
    sa.Column('reason', sa.String(length=40), nullable=False),
    sa.Column('detail', sa.String(length=2000), nullable=False),
    sa.Column('zmq_seq', sa.BigInteger(), nullable=True),
    sa.Column('batch_index', sa.Integer(), nullable=True),
    sa.PrimaryKeyConstraint('log_seq', name=op.f('pk_dead_letters'))
    )
    op.create_table('donor_blocks',
    sa.Column('donor_id', sa.String(length=200), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.Column('content_key', sa.LargeBinary(), nullable=False),
    sa.Column('block_hash', sa.BigInteger(), nullable=False),
    sa.Column('block_hash_ext', sa.LargeBinary(), nullable=False),
    sa.PrimaryKeyConstraint('donor_id', 'position', name=op.f('pk_donor_blocks'))
    )
    with op.batch_alter_table('donor_blocks', schema=None) as batch_op:
        batch_op.create_index('ix_donor_blocks_content_key', ['content_key'], unique=False)

    op.create_table('donors',
    sa.Column('donor_id', sa.String(length=200), nullable=False),
    sa.Column('namespace', sa.String(length=128), nullable=False),
    sa.Column('engine_id', sa.String(length=200), nullable=False),
    sa.Column('attention_dp_rank', sa.Integer(), nullable=False),
    sa.Column('window_size', sa.Integer(), nullable=False),
    sa.Column('generation', sa.BigInteger(), nullable=False),
    sa.Column('num_tokens', sa.BigInteger(), nullable=False),
    sa.Column('num_blocks', sa.Integer(), nullable=False),
    sa.Column('tokens_per_block', sa.Integer(), nullable=False),
    sa.Column('provider_generation', sa.BigInteger(), nullable=False),
    sa.Column('expires_at', sa.Float(), nullable=True),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('store_ref', sa.String(length=1000), nullable=True),
    sa.Column('checksum', sa.String(length=128), nullable=True),
    sa.Column('size_bytes', sa.BigInteger(), nullable=True),
    sa.Column('registered_seq', sa.BigInteger(), nullable=False),
    sa.Column('updated_seq', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('donor_id', name=op.f('pk_donors'))
    )
    with op.batch_alter_table('donors', schema=None) as batch_op:
        batch_op.create_index('ix_donors_engine_state', ['engine_id', 'state'], unique=False)

    op.create_table('engines',
    sa.Column('engine_id', sa.String(length=200), nullable=False),
    sa.Column('generation', sa.BigInteger(), nullable=False),
    sa.Column('status', sa.String(length=20), nullable=False),
    sa.Column('registered_seq', sa.BigInteger(), nullable=False),
    sa.Column('generation_seq', sa.BigInteger(), nullable=False),
    sa.Column('last_seq', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('engine_id', name=op.f('pk_engines'))
    )
    op.create_table('leases',
    sa.Column('lease_id', sa.String(length=200), nullable=False),
    sa.Column('donor_id', sa.String(length=200), nullable=False),
    sa.Column('request_id', sa.String(length=200), nullable=False),
    sa.Column('holder', sa.String(length=200), nullable=False),
    sa.Column('expires_at', sa.Float(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('release_reason', sa.String(length=64), nullable=True),
    sa.Column('taken_seq', sa.BigInteger(), nullable=False),
    sa.Column('released_seq', sa.BigInteger(), nullable=True),
    sa.PrimaryKeyConstraint('lease_id', name=op.f('pk_leases'))
    )
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.create_index('ix_leases_donor_state', ['donor_id', 'state'], unique=False)

    op.create_table('log',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=False, nullable=False),
    sa.Column('committed_at', sa.Float(), nullable=False),
    sa.Column('kind', sa.String(length=40), nullable=False),
    sa.Column('type_name', sa.String(length=64), nullable=False),
    sa.Column('engine_id', sa.String(length=200), nullable=True),
    sa.Column('source_id', sa.String(length=400), nullable=True),
    sa.Column('source_epoch', sa.Integer(), nullable=True),
    sa.Column('zmq_seq', sa.BigInteger(), nullable=True),
    sa.Column('batch_index', sa.Integer(), nullable=True),
    sa.Column('event_id', sa.BigInteger(), nullable=True),
    sa.Column('attention_dp_rank', sa.Integer(), nullable=True),
    sa.Column('window_size', sa.Integer(), nullable=True),
    sa.Column('applied', sa.Boolean(), nullable=False),
    sa.Column('body', sa.LargeBinary(), nullable=False),
    sa.Column('payload', sa.LargeBinary(), nullable=True),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_log')),
    sa.UniqueConstraint('source_id', 'source_epoch', 'zmq_seq', 'batch_index', name=op.f('uq_log_source_id_source_epoch_zmq_seq_batch_index'))
    )
    with op.batch_alter_table('log', schema=None) as batch_op:
        batch_op.create_index('ix_log_engine_seq', ['engine_id', 'seq'], unique=False)
        batch_op.create_index('ix_log_kind', ['kind'], unique=False)

    op.create_table('sources',
    sa.Column('source_id', sa.String(length=400), nullable=False),
    sa.Column('engine_id', sa.String(length=200), nullable=False),
    sa.Column('epoch', sa.Integer(), nullable=False),
    sa.Column('last_seq', sa.BigInteger(), nullable=False),
    sa.Column('last_ts', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('source_id', name=op.f('pk_sources'))
    )
    op.create_table('streams',
    sa.Column('engine_id', sa.String(length=200), nullable=False),
    sa.Column('attention_dp_rank', sa.Integer(), nullable=False),
    sa.Column('window_size', sa.Integer(), nullable=False),
    sa.Column('last_event_id', sa.BigInteger(), nullable=True),
    sa.Column('resync', sa.Boolean(), nullable=False),
    sa.PrimaryKeyConstraint('engine_id', 'attention_dp_rank', 'window_size', name=op.f('pk_streams'))
    )


    _forbid_log_changes()


def _forbid_log_changes() -> None:
    """The log is append-only (DESIGN §5): the database itself refuses UPDATE and DELETE on it."""
    if op.get_bind().dialect.name == "sqlite":
        for verb in ("UPDATE", "DELETE"):
            op.execute(f"CREATE TRIGGER log_no_{verb.lower()} BEFORE {verb} ON log "
                       "BEGIN SELECT RAISE(ABORT, 'the ledger log is append-only'); END")
        return
    op.execute("CREATE FUNCTION semkv_log_append_only() RETURNS trigger LANGUAGE plpgsql AS $$ "
               "BEGIN RAISE EXCEPTION 'the ledger log is append-only'; END $$")
    op.execute("CREATE TRIGGER log_append_only BEFORE UPDATE OR DELETE ON log "
               "FOR EACH ROW EXECUTE FUNCTION semkv_log_append_only()")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS log_append_only ON log")
        op.execute("DROP FUNCTION IF EXISTS semkv_log_append_only()")
    op.drop_table('streams')
    op.drop_table('sources')
    with op.batch_alter_table('log', schema=None) as batch_op:
        batch_op.drop_index('ix_log_kind')
        batch_op.drop_index('ix_log_engine_seq')

    op.drop_table('log')
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.drop_index('ix_leases_donor_state')

    op.drop_table('leases')
    op.drop_table('engines')
    with op.batch_alter_table('donors', schema=None) as batch_op:
        batch_op.drop_index('ix_donors_engine_state')

    op.drop_table('donors')
    with op.batch_alter_table('donor_blocks', schema=None) as batch_op:
        batch_op.drop_index('ix_donor_blocks_content_key')

    op.drop_table('donor_blocks')
    op.drop_table('dead_letters')
    op.drop_table('counters')
    with op.batch_alter_table('blocks', schema=None) as batch_op:
        batch_op.drop_index('ix_blocks_engine_state')

    op.drop_table('blocks')
