"""Property tests (DESIGN §9): any interleaving of created / stored / removed / updated /
AllBlocksCleared, with dropped, duplicated and reordered batches recorded 1 to 4 to a ledger
transaction, yields

1. live projections equal to a replay of the log, and
2. block states equal to a clean-room reference model of DESIGN §5 — in particular no block is
   live after its removal in event_id order, nothing learnt before a lost batch stays live, and a
   batch that arrives after its seq was declared lost is logged and never applied.

The reference model below is written independently of ``ledger.decide``/``ledger.apply`` (the
differential-harness habit of Dynamo's kv-router, STYLE §5). ``test_property_suite_catches_a_broken_apply``
proves the suite fails when ``apply`` is broken.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from ledger import apply as apply_module
from ledger.db import sync_engine
from ledger.migrate import upgrade
from ledger.replay import replay
from ledger.schema import BlockRow
from ledger.types import join_hash
from ledger.writer import LedgerWriter
from tools.harness.builders import batch, cleared, created, removed, stored, updated

HASHES = [1, 2, 3, 4, 5, 9622824665191806685, 2**64 - 1]


@pytest.fixture(scope="module")
def template_db(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tpl") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


# -- generated engine histories ------------------------------------------------------------------

op_strategy = st.one_of(
    st.tuples(st.just("stored"), st.lists(st.sampled_from(HASHES), min_size=1, max_size=3)),
    st.tuples(st.just("removed"), st.lists(st.sampled_from(HASHES), min_size=1, max_size=3)),
    st.tuples(st.just("updated"), st.sampled_from(HASHES)),
    st.tuples(st.just("created"), st.none()),
    st.tuples(st.just("cleared"), st.none()),
)
# What happens to each published batch on the way to the ledger.
delivery_strategy = st.sampled_from(["deliver", "deliver", "deliver", "drop", "duplicate", "swap"])


@st.composite
def histories(draw):
    batches = draw(st.lists(st.lists(op_strategy, min_size=1, max_size=4), min_size=1, max_size=10))
    deliveries = draw(st.lists(delivery_strategy, min_size=len(batches), max_size=len(batches)))
    skip_event_id = draw(st.lists(st.booleans(), min_size=len(batches), max_size=len(batches)))
    per_transaction = draw(st.integers(min_value=1, max_value=4))  # arrived batches per ledger transaction
    return batches, deliveries, skip_event_id, per_transaction


def build(history):
    """Published batches with consecutive seqs and event_ids (an event_id may be skipped, as when
    TensorRT-LLM's bounded buffer drops events), then the arrival order after faults."""
    batches, deliveries, skip_event_id = history[:3]
    published, event_id = [], 0
    for seq, ops in enumerate(batches):
        events = []
        for kind, arg in ops:
            if skip_event_id[seq] and not events:
                event_id += 1
            if kind == "created":
                events.append(created(event_id=0))
                event_id = 0
            elif kind == "cleared":
                events.append(cleared())
            elif kind == "stored":
                events.append(stored(*dict.fromkeys(arg), event_id=event_id))
            elif kind == "removed":
                events.append(removed(*arg, event_id=event_id))
            else:
                events.append(updated(arg, cache_level=(0, 1), event_id=event_id))
            event_id += 1
        published.append(batch(seq, *events))
    arrived = []
    for i, (b, how) in enumerate(zip(published, deliveries)):
        if how == "deliver":
            arrived.append(b)
        elif how == "duplicate":
            arrived += [b, b]
        elif how == "swap" and arrived:
            arrived.insert(len(arrived) - 1, b)
    return arrived


# -- the clean-room reference model ---------------------------------------------------------------

def reference(arrived):
    """hash -> state after the arrival sequence, per DESIGN §5 in the plainest terms. A removed
    block has no row (ledger.apply's module docstring), so it is absent here too."""
    blocks: dict = {}
    last_seq = last_event_id = None
    epochs: list[dict] = [{}]  # seq -> digest of what was logged, per source epoch (the last: current)
    continuous = False  # do we have an event_id baseline we trust?

    def lose_continuity():
        # what the previous loss quarantined is dropped; what is live now is quarantined
        nonlocal continuous, blocks
        blocks = {h: "quarantined" for h, s in blocks.items() if s == "live"}
        continuous = False

    for b in arrived:
        if last_seq is not None and b.seq <= last_seq:
            if any(logged.get(b.seq) == b.digest for logged in epochs[-17:]):
                continue  # duplicate (in this epoch or one of the 16 before)
            if b.seq not in epochs[-1]:
                # a late batch (its seq was declared lost): logged, never applied; without the
                # consumer's proof that the engine did not restart, continuity is lost (fail closed)
                epochs[-1][b.seq] = b.digest
                lose_continuity()
                continue
            lose_continuity()  # another payload at a seq we have: the engine restarted
            epochs.append({})
        elif last_seq is not None and b.seq > last_seq + 1:
            lose_continuity()
        last_seq = b.seq
        epochs[-1][b.seq] = b.digest
        for e in b.events:
            kind = type(e.body).__name__
            if kind == "EngineCreated":
                if continuous and last_event_id is not None:
                    lose_continuity()
            elif e.event_id is not None and continuous and last_event_id is not None:
                if e.event_id <= last_event_id:
                    lose_continuity()  # older event: recorded, not applied, and continuity is lost
                    continue
                if e.event_id > last_event_id + 1:
                    lose_continuity()
            if kind == "AllBlocksCleared":
                lose_continuity()
            if e.event_id is not None:
                last_event_id = e.event_id
                continuous = True
            if kind == "BlockStored":
                for blk in e.body.blocks:
                    blocks[blk.block_hash] = "live"
            elif kind == "BlockRemoved":
                for h in e.body.block_hashes:
                    blocks.pop(h, None)
    return blocks


def ledger_states(db: str) -> dict:
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(BlockRow.__table__)).all()
    finally:
        engine.dispose()
    return {join_hash(r.block_hash, r.block_hash_ext): r.state for r in rows}


def run_history(template_db: Path, history) -> None:
    arrived = build(history)
    per_transaction = history[3] if len(history) > 3 else 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ledger.db"
        shutil.copy(template_db, path)
        db = f"sqlite:///{path}"

        async def feed():
            writer = await LedgerWriter.open(db)
            try:
                for start in range(0, len(arrived), per_transaction):
                    await writer.append(arrived[start:start + per_transaction])
            finally:
                await writer.close()

        asyncio.run(feed())
        report = replay(db)
        assert report.equal, [(d.table, d.totals) for d in report.diffs if d.count]
        assert ledger_states(db) == reference(arrived)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=histories())
def test_projections_equal_replay_and_reference_model(template_db, history):
    run_history(template_db, history)


def test_property_suite_catches_a_broken_apply(template_db, monkeypatch):
    # Self-test: an apply that forgets removals must be caught by the same property.
    monkeypatch.setitem(apply_module._HANDLERS, apply_module.ev.BlockRemoved, lambda proj, entry, body: None)
    history = ([[("stored", [1])], [("removed", [1])]], ["deliver", "deliver"], [False, False])
    with pytest.raises(AssertionError):
        run_history(template_db, history)
