"""What the lookup leaves to others (connector/scheduler.py): on TensorRT-LLM a promise writes nothing
to the ledger (vLLM's lease is written once the engine allocated the blocks, so a promise never
allocated costs no ledger write there either); the
donor store's bytes are trusted from this process's record of what it checksummed (the file kept
open), which a background recheck (``store_recheck_s``) drops once an entry's file changes. A file
written IN PLACE inside that window is the one case TensorRT-LLM leaves no safe path for: the
worker's checksums stop the executor before attention reads anything (DESIGN §2 rules 3, 6, 7)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from connector.harness import ExecutorStopped, LlmRequest
from tools.harness.fleet import Engine, Fleet
from tests.connector.test_negative_controls import DOC, QUESTION, assert_missed, donor_on_a


def test_a_promise_writes_no_ledger_lease_and_releases_its_pin(fleet: Fleet) -> None:
    donor_on_a(fleet)
    b = fleet.engine("B")
    [donor_id] = b.scheduler.spans.view._donors
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
    assert fleet.leases_written() == 0
    # allocated and loaded on TensorRT-LLM: still no ledger write (the promise holds the donor's
    # secured file, released with the load); vLLM's lease: test_ledger_busy, test_rules
    result = b.generate(DOC + QUESTION)
    assert result.num_connector_tokens == len(DOC)
    assert fleet.leases_written() == 0 and b.scheduler.store.handed_over() == 0


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
    [donor] = b.scheduler.spans.view._donors.values()
    assert b.scheduler.store.known_verified(donor.store_ref, donor.checksum)
    return b, entry


def test_an_entry_written_in_place_inside_the_recheck_window_stops_the_executor_unread(fleet: Fleet) -> None:
    """The residual case (connector/README.md, "What a promise means"): the lookup trusts its record,
    secures the very file that was checksummed, and promises; the worker's per-layer checksum then
    finds the new bytes in ``start_load_kv``: TensorRT-LLM's executor stops, nothing read, nothing
    stored. The restarted engine's lookup checks the file in full, misses and evicts it."""
    b, entry = verified_by_b(fleet, store_recheck_s=3600)  # the recheck runs only when the test says
    reads: list[int] = []
    b.llm.add_forward_observer(lambda event, layer, ids: reads.append(layer))
    corrupt_in_place(entry)
    with pytest.raises(ExecutorStopped, match="checksum"):
        b.llm.generate(DOC + QUESTION)
    assert reads == [] and b.llm.kv_cache_manager.stored_block_hashes() == []
    assert b.metrics.value("semkv_exact_materialized_total") == 0
    assert b.metrics.value("semkv_load_failures_total", reason="checksum_mismatch") == 1
    restarted = fleet.restart("B")  # its view checksums the entry in the background, its lookup inline
    result = restarted.generate(DOC + QUESTION)
    assert result.num_connector_tokens == 0
    assert set(restarted.misses()) <= {"checksum_mismatch", "store_missing", "no_donor", "donor_evicted"}
    restarted.scheduler.flush()
    assert not entry.exists()  # and evicted it


def test_the_recheck_tick_forgets_a_vanished_entry_by_itself(fleet: Fleet) -> None:
    b, entry = verified_by_b(fleet, store_recheck_s=0.01)
    [donor] = b.scheduler.spans.view._donors.values()
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
