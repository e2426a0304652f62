"""The recorder contract: one suite, run against every backend (STYLE §1).

Each test names the DESIGN §5 rule (or §2 safety rule) it pins. Subclasses provide the ``db``
fixture: a migrated scratch ledger on SQLite (``test_sqlite.py``) or PostgreSQL (``test_postgres.py``).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy import select, text

from ledger import events as ev
from ledger.db import sync_engine
from ledger.errors import EventRejected
from ledger.donor_view import DonorView
from ledger import reads as reads_module
from ledger.client import FreshnessMemo, LedgerClient
from ledger.replay import replay
from ledger.schema import BlockRow, CounterRow, EngineRow, LogRow
from ledger.types import BlockState, DonorState, FreshnessPolicy, GenerationReason, StaleReason, join_hash, split_hash
from ledger.writer import LedgerWriter
from tools.harness.builders import batch, cleared, created, removed, stored, updated

ENGINE = "engine-a"


def append(db: str, *items, now: float | None = None):
    async def run():
        writer = await LedgerWriter.open(db)
        try:
            return await writer.append(list(items), now=now)
        finally:
            await writer.close()

    return asyncio.run(run())


def blocks(db: str, engine_id: str = ENGINE) -> dict:
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(BlockRow.__table__).where(BlockRow.__table__.c.engine_id == engine_id)).all()
    finally:
        engine.dispose()
    return {join_hash(r.block_hash, r.block_hash_ext): r._asdict() for r in rows}


def state(db: str, block_hash) -> str | None:
    row = blocks(db).get(block_hash)
    return None if row is None else row["state"]


def scalar(db: str, query):
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            return conn.execute(query).scalar()
    finally:
        engine.dispose()


def counter(db: str, name: str, engine_id: str = ENGINE) -> int:
    table = CounterRow.__table__
    return scalar(db, select(table.c.value).where(table.c.engine_id == engine_id, table.c.name == name)) or 0


def generation(db: str, engine_id: str = ENGINE) -> int:
    return scalar(db, select(EngineRow.__table__.c.generation).where(EngineRow.__table__.c.engine_id == engine_id))


def assert_replay_equal(db: str) -> None:
    report = replay(db)
    assert report.equal, [(d.table, d.totals, d.changed[:2], d.only_in_live[:2], d.only_in_replay[:2])
                          for d in report.diffs if d.count]


class RecorderContract:
    """Subclass and provide a ``db`` fixture."""

    # -- log ------------------------------------------------------------------------------------

    def test_log_keeps_original_payload_bytes(self, db):
        event = stored(11, event_id=1)
        append(db, batch(0, created(), event))
        payload = scalar(db, select(LogRow.__table__.c.payload).where(LogRow.__table__.c.kind == "block_stored"))
        assert bytes(payload) == event.raw

    def test_log_is_append_only_in_the_database(self, db):
        append(db, batch(0, created()))
        engine = sync_engine(db)
        try:
            statements = ["UPDATE log SET kind = 'x'", "DELETE FROM log"]
            if engine.dialect.name == "postgresql":  # a row trigger never fires on TRUNCATE (migration 0007)
                statements += ["TRUNCATE log", "TRUNCATE log CASCADE"]
            for statement in statements:
                with pytest.raises(Exception, match="append-only"):
                    with engine.begin() as conn:
                        conn.execute(text(statement))
        finally:
            engine.dispose()
        assert scalar(db, select(LogRow.__table__.c.kind).where(LogRow.__table__.c.seq == 1)) == "engine_registered"

    def test_every_event_logged_exactly_once_with_global_seq(self, db):
        append(db, batch(0, created(), stored(1, 2, event_id=1)), batch(1, removed(1, event_id=2)))
        seqs = [r for r in _all(db, select(LogRow.__table__.c.seq).order_by(LogRow.__table__.c.seq))]
        assert seqs == list(range(1, len(seqs) + 1))
        kinds = _all(db, select(LogRow.__table__.c.type_name).where(LogRow.__table__.c.batch_index >= 0))
        assert kinds == ["created", "stored", "removed"]

    # -- idempotency (DESIGN §5) -----------------------------------------------------------------

    def test_duplicate_batch_is_a_noop(self, db):
        first = batch(0, created(), stored(1, event_id=1))
        append(db, first)
        rows_before = scalar(db, _count())
        result = append(db, first)
        assert result.duplicate_batches == 1 and result.events_applied == 0
        assert scalar(db, _count()) == rows_before
        assert generation(db) == 1

    # -- per-stream event_id order ---------------------------------------------------------------

    def test_older_event_id_is_logged_not_applied(self, db):
        # A late Stored(A) must not resurrect A after Removed(A) (DESIGN §5).
        append(db, batch(0, created(), stored(7, event_id=1), removed(7, event_id=2)))
        result = append(db, batch(1, stored(7, event_id=1)))
        assert result.events_stale == 1
        assert state(db, 7) is None  # removed: the block left the projection
        assert counter(db, "events_stale") == 1
        # ...and, since it may be a restart whose `created` was lost, continuity is declared lost.
        assert generation(db) == 2 and counter(db, "gaps.event_id_regression") == 1
        applied = _all(db, select(LogRow.__table__.c.applied).where(LogRow.__table__.c.zmq_seq == 1,
                                                                    LogRow.__table__.c.batch_index == 0))
        assert applied == [False]

    def test_event_id_jump_bumps_generation_and_quarantines(self, db):
        append(db, batch(0, created(), stored(1, 2, event_id=1)))
        result = append(db, batch(1, stored(3, event_id=5)))
        assert result.gaps == 1 and generation(db) == 2
        assert state(db, 1) == state(db, 2) == BlockState.QUARANTINED
        assert state(db, 3) == BlockState.LIVE and blocks(db)[3]["generation"] == 2
        assert counter(db, "gaps.event_id_gap") == 1

    # -- gaps, restarts, generations --------------------------------------------------------------

    def test_seq_gap_bumps_generation_and_quarantines(self, db):
        append(db, batch(0, stored(1)))
        result = append(db, batch(3, stored(2)))
        assert result.gaps == 1 and generation(db) == 2
        assert state(db, 1) == BlockState.QUARANTINED and state(db, 2) == BlockState.LIVE
        assert counter(db, "generation_bumps.seq_gap") == 1

    def test_seq_reset_is_a_restart(self, db):
        append(db, batch(0, stored(1)), batch(1, stored(2)))
        result = append(db, batch(0, stored(1), ts=99.0))
        assert result.generation_bumps == 1 and generation(db) == 2
        assert counter(db, "generation_bumps.seq_reset") == 1
        assert state(db, 1) == BlockState.LIVE and blocks(db)[1]["generation"] == 2
        assert state(db, 2) == BlockState.QUARANTINED

    def test_created_on_known_stream_is_a_restart(self, db):
        append(db, batch(0, created(), stored(1, event_id=1)))
        append(db, batch(1, created(0), stored(2, event_id=1)))
        assert generation(db) == 2 and counter(db, "generation_bumps.created") == 1
        assert state(db, 1) == BlockState.QUARANTINED and state(db, 2) == BlockState.LIVE

    def test_created_per_window_after_restart_bumps_once(self, db):
        append(db, batch(0, created(window_size=128), created(window_size=4096),
                         stored(1, event_id=1, window_size=128)))
        append(db, batch(1, created(window_size=128), created(window_size=4096)))
        assert generation(db) == 2

    def test_all_blocks_cleared_bumps_and_quarantines(self, db):
        append(db, batch(0, stored(1, 2)))
        append(db, batch(1, cleared(), stored(3)))
        assert generation(db) == 2 and counter(db, "generation_bumps.all_blocks_cleared") == 1
        assert state(db, 1) == BlockState.QUARANTINED and state(db, 3) == BlockState.LIVE

    def test_block_stored_again_is_live_in_new_generation(self, db):
        append(db, batch(0, stored(1)))
        append(db, batch(1, cleared()))
        append(db, batch(2, stored(1)))
        row = blocks(db)[1]
        assert row["state"] == BlockState.LIVE and row["generation"] == 2

    def test_gap_report_bumps(self, db):
        append(db, batch(0, stored(1)))
        append(db, ev.GapReport(source_id="s", engine_id=ENGINE, from_seq=1, to_seq=1,
                                reason="consumer_resume"))
        assert generation(db) == 2 and state(db, 1) == BlockState.QUARANTINED

    # -- block semantics -------------------------------------------------------------------------

    def test_updated_moves_cache_level_and_priority(self, db):
        append(db, batch(0, stored(1, cache_level=0, priority=35)))
        append(db, batch(1, updated(1, cache_level=(0, 1), priority=(35, 80))))
        row = blocks(db)[1]
        assert (row["cache_level"], row["priority"], row["state"]) == (1, 80, BlockState.LIVE)

    def test_removed_unknown_block_is_logged_and_counted(self, db):
        append(db, batch(0, removed(424242)))
        assert counter(db, "removed_unknown") == 1
        assert scalar(db, _count().where(LogRow.__table__.c.kind == "block_removed")) == 1

    def test_duplicate_store_then_double_remove(self, db):
        # Decided semantics (ledger.apply docstring): a removal is authoritative at once, and a
        # removed block leaves the projection (its history stays in the log).
        append(db, batch(0, stored(5), stored(5)))
        assert blocks(db)[5]["store_count"] == 2
        append(db, batch(1, removed(5)))
        assert state(db, 5) is None
        append(db, batch(2, removed(5)))
        assert counter(db, "removed_unknown") == 1 and counter(db, "stored_while_live") == 1
        assert counter(db, "blocks_removed") == 1
        assert scalar(db, _count().where(LogRow.__table__.c.kind == "block_removed")) == 2

    def test_removed_block_stored_again_is_a_new_row(self, db):
        append(db, batch(0, stored(5, 6)))
        append(db, batch(1, removed(5)))
        append(db, batch(2, stored(5)))
        row = blocks(db)[5]
        assert (row["state"], row["store_count"], row["stored_seq"]) == (BlockState.LIVE, 1, row["updated_seq"])
        assert set(blocks(db)) == {5, 6}

    def test_stored_and_removed_in_one_transaction_writes_no_row(self, db):
        append(db, batch(0, stored(8)))
        append(db, batch(1, stored(5), removed(5), removed(8), stored(8)))
        assert set(blocks(db)) == {8}
        assert blocks(db)[8]["store_count"] == 1 and counter(db, "blocks_removed") == 2

    def test_removal_of_a_quarantined_block_deletes_it(self, db):
        append(db, batch(0, created(), stored(1, 2, event_id=1)))
        append(db, batch(1, stored(3, event_id=5)))  # event_id jump: quarantine
        assert state(db, 1) == BlockState.QUARANTINED
        append(db, batch(2, removed(1, event_id=6)))
        assert state(db, 1) is None and state(db, 2) == BlockState.QUARANTINED
        assert counter(db, "removed_not_live") == 1

    def test_removals_of_unloaded_blocks_count_as_apply_counts_them(self, db):
        # A transaction that only removes a hash deletes its row without reading it (ledger.recorder
        # _delete_unloaded); the counters must be those replay's apply computes.
        append(db, batch(0, created(), stored(1, 2, 3, event_id=1)))
        append(db, batch(1, stored(4, event_id=5)))  # event_id jump: 1, 2, 3 quarantined
        append(db, batch(2, stored(5, event_id=6)))
        append(db, batch(3, removed(5, 5, 1, 424242, event_id=7), removed(1, event_id=8)))
        assert set(blocks(db)) == {2, 3, 4}
        assert (counter(db, "blocks_removed"), counter(db, "removed_not_live"), counter(db, "removed_unknown")) == (1, 1, 3)
        assert_replay_equal(db)

    def test_unloaded_removals_around_a_quarantine_in_one_transaction(self, db):
        append(db, batch(0, created(), stored(1, 2, event_id=1)))
        # one transaction: remove 1 while live, then an event_id jump quarantines 2, then remove 2
        append(db, batch(1, removed(1, event_id=2), stored(9, event_id=5), removed(2, event_id=6)))
        assert set(blocks(db)) == {9} and state(db, 9) == BlockState.LIVE
        assert (counter(db, "blocks_removed"), counter(db, "removed_not_live"), counter(db, "removed_unknown")) == (1, 1, 0)
        assert_replay_equal(db)

    def test_a_bump_drops_the_blocks_an_earlier_bump_quarantined(self, db):
        append(db, batch(0, created(), stored(1, 2, event_id=1)))
        append(db, batch(1, stored(3, event_id=5)))  # jump: 1, 2 quarantined
        assert state(db, 1) == state(db, 2) == BlockState.QUARANTINED
        # 2 is loaded (updated), 1 is not: both leave; 3 (live until now) is quarantined
        append(db, batch(2, updated(2, cache_level=(0, 1), event_id=6), stored(4, event_id=9)))
        assert {h: row["state"] for h, row in blocks(db).items()} == {3: BlockState.QUARANTINED, 4: BlockState.LIVE}
        assert counter(db, "updated_not_live") == 1
        assert_replay_equal(db)

    def test_chain_parent_hashes(self, db):
        append(db, batch(0, stored(10, 11, 12, parent=9)))
        rows = blocks(db)
        assert [join_hash(rows[h]["parent_hash"], rows[h]["parent_hash_ext"] or b"") for h in (10, 11, 12)] == [9, 10, 11]

    def test_hashes_round_trip_losslessly(self, db):
        wide = bytes(range(32))
        hashes = [9622824665191806685, 2**64 - 1, 2**63, 0, 1, wide]
        append(db, batch(0, stored(*hashes)))
        assert set(blocks(db)) == set(hashes)
        assert split_hash(2**64 - 1) == (-1, b"")

    def test_projection_equals_replay(self, db):
        append(db, batch(0, created(), stored(1, 2, event_id=1), removed(1, event_id=2)),
               batch(1, updated(2, cache_level=(0, 1), event_id=3)), batch(4, stored(3, event_id=4)))
        assert_replay_equal(db)

    # -- donors, leases, freshness ---------------------------------------------------------------

    def _donor(self, db, donor_id="d1", hashes=(1, 2, 3), namespace="ns", **kw):
        client = LedgerClient(db)
        try:
            gen = client.engine(ENGINE).generation
            client.register_donor(ev.DonorRegistered(
                donor_id=donor_id, namespace=namespace, engine_id=ENGINE, generation=gen,
                content_keys=[f"{namespace}-k{i}".encode() for i in range(len(hashes))],
                block_hashes=list(hashes), num_tokens=4 * len(hashes), tokens_per_block=4, **kw))
            client.mark_donor_saved(donor_id, store_ref=f"file:{donor_id}", checksum="abc", size_bytes=100)
        finally:
            client.close()

    def test_donor_fresh_then_stale_by_reason(self, db):
        append(db, batch(0, stored(1, 2, 3)))
        self._donor(db)
        client = LedgerClient(db)
        try:
            assert client.donor_freshness("d1", namespace="ns") is None
            assert client.donor_freshness("d1", namespace="other") == StaleReason.NAMESPACE_MISMATCH
            assert client.donor_freshness("nope", namespace="ns") == StaleReason.UNKNOWN_DONOR
            append(db, batch(1, removed(3)))
            assert client.donor_freshness("d1", namespace="ns") == StaleReason.BLOCKS_NOT_LIVE
            assert client.donor_freshness("d1", namespace="ns", num_blocks=2) is None
            assert client.donor_freshness("d1", namespace="ns", policy=FreshnessPolicy.STORE) is None
            append(db, batch(2, cleared()))
            assert client.donor_freshness("d1", namespace="ns", policy=FreshnessPolicy.STORE) == StaleReason.QUARANTINED
        finally:
            client.close()
        assert_replay_equal(db)

    def test_donor_expiry_and_eviction(self, db):
        append(db, batch(0, stored(1, 2, 3)))
        self._donor(db, expires_at=time.time() + 3600)
        client = LedgerClient(db)
        try:
            assert client.donor_freshness("d1", namespace="ns", now=time.time() + 7200) == StaleReason.EXPIRED
            client.evict_donor("d1", "capacity")
            assert client.donor_freshness("d1", namespace="ns") == StaleReason.EVICTED
            with pytest.raises(EventRejected):
                client.evict_donor("missing", "x")
        finally:
            client.close()

    def test_find_donor_span_is_longest_fresh_prefix(self, db):
        append(db, batch(0, stored(1, 2, 3, 4)))
        self._donor(db, "short", hashes=(1, 2))
        client = LedgerClient(db)
        try:
            # "short" holds keys ns-k0, ns-k1; register a longer one over the same chain.
            gen = client.engine(ENGINE).generation
            client.register_donor(ev.DonorRegistered(
                donor_id="long", namespace="ns", engine_id=ENGINE, generation=gen,
                content_keys=[f"ns-k{i}".encode() for i in range(4)], block_hashes=[1, 2, 3, 4],
                num_tokens=16, tokens_per_block=4))
            keys = [f"ns-k{i}".encode() for i in range(6)]
            assert client.find_donor_span("ns", keys).donor_id == "short"  # "long" not saved yet
            client.mark_donor_saved("long", store_ref="f", checksum="c", size_bytes=1)
            span = client.find_donor_span("ns", keys)
            assert (span.donor_id, span.num_blocks) == ("long", 4)
            assert client.find_donor_span("other-ns", keys) is None
            append(db, batch(1, removed(3)))
            span = client.find_donor_span("ns", keys)
            assert span.num_blocks == 2
            assert client.find_donor_span("ns", keys, policy=FreshnessPolicy.STORE).num_blocks == 4
        finally:
            client.close()

    def test_lease_take_release_expiry(self, db):
        append(db, batch(0, stored(1, 2, 3)))
        self._donor(db)
        client = LedgerClient(db)
        try:
            now = time.time()
            lease = client.take_lease("d1", request_id="r1", holder="h", namespace="ns", num_blocks=3, ttl_s=30, now=now)
            assert client.held_leases(now=now) == 1
            assert client.donor_freshness("d1", namespace="ns", lease_id=lease.lease_id, now=now) is None
            assert client.held_leases(now=now + 60) == 0  # expired
            assert client.donor_freshness("d1", namespace="ns", lease_id=lease.lease_id,
                                          now=now + 60) == StaleReason.LEASE_NOT_HELD
            assert client.release_lease(lease.lease_id, "finished") is True
            assert client.release_lease(lease.lease_id, "finished") is False
            assert client.held_leases(now=now) == 0
            append(db, batch(1, cleared()))
            refused = client.take_lease("d1", request_id="r2", holder="h", namespace="ns", num_blocks=3, ttl_s=30)
            assert refused == StaleReason.QUARANTINED
        finally:
            client.close()
        assert_replay_equal(db)

    def test_lease_up_to_blocks_pins_the_live_prefix(self, db):
        append(db, batch(0, stored(1, 2, 3, 4)))
        self._donor(db, hashes=(1, 2, 3, 4))
        append(db, batch(1, removed(3)))
        client = LedgerClient(db)
        try:
            refused = client.take_lease("d1", request_id="r", holder="h", namespace="ns", num_blocks=4, ttl_s=30)
            assert refused == StaleReason.BLOCKS_NOT_LIVE
            lease = client.take_lease("d1", request_id="r", holder="h", namespace="ns", num_blocks=1,
                                      up_to_blocks=4, ttl_s=30)
            assert lease.num_blocks == 2  # blocks 0 and 1 are live, block 2 (hash 3) is not
            too_short = client.take_lease("d1", request_id="r", holder="h", namespace="ns", num_blocks=3,
                                          up_to_blocks=4, ttl_s=30)
            assert too_short == StaleReason.BLOCKS_NOT_LIVE
            store = client.take_lease("d1", request_id="r", holder="h", namespace="ns", num_blocks=1, up_to_blocks=4,
                                      ttl_s=30, policy=FreshnessPolicy.STORE)
            assert store.num_blocks == 4  # policy store: the donor store's bytes, not engine blocks
            assert client.held_leases() == 2
        finally:
            client.close()
        assert_replay_equal(db)

    def test_a_revalidation_is_answered_from_its_memo_only_while_nothing_committed(self, db):
        """§2 rule 6 with the worker's cheap per-layer check (``donor_freshness(memo=...)``): a fresh
        answer is reused only while no connection committed anything and no expiry passed; a
        removal, a lease released or a donor evicted — by the writer, by a second client on its own
        connection, or on this very connection — is read, never missed. PostgreSQL has no change
        counter: every revalidation reads."""
        sqlite = db.startswith("sqlite")
        append(db, batch(0, stored(1, 2, 3)))
        self._donor(db)
        client, other = LedgerClient(db), LedgerClient(db)

        def check(memo: FreshnessMemo, **ask) -> tuple[StaleReason | None, bool]:
            """(answer, whether it came from the memo)"""
            return client.donor_freshness("d1", **ask, memo=memo), memo.unchanged

        try:
            now = time.time()
            lease = client.take_lease("d1", request_id="r1", holder="h", namespace="ns", num_blocks=3, ttl_s=30,
                                      now=now)
            ask = {"namespace": "ns", "lease_id": lease.lease_id, "now": now}
            memo = FreshnessMemo()
            assert check(memo, **ask) == (None, False)
            assert check(memo, **ask) == (None, sqlite)  # nothing committed: unchanged
            # time alone: past the lease's expiry the memo no longer answers
            assert check(memo, **ask | {"now": lease.expires_at + 1}) == (StaleReason.LEASE_NOT_HELD, False)
            # a read of 2 blocks' liveness does not answer for all 3
            memo = FreshnessMemo()
            assert check(memo, **ask, num_blocks=2) == (None, False)
            assert check(memo, **ask, num_blocks=2) == (None, sqlite)
            assert check(memo, **ask) == (None, False)
            assert check(memo, **ask, num_blocks=2) == (None, sqlite)  # all 3 read: 2 are answered
            # an unrelated commit by another connection (the writer): read again, still fresh
            append(db, batch(1, stored(9)))
            assert check(memo, **ask) == (None, False)
            # the lease released by a second client, on its own connection
            assert check(memo, **ask) == (None, sqlite)
            assert other.release_lease(lease.lease_id, "finished") is True
            assert check(memo, **ask) == (StaleReason.LEASE_NOT_HELD, False)
            # a donor block removed on its engine (the writer's connection)
            memo = FreshnessMemo()
            assert check(memo, namespace="ns", now=now) == (None, False)
            append(db, batch(2, removed(3)))
            assert check(memo, namespace="ns", now=now) == (StaleReason.BLOCKS_NOT_LIVE, False)
            # the donor evicted on THIS connection (SQLite's data_version ignores a connection's own commits)
            store = {"namespace": "ns", "now": now, "policy": FreshnessPolicy.STORE}
            assert check(memo, **store) == (None, False)
            assert check(memo, **store) == (None, sqlite)
            client.evict_donor("d1", "capacity")
            assert check(memo, **store) == (StaleReason.EVICTED, False)
        finally:
            client.close()
            other.close()

    def test_span_without_block_check_then_lease_checks_them(self, db):
        append(db, batch(0, stored(1, 2, 3, 4)))
        self._donor(db, hashes=(1, 2, 3, 4))
        append(db, batch(1, removed(2)))
        keys = [f"ns-k{i}".encode() for i in range(4)]
        client = LedgerClient(db)
        try:
            assert client.find_donor_span("ns", keys).num_blocks == 1
            optimistic = client.find_donor_span("ns", keys, check_blocks=False)
            assert optimistic.num_blocks == 4  # the donor's state is fresh; its blocks are not checked
            lease = client.take_lease("d1", request_id="r", holder="h", namespace="ns", num_blocks=1,
                                      up_to_blocks=optimistic.num_blocks, ttl_s=30)
            assert lease.num_blocks == 1
            assert client.find_donor_span("ns", keys, min_blocks=2) is None
            assert client.find_donor_span("ns", keys, min_blocks=5, check_blocks=False) is None
        finally:
            client.close()

    def _view_span(self, client, view, keys, **kw):
        client.refresh_view(view)
        found = view.longest_span("ns", keys, now=time.time(), **kw)
        return None if found is None else (found[0].donor_id, found[1])

    def test_donor_view_follows_the_ledger(self, db):
        """The scheduler's in-memory view agrees with the projection read (``find_donor_span``)
        after every change it has caught up with: removals, a clear, an eviction."""
        append(db, batch(0, stored(1, 2, 3, 4)))
        self._donor(db, hashes=(1, 2, 3, 4))
        keys = [f"ns-k{i}".encode() for i in range(4)]
        client, view = LedgerClient(db), DonorView()
        try:
            assert not view.ready
            assert self._view_span(client, view, keys) == ("d1", 4)
            assert view.ready and view.stats()["donors"] == 1 and view.stats()["blocks"] == 4
            assert self._view_span(client, view, keys[:2]) == ("d1", 2)
            assert self._view_span(client, view, [*keys[:2], b"other"]) == ("d1", 2)  # binary search
            assert view.longest_span("other-ns", keys, now=time.time()) is None
            append(db, batch(1, removed(3)))  # position 2
            assert self._view_span(client, view, keys) == ("d1", 2) == ("d1", client.find_donor_span("ns", keys).num_blocks)
            assert self._view_span(client, view, keys, min_blocks=3) is None
            assert self._view_span(client, view, keys, check_blocks=False) == ("d1", 4)  # policy store
            append(db, batch(2, removed(1)))
            assert self._view_span(client, view, keys) is None is client.find_donor_span("ns", keys)
            client.evict_donor("d1", "capacity")
            client.refresh_view(view)
            assert view.stats()["donors"] == 0 and view.liveness.stats() == {"donors": 0, "blocks": 0}
        finally:
            client.close()

    def test_donor_view_sees_generations_expiry_and_wanted(self, db):
        append(db, batch(0, stored(1, 2, 3), stored(11, 12, 13)))
        self._donor(db, "old", hashes=(1, 2, 3))
        self._donor(db, "new", hashes=(11, 12, 13))
        self._donor(db, "elsewhere", hashes=(1, 2, 3))
        expires_at = time.time() + 3.0  # long enough that a loaded machine still sees it live first
        self._donor(db, "expiring", hashes=(1, 2, 3), expires_at=expires_at)
        keys = [f"ns-k{i}".encode() for i in range(3)]
        client = LedgerClient(db)
        view = DonorView(wanted=lambda donor_id, store_ref, checksum: donor_id != "elsewhere")
        try:
            assert self._view_span(client, view, keys) == ("expiring", 3)  # the newest
            assert view.stats()["donors"] == 3  # "elsewhere" is not in this host's store
            time.sleep(max(0.0, expires_at - time.time()) + 0.05)
            assert self._view_span(client, view, keys) == ("new", 3)
            append(db, batch(1, removed(12)))
            assert self._view_span(client, view, keys) == ("old", 3)  # a live older donor beats a dead newer
            append(db, batch(2, cleared()))  # generation bump: every donor of the engine is stale
            assert self._view_span(client, view, keys) is None
            assert view.stats()["donors"] == 0  # quarantined donors left the view
        finally:
            client.close()

    def test_donor_view_far_behind_catches_up_in_bounded_steps(self, db, monkeypatch):
        """After an outage the view reads at most VIEW_CATCH_UP_MAX_SEQS log rows per catch-up (no
        statement outgrows a statement timeout), and is not ready until the last step."""
        append(db, batch(0, stored(1, 2, 3, 4)))
        self._donor(db, hashes=(1, 2, 3, 4))
        keys = [f"ns-k{i}".encode() for i in range(4)]
        client, view = LedgerClient(db), DonorView(max_staleness_s=0.05)
        try:
            assert self._view_span(client, view, keys) == ("d1", 4)
            append(db, batch(1, removed(4)))
            append(db, batch(2, removed(3)))
            append(db, batch(3, stored(9)))
            monkeypatch.setattr(reads_module, "VIEW_CATCH_UP_MAX_SEQS", 1)
            time.sleep(0.06)  # older than max_staleness_s: only a complete catch-up makes it ready
            steps = []
            while not view.ready:
                steps.append(client.refresh_view(view))
                assert len(steps) < 50
            assert len(steps) >= 3 and steps == sorted(steps)
            assert view.longest_span("ns", keys, now=time.time()) is not None
            assert self._view_span(client, view, keys) == ("d1", 2) == ("d1", client.find_donor_span("ns", keys).num_blocks)
        finally:
            client.close()

    def test_donor_view_size_bound(self, db):
        append(db, batch(0, stored(1, 2, 3), stored(11, 12, 13)))
        self._donor(db, "old", hashes=(1, 2, 3))
        self._donor(db, "new", hashes=(11, 12, 13))
        keys = [f"ns-k{i}".encode() for i in range(3)]
        client, view = LedgerClient(db), DonorView(max_blocks=4)
        try:
            assert self._view_span(client, view, keys) == ("new", 3)
            assert view.stats()["dropped"] == 1 and view.stats()["blocks"] == 3  # the oldest left
        finally:
            client.close()

    def test_donors_for_key_ignores_freshness(self, db):
        append(db, batch(0, stored(1, 2, 3)))
        self._donor(db, "old")
        self._donor(db, "new")
        client = LedgerClient(db)
        try:
            append(db, batch(1, cleared()))  # both quarantined: stale, but still the donors of that text
            found = client.donors_for_key("ns", b"ns-k1", limit=4)
            assert [d.donor_id for d in found] == ["new", "old"]
            assert {d.state for d in found} == {DonorState.QUARANTINED}
            assert found[0].engine_id == ENGINE and found[0].num_blocks == 3
            assert client.donors_for_key("ns", b"ns-k1", limit=1)[0].donor_id == "new"
            assert client.donors_for_key("other", b"ns-k1") == []
            assert client.find_donor_span("ns", [b"ns-k0"]) is None
        finally:
            client.close()

    def test_engine_generation_reason(self, db):
        append(db, batch(0, created(), stored(1, event_id=1)))
        client = LedgerClient(db)
        try:
            info = client.engine(ENGINE)
            assert (info.generation, info.generation_reason) == (1, None)
            append(db, batch(1, created(0), stored(2, event_id=1)))  # a `created` on a known stream: restart
            assert client.engine(ENGINE).generation_reason == GenerationReason.CREATED
            append(db, batch(2, cleared()))
            info = client.engine(ENGINE)
            assert (info.generation, info.generation_reason) == (3, GenerationReason.ALL_BLOCKS_CLEARED)
            assert client.engine("never-seen") is None
        finally:
            client.close()

    def test_evict_if_unleased_checks_and_evicts_in_one_transaction(self, db):
        append(db, batch(0, stored(1, 2, 3)))
        self._donor(db)
        client = LedgerClient(db)
        try:
            lease = client.take_lease("d1", request_id="r", holder="h", namespace="ns", num_blocks=3, ttl_s=30)
            assert client.evict_donor_if_unleased("d1", "capacity") is False
            assert client.donor_freshness("d1", namespace="ns") is None
            assert client.evict_donor_if_unleased("d1", "capacity", now=time.time() + 60) is True  # lease expired
            assert client.donor_freshness("d1", namespace="ns") == StaleReason.EVICTED
            assert client.evict_donor_if_unleased("d1", "x", now=time.time() + 60) is True  # already evicted: no write
            with pytest.raises(EventRejected):
                client.evict_donor_if_unleased("missing", "x")
            assert client.release_lease(lease.lease_id, "finished") is True
            assert counter(db, "donors_evicted") == 1
        finally:
            client.close()
        assert_replay_equal(db)

    def test_client_connections_are_per_thread(self, db):
        import threading

        append(db, batch(0, stored(1, 2, 3)))
        self._donor(db)
        client = LedgerClient(db)
        errors: list[BaseException] = []

        def work() -> None:
            try:
                for _ in range(20):
                    lease = client.take_lease("d1", request_id="r", holder="h", namespace="ns", num_blocks=3, ttl_s=30)
                    assert client.donor_freshness("d1", namespace="ns", lease_id=lease.lease_id) is None
                    assert client.release_lease(lease.lease_id, "done")
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        try:
            threads = [threading.Thread(target=work) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == [] and client.held_leases() == 0
        finally:
            client.close()
        assert_replay_equal(db)

    def test_donor_registered_twice_is_rejected(self, db):
        append(db, batch(0, stored(1, 2, 3)))
        self._donor(db)
        with pytest.raises(EventRejected):
            self._donor(db)

    def test_dead_letter_inside_a_batch_keeps_every_index_unique(self, db):
        import msgspec

        good = [msgspec.structs.replace(stored(1), batch_index=0), msgspec.structs.replace(stored(2), batch_index=2)]
        bad = ev.DeadLetter(source_id="s", engine_id=ENGINE, reason="schema_mismatch", detail="x", raw=b"\x01",
                            seq=0, batch_index=1)
        received = msgspec.structs.replace(batch(0, *good), dead_letters=[bad])
        append(db, received)
        indices = _all(db, select(LogRow.__table__.c.batch_index).where(LogRow.__table__.c.zmq_seq == 0)
                       .order_by(LogRow.__table__.c.batch_index))
        assert indices == [-1, 0, 1, 2]
        assert append(db, received).duplicate_batches == 1

    def test_dead_letters_are_logged_with_reason(self, db):
        letter = ev.DeadLetter(source_id="s", engine_id=ENGINE, reason="malformed_msgpack", detail="bad",
                               raw=b"\xc1\xc1", seq=None)
        append(db, letter)
        assert counter(db, "dead_letters.malformed_msgpack") == 1
        payload = scalar(db, select(LogRow.__table__.c.payload).where(LogRow.__table__.c.kind == "event_dead_lettered"))
        assert bytes(payload) == b"\xc1\xc1"
        assert_replay_equal(db)


def _count():
    from sqlalchemy import func

    return select(func.count()).select_from(LogRow.__table__)


def _all(db: str, query) -> list:
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            return list(conn.execute(query).scalars())
    finally:
        engine.dispose()
