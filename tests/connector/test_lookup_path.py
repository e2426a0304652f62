"""What the lookup leaves to others (connector/scheduler.py): the ledger lease is written once the
engine allocated the promised blocks, so a promise never allocated costs no ledger write; the
donor store's bytes are trusted from this process's record of what it checksummed, which a
background recheck (``store_recheck_s``) drops once an entry's file changes — a change inside that
window fails at the worker's per-layer checksum, never loads (DESIGN §2 rules 6 and 7)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from connector.harness import LlmRequest
from connector.harness.connector_driver import ConnectorWorkerError
from ledger.db import sync_engine
from ledger.schema import LeaseRow
from tests.connector.conftest import Engine, Fleet
from tests.connector.test_negative_controls import DOC, QUESTION, assert_missed, donor_on_a


def leases_written(fleet: Fleet) -> int:
    """Leases the ledger ever recorded (released ones keep their row)."""
    engine = sync_engine(fleet.db)
    try:
        with engine.connect() as conn:
            return conn.execute(select(func.count()).select_from(LeaseRow)).scalar_one()
    finally:
        engine.dispose()


def test_a_promise_never_allocated_writes_no_ledger_lease_and_releases_its_pin(fleet: Fleet) -> None:
    donor_on_a(fleet)
    b = fleet.engine("B")
    [donor_id] = b.scheduler._view._donors
    for rid, end in ((501, "finished"), (502, "relookup")):
        request = LlmRequest(rid, DOC + QUESTION, 1)
        assert b.scheduler.get_num_new_matched_tokens(request, 0) == (len(DOC), False)
        assert b.scheduler.store._pinned(donor_id)  # pinned before the answer
        if end == "relookup":  # asked again (re-allocation): the first promise is void
            assert b.scheduler.get_num_new_matched_tokens(request, 0) == (len(DOC), False)
        b.scheduler.request_finished(request, [])
        b.scheduler.flush()
        assert not b.scheduler.store._pinned(donor_id)
        assert b.metrics.value("semkv_leases_released_total", reason=end) == 1
    assert b.metrics.value("semkv_leases_held") == 0
    assert leases_written(fleet) == 0
    # allocated: the lease is written, held while the plan ships, and released at the end
    result = b.generate(DOC + QUESTION)
    assert result.num_connector_tokens == len(DOC)
    assert leases_written(fleet) == 1 and fleet.held_leases() == 0


def corrupt_in_place(entry: Path) -> None:
    time.sleep(0.02)  # file times tick once per jiffy (≤ 10 ms): make the write's mtime differ from the save's
    with open(entry, "r+b") as f:  # the last layer's bytes: same inode and size
        f.seek(os.path.getsize(entry) - 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def verified_by_b(fleet: Fleet, **b_kw) -> tuple[Engine, Path]:
    """B, whose store has checksummed A's donor entry (its view does that off the engine's path)."""
    donor_on_a(fleet)
    b = fleet.engine("B", **b_kw)
    b.scheduler.flush()
    [entry] = Path(fleet.store_dir).glob("*.kv")
    [donor] = b.scheduler._view._donors.values()
    assert b.scheduler.store.known_verified(donor.store_ref, donor.checksum)
    return b, entry


def test_an_entry_changed_after_its_checksum_fails_one_load_then_is_missed(fleet: Fleet) -> None:
    b, entry = verified_by_b(fleet, store_recheck_s=3600)  # the recheck runs only when the test says
    [donor] = b.scheduler._view._donors.values()
    corrupt_in_place(entry)
    # inside the recheck window the lookup trusts its record: promised, and the worker's per-layer
    # checksum fails the request before attention reads the layer (TensorRT-LLM 1.2: no recompute)
    with pytest.raises(ConnectorWorkerError, match="checksum"):
        b.generate(DOC + QUESTION)
    assert b.metrics.value("semkv_exact_materialized_total") == 0
    b.scheduler.flush()
    assert fleet.held_leases() == 0
    assert b.metrics.value("semkv_load_failures_total", reason="checksum_mismatch") == 1
    # the worker's failure made the store forget the entry (no recheck ran): the next lookup checks it
    assert not b.scheduler.store.known_verified(donor.store_ref, donor.checksum)
    result = b.generate(DOC + QUESTION)
    assert result.num_connector_tokens == 0 and b.metrics.value("semkv_promises_total") == 1  # no new promise
    assert b.misses() == {"checksum_mismatch": 1}  # the lookup's full check found the changed file
    b.scheduler.flush()
    assert not entry.exists()  # and evicted it


def test_the_recheck_tick_forgets_a_vanished_entry_by_itself(fleet: Fleet) -> None:
    b, entry = verified_by_b(fleet, store_recheck_s=0.01)
    [donor] = b.scheduler._view._donors.values()
    entry.unlink()  # outside the store: no ledger fact, only the recheck can notice
    deadline = time.monotonic() + 10
    while b.scheduler.store.known_verified(donor.store_ref, donor.checksum):
        assert time.monotonic() < deadline, "the recheck tick never ran"
        time.sleep(0.01)
    assert_missed(b, b.generate(DOC + QUESTION), "store_missing")


def test_with_store_recheck_off_every_lookup_checks_the_file(fleet: Fleet) -> None:
    b, entry = verified_by_b(fleet, store_recheck_s=0)
    corrupt_in_place(entry)
    assert_missed(b, b.generate(DOC + QUESTION), "checksum_mismatch")
    b.scheduler.flush()
    assert not entry.exists()
