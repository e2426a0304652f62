"""Hypothesis: random schedules of donations (request/finish), restarts, event gaps, store evictions,
corruption and lookups never produce a promise on a stale, quarantined or mismatched donor.

Engine A is the harness's KV cache manager (real v1 block hashes and KV events, no model); its KV
blocks are filled with a pattern that is a function of (cache salt, LoRA, token prefix), so B can
check that what it loaded is exactly the KV its own prompt needs. A's events reach the ledger
through the real decoder (``consumer.wire.decode_message``) and recorder. The oracle below is
written from DESIGN §5 independently of the ledger and the connector: a promise of ``n`` blocks is
valid iff some donor has the same salt, LoRA and first ``n`` blocks of tokens, was registered in
A's current epoch (no restart, no lost event since), was not evicted or corrupted, and all of its
first ``n`` blocks are still in A's reuse tree.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from connector._trtllm import RequestData, SchedulerOutput
from connector.harness import HarnessLlmArgs, KvCacheConfig, KVCacheManager, LlmRequest, ModelConfig
from connector.harness.connector_driver import HarnessStream
from connector.metrics import ConnectorMetrics
from connector.scheduler import SemKvScheduler
from connector.settings import load_connector_settings
from connector.worker import SemKvWorker
from consumer.wire import decode_message
from ledger import recorder
from ledger.db import sync_engine
from ledger.migrate import upgrade

TPB = 4
CFG = ModelConfig(vocab_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=2, intermediate_size=8,
                  tokens_per_block=TPB, max_context=64)
LLM_ARGS = HarnessLlmArgs(model=CFG.name, harness_model_config=CFG, kv_cache_config=KvCacheConfig(tokens_per_block=TPB),
                          max_seq_len=64, max_num_tokens=64)
BASE = [3, 9, 27, 17, 51, 25, 11, 33, 35, 41, 59, 49, 19, 57, 43, 1, 5, 13, 39, 53]
DOCS = [BASE[:16], BASE[:8] + [2, 4, 6, 8, 10, 12, 14, 16], BASE[:12], [7] * 12, BASE]
SALTS = [None, "tenant-x"]
LORAS = [None, 3]


def pattern(salt: str | None, lora: int | None, tokens: list[int]) -> torch.Tensor:
    """The KV a block holds, as a function of everything that determines it: [layers, 2, elems]."""
    seed = int.from_bytes(hashlib.sha256(repr((salt, lora, tuple(tokens))).encode()).digest()[:4], "little")
    return (seed % 100_000) / 7.0 + torch.arange(CFG.num_layers * 2 * TPB * 2, dtype=torch.float32).view(
        CFG.num_layers, 2, -1)


class World:
    def __init__(self, root: Path, template: Path) -> None:
        shutil.copy(template, root / "ledger.db")
        self.db = f"sqlite:///{root / 'ledger.db'}"
        self.store_dir = root / "donors"
        self.writer = sync_engine(self.db, writer=True)
        self.seq = self.rid = 0
        self.epoch, self.last_eid, self.drop_next = 0, None, False
        self.donors: dict[str, tuple[list[int], str | None, int | None, int, list[int]]] = {}
        self.gone: set[str] = set()
        self.b_metrics = ConnectorMetrics()
        self.b_sched, self.b_worker = self._connector("B", self.b_metrics)
        self.b_kv = torch.zeros(32, CFG.num_layers, 2, TPB * 2)
        self.b_worker.register_kv_caches(self.b_kv)
        self.a_sched = self.a_worker = None
        self.restart_a()

    def _connector(self, engine_id: str, metrics: ConnectorMetrics):  # noqa: ANN202
        # LoRA task ids are fleet-wide here (both engines map them alike), so LoRA donors cross engines
        s = load_connector_settings({"db": self.db, "mode": "exact_equivalent", "engine_id": engine_id,
                                     "store_dir": self.store_dir, "lookup_timeout_s": 1.0,
                                     "namespace": {"lora_task_ids": "fleet"}}, environ={})
        return (SemKvScheduler(LLM_ARGS, settings=s, metrics=metrics),
                SemKvWorker(LLM_ARGS, settings=s, metrics=metrics))

    def close(self) -> None:
        for part in (self.a_sched, self.a_worker, self.b_sched, self.b_worker):
            part.close()
        self.writer.dispose()

    # -- engine A -----------------------------------------------------------------------------
    def restart_a(self) -> None:
        if self.a_sched is not None:
            self.a_sched.close()
            self.a_worker.close()
        self.kvm = KVCacheManager(num_layers=CFG.num_layers, num_kv_heads=1, head_dim=2, tokens_per_block=TPB,
                                  num_blocks=12, event_buffer_max_size=10_000, window_size=64)
        self.a_sched, self.a_worker = self._connector("A", ConnectorMetrics())
        self.a_worker.register_kv_caches(self.kvm.kv_cache)
        self.pump()

    def donate(self, doc: list[int], salt: str | None, lora: int | None) -> None:
        """A request on A in TensorRT-LLM's order: allocated (its save armed), its first report's
        metadata shipped, its prefill "computed" (the pattern), finished, and saved in the same
        iteration's ``get_finished``."""
        self.rid += 1
        request = LlmRequest(self.rid, list(doc), 1, lora, salt)
        seq, _ = self.kvm.add_sequence(self.rid, doc, lora_task_id=lora, cache_salt=salt)
        self.a_sched.update_state_after_alloc(request, seq.block_ids)
        meta = self.a_sched.build_connector_meta(SchedulerOutput())
        self.a_worker.bind_connector_meta(meta)
        self.a_worker.start_load_kv(HarnessStream())
        for i, slot in enumerate(seq.block_ids):
            if (i + 1) * TPB <= len(doc):
                self.kvm.kv_cache[slot] = pattern(salt, lora, doc[: (i + 1) * TPB])
        self.kvm.store_context_blocks(seq)
        request.output_token_ids.append(1)
        seq.tokens.append(1)
        if self.a_sched.request_finished(request, seq.block_ids):
            [save] = meta.saves
            n = save.num_blocks
            self.donors[save.donor_id] = (doc[: n * TPB], salt, lora, self.epoch, self.kvm.block_hashes(seq)[:n])
            assert self.a_worker.get_finished([self.rid], []) == ([self.rid], [])
            assert self.a_worker.flush()
        self.kvm.remove_sequence(seq)
        self.pump()

    def pump(self) -> None:
        """A's events -> msgpack frames -> decode_message -> recorder, tracking the epoch (oracle)."""
        self.kvm.flush_iteration_events()
        events = self.kvm.events.get_events(0)
        if self.drop_next and events:  # TensorRT-LLM's bounded buffer dropped the oldest event
            events, self.drop_next = events[1:], False
        for kv_event in events:
            self._observe(kv_event)
        if not events:
            return
        payload = msgspec.msgpack.encode([time.time(), events, None])
        batch = decode_message([b"kv", self.seq.to_bytes(8, "big"), payload], source_id="A@test", engine_id="A",
                               received_at=time.time())
        self.seq += 1
        with self.writer.begin() as conn:
            recorder.append(conn, [batch])

    def _observe(self, event: dict) -> None:
        """DESIGN §5: a `created` after a baseline (restart) or an event_id jump (lost events) starts
        a new generation; the event itself is then the new baseline."""
        eid, created = event["event_id"], event["data"]["type"] == "created"
        if self.last_eid is not None and (created or eid > self.last_eid + 1):
            self.epoch += 1
        self.last_eid = eid

    # -- oracle and engine B ------------------------------------------------------------------
    def valid(self, prompt: list[int], salt: str | None, lora: int | None, blocks: int) -> bool:
        live = {b.block_hash for b in self.kvm._walk_tree()}
        for donor_id, (tokens, d_salt, d_lora, epoch, hashes) in self.donors.items():
            if (donor_id not in self.gone and d_salt == salt and d_lora == lora and epoch == self.epoch
                    and len(tokens) >= blocks * TPB and tokens[: blocks * TPB] == prompt[: blocks * TPB]
                    and all(h in live for h in hashes[:blocks])):
                return True
        return False

    def lookup(self, prompt: list[int], salt: str | None, lora: int | None) -> int:
        self.rid += 1
        request = LlmRequest(self.rid, prompt, 1, lora, salt)
        self.b_sched.sync_view()  # the view's catch-up tick, made deterministic (its lag has its own test)
        n, load_async = self.b_sched.get_num_new_matched_tokens(request, 0)
        assert not load_async and n % TPB == 0 and n < len(prompt)
        blocks = n // TPB
        if n:
            assert self.valid(prompt, salt, lora, blocks), f"promise of {blocks} blocks on a stale/mismatched donor"
            block_ids = list(range(-(-len(prompt) // TPB)))
            self.b_sched.update_state_after_alloc(request, block_ids)
            data = RequestData(request_id=self.rid, new_tokens=prompt, new_block_ids=block_ids, computed_position=0,
                               num_scheduled_tokens=len(prompt))
            meta = self.b_sched.build_connector_meta(SchedulerOutput(new_requests=[data]))
            self.b_worker.bind_connector_meta(meta)
            self.b_worker.start_load_kv(HarnessStream())
            for layer in range(CFG.num_layers):
                self.b_worker.wait_for_layer_load(layer, HarnessStream())
            for i in range(blocks):  # exactly the KV this prompt needs
                assert torch.equal(self.b_kv[i], pattern(salt, lora, prompt[: (i + 1) * TPB]))
        self.b_sched.request_finished(request, [])
        return blocks


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tpl") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


_doc, _salt, _lora = st.sampled_from(range(len(DOCS))), st.sampled_from(SALTS + [None] * 2), st.sampled_from(LORAS + [None] * 2)
operation = st.one_of(
    *[st.tuples(st.just("donate"), _doc, _salt, _lora)] * 3,
    *[st.tuples(st.just("lookup"), _doc, _salt, _lora)] * 4,
    st.tuples(st.just("restart"), st.none(), st.none(), st.none()),
    st.tuples(st.just("gap"), st.none(), st.none(), st.none()),
    st.tuples(st.just("evict"), st.integers(0, 7), st.none(), st.none()),
    st.tuples(st.just("corrupt"), st.integers(0, 7), st.none(), st.none()),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(ops=st.lists(operation, min_size=3, max_size=24))
def test_never_a_promise_on_a_stale_quarantined_or_mismatched_donor(ops, template, tmp_path_factory) -> None:
    world = World(tmp_path_factory.mktemp("world"), template)
    promised = 0
    try:
        for kind, arg, salt, lora in ops:
            if kind == "donate":
                world.donate(DOCS[arg], salt, lora)
            elif kind == "lookup":
                promised += world.lookup(DOCS[arg] + [60, 61], salt, lora)
                event("promised blocks" if promised else "no promise yet")
            elif kind == "restart":
                world.restart_a()
            elif kind == "gap":
                world.drop_next = True
            elif world.donors:
                donor_id = list(world.donors)[arg % len(world.donors)]
                if kind == "evict":
                    world.a_worker.store.evict(donor_id, "test", force=True)
                else:
                    entry = world.store_dir / f"{donor_id}.kv"
                    if entry.exists():
                        with open(entry, "r+b") as f:
                            f.seek(os.path.getsize(entry) - 3)
                            f.write(b"\xff\x00\xff")
                world.gone.add(donor_id)
        world.b_sched.flush()
        assert world.b_sched.ledger.held_leases() == 0
    finally:
        world.close()


def test_the_oracle_sees_promises(template, tmp_path) -> None:
    """Self-test: the schedule above does produce promises (the property is not vacuous)."""
    world = World(tmp_path, template)
    try:
        world.donate(DOCS[0], None, None)
        assert world.lookup(DOCS[0] + [60, 61], None, None) == 4
        assert world.lookup(DOCS[2] + [60, 61], None, None) == 3
        world.drop_next = True
        world.donate(DOCS[3], None, None)  # its first event is lost: A's generation is bumped
        assert world.lookup(DOCS[0] + [60, 61], None, None) == 0
    finally:
        world.close()


def test_the_oracle_catches_a_connector_that_ignores_the_salt(template, tmp_path, monkeypatch) -> None:
    """Self-test: with the salt left out of the namespace, the oracle rejects the promise."""
    import connector.namespace as namespace

    real = namespace.request_scope
    monkeypatch.setattr(namespace, "request_scope", lambda request: ("none", *real(request)[1:]))
    world = World(tmp_path, template)
    try:
        world.donate(DOCS[0], "tenant-x", None)
        with pytest.raises(AssertionError, match="stale/mismatched donor"):
            world.lookup(DOCS[0] + [60, 61], None, None)
    finally:
        world.close()
