"""A restart the consumer reported before the new run published anything is bumped once (issue #22).

The consumer's idle probe proves an idle engine restarted (its replay buffer no longer holds the
last batch) and reports it (``GapReport`` with reason ``seq_reset``): the ledger bumps now. The new
run's first batch then comes ``new_run`` with ``restart_logged``: a new source epoch without a
second bump, unless the engine applied events meanwhile (another source of it), in which case
the bump happens as for any new run (fail closed).
"""

from __future__ import annotations

import msgspec
import pytest

from ledger import events as ev
from ledger.types import GenerationReason
from tests.engine_runs import DIALECTS, EngineRun, received
from tests.integration.ledger.suite import ENGINE, append, assert_replay_equal, counter, generation, state

SOURCE = f"{ENGINE}@tcp://127.0.0.1:5557"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db(request) -> str:
    return request.getfixturevalue("sqlite_db" if request.param == "sqlite" else "postgres_db")


def reported(last_seq: int) -> ev.GapReport:
    return ev.GapReport(SOURCE, ENGINE, last_seq + 1, 0, GenerationReason.SEQ_RESET)


def first_of_new_run(frames: list[bytes], source_id: str = SOURCE) -> ev.ReceivedBatch:
    return msgspec.structs.replace(received(frames, ENGINE, source_id, new_run=True), restart_logged=True)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_reported_restart_is_bumped_once(db, dialect):
    old = EngineRun(dialect)
    append(db, *(received(old.batch(("stored", [10 + i])), ENGINE, SOURCE) for i in range(3)))
    append(db, reported(2))
    assert generation(db) == 2 and state(db, 10) == "quarantined"
    new = EngineRun(dialect)
    append(db, first_of_new_run(new.batch(("stored", [99]))), received(new.batch(("stored", [98])), ENGINE, SOURCE))
    assert generation(db) == 2 and state(db, 99) == "live" and state(db, 98) == "live"
    assert counter(db, "generation_bumps.seq_reset") == 1
    assert_replay_equal(db)


def test_a_reported_restart_is_bumped_again_when_the_engine_was_trusted_meanwhile(db):
    old = EngineRun("vllm")
    append(db, *(received(old.batch(("stored", [10 + i])), ENGINE, SOURCE) for i in range(3)))
    append(db, reported(2))
    other = EngineRun("vllm")  # a second source of the same engine applies an event: active again
    append(db, received(other.batch(("stored", [50])), ENGINE, f"{ENGINE}@tcp://127.0.0.1:5600"))
    append(db, first_of_new_run(EngineRun("vllm").batch(("stored", [99]))))
    assert generation(db) == 3 and counter(db, "generation_bumps.seq_reset") == 2
    assert state(db, 50) == "quarantined" and state(db, 99) == "live"
    assert_replay_equal(db)
