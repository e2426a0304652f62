"""A promise TensorRT-LLM can survive: every fault after the answer, at every point, on both versions.

Faults × points × version models (docs/tensorrt-llm.md has the table this test proves). Engine A
saved a donor of DOC; engine B's request DOC + question is promised DOC's 10 blocks, then a fault
is injected:

* points: right after ``get_num_new_matched_tokens`` answered (the promise), right after
  ``update_state_after_alloc`` (the allocation), and between two layers of the worker's copy
  (TensorRT-LLM's worker copies every layer in ``start_load_kv``, before the forward);
* faults: the ledger down (every statement of B's ledger clients fails as SQLite does when its file
  cannot be opened), the ledger locked (another connection holds SQLite's write lock), the donor's
  blocks removed on its engine (its ``removed`` events through the consumer), the donor engine
  restarted (``created``: generation bump), the store entry deleted, the entry replaced by a
  corrupted copy, the entry replaced by another namespace's entry, and the entry CORRUPTED IN PLACE.

For every cell: the executor either keeps running with attention having read only verified bytes
(logits bit-identical to TensorRT-LLM's own reuse of the same prefix) or — the one case with no safe
path, the secured file written in place — stops in ``start_load_kv`` before attention read
anything; the reuse tree never holds a block whose bytes differ from the engine's own computation;
and the outcome is counted by reason.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from connector.donor_store import FileDonorStore
from connector.harness import ExecutorStopped, block_hash_chain
from connector.harness.trtllm_versions import TRTLLM_1X, TRTLLM_MAIN_2026, TrtllmVersion
from ledger.errors import PersistenceError
from tools.harness.fleet import MODEL, Engine, Fleet, shared_model, doc_tokens
from tests.connector.test_two_engines import native_engine

TPB = MODEL.tokens_per_block
DOC = doc_tokens(10 * TPB, seed=71)
PROMPT = DOC + doc_tokens(20, seed=72)
POINTS = ("after_promise", "after_allocation", "between_layers")
SURVIVED = {  # fault -> the freshness signals it may be counted under (semkv_stale_after_promise_total)
    "ledger_down": {"ledger_error"},
    "ledger_locked": set(),  # a promise writes nothing to the ledger; the worker only reads it
    "donor_blocks_removed": {"donor_blocks_removed"},
    "donor_engine_restarted": {"donor_quarantined", "donor_generation_mismatch", "donor_blocks_removed"},
    "store_entry_deleted": set(),
    "store_entry_replaced_corrupted": set(),
    "namespace_changed": set(),
}
REQUIRED = {  # (fault, point) -> the signals the worker's revalidation must count
    **{("ledger_down", point): {"ledger_error"} for point in POINTS},
    **{("donor_engine_restarted", point): {"donor_quarantined"} for point in POINTS},
    # block liveness is checked before the first copy (per layer only with per_layer_block_check)
    **{("donor_blocks_removed", point): {"donor_blocks_removed"} for point in ("after_promise", "after_allocation")},
}
NO_SAFE_PATH = {"store_entry_corrupted_in_place": "checksum_mismatch"}


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """TensorRT-LLM's own reuse of DOC for PROMPT: the logits and the KV of every block it stores."""
    native = native_engine()
    native.generate(DOC, 1)
    got = native.generate(PROMPT, 1)
    blocks = {h: native.kv_cache_manager.read_stored_block(h) for h in native.kv_cache_manager.stored_block_hashes()}
    return {"logits": got.prefill_logits, "blocks": blocks}


# ------------------------------------------------------------------------------------- faults
class Faults:
    """Injects each fault into the world of one test (the fleet, engine B, the donor's entry)."""

    def __init__(self, fleet: Fleet, b: Engine) -> None:
        self.fleet, self.b = fleet, b
        self.undo: list[Callable[[], None]] = []

    def entry(self) -> Path:
        [entry] = Path(self.fleet.store_dir).glob("*.kv")
        return entry

    def ledger_down(self) -> None:
        def refuse() -> Any:
            raise PersistenceError("OperationalError: unable to open database file")

        for client in (self.b.scheduler.ledger, self.b.worker.ledger):
            original = client._connections._sql
            client._connections._sql = refuse  # type: ignore[method-assign]
            self.undo.append(lambda client=client, original=original: setattr(client._connections, "_sql", original))

    def ledger_locked(self) -> None:
        holder = sqlite3.connect(self.fleet.db.removeprefix("sqlite:///"), timeout=10, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        self.undo.append(lambda: (holder.execute("ROLLBACK"), holder.close()))

    def donor_blocks_removed(self) -> None:
        events = self.fleet.engines["A"].llm.kv_cache_manager.events  # A's own event stream reports the eviction
        for block_hash in block_hash_chain(DOC, TPB):
            events.enqueue_removed(block_hash)
        events.flush()
        self.fleet.sync()

    def donor_engine_restarted(self) -> None:
        self.fleet.restart("A")
        self.fleet.sync()

    def store_entry_deleted(self) -> None:
        self.entry().unlink()

    def store_entry_replaced_corrupted(self) -> None:
        entry = self.entry()
        data = bytearray(entry.read_bytes())
        data[-64:] = bytes(64)
        tmp = entry.with_name(".tmp-replacement.kv")
        tmp.write_bytes(data)
        os.rename(tmp, entry)  # a new file under the same name

    def namespace_changed(self) -> None:
        entry = self.entry()
        other = FileDonorStore(entry.parent / "other", 2**30)
        header = {"namespace": "another-model-version", "num_layers": MODEL.num_layers, "kv_factor": 2,
                  "block_elems": MODEL.num_kv_heads * MODEL.head_dim * TPB, "dtype": "float32", "itemsize": 4,
                  "num_blocks": 10, "tokens_per_block": TPB}
        layers = [np.ones((10, 2, header["block_elems"]), np.float32) for _ in range(MODEL.num_layers)]
        written = other.put(entry.stem, layers, header)
        os.rename(entry.parent / "other" / written.ref, entry)

    def store_entry_corrupted_in_place(self) -> None:
        entry = self.entry()
        with open(entry, "r+b") as f:  # the same file (the one the promise secured), new bytes
            f.seek(os.path.getsize(entry) - 64)
            f.write(bytes(64))

    def restore(self) -> None:
        for undo in reversed(self.undo):
            undo()
        self.undo.clear()


def inject_at(point: str, b: Engine, inject: Callable[[], None]) -> None:
    """Run ``inject`` once at ``point`` of B's next promised request."""
    done: list[bool] = []

    def once() -> None:
        if not done:
            done.append(True)
            inject()

    if point == "between_layers":
        copy_layer = b.worker._copy_layer

        def copy_then_inject(load: Any, layer_idx: int) -> None:
            copy_layer(load, layer_idx)
            if layer_idx == 0:
                once()

        b.worker._copy_layer = copy_then_inject  # type: ignore[method-assign]
        return
    hook = {"after_promise": "after_get_num_new_matched_tokens", "after_allocation": "after_update_state_after_alloc"}
    b.llm.add_lifecycle_observer(lambda at, ids: once() if at == hook[point] else None)


# ------------------------------------------------------------------------------------- the matrix
@pytest.mark.parametrize("version", [TRTLLM_1X, TRTLLM_MAIN_2026], ids=lambda v: v.name)
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("fault", [*SURVIVED, *NO_SAFE_PATH])
def test_fault_after_the_promise(fleet: Fleet, reference: dict[str, Any], version: TrtllmVersion, point: str,
                                 fault: str) -> None:
    a = fleet.engine("A", version=version)
    a.generate(DOC)
    fleet.sync()
    b = fleet.engine("B", version=version)
    reads: list[int] = []
    b.llm.add_forward_observer(lambda event, layer, ids: reads.append(layer) if event == "attention_read" else None)
    faults = Faults(fleet, b)
    inject_at(point, b, getattr(faults, fault))
    try:
        if fault in NO_SAFE_PATH:
            assert_stopped_before_any_read(b, reads, NO_SAFE_PATH[fault])
        else:
            assert_kept(b, reference, SURVIVED[fault], REQUIRED.get((fault, point), set()))
    finally:
        faults.restore()
    if b.llm.stopped is None:
        b.settle()  # the background writes a locked ledger held back
    assert_reuse_tree_verified(b, reference)
    if fault in NO_SAFE_PATH:  # the operator restarts the engine: it serves the prompt right (cold)
        restarted = fleet.restart("B", version=version)
        again = restarted.generate(PROMPT)
        cold = shared_model(MODEL).forward_dense(PROMPT)
        assert torch.allclose(again.prefill_logits, cold[again.prefill_start:], rtol=1e-4, atol=1e-4)


def assert_kept(b: Engine, reference: dict[str, Any], signals: set[str], required: set[str]) -> None:
    """The promise was kept: every promised token loaded from verified bytes, the executor running
    (the engine's own ``generate``: nothing here waits for the connector's background writes)."""
    got = b.llm.generate(PROMPT)
    assert b.llm.stopped is None
    assert got.num_connector_tokens == len(DOC)
    assert torch.equal(got.prefill_logits, reference["logits"])  # what attention read: the verified bytes
    assert b.metrics.value("semkv_exact_materialized_total") == 1
    assert b.metrics.value("semkv_load_failures_total", reason="checksum_mismatch") == 0
    counted = {reason for reason in SIGNALS if b.metrics.value("semkv_stale_after_promise_total", reason=reason)}
    assert required <= counted <= signals, counted
    assert b.llm.generate(doc_tokens(3 * TPB, seed=73)).num_connector_tokens == 0  # and it goes on
    assert b.scheduler.store.handed_over() == 0


def assert_stopped_before_any_read(b: Engine, reads: list[int], reason: str) -> None:
    with pytest.raises(ExecutorStopped) as stop:
        b.llm.generate(PROMPT)
    assert stop.value.hook == "start_load_kv" and reads == []  # attention read nothing
    assert b.metrics.value("semkv_load_failures_total", reason=reason) == 1
    assert b.metrics.value("semkv_exact_materialized_total") == 0
    assert not b.scheduler.store.known_verified(b.worker.failed_plans[-1].store_ref,
                                                b.worker.failed_plans[-1].checksum)  # never trusted again


def assert_reuse_tree_verified(b: Engine, reference: dict[str, Any]) -> None:
    """Every block of PROMPT in B's reuse tree holds exactly the engine's own computation."""
    mine = set(b.llm.kv_cache_manager.stored_block_hashes())
    for block_hash, kv in reference["blocks"].items():
        if block_hash in mine:
            assert torch.equal(b.llm.kv_cache_manager.read_stored_block(block_hash), kv)


SIGNALS = ("ledger_error", "donor_blocks_removed", "donor_quarantined", "donor_generation_mismatch",
           "donor_evicted", "donor_expired", "donor_unknown", "donor_not_saved", "namespace_mismatch")
