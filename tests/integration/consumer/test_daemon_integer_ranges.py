"""A running ``semkv-ledger consume`` fed every integer field of every dialect at its boundaries
over real ZMQ, on a real SQLite file and the real PostgreSQL server (issue 18, defect 1).

Before: one well-formed event with ``lora_id`` = 2**63 (dialect b) made the daemon exit 1
(``OverflowError: Python int too large to convert to SQLite INTEGER``; asyncpg "out of int64
range"), and the engine's replay buffer handed it back at every restart. Here the daemon must never
exit, each event must be either logged or a dead letter of its own (its siblings logged), a value
the columns can hold must be logged (the database took it), and no event may reach the database's
refusal net (``refused_by_ledger``): the decoder's bounds must be the columns' own.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.migrate import upgrade
from tests.conftest import create_pg_database, drop_pg_database, require_pg
from tests.integration.consumer.daemon_support import RunningConsumer
from tests.wire_fields import BOUNDARIES, FIELDS, U64_MAX, Field, batch_of, good_event

pytestmark = pytest.mark.slow
HASH_FIELDS = {"block_hash", "parent_hash", "parent_block_hash", "removed_hash"}


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def consumer(request, tmp_path_factory) -> Iterator[RunningConsumer]:
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "sqlite":
        db, drop = f"sqlite:///{tmp / 'ledger.db'}", None
    else:
        require_pg()
        db = drop = create_pg_database()
    upgrade(db)
    running = RunningConsumer(db, tmp / "consume.log")
    try:
        yield running
        assert running.proc.poll() is None, "the daemon exited"
    finally:
        running.close()
        if drop:
            drop_pg_database(drop)


def check(consumer: RunningConsumer, field: Field, value: int) -> None:
    events, rank = batch_of(field, value, good_event(field.dialect))
    kinds, letters = consumer.outcome(consumer.send(events, rank))
    assert "refused_by_ledger" not in letters.values(), (field.name, value, letters)
    if field.batch_level:
        if field.valid(value):
            assert (len(kinds), letters) == (1, {}), (field.name, value)
        else:
            assert (kinds, letters) == ({}, {None: "value_out_of_range"}), (field.name, value)
        return
    assert sorted([*kinds, *letters]) == [0, 1, 2], (field.name, value, kinds, letters)  # each event once
    assert 0 in kinds and 2 in kinds  # the siblings were logged
    if field.valid(value) and not field.structural:
        assert 1 in kinds, (field.name, value, letters)  # the database held it
    elif not field.valid(value):
        expected = "hash_out_of_range" if field.name in HASH_FIELDS else "value_out_of_range"
        assert letters == {1: expected}, (field.name, value, letters)


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f"{f.dialect}-{f.name}")
def test_every_boundary_of_every_field_is_logged_or_a_dead_letter_and_the_daemon_stays_up(consumer, field):
    for value in BOUNDARIES:
        check(consumer, field, value)


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(field=st.sampled_from(FIELDS),
       value=st.one_of(st.sampled_from(BOUNDARIES), st.integers(-(2**63), U64_MAX),
                       st.sampled_from(BOUNDARIES).flatmap(lambda b: st.integers(max(-(2**63), b - 2),
                                                                                min(U64_MAX, b + 2)))))
def test_any_integer_anywhere_never_stops_the_daemon(consumer, field, value):
    check(consumer, field, value)
