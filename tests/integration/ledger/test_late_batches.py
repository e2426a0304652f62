"""Late batches never resurrect, and a batch is logged once across source epochs (DESIGN §5; issue #18).

Each case feeds the recorder what the consumer passes on, decoded by the consumer's own decoder
from the wire in dialect (a) (TensorRT-LLM LLM-API dicts with ``event_id``) and (b) (vLLM maps
without one), on SQLite and PostgreSQL. The seen case: Stored(A) lost, Removed(A) applied, then
Stored(A) arriving late. Before the fix the late batch bumped the generation, opened a new source
epoch and was applied: A live, and the source position moved back to its seq.
"""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import select

from ledger import events as ev
from ledger.db import sync_engine
from ledger.schema import LogRow
from ledger.writer import LedgerWriter
from tests.engine_runs import DIALECTS, EngineRun, received
from tests.integration.ledger.suite import append, assert_replay_equal, counter, generation, state

ENGINE = "engine-a"
X, A, Y = 11, 2**64 - 7, 13  # A above 2**63 (dialect (a) sends unsigned 64-bit hashes)
_LOG = LogRow.__table__


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db(request) -> str:
    return request.getfixturevalue("sqlite_db" if request.param == "sqlite" else "postgres_db")


def batch_rows(db: str) -> list[tuple[int, int, int]]:
    """(source epoch, zmq seq, digest) of every batch_received row, in log order."""
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(_LOG.c.source_epoch, _LOG.c.zmq_seq, _LOG.c.body)
                                .where(_LOG.c.kind == "batch_received").order_by(_LOG.c.seq)).all()
    finally:
        engine.dispose()
    return [(r[0], r[1], ev.BODY_DECODER.decode(bytes(r[2])).digest) for r in rows]


def applied_at(db: str, zmq_seq: int) -> list[bool]:
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            return [bool(r[0]) for r in conn.execute(select(_LOG.c.applied).where(
                _LOG.c.zmq_seq == zmq_seq, _LOG.c.batch_index >= 0).order_by(_LOG.c.seq))]
    finally:
        engine.dispose()


def positions(db: str):
    async def read():
        writer = await LedgerWriter.open(db)
        try:
            return await writer.source_positions()
        finally:
            await writer.close()

    return list(asyncio.run(read()).values())


def lost_store_then_removal(dialect: str):
    """Frames of: 0 stores X, 1 stores A (lost on the wire), 2 removes A, 3 stores Y."""
    run = EngineRun(dialect)
    return run, [run.batch(("stored", [X])), run.batch(("stored", [A])), run.batch(("removed", [A])),
                 run.batch(("stored", [Y]))]


@pytest.mark.parametrize("dialect", DIALECTS)
def test_late_store_after_removal_is_logged_once_and_never_applied(db, dialect):
    _, (f0, f1, f2, f3) = lost_store_then_removal(dialect)
    append(db, received(f0))
    append(db, received(f2))  # 1 is missing: a gap, the generation is bumped
    assert generation(db) == 2 and state(db, A) is None

    # The consumer's replay proved that the engine did not restart: Stored(A) is a late batch.
    result = append(db, received(f1, late=True))
    assert (result.batches, result.stale_batches, result.events_stale, result.events_applied) == (1, 1, 1, 0)
    assert result.generation_bumps == 0 and generation(db) == 2
    assert state(db, A) is None  # not resurrected
    assert applied_at(db, 1) == [False]

    # The source position stayed at seq 2: the next batch is no gap, and a copy of the late batch
    # (re-sent, or passed on again after a consumer restart) is a duplicate.
    result = append(db, received(f3))
    assert (result.gaps, result.generation_bumps, result.events_applied) == (0, 0, 1)
    assert append(db, received(f1, late=True)).duplicate_batches == 1
    assert append(db, received(f1)).duplicate_batches == 1
    assert state(db, A) is None and state(db, Y) == "live"
    assert [(epoch, seq) for epoch, seq, _ in batch_rows(db)] == [(1, 0), (1, 2), (1, 1), (1, 3)]
    assert counter(db, "batches_stale") == 1 and counter(db, "events_stale") == 1
    [position] = positions(db)
    assert (position.epoch, position.last_seq, position.last_digest) == (1, 3, received(f3).digest)
    assert_replay_equal(db)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_late_store_without_the_consumers_proof_fails_closed_and_is_never_applied(db, dialect):
    """No replay endpoint: nobody proved that the engine did not restart, so the generation is
    bumped too, but the batch is still logged in the current epoch, stale."""
    _, (f0, f1, f2, f3) = lost_store_then_removal(dialect)
    append(db, received(f0), received(f2))
    result = append(db, received(f1))
    assert result.events_stale == 1 and result.events_applied == 0 and result.generation_bumps == 1
    assert generation(db) == 3 and counter(db, "generation_bumps.seq_reset") == 1
    assert state(db, A) is None
    assert append(db, received(f3)).gaps == 0
    assert state(db, A) is None and state(db, Y) == "live"
    assert [epoch for epoch, _, _ in batch_rows(db)] == [1, 1, 1, 1]
    assert_replay_equal(db)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_late_batch_of_a_run_the_ledger_moved_past_is_dead_lettered(db, dialect):
    """The consumer says ``late`` but the ledger holds another payload at that seq (one run sends
    one payload per seq): a batch of another run. Not logged as a batch (its seq is taken), not
    applied, the position unmoved: its events are dead letters."""
    run, (f0, f1, f2, f3) = lost_store_then_removal(dialect)
    append(db, received(f0), received(f1), received(f2))
    other = EngineRun(dialect)
    other.next_seq = 1
    stray = other.batch(("stored", [A]))
    result = append(db, received(stray, late=True))
    assert (result.batches, result.dead_letters, result.events_applied, result.generation_bumps) == (0, 1, 0, 0)
    assert state(db, A) is None
    assert counter(db, "dead_letters.late_from_another_run") == 1
    assert append(db, received(f3)).gaps == 0  # the position stayed at 2
    assert_replay_equal(db)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_copy_of_an_earlier_runs_batch_is_a_duplicate_not_a_restart(db, dialect):
    """After an engine restart (epoch 2), a copy of the first run's batch is recognised by
    (source, seq, digest) in the earlier epoch: not a third run, and never applied."""
    _, (f0, f1, f2, _) = lost_store_then_removal(dialect)
    append(db, received(f0), received(f1), received(f2))  # A stored, then removed
    second = EngineRun(dialect)
    append(db, received(second.batch(("stored", [Y]))), received(second.batch(("stored", [X]))))
    assert generation(db) == 2 and [e for e, _, _ in batch_rows(db)] == [1, 1, 1, 2, 2]
    for copy in (f1, f0):  # Stored(A) of the first run, re-sent
        result = append(db, received(copy))
        assert result.duplicate_batches == 1 and result.generation_bumps == 0
    assert generation(db) == 2 and state(db, A) is None
    assert len(batch_rows(db)) == 5
    assert_replay_equal(db)


def test_a_proven_restart_past_the_old_last_seq_opens_an_epoch_and_logs_the_gap(db):
    """The consumer proved a restart (``new_run``) and first heard of the new run at seq 5, past
    the old run's last seq 2: a new epoch, the gap [0, 5) logged, the batch applied."""
    _, (f0, f1, f2, _) = lost_store_then_removal("trt")
    append(db, received(f0), received(f1), received(f2))
    second = EngineRun("trt")
    second.next_seq = 5
    result = append(db, received(second.batch(("stored", [Y])), new_run=True))
    assert (result.gaps, result.generation_bumps, result.events_applied) == (1, 1, 1)
    assert counter(db, "gaps.seq_gap") == 1 and counter(db, "generation_bumps.seq_reset") == 1
    assert batch_rows(db)[-1][:2] == (2, 5)
    assert state(db, Y) == "live" and state(db, X) == "quarantined"
    assert_replay_equal(db)


def test_a_proven_restart_whose_batches_equal_an_earlier_runs_opens_an_epoch(db):
    """A run that publishes byte for byte what an earlier run did (a capture published again with
    ``semkv-ledger publish``): the consumer proved the restart (``new_run``), so its first batch
    opens a new epoch although (seq, digest) is logged in an earlier epoch. Before, it was dropped
    as that epoch's duplicate, the proof with it, and the next batches continued the old run:
    no bump, the old run's blocks live (newcomer finding, 2026-12-05)."""
    first = EngineRun("trt")
    frames = [first.batch(("stored", [X])), first.batch(("stored", [A]))]
    append(db, *(received(f) for f in frames))
    second = EngineRun("trt")
    append(db, received(second.batch(("stored", [Y]))), received(second.batch(("removed", [Y]))))
    assert generation(db) == 2
    result = append(db, received(frames[0], new_run=True), received(frames[1]))  # the first run, published again
    assert (result.duplicate_batches, result.generation_bumps) == (0, 1)
    assert generation(db) == 3 and [e for e, _, _ in batch_rows(db)] == [1, 1, 2, 2, 3, 3]
    assert state(db, X) == "live" and state(db, A) == "live"
    assert_replay_equal(db)
