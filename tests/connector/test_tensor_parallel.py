"""Tensor parallelism (TP = 2) end to end: two reference-harness engines "A" and "B", each TP = 2 —
one process per rank, ``torch.distributed`` on gloo over 127.0.0.1 (tools/harness/tp.py) — with the
real connector, sharing one SQLite ledger and one donor store. The scheduler exists on rank 0 only
and its metadata is broadcast to both ranks' workers (connector/harness/connector_driver.py, as
TensorRT-LLM's ``KvCacheConnectorManager`` does).

Proves: each rank's worker saves its own shard and the donor is complete (``donor_saved``, naming
the manifest) only with both; B materializes A's donor — each rank loading its own shard —
bit-identically to TP = 2 native reuse; a TP = 2 donor is never offered to a TP = 1 engine
(namespace ``parallel_layout``); rank 0's shard missing or rank 1's shard corrupt makes the whole
donor a counted miss and a prefill, the executor of every rank running on; rank 1's shard evicted or
replaced AFTER rank 0 promised (in the window before rank 1's ``start_load_kv``) still loads the
bytes rank 0 checksummed and secured, bit-identically, every executor running on.

Freshness policy ``store``: the ranks' KV events do not reach a consumer here, so a donor's
freshness is its checksummed bytes (the engine-block policy is covered for TP = 1 and attention DP).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from sqlalchemy import select

from connector.donor_store import FileDonorStore, shard_ref
from connector.harness import HarnessLLM, KvCacheConfig, TensorParallel
from connector.metrics import ConnectorMetrics
from connector.settings import load_connector_settings
from ledger.db import sync_engine
from ledger.migrate import upgrade
from ledger.schema import DonorRow
from tests.harness.helpers import CFG, CHUNK, prompt
from tools.harness.fleet import bind_connector
from tools.harness.tp import run_tensor_parallel

TPB = CFG.tokens_per_block
DOC = prompt(6 * TPB, seed=61)
QUESTION = prompt(13, seed=62)
KVC = KvCacheConfig(tokens_per_block=TPB, max_tokens=128 * TPB, event_buffer_max_size=0)


def _settings(root: str, engine_id: str) -> dict:
    return {"db": f"sqlite:///{root}/ledger.db", "mode": "exact_equivalent", "engine_id": engine_id,
            "store_dir": f"{root}/donors", "lookup_timeout_s": 1.0, "store_capacity_bytes": 2**28,
            "freshness_policy": "store", "donor_view_refresh_s": 0.05}


def _engine(tp: TensorParallel, root: str, engine_id: str) -> tuple[HarnessLLM, ConnectorMetrics]:
    settings, metrics = load_connector_settings(_settings(root, engine_id), environ={}), ConnectorMetrics()
    llm = HarnessLLM(CFG, kv_cache_config=KVC, kv_connector=bind_connector(settings, metrics), max_num_tokens=CHUNK,
                     tensor_parallel=tp)
    return llm, metrics


def _native(tp: TensorParallel, *, reuse: bool):  # noqa: ANN202 - B's native-reuse path (or a cold prefill)
    llm = HarnessLLM(CFG, kv_cache_config=KvCacheConfig(tokens_per_block=TPB, max_tokens=128 * TPB,
                                                        enable_block_reuse=reuse), max_num_tokens=CHUNK,
                     tensor_parallel=tp)
    if reuse:
        llm.generate(DOC, 1)
    return llm.generate(DOC + QUESTION, 3)


def _donor_saved_by_a(tp: TensorParallel, root: str) -> None:
    a, _ = _engine(tp, root, "A")
    a.generate(DOC, 2)
    a.connector.workers[0].flush()  # this rank's shard is written (and the manifest, by the last rank)
    if tp.rank == 0:
        a.connector.scheduler.flush()
    dist.barrier()  # both ranks' shards are published before anyone looks for the donor
    if tp.rank == 0:  # A is done: its scheduler's background jobs must not race B's (e.g. checksum the faulted shard)
        a.connector.scheduler.close()
    a.connector.workers[0].close()


def _fault(root: str, fault: str | None) -> None:
    donors = Path(root) / "donors"
    [manifest] = [p for p in donors.glob("*.kv") if ".tp" not in p.name]
    donor_id = manifest.name.removesuffix(".kv")
    if fault == "rank0_missing":
        (donors / shard_ref(donor_id, 0, 2)).unlink()
    elif fault == "rank1_corrupt":
        shard = donors / shard_ref(donor_id, 1, 2)
        data = bytearray(shard.read_bytes())
        data[-64:] = bytes(b ^ 0xFF for b in data[-64:])
        tmp = shard.with_name(".tmp-corrupted.kv")
        tmp.write_bytes(data)
        os.rename(tmp, shard)  # a new file under the same name, its last layer's bytes wrong


def _fault_after_promise(b: HarnessLLM, root: str, fault: str) -> None:
    """On rank 1, once: between rank 0's promise (the plan is in the bound metadata) and this rank's
    ``start_load_kv``, its shard is evicted by another process, or replaced by a corrupt file."""
    worker, done = b.connector.workers[0], []

    def observe(point: str, _ids: object) -> None:
        meta = worker.get_connector_meta()
        if point != "after_build_connector_meta" or done or not getattr(meta, "loads", ()):
            return
        done.append(point)
        if fault == "rank1_evicted_after_promise":
            donor_id = _manifest_ref(root).removesuffix(".kv")
            assert FileDonorStore(Path(root) / "donors", 2**28).evict(donor_id, "capacity")
        else:
            _fault(root, "rank1_corrupt")

    b.add_lifecycle_observer(observe)


def _b_loads_a_donor(tp: TensorParallel, root: str, fault: str | None) -> dict:
    _donor_saved_by_a(tp, root)
    if fault == "launcher_env_all_rank0":  # a launcher's variable says rank 0 in every process of B
        os.environ["OMPI_COMM_WORLD_RANK"], fault = "0", None
    b, metrics = _engine(tp, root, "B")
    if fault is not None and fault.endswith("_after_promise"):
        if tp.rank == 1:
            _fault_after_promise(b, root, fault)
        fault = None
    if tp.rank == 0:
        b.connector.scheduler.sync_view()
        b.connector.scheduler.flush()  # its view took the donor in and checksummed every shard
        verified = b.connector.scheduler.store.shards_of(_manifest_ref(root))
        _fault(root, fault)
        b.connector.scheduler.sync_view()  # the store's recheck notices a shard is not the one it checksummed
    dist.barrier()
    got = b.generate(DOC + QUESTION, 3)
    after = b.generate(prompt(3 * TPB, seed=63), 2)  # the executor runs on
    if tp.rank == 0:
        b.connector.scheduler.flush()
    worker = b.connector.workers[0]
    return {"connector_tokens": got.num_connector_tokens, "reused": got.num_reused_tokens,
            "logits": got.prefill_logits, "tokens": got.token_ids, "native": _native(tp, reuse=True).prefill_logits,
            "cold": _native(tp, reuse=False).prefill_logits, "stopped": b.stopped, "after": after.token_ids,
            "misses": metrics.misses_by_reason(), "promises": metrics.value("semkv_promises_total"),
            "load_failures": metrics.value("semkv_load_failures_total"), "verified": verified if tp.rank == 0 else None,
            "materialized": metrics.value("semkv_exact_materialized_total"), "tp_rank": worker.tp_rank}


def _manifest_ref(root: str) -> str:
    [manifest] = [p for p in (Path(root) / "donors").glob("*.kv") if ".tp" not in p.name]
    return manifest.name


@pytest.fixture
def root(tmp_path: Path) -> str:
    upgrade(f"sqlite:///{tmp_path}/ledger.db")
    return str(tmp_path)


def _donors(root: str) -> list[tuple]:
    engine = sync_engine(f"sqlite:///{root}/ledger.db")
    try:
        with engine.connect() as conn:
            t = DonorRow.__table__
            return [tuple(r) for r in conn.execute(select(t.c.engine_id, t.c.num_blocks, t.c.state, t.c.store_ref))]
    finally:
        engine.dispose()


def test_b_materializes_a_tp2_donor_shard_by_shard_bit_identical_to_tp2_native_reuse(root: str) -> None:
    r0, r1 = run_tensor_parallel(_b_loads_a_donor, 2, (root, None))
    [(engine_id, num_blocks, state, store_ref)] = [d for d in _donors(root) if d[0] == "A"]
    assert (num_blocks, state) == (6, "live")
    donor_id = store_ref.removesuffix(".kv")
    # the ledger names the manifest; the manifest lists each rank's shard, and each was checksummed
    assert [ref for ref, _ in r0["verified"]] == [shard_ref(donor_id, 0, 2), shard_ref(donor_id, 1, 2)]
    assert (r0["tp_rank"], r1["tp_rank"]) == (0, 1)
    for rank in (r0, r1):
        assert rank["connector_tokens"] == len(DOC) and rank["reused"] == 0
        assert torch.equal(rank["logits"], rank["native"])  # bit-identical to TP = 2 native reuse
        assert rank["stopped"] is None
    assert r0["misses"] == {"no_donor": 1} and r0["promises"] == 1 and r0["load_failures"] == 0  # "after" misses
    assert r0["materialized"] == r1["materialized"] == 1  # each rank's worker loaded its own shard
    assert r0["tokens"] == r1["tokens"]


@pytest.mark.parametrize(("fault", "reason"), [("rank0_missing", "store_missing"),
                                               ("rank1_corrupt", "checksum_mismatch")])
def test_one_ranks_shard_missing_or_corrupt_fails_the_whole_donor_closed(root: str, fault: str, reason: str) -> None:
    r0, r1 = run_tensor_parallel(_b_loads_a_donor, 2, (root, fault))
    assert r0["misses"] == {reason: 1, "no_donor": 1} and r0["promises"] == 0  # "no_donor": the request after
    for rank in (r0, r1):
        assert rank["connector_tokens"] == 0 and rank["load_failures"] == 0 and rank["materialized"] == 0
        assert torch.equal(rank["logits"], rank["cold"])  # prefilled like any cold request
        assert rank["stopped"] is None and rank["after"]  # every rank's executor keeps serving


def test_a_launcher_environment_that_names_the_wrong_rank_does_not_decide_which_shard_loads(root: str) -> None:
    # before: both of B's workers took rank 0 from OMPI_COMM_WORLD_RANK, rank 1 loaded rank 0's shard
    # (same shape, a valid shard: no check fails) and its logits were wrong; the process group decides now
    r0, r1 = run_tensor_parallel(_b_loads_a_donor, 2, (root, "launcher_env_all_rank0"))
    assert (r0["tp_rank"], r1["tp_rank"]) == (0, 1)
    for rank in (r0, r1):
        assert rank["connector_tokens"] == len(DOC) and torch.equal(rank["logits"], rank["native"])


@pytest.mark.parametrize("fault", ["rank1_evicted_after_promise", "rank1_replaced_after_promise"])
def test_rank1s_shard_evicted_or_replaced_after_the_promise_still_loads_what_rank0_secured(root: str,
                                                                                          fault: str) -> None:
    r0, r1 = run_tensor_parallel(_b_loads_a_donor, 2, (root, fault))
    assert r0["promises"] == 1 and r0["materialized"] == r1["materialized"] == 1
    for rank in (r0, r1):
        assert rank["connector_tokens"] == len(DOC) and rank["load_failures"] == 0
        assert torch.equal(rank["logits"], rank["native"])  # the checksummed bytes, not the new file
        assert rank["stopped"] is None and rank["after"]


def _tp1_engine_after_a(tp: TensorParallel, root: str) -> dict:
    _donor_saved_by_a(tp, root)
    if tp.rank != 0:
        return {}
    single, metrics = _engine(TensorParallel(), root, "C")  # TP = 1, in rank 0's process
    single.connector.scheduler.sync_view()
    single.connector.scheduler.flush()
    got = single.generate(DOC + QUESTION, 2)
    single.connector.scheduler.flush()
    a_ns = single.connector.scheduler.namespace
    return {"connector_tokens": got.num_connector_tokens, "misses": metrics.misses_by_reason(),
            "parallel_layout": (a_ns.fields or {}).get("parallel_layout"),
            "mismatched": {s.labels["field"]: s.value for m in metrics.namespace_mismatch.collect()
                           for s in m.samples if s.name.endswith("_total")}}


def test_a_tp2_donor_is_never_offered_to_a_tp1_engine(root: str) -> None:
    r0, _ = run_tensor_parallel(_tp1_engine_after_a, 2, (root,))
    assert [d[:3] for d in _donors(root) if d[0] == "A"] == [("A", 6, "live")]
    assert r0["parallel_layout"] is None and r0["connector_tokens"] == 0
    # the same tokens' donor exists, under another namespace: its per-rank pool is half the KV heads
    assert r0["misses"] == {"namespace_mismatch": 1} and r0["mismatched"] == {"kv_layout": 1}
