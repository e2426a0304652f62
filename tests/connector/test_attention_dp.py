"""Attention data parallelism: one engine "A" whose ranks each run their own scheduler, worker and KV
pool (TensorRT-LLM 2026 main's contract, connector/layouts.py), sharing one donor store and one
ledger fed through the real publisher → consumer daemon → ledger path (tools/harness/fleet.py). Each
rank is a reference-harness engine with ``attention_dp_rank`` set: its KV events and every
``SchedulerOutput`` carry the rank, and its events reach A's one publisher as TensorRT-LLM's
gathered drain reaches the bridge.

Proves: a donor saved by one rank is materialized by another bit-identically to native reuse, in
both directions; donors are registered under their owner's rank and their block liveness is read
from that rank's blocks only, so a rank holding the same blocks never makes an evicted donor look
fresh; a scheduler that does not know its rank, or is told contradicting ranks, registers nothing;
a rank's donor file missing or corrupt is a counted miss and a prefill, the executor running on;
a plain engine never gets an attention-DP donor (namespace ``parallel_layout``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from sqlalchemy import select

from connector.harness import HarnessLLM, KvCacheConfig, block_hash_chain
from connector.harness.trtllm_versions import TRTLLM_1X, TRTLLM_MAIN_2026, TrtllmVersion
from connector.metrics import ConnectorMetrics
from ledger.db import sync_engine
from ledger.schema import BlockRow, DonorRow
from ledger.types import FreshnessPolicy, StaleReason, split_hash
from tests.connector.test_two_engines import native_engine
from tools.harness.fleet import MODEL, Engine, Fleet, bind_connector, doc_tokens, shared_model

TPB = MODEL.tokens_per_block
DOC = doc_tokens(12 * TPB, seed=31)
QUESTION = doc_tokens(24, seed=32)


@pytest.fixture
def fleet(tmp_path: Path):  # noqa: ANN201 - one source ("A", the attention-DP engine) and a plain "B"
    f = Fleet(tmp_path, ("A", "B")).start()
    try:
        yield f
    finally:
        f.stop()


def adp_ranks(fleet: Fleet, num_ranks: int, *, engine_id: str = "A", kv_cache_config: KvCacheConfig | None = None,
              version: TrtllmVersion = TRTLLM_MAIN_2026, **overrides) -> list[Engine]:
    """The ranks of one attention-DP engine on ``engine_id``'s source: one harness engine per rank
    (own pool, scheduler, worker, metrics), the same connector settings for all (one TOML)."""
    kvc = kv_cache_config or KvCacheConfig(tokens_per_block=TPB, event_buffer_max_size=4096,
                                           max_tokens=4 * MODEL.max_context)
    ranks = []
    for rank in range(num_ranks):
        old = fleet.engines.pop(f"{engine_id}/rank{rank}", None)
        if old is not None:
            fleet.close_engine(old)
        settings, metrics = fleet.connector_settings(engine_id, **overrides), ConnectorMetrics()
        llm = HarnessLLM(MODEL, kv_cache_config=kvc, kv_connector=bind_connector(settings, metrics),
                         max_num_tokens=256, model=shared_model(MODEL), trtllm_version=version,
                         attention_dp_rank=rank, attention_dp_size=num_ranks)
        engine = Engine(engine_id, llm, fleet.publishers[engine_id], metrics, settings)
        fleet.engines[f"{engine_id}/rank{rank}"] = engine  # Fleet.sync pumps and catches up every rank
        ranks.append(engine)
    return ranks


def donors(fleet: Fleet) -> list[tuple[int, int, str]]:
    """``(attention_dp_rank, num_blocks, state)`` of every donor in the ledger, by registration."""
    engine = sync_engine(fleet.db)
    try:
        with engine.connect() as conn:
            t = DonorRow.__table__
            return [tuple(r) for r in conn.execute(select(t.c.attention_dp_rank, t.c.num_blocks, t.c.state)
                                                   .order_by(t.c.registered_seq))]
    finally:
        engine.dispose()


def donor_ids(fleet: Fleet, *, rank: int, num_blocks: int) -> list[tuple[str, str]]:
    """``(donor_id, namespace)`` of the donors of ``rank`` with ``num_blocks`` blocks."""
    engine = sync_engine(fleet.db)
    try:
        with engine.connect() as conn:
            t = DonorRow.__table__
            return [tuple(r) for r in conn.execute(select(t.c.donor_id, t.c.namespace).where(
                t.c.attention_dp_rank == rank, t.c.num_blocks == num_blocks))]
    finally:
        engine.dispose()


def live_doc_blocks(fleet: Fleet, rank: int) -> int:
    """How many of DOC's engine blocks are live in rank ``rank``'s stream of engine A."""
    engine = sync_engine(fleet.db)
    wanted = {split_hash(h) for h in block_hash_chain(DOC, TPB)}
    try:
        with engine.connect() as conn:
            t = BlockRow.__table__
            rows = conn.execute(select(t.c.block_hash, t.c.block_hash_ext).where(
                t.c.engine_id == "A", t.c.attention_dp_rank == rank, t.c.state == "live"))
            return len(wanted & {(h, bytes(ext)) for h, ext in rows})
    finally:
        engine.dispose()


def test_ranks_materialize_each_others_donors_bit_identical_to_native_reuse(fleet: Fleet) -> None:
    r0, r1 = adp_ranks(fleet, 2)
    doc, question, more = doc_tokens(15 * TPB), doc_tokens(40, seed=2), doc_tokens(30, seed=3)
    r0.generate(doc)
    fleet.sync()

    got = r1.generate(doc + question, max_new_tokens=4)

    assert got.num_reused_tokens == 0 and got.num_connector_tokens == len(doc) == 480
    native = native_engine()
    native.generate(doc, 1)
    reference = native.generate(doc + question, 4)
    assert reference.num_reused_tokens == got.num_connector_tokens  # same prefill start
    assert torch.equal(got.prefill_logits, reference.prefill_logits)  # bit-identical
    assert got.token_ids == reference.token_ids
    blocks = len(doc) // TPB  # rank 1's blocks hold exactly the native engine's bytes for the document
    assert torch.equal(r1.llm.kv_cache[got.block_ids[:blocks]], native.kv_cache[reference.block_ids[:blocks]])
    assert r1.metrics.value("semkv_exact_materialized_total") == 1 and r1.misses() == {}
    fleet.sync()
    # each rank's donor is registered under its own rank: rank 0's document, rank 1's document + question
    assert donors(fleet) == [(0, 15, "live"), (1, 16, "live")]

    # and back: rank 0's device reuse covers the document, rank 1's donor the question's whole block
    back = r0.generate(doc + question + more, max_new_tokens=2)
    assert (back.num_reused_tokens, back.num_connector_tokens) == (480, TPB)
    native.generate(doc + question, 1)
    reference = native.generate(doc + question + more, 2)
    assert reference.num_reused_tokens == back.num_reused_tokens + back.num_connector_tokens
    assert torch.equal(back.prefill_logits, reference.prefill_logits)
    assert r0.metrics.value("semkv_exact_materialized_total") == 1
    assert r0.misses() == {"no_donor": 1}  # its first request, before any donor existed
    assert r0.llm.stopped is None and r1.llm.stopped is None


def test_a_donors_liveness_is_read_from_its_own_ranks_blocks_only(fleet: Fleet) -> None:
    """Ranks serving the same prefix hold blocks of the same hashes. Rank 0's donor of DOC must go
    stale when rank 0 evicts DOC, although rank 1 still holds those very hashes live."""
    small = KvCacheConfig(tokens_per_block=TPB, event_buffer_max_size=4096, max_tokens=24 * TPB)
    r0, r1, r2 = adp_ranks(fleet, 3, kv_cache_config=small)
    r0.generate(DOC)
    fleet.sync()
    assert r1.generate(DOC).num_connector_tokens == 11 * TPB  # rank 1 loads rank 0's donor ...
    fleet.sync()
    assert donors(fleet) == [(0, 12, "live")]  # ... the same span: no second donor
    assert live_doc_blocks(fleet, 0) == live_doc_blocks(fleet, 1) == 12

    r0.generate(doc_tokens(24 * TPB, seed=99))  # needs rank 0's whole pool: DOC's blocks `removed` there
    fleet.sync()
    assert (live_doc_blocks(fleet, 0), live_doc_blocks(fleet, 1)) == (0, 12)

    result = r2.generate(DOC + QUESTION)
    assert result.num_connector_tokens == 0
    assert r2.misses() == {"donor_blocks_removed": 1}
    assert r2.metrics.value("semkv_promises_total") == 0
    client = fleet.ledger()
    try:
        [(donor_id, namespace)] = donor_ids(fleet, rank=0, num_blocks=12)  # DOC's donor
        assert client.donor_freshness(donor_id, namespace=namespace,
                                      policy=FreshnessPolicy.ENGINE) == StaleReason.BLOCKS_NOT_LIVE
        # control: the blocks are the only reason (policy `store` takes the checksummed bytes as evidence)
        assert client.donor_freshness(donor_id, namespace=namespace, policy=FreshnessPolicy.STORE) is None
    finally:
        client.close()
    cold = shared_model(MODEL).forward_dense(DOC + QUESTION)
    assert torch.allclose(result.prefill_logits, cold[result.prefill_start:], rtol=1e-4, atol=1e-4)
    fleet.sync()  # rank 2 computed DOC + QUESTION itself: that is a donor of its own, under rank 2
    assert (2, 12, "live") in donors(fleet)


def test_a_scheduler_never_told_its_rank_registers_no_donor(fleet: Fleet) -> None:
    """A runtime that reports no ``SchedulerOutput.attention_dp_rank`` (1.x's manager shape): the
    request is served, but which rank's blocks hold it is unknown, so it is no donor."""
    [r0] = adp_ranks(fleet, 1, version=TRTLLM_1X)
    r0.generate(DOC)
    fleet.sync()
    assert donors(fleet) == []
    assert r0.metrics.value("semkv_donors_not_registered_total", reason="attention_dp_rank_unknown") == 1
    assert r0.metrics.value("semkv_donors_registered_total") == 0
    assert r0.llm.stopped is None


def test_a_configured_rank_that_disagrees_with_the_runtime_registers_no_donor(fleet: Fleet) -> None:
    """``attention_dp_rank = 0`` in the TOML every rank shares: rank 0 agrees, rank 1 is told 1 by
    TensorRT-LLM and refuses to register anything (its donors' liveness would be read from rank 0)."""
    r0, r1 = adp_ranks(fleet, 2, attention_dp_rank=0)
    r0.generate(DOC)
    r1.generate(doc_tokens(12 * TPB, seed=33))
    r1.generate(doc_tokens(12 * TPB, seed=34))
    fleet.sync()
    assert donors(fleet) == [(0, 12, "live")]
    assert r1.metrics.value("semkv_donors_not_registered_total", reason="attention_dp_rank_conflict") == 2
    assert r1.scheduler.donor_rank.conflict is not None and r0.scheduler.donor_rank.conflict is None
    assert r1.llm.stopped is None


def _delete(entry: Path) -> None:
    entry.unlink()


def _replace_corrupted(entry: Path) -> None:
    data = bytearray(entry.read_bytes())
    data[-64:] = bytes(b ^ 0xFF for b in data[-64:])
    tmp = entry.with_name(".tmp-corrupted.kv")
    tmp.write_bytes(data)
    os.rename(tmp, entry)  # a new file under the same name, its last layer's bytes wrong


@pytest.mark.parametrize("owner", [0, 1])
@pytest.mark.parametrize(("fault", "reason"), [(_delete, "store_missing"), (_replace_corrupted, "checksum_mismatch")],
                         ids=["missing", "corrupt"])
def test_a_ranks_donor_file_missing_or_corrupt_is_a_counted_miss_and_a_prefill(fleet: Fleet, owner: int, fault,
                                                                               reason: str) -> None:
    ranks = adp_ranks(fleet, 2)
    donor_rank, other = ranks[owner], ranks[1 - owner]
    donor_rank.generate(DOC)
    fleet.sync()
    other.scheduler.flush()  # the other rank's view took the donor in and checksummed its file
    assert donors(fleet) == [(owner, 12, "live")]
    [entry] = Path(fleet.store_dir).glob("*.kv")
    fault(entry)
    other.scheduler.sync_view()  # its store recheck notices the file is not the one it checksummed

    result = other.generate(DOC + QUESTION)

    assert result.num_connector_tokens == 0 and result.num_reused_tokens == 0
    assert other.misses() == {reason: 1}
    assert other.metrics.value("semkv_promises_total") == 0
    assert other.metrics.value("semkv_load_failures_total") == 0
    cold = native_engine().generate(DOC + QUESTION)  # the request was prefilled like any cold one
    assert torch.equal(result.prefill_logits, cold.prefill_logits)
    # both ranks keep serving
    assert other.llm.stopped is None and donor_rank.llm.stopped is None
    assert other.generate(doc_tokens(3 * TPB, seed=35)).token_ids
    assert donor_rank.generate(DOC + QUESTION).num_reused_tokens == len(DOC)  # its own device reuse, untouched


def test_a_plain_engine_never_gets_an_attention_dp_donor(fleet: Fleet) -> None:
    """The MLP/MoE of an attention-DP engine is computed across its ranks: its KV is not the bytes
    an engine without attention DP computes. The namespace carries the parallel layout, not the rank."""
    r0, r1 = adp_ranks(fleet, 2)
    r0.generate(DOC)
    fleet.sync()
    b = fleet.engine("B")
    result = b.generate(DOC + QUESTION)
    assert result.num_connector_tokens == 0
    assert b.misses() == {"namespace_mismatch": 1}
    assert b.metrics.value("semkv_namespace_mismatch_total", field="parallel_layout") == 1
    # control: a rank of the same engine does get it
    assert r1.generate(DOC + QUESTION).num_connector_tokens == len(DOC)
    assert r0.scheduler.namespace.fields["parallel_layout"] == r1.scheduler.namespace.fields["parallel_layout"]
