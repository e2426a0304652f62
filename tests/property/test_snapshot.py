"""A projection snapshot plus the log after it folds to the same projection as the whole log
(issue 23), on random engine histories (the generator of test_ledger_interleavings: stores,
removals, updates, engine restarts and cache clears, with lost, duplicated and reordered batches)
and on a ledger with donors and leases; snapshots are stored in and read back from the real table.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger import events as ev
from ledger.client import LedgerClient
from ledger.writes import Lease
from ledger.db import sync_engine
from ledger.migrate import current_revision, upgrade
from ledger.replay import rebuild, replay, snapshot_at_head
from ledger.snapshot import from_projection, latest_snapshot, save_snapshot
from tests.property.test_ledger_interleavings import build, histories
from tools.harness.builders import batch, created, record, removed, stored


@pytest.fixture(scope="module")
def template_db(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tpl") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


def feed(db: str, arrived: list) -> None:
    record(db, *([b] for b in arrived))


def encoded(proj, seq: int) -> bytes:
    return msgspec.msgpack.encode(from_projection(proj, seq))


def assert_snapshot_plus_tail_is_the_whole_fold(db: str, split: int) -> None:
    engine = sync_engine(db, writer=True)
    try:
        with engine.connect() as conn:
            whole, _, head = rebuild(conn)
            split = min(split, head)
            at_split, _, _ = rebuild(conn, split)
            revision = current_revision(conn)
            conn.rollback()
        with engine.begin() as conn:
            save_snapshot(conn, from_projection(at_split, split), revision)
        with engine.connect() as conn:
            start = latest_snapshot(conn, revision, split)
            assert start is not None and start.seq == split
            resumed, folded, last = rebuild(conn, start=start)
    finally:
        engine.dispose()
    assert folded == head - split and last == head
    assert encoded(resumed, head) == encoded(whole, head)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=histories(), split=st.integers(min_value=0, max_value=60))
def test_a_snapshot_plus_the_log_after_it_folds_like_the_whole_log(template_db, history, split):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ledger.db"
        shutil.copy(template_db, path)
        db = f"sqlite:///{path}"
        feed(db, build(history))
        assert_snapshot_plus_tail_is_the_whole_fold(db, split)


def test_donors_and_leases_survive_a_snapshot_and_replay_until_starts_from_it(sqlite_db: str) -> None:
    feed(sqlite_db, [batch(0, created(), stored(1, 2, 3, event_id=1))])
    client = LedgerClient(sqlite_db)
    try:
        client.register_donor(ev.DonorRegistered(donor_id="d1", namespace="ns", engine_id="engine-a", generation=1,
                                                 content_keys=[b"k1", b"k2"], block_hashes=[1, 2], num_tokens=32,
                                                 tokens_per_block=16))
        client.mark_donor_saved("d1", store_ref="d1.kv", checksum="c" * 32, size_bytes=64)
        taken = snapshot_at_head(sqlite_db)
        lease = client.take_lease("d1", request_id="r1", holder="h", namespace="ns", num_blocks=2, ttl_s=60.0)
        assert isinstance(lease, Lease), lease
        feed(sqlite_db, [batch(1, removed(2, event_id=2))])
        assert client.release_lease(lease.lease_id, "finished")
    finally:
        client.close()
    assert taken.started_from == 0 and taken.folded == taken.seq and taken.size_bytes > 0 and not taken.already_there
    following = snapshot_at_head(sqlite_db)
    assert following.started_from == taken.seq and not following.already_there  # the next one folds from it
    again = snapshot_at_head(sqlite_db)  # nothing logged since: nothing written, and it says so
    assert again.already_there and again.seq == following.seq and again.folded == 0 and again.size_bytes == 0
    for split in range(taken.seq + 1):
        assert_snapshot_plus_tail_is_the_whole_fold(sqlite_db, split)
    report = replay(sqlite_db, until=taken.seq + 1)
    assert report.started_from == taken.seq and report.events == 1 and not report.compared
    full = replay(sqlite_db)
    assert full.started_from == 0 and full.equal  # the audit folds the whole log
