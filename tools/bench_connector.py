"""KV Cache Connector benchmark (issue 5; targets in DESIGN §7).

Measures, in one run:

1. ``get_num_new_matched_tokens`` latency (p50/p99) at 2K, 8K and 32K-token prompts against a ledger
   holding 1M live blocks (plus ~1M donor blocks): the hit path (longest fresh donor span, store
   check, the donor's checksummed file secured) and the miss path (no donor), with the key-hashing
   and lease shares broken out, for each promise protocol side by side: TensorRT-LLM's BINDING
   promises (the default: bytes secured in the lookup, no ledger lease), vLLM's RETRACTABLE ones
   (``engine=VLLM``: the lease queued at allocation, ``build_connector_meta`` waits for it) and
   TensorRT-LLM with ``lease_before_answer`` (the lease written inside the lookup: what earlier
   releases did on TensorRT-LLM); on the default
   engine also freshness policy ``store`` (no block check) and a donor view holding every donor of
   the ledger (its size does not matter; its memory is reported). SQLite; PostgreSQL with
   ``--postgres`` (default and ``lease_before_answer``). Key hashing is timed as a whole-prompt hit
   does it now (tokens packed, the last prefix key) and as connector version 1 did (every key
   chained block by block), on the same prompts, side by side.
2. TTFT on the reference harness model (2 layers, 4 heads, 2 KV heads, head_dim 32, fp32, CPU):
   cold prefill vs. a prefix materialized from another engine's donor vs. the engine's own
   device reuse of the same prefix (the ideal the connector can at best reach), at 8K/16K/32K.
   B's donor store has verified A's donors beforehand (a donor bigger than
   ``store_inline_verify_max_bytes`` is verified in the background after its first lookup, which misses).
   With it, the IN-PLACE WRITE WINDOW of each materialized binding promise: from the lookup's answer
   (``get_num_new_matched_tokens`` returning) to the worker having read and checksummed the plan's
   last layer (the end of ``start_load_kv``, where TensorRT-LLM's worker loads every layer): the
   only time in which a write into the secured file itself could still change the bytes promised.
3. Worker revalidation time as a share of the copy time of those plans (the 32K plan is DESIGN
   §7's target), and the same for a synthetic 32-layer pool (worker only, no model).

The bulk of the ledger (1M blocks, ~2000 donors of 512 blocks) is written straight into the
projection tables with SQL (the recorder's own path runs at ~50–90k block events/s here, see
ledger-*.md); the donors used by the lookups are registered, saved and leased through the real
connector/ledger path. Harness engines' KV events go to the ledger through the real decoder
(``consumer.wire.decode_message``) and recorder, without ZMQ.

Usage: ``python tools/bench_connector.py [--blocks 1000000] [--postgres] [--quick]``; prints the
table and writes it to ``tools/results/connector-YYYY-MM-DD.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import datetime as dt
import itertools
import os
import statistics
import struct
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connector._trtllm import SchedulerOutput  # noqa: E402
from connector.donor_store import FileDonorStore  # noqa: E402
from connector.engine_contract import TENSORRT_LLM, VLLM, EngineContract  # noqa: E402
from connector.harness import HarnessLLM, HarnessLlmArgs, HarnessTransformer, KvCacheConfig, LlmRequest, ModelConfig  # noqa: E402
from connector.harness.connector_driver import HarnessStream  # noqa: E402
from connector.metrics import ConnectorMetrics  # noqa: E402
from connector.namespace import content_keys, prefix_keys  # noqa: E402
from connector.plan import ConnectorMetadata, LoadPlan  # noqa: E402
from connector.scheduler import SemKvScheduler  # noqa: E402
from connector.settings import load_connector_settings  # noqa: E402
from connector.worker import SemKvWorker  # noqa: E402
from consumer.wire import decode_message  # noqa: E402
from ledger import events as ev  # noqa: E402
from ledger import recorder  # noqa: E402
from ledger.db import sync_engine  # noqa: E402
from ledger.migrate import upgrade  # noqa: E402
from ledger.client import LedgerClient  # noqa: E402
from ledger.schema import BlockRow, DonorBlockRow, DonorRow, EngineRow  # noqa: E402
from ledger.types import u64_to_i64  # noqa: E402

TPB = 32
BULK_ENGINE = "bulk"
DONOR_BLOCKS = 512


def model_config(max_context: int) -> ModelConfig:
    return ModelConfig(max_context=max_context)


def llm_args(cfg: ModelConfig, max_tokens: int) -> HarnessLlmArgs:
    return HarnessLlmArgs(model=cfg.name, harness_model_config=cfg, max_seq_len=cfg.max_context, max_num_tokens=2048,
                          kv_cache_config=KvCacheConfig(tokens_per_block=TPB, max_tokens=max_tokens))


def settings(db: str, store: Path, engine_id: str, **kw):  # noqa: ANN201
    values = {"db": db, "mode": "exact_equivalent", "engine_id": engine_id, "store_dir": store,
              "lookup_timeout_s": 1.0, "store_capacity_bytes": 64 * 2**30, **kw}
    return load_connector_settings(values, environ={})


# ---------------------------------------------------------------------------------------------
# ledger population
# ---------------------------------------------------------------------------------------------


def _h(i: int) -> int:
    return u64_to_i64((i * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % 2**64)


def block_row(h: int, seq: int) -> dict:
    return {"engine_id": BULK_ENGINE, "attention_dp_rank": 0, "window_size": 0, "block_hash": h, "block_hash_ext": b"",
            "parent_hash": None, "parent_hash_ext": None, "num_tokens": TPB, "tokens_digest": h, "cache_level": 0,
            "priority": 35, "cache_salt": None, "lora_id": None, "state": "live", "generation": 1, "store_count": 1,
            "stored_seq": seq, "updated_seq": seq}


def populate(db: str, namespace: str, num_blocks: int) -> float:
    """1M live blocks of engine ``bulk`` and donors over them (straight into the projections)."""
    started = time.perf_counter()
    engine = sync_engine(db, writer=True)
    with engine.begin() as conn:
        conn.execute(EngineRow.__table__.insert(), [{"engine_id": BULK_ENGINE, "generation": 1, "status": "active",
                                                    "registered_seq": 1, "generation_seq": 1, "last_seq": 1}])
    chunk = 50_000
    for start in range(0, num_blocks, chunk):
        with engine.begin() as conn:
            conn.execute(BlockRow.__table__.insert(), [block_row(_h(i), 2) for i in range(start, min(num_blocks, start + chunk))])
            donors, dblocks = [], []
            for d in range(start // DONOR_BLOCKS, min(num_blocks, start + chunk) // DONOR_BLOCKS):
                donor_id = f"bulk-{d}"
                donors.append({"donor_id": donor_id, "namespace": namespace, "engine_id": BULK_ENGINE,
                               "attention_dp_rank": 0, "window_size": 0, "generation": 1,
                               "num_tokens": DONOR_BLOCKS * TPB, "num_blocks": DONOR_BLOCKS, "tokens_per_block": TPB,
                               "provider_generation": 0, "expires_at": None, "state": "live",
                               "store_ref": f"{donor_id}.kv", "checksum": "0" * 32, "size_bytes": 1,
                               "registered_seq": 2, "updated_seq": 2})
                dblocks += [{"donor_id": donor_id, "position": p, "content_key": uuid.uuid4().bytes,
                             "block_hash": _h(d * DONOR_BLOCKS + p), "block_hash_ext": b""} for p in range(DONOR_BLOCKS)]
            if donors:
                conn.execute(DonorRow.__table__.insert(), donors)
                conn.execute(DonorBlockRow.__table__.insert(), dblocks)
    # fresh planner statistics after the bulk load (PostgreSQL needs them); on PostgreSQL also the
    # vacuum its autovacuum would otherwise start on the 2M new rows in the middle of the timings
    # (VACUUM runs outside a transaction; SQLite's ANALYZE inside one, or it is rolled back)
    if engine.dialect.name == "sqlite":
        with engine.begin() as conn:
            conn.exec_driver_sql("ANALYZE")
    else:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE")
    engine.dispose()
    return time.perf_counter() - started


def add_lookup_donor(db: str, ledger: LedgerClient, store: FileDonorStore, namespace, tokens: list[int],
                     layout: tuple[int, int, int], seed: int) -> str:
    """Register + save (real path) a donor for ``tokens``' whole blocks; its blocks live in ``bulk``."""
    n = len(tokens) // TPB
    keys = content_keys(namespace, tokens, TPB, n)
    hashes = [(_h(10_000_000 + seed * 100_000 + i)) % 2**64 for i in range(n)]
    engine = sync_engine(db, writer=True)
    with engine.begin() as conn:
        conn.execute(BlockRow.__table__.insert(), [block_row(u64_to_i64(h), 3) for h in hashes])
    engine.dispose()
    donor_id = uuid.uuid4().hex
    ledger.register_donor(ev.DonorRegistered(donor_id=donor_id, namespace=namespace.digest, engine_id=BULK_ENGINE,
                                             generation=1, content_keys=keys, block_hashes=hashes, num_tokens=n * TPB,
                                             tokens_per_block=TPB))
    layers, kv_factor, elems = layout
    data = [np.zeros((n, kv_factor, elems), np.float32) for _ in range(layers)]
    store.put(donor_id, data, {"namespace": namespace.digest, "num_layers": layers, "kv_factor": kv_factor,
                               "block_elems": elems, "dtype": "float32", "itemsize": 4, "num_blocks": n,
                               "tokens_per_block": TPB})
    return donor_id


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class GcWatch:
    """Counts Python's cyclic garbage collections (``gc.callbacks``), so each timed lookup can say
    whether a collection ran inside it: a full collection of this process's heap takes ~15 ms here
    and lands on whichever thread allocates past the threshold, engine thread included; it is the
    host process's pause, not the connector's work."""

    def __init__(self) -> None:
        self.collections = 0
        gc.callbacks.append(self._count)

    def _count(self, phase: str, info: dict) -> None:
        if phase == "stop":
            self.collections += 1


GC = GcWatch()
TRTLLM_GC_GEN0_THRESHOLD = 20_000
"""TensorRT-LLM's executor loop runs under ``gc.set_threshold(garbage_collection_gen0_threshold)``,
default 20000 (NVIDIA/TensorRT-LLM ``tensorrt_llm/llmapi/llm_args.py`` ``TorchLlmArgs``;
``customized_gc_thresholds`` around ``PyExecutor.event_loop``): its rows are measured so."""


@contextlib.contextmanager
def gc_threshold(gen0: int | None) -> Iterator[None]:
    """``gc.set_threshold(gen0)`` for the block (None: Python's defaults)."""
    before = gc.get_threshold()
    if gen0:
        gc.set_threshold(gen0)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _ms(values: list[float], q: float) -> str:
    """The ``q`` quantile in ms, or a dash when nothing was measured (no lease written)."""
    return f"{pct(values, q) * 1e3:.3f} ms" if values else "—"


# ---------------------------------------------------------------------------------------------
# 1. lookup latency
# ---------------------------------------------------------------------------------------------


def _chained_keys_v1(namespace, token_ids, tokens_per_block, num_blocks):  # noqa: ANN001, ANN202
    """Connector version 1's content keys (chained block by block, every key computed: one
    ``xxh3_128_digest(seed || parent || block)`` per block), for the side-by-side timing."""
    import xxhash

    n = min(num_blocks, len(token_ids) // tokens_per_block)
    packed = struct.pack(f"<{n * tokens_per_block}q", *token_ids[: n * tokens_per_block])
    seed, stride, keys, parent = namespace.key_seed, tokens_per_block * 8, [], b""
    for start in range(0, n * stride, stride):
        parent = xxhash.xxh3_128_digest(seed + parent + packed[start : start + stride])
        keys.append(parent)
    return keys


def _whole_prompt_key(namespace, token_ids, tokens_per_block, num_blocks):  # noqa: ANN001, ANN202
    """What a whole-prompt hit computes now: the tokens packed once, the last key probed."""
    return prefix_keys(namespace, token_ids, tokens_per_block, num_blocks)[-1]


def lease_where(engine: EngineContract, lease_before_answer: bool) -> str:
    """Where a hit's ledger lease is written, for the table."""
    if lease_before_answer:
        return "in the lookup (timed in the hit)"
    if engine.recomputes_failed_loads:
        return "after alloc; build_connector_meta waits for it"
    return "none (the secured file holds the bytes)"


def bench_lookups(db: str, store_dir: Path, sizes: list[int], repeats: int, policy: str = "engine",
                  whole_view: bool = False, engine: EngineContract = TENSORRT_LLM, seed_offset: int = 0,
                  gc_gen0: int | None = None,
                  **extra_settings) -> list[dict]:  # noqa: ANN003
    """``whole_view``: the donor view also holds the ~1M bulk donor blocks (as if their bytes were in
    this host's store), to show a lookup does not slow down with the view's size, and its memory.
    ``engine``: the promise protocol (TensorRT-LLM: binding; vLLM: retractable); ``extra_settings``
    (e.g. ``lease_before_answer=True``) go to the connector's settings; ``seed_offset`` keeps each
    variant's lookup donors' block hashes distinct in the shared ledger."""
    cfg = model_config(max(sizes) + 1024)
    args = llm_args(cfg, 4096)
    metrics = ConnectorMetrics()
    extra = {"donor_view_max_blocks": 4_000_000} if whole_view else {}
    if extra_settings.get("lease_before_answer"):
        # the lookup's deadline is then lease_in_lookup_timeout_s (default 50 ms): raised like
        # lookup_timeout_s, so that a slow lease shows in the latency instead of failing the hit
        extra_settings.setdefault("lease_in_lookup_timeout_s", 1.0)
    sched = SemKvScheduler(args, settings=settings(db, store_dir, "bench-B", freshness_policy=policy, **extra,
                                                   **extra_settings),
                           metrics=metrics, engine=engine)
    where = lease_where(engine, bool(extra_settings.get("lease_before_answer")))
    view_note = ""
    if whole_view:
        rss_before = _rss_mib()
        view = sched.spans.view
        assert view is not None
        view.wanted = lambda donor_id, store_ref, checksum: True
        view.cursor = -1  # reload everything with the new filter
        started = time.perf_counter()
        sched.sync_view()
        stats = view.stats()
        view_note = (f"view of {stats['donors']:,} donors / {stats['blocks']:,} blocks loaded in "
                     f"{time.perf_counter() - started:.1f} s, +{_rss_mib() - rss_before:,.0f} MiB RSS")
        print(view_note, flush=True)
    layout = (cfg.num_layers, 2, cfg.num_kv_heads * cfg.head_dim * TPB)
    lease_times: list[float] = []
    take_lease = sched.ledger.take_lease  # the promise book's ledger (same object): in the lookup or on the ledger thread

    def timed_take_lease(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        started = time.perf_counter()
        try:
            return take_lease(*a, **kw)
        finally:
            lease_times.append(time.perf_counter() - started)

    sched.ledger.take_lease = timed_take_lease

    def signals_by_reason() -> dict[str, float]:  # binding promises the ledger then called stale (or failed)
        return metrics.counts_by_reason("semkv_stale_after_promise")

    def signals() -> float:
        return sum(signals_by_reason().values())

    rows = []
    gen = torch.Generator().manual_seed(7)
    try:
        for size in sizes:
            tokens = torch.randint(1, cfg.vocab_size, (size,), generator=gen).tolist()
            prompt = tokens + [1, 2, 3]
            ns = sched.namespace.for_request(LlmRequest(0, prompt, 1))
            donor_id = add_lookup_donor(db, sched.ledger, sched.store, ns, tokens, layout,
                                        seed=size + seed_offset + (50_000 if policy != "engine" else 0)
                                        + (100_000 if whole_view else 0))
            sched.store.verify(f"{donor_id}.kv", _checksum(db, donor_id))  # as the background verifier would
            sched.sync_view()  # the donor view's tick would take it in within donor_view_refresh_s
            lease_times.clear()
            signals_before = signals()
            gc_ran: list[bool] = []
            with gc_threshold(gc_gen0):
                hit, miss = _timed_lookups(sched, prompt, size, cfg, gen, repeats, settle_each=False, gc_ran=gc_ran)
                idle_hit, idle_miss = _timed_lookups(sched, prompt, size, cfg, gen, repeats, settle_each=True)
            clean_hit = [t for t, ran in zip(hit, gc_ran[0::2], strict=True) if not ran]
            clean_miss = [t for t, ran in zip(miss, gc_ran[1::2], strict=True) if not ran]
            leases_written, stale = len(lease_times), signals() - signals_before
            keys, keys_before = [], []
            request_tokens = LlmRequest(0, prompt, 1).get_tokens(0)
            for _ in range(repeats):
                for fn, out in ((_whole_prompt_key, keys), (_chained_keys_v1, keys_before)):
                    started = time.perf_counter()
                    fn(ns, request_tokens, TPB, size // TPB)
                    out.append(time.perf_counter() - started)
            rows.append({"size": size, "policy": policy, "hit": hit, "miss": miss, "idle_hit": idle_hit,
                         "clean_hit": clean_hit, "clean_miss": clean_miss, "gc_lookups": sum(gc_ran),
                         "gc_gen0": gc_gen0 or gc.get_threshold()[0],
                         "idle_miss": idle_miss, "keys": keys, "keys_before": keys_before, "lease": lease_times[3:],
                         "leases_written": leases_written, "hits": 2 * (repeats + 3), "stale": stale,
                         "stale_by_reason": signals_by_reason(), "where": where, "note": view_note})
            print(f"lookup {policy} {engine.name}{' lease_before_answer' if extra_settings.get('lease_before_answer') else ''} "
                  f"{size}: hit p50 {pct(hit, .5) * 1e3:.3f} ms p99 {pct(hit, .99) * 1e3:.3f} ms, "
                  f"miss p50 {pct(miss, .5) * 1e3:.3f} ms p99 {pct(miss, .99) * 1e3:.3f} ms; after idle: hit p99 "
                  f"{pct(idle_hit, .99) * 1e3:.3f} ms, miss p99 {pct(idle_miss, .99) * 1e3:.3f} ms; keys "
                  f"{statistics.median(keys) * 1e3:.3f} ms (before {statistics.median(keys_before) * 1e3:.3f} ms), "
                  f"lease p50 {_ms(lease_times[3:], .5)} ({leases_written} written for "
                  f"{2 * (repeats + 3)} hits; freshness signals {stale:.0f}: {signals_by_reason()})", flush=True)
    finally:
        sched.close()
    return rows


def _timed_lookups(sched: SemKvScheduler, prompt: list[int], size: int, cfg: ModelConfig, gen: torch.Generator,
                   repeats: int, *, settle_each: bool, gc_ran: list[bool] | None = None
                   ) -> tuple[list[float], list[float]]:
    """``repeats`` hit and miss lookups (after 3 untimed ones), each request then run on as an
    engine would: a hit's blocks allocated (its ledger lease queued, unless the lookup wrote it) and
    its metadata built (which, for retractable promises only, waits for the lease), then finished.
    ``settle_each=False``: like an engine, the next lookup does not wait for the background work
    (binding promises' lease writes, lease releases, miss diagnosis), which runs beside it (waited
    for every 50 iterations, untimed). ``settle_each=True`` (the method of the 2026-11-29/30 tables): all
    background work is waited for before each lookup, so the engine thread has just been idle —
    on this VM the next ~100 µs of Python then run up to 2x slower. ``gc_ran`` gets, per timed
    lookup (hits then misses, interleaved), whether a garbage collection ran inside it."""
    hit: list[float] = []
    miss: list[float] = []
    for i in range(repeats + 3):
        request = LlmRequest(1000 + i, prompt, 1)
        collections, started = GC.collections, time.perf_counter()
        n, _ = sched.get_num_new_matched_tokens(request, 0)
        elapsed = time.perf_counter() - started
        if gc_ran is not None and i >= 3:
            gc_ran.append(GC.collections != collections)
        assert n == size, (n, size, sched.metrics.misses_by_reason())
        ship_plan(sched, request, prompt, size // TPB)
        sched.request_finished(request, [])
        if settle_each:
            sched.flush()
        if i >= 3:
            hit.append(elapsed)
        other = LlmRequest(5000 + i, torch.randint(1, cfg.vocab_size, (size + 3,), generator=gen).tolist(), 1)
        collections, started = GC.collections, time.perf_counter()
        n, _ = sched.get_num_new_matched_tokens(other, 0)
        elapsed = time.perf_counter() - started
        if gc_ran is not None and i >= 3:
            gc_ran.append(GC.collections != collections)
        assert n == 0
        sched.request_finished(other, [])
        if settle_each or i % 50 == 49:
            sched.flush()
        if i >= 3:
            miss.append(elapsed)
    sched.flush()
    return hit, miss


def ship_plan(sched: SemKvScheduler, request: LlmRequest, prompt: list[int], num_blocks: int) -> LoadPlan:
    """What the engine does after a hit: allocate the blocks (vLLM's ledger lease is queued then) and
    build the iteration's metadata (vLLM's promises wait there for the lease; TensorRT-LLM's ship at
    once and write no lease, unless the lookup wrote it: ``lease_before_answer``). ``bench_lookups``
    times ``take_lease`` wherever it runs, and ``_timed_lookups`` waits for the ledger thread at the
    end of each method (so every queued lease is written, and timed, before a row is recorded).
    Returns the shipped plan."""
    block_ids = list(range(len(prompt) // TPB + 1))
    sched.update_state_after_alloc(request, block_ids)
    data = type("RD", (), {"request_id": request.request_id, "computed_position": 0, "new_block_ids": block_ids,
                           "block_hashes": []})()
    [plan] = sched.build_connector_meta(SchedulerOutput(new_requests=[data])).loads
    assert plan.failed is None and plan.num_blocks == num_blocks, plan
    return plan


def _saved_donors(db: str, engine_id: str) -> list[tuple[str, str, str]]:
    t = DonorRow.__table__
    engine = sync_engine(db)
    with engine.connect() as conn:
        rows = conn.execute(t.select().where(t.c.engine_id == engine_id, t.c.state == "live")).all()
    engine.dispose()
    return [(r.donor_id, r.store_ref, r.checksum) for r in rows]


def _checksum(db: str, donor_id: str) -> str:
    engine = sync_engine(db)
    with engine.connect() as conn:
        value = conn.execute(DonorRow.__table__.select().where(DonorRow.__table__.c.donor_id == donor_id)).first()
    engine.dispose()
    return value.checksum


# ---------------------------------------------------------------------------------------------
# 2. TTFT and 3. revalidation share
# ---------------------------------------------------------------------------------------------


def pump(writer_engine, llm: HarnessLLM, source_id: str, engine_id: str, seq: list[int]) -> None:
    events = llm.get_kv_cache_events(0)
    if not events:
        return
    payload = msgspec.msgpack.encode([time.time(), events, None])
    batch = decode_message([b"kv", seq[0].to_bytes(8, "big"), payload], source_id=source_id, engine_id=engine_id,
                           received_at=time.time())
    seq[0] += 1
    with writer_engine.begin() as conn:
        recorder.append(conn, [batch])


def watch_in_place_window(llm: HarnessLLM, answered: dict, loaded: dict) -> None:
    """Time each binding promise's in-place write window on ``llm``: ``answered[request_id]`` is
    ``perf_counter()`` when its scheduler's ``get_num_new_matched_tokens`` returned a hit,
    ``loaded[request_id]`` when the (first) worker's ``start_load_kv`` that loaded its plan returned
    (on TensorRT-LLM every layer is read, checksummed and copied there, before the forward)."""
    sched, worker = llm.connector.scheduler, llm.connector.workers[0]
    lookup, start_load_kv = sched.get_num_new_matched_tokens, worker.start_load_kv

    def timed_lookup(request, num_computed_tokens):  # noqa: ANN001, ANN202
        result = lookup(request, num_computed_tokens)
        now = time.perf_counter()
        if result[0] > 0:
            answered[request.request_id] = now
        return result

    def timed_start_load_kv(stream):  # noqa: ANN001, ANN202
        meta = worker.get_connector_meta()
        start_load_kv(stream)  # a raise (a failed load) records nothing
        now = time.perf_counter()
        if isinstance(meta, ConnectorMetadata):
            for plan in meta.loads:
                loaded.setdefault(plan.request_id, now)

    sched.get_num_new_matched_tokens = timed_lookup
    worker.start_load_kv = timed_start_load_kv


def bench_ttft(db: str, store_dir: Path, sizes: list[int], reps: int = 3) -> list[dict]:
    rows = []
    writer = sync_engine(db, writer=True)
    gen = torch.Generator().manual_seed(11)
    for size in sizes:
        cfg = model_config(size + 256)
        kvc = KvCacheConfig(tokens_per_block=TPB, max_tokens=2 * (size + 256), event_buffer_max_size=1_000_000)
        model = HarnessTransformer(cfg)

        def make_engine(name: str) -> HarnessLLM:
            # only A registers donors (B's own would be longer, and unverified in the next fresh B)
            s, m = settings(db, store_dir, name if "-A-" in name else None), ConnectorMetrics()
            sched = type("S", (SemKvScheduler,), {"__init__": lambda self, a: SemKvScheduler.__init__(self, a, settings=s, metrics=m)})
            work = type("W", (SemKvWorker,), {"__init__": lambda self, a: SemKvWorker.__init__(self, a, settings=s, metrics=m)})
            return HarnessLLM(cfg, kv_cache_config=kvc, kv_connector=(sched, work), max_num_tokens=2048, model=model)

        engines = []
        try:
            for name in (f"ttft-A-{size}", f"ttft-B-{size}"):
                engines.append((name, make_engine(name), None))
            (a_id, a, _), (b_id, b, _) = engines
            doc = torch.randint(1, cfg.vocab_size, (size,), generator=gen).tolist()
            q1, q2 = [torch.randint(1, cfg.vocab_size, (64,), generator=gen).tolist() for _ in range(2)]
            warm = torch.randint(1, cfg.vocab_size, (256,), generator=gen).tolist()
            a.generate(warm, 1)  # warm-up donor: B's first load opens its connections and caches
            cold = a.generate(doc + q1, 1)
            # TensorRT-LLM: A's saves were armed at allocation and gathered in the get_finished of the
            # iteration that finished each request, so nothing is pending on the (now idle) engine;
            # only the store writes (worker's saver thread) are waited for
            assert not a.pending_transfers(), a.pending_transfers()
            a.connector.workers[0].flush()
            pump(writer, a, f"{a_id}@bench", a_id, [0])
            native = a.generate(doc + q2, 1)  # A's own device reuse of doc: the ideal
            natives = [native.prefill_seconds]
            for _ in range(reps - 1):
                q = torch.randint(1, cfg.vocab_size, (64,), generator=gen).tolist()
                natives.append(a.generate(doc + q, 1).prefill_seconds)
            materialized, revalidation, copy, windows = [], [], [], []
            for rep in range(reps):
                if rep:  # a fresh engine B each time (its own cache would otherwise hold the doc)
                    b.connector.workers[0].close()
                    b.connector.scheduler.close()
                    b = make_engine(b_id)
                    engines[1] = (b_id, b, engines[1][2])
                worker = b.connector.workers[0]
                for donor_id, ref, checksum in _saved_donors(db, a_id):  # B's background verifier has seen them
                    b.connector.scheduler.store.verify(ref, checksum)
                answered: dict = {}
                loaded: dict = {}
                watch_in_place_window(b, answered, loaded)
                assert b.generate(warm + [1], 1).num_connector_tokens == len(warm)
                assert not b.pending_transfers(), b.pending_transfers()  # B registers no donors
                worker.flush()
                worker.revalidation_seconds = worker.copy_seconds = 0.0
                answered.clear()
                loaded.clear()
                got = b.generate(doc + q2, 1)
                assert got.num_connector_tokens == size, got.num_connector_tokens
                assert native.num_reused_tokens == size
                assert torch.equal(got.prefill_logits, native.prefill_logits), "materialized != native reuse"
                assert list(answered) == list(loaded) == [got.request_id], (answered, loaded, got.request_id)
                materialized.append(got.prefill_seconds)
                revalidation.append(worker.revalidation_seconds)
                copy.append(worker.copy_seconds)
                windows.append(loaded[got.request_id] - answered[got.request_id])
            row = {"size": size, "cold": cold.prefill_seconds, "materialized": statistics.median(materialized),
                   "native": statistics.median(natives), "revalidation": statistics.median(revalidation),
                   "copy": statistics.median(copy), "windows": windows}
            rows.append(row)
            print(f"ttft {size}: cold {row['cold']:.3f} s, materialized {row['materialized']:.3f} s, "
                  f"native reuse {row['native']:.3f} s; revalidation {row['revalidation'] * 1e3:.2f} ms "
                  f"vs copy {row['copy'] * 1e3:.2f} ms; in-place window p50 {statistics.median(windows) * 1e3:.2f} ms "
                  f"max {max(windows) * 1e3:.2f} ms ({', '.join(f'{w * 1e3:.2f}' for w in windows)} ms)", flush=True)
        finally:
            for _, llm, _ in engines:
                llm.connector.workers[0].close()
                llm.connector.scheduler.close()
    writer.dispose()
    return rows


def bench_synthetic_revalidation(db: str, store_dir: Path, layers: int, tokens: int) -> dict:
    """Worker only: a 32-layer pool (2 KV heads x 64 dims x 32 tokens, fp32) loading a ``tokens`` plan."""
    cfg = ModelConfig(num_layers=layers, num_heads=2, num_kv_heads=2, head_dim=64, max_context=tokens + 64)
    args = llm_args(cfg, tokens + 64)
    n = tokens // TPB
    s = settings(db, store_dir, "synthetic")
    sched = SemKvScheduler(args, settings=s, metrics=ConnectorMetrics())
    worker = SemKvWorker(args, settings=s, metrics=ConnectorMetrics())
    elems = cfg.num_kv_heads * cfg.head_dim * TPB
    pool = torch.zeros(n + 2, layers, 2, elems)
    worker.register_kv_caches(pool)
    prompt = list(range(1, tokens + 1)) + [1]
    ns = sched.namespace.for_request(LlmRequest(0, prompt, 1))
    donor_id = add_lookup_donor(db, sched.ledger, sched.store, ns, prompt[:tokens], (layers, 2, elems), seed=777)
    sched.store.verify(f"{donor_id}.kv", _checksum(db, donor_id))

    def load(rid: int) -> float:
        request = LlmRequest(rid, prompt, 1)
        assert sched.get_num_new_matched_tokens(request, 0)[0] == tokens
        plan = ship_plan(sched, request, prompt, n)
        worker.bind_connector_meta(ConnectorMetadata((plan,), (), 0))
        started = time.perf_counter()
        worker.start_load_kv(HarnessStream())
        for layer in range(layers):
            worker.wait_for_layer_load(layer, HarnessStream())
        total = time.perf_counter() - started
        sched.request_finished(request, [])
        sched.flush()
        return total

    try:
        load(1)  # warm-up: connections, statement caches, page cache
        worker.revalidation_seconds = worker.copy_seconds = 0.0
        total = load(2)
        return {"layers": layers, "tokens": tokens, "bytes": n * layers * 2 * elems * 4, "total": total,
                "revalidation": worker.revalidation_seconds, "copy": worker.copy_seconds}
    finally:
        worker.close()
        sched.close()


# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--postgres", action="store_true")
    parser.add_argument("--quick", action="store_true", help="small run (smoke test of this script)")
    parser.add_argument("--out", type=Path, help="where to save the table (default: results/connector-<date>.md, "
                        "with the time appended if that exists)")
    parser.add_argument("--lookups-only", action="store_true", help="only the lookup latency table (no TTFT)")
    args = parser.parse_args()
    lookup_sizes, ttft_sizes = [2048, 8192, 32768], [8192, 16384, 32768]
    if args.quick:
        args.blocks, args.repeats, lookup_sizes, ttft_sizes = 20_000, 20, [2048, 8192], [2048]
    today = dt.date.today().isoformat()
    results: dict = {"lookups": {}, "speed": [machine_speed()]}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        backends = [("SQLite", f"sqlite:///{root / 'ledger.db'}", None)]
        if args.postgres:
            from tools.harness.postgres import create_pg_database, drop_pg_database

            url = create_pg_database()
            backends.append(("PostgreSQL", url, lambda: drop_pg_database(url)))
        cfg = model_config(max(lookup_sizes) + 1024)
        for name, db, drop in backends:
            try:
                upgrade(db)
                probe = SemKvScheduler(llm_args(cfg, 4096), settings=settings(db, root / "donors", "probe"),
                                       metrics=ConnectorMetrics())
                ns = probe.namespace.for_request(LlmRequest(0, [1], 1))
                probe.close()
                took = populate(db, ns.digest, args.blocks)
                print(f"{name}: populated {args.blocks:,} blocks in {took:.1f} s", flush=True)
                for label, kw in lookup_variants(name):
                    key = f"{name} — {label}"
                    try:
                        results["lookups"][key] = bench_lookups(db, root / f"donors-{name}-{len(results['lookups'])}",
                                                                lookup_sizes, args.repeats, **kw)
                    except Exception as exc:  # noqa: BLE001 - one variant failing leaves the others' rows
                        results.setdefault("failures", []).append(f"{key}: {type(exc).__name__}: {exc}")
                        print(f"{key} failed: {exc!r}", flush=True)
                if name == "SQLite" and not args.lookups_only:
                    results["ttft"] = bench_ttft(db, root / "donors-ttft", ttft_sizes)
                    results["synthetic"] = bench_synthetic_revalidation(db, root / "donors-syn", 32,
                                                                        4096 if args.quick else 32768)
                    print(f"synthetic: {results['synthetic']}", flush=True)
            except Exception as exc:  # noqa: BLE001 - the table records which part failed and why
                results.setdefault("failures", []).append(f"{name}: {type(exc).__name__}: {exc}")
                print(f"{name} failed: {exc!r}", flush=True)
            finally:
                if drop is not None:
                    drop()
    results["speed"].append(machine_speed())
    write_table(results, args, today)


TABLE_ORDER = ["TensorRT-LLM (binding promises, the default)", "vLLM (retractable)",
               "TensorRT-LLM with lease_before_answer", "TensorRT-LLM, policy store",
               "TensorRT-LLM, view holding every donor"]


def lookup_variants(backend: str) -> list[tuple[str, dict]]:
    """The lookup rows of ``backend``, in the order they run (the view holding every donor runs
    before the variants that add donors for the same prompts, as in earlier tables)."""
    trt = {"gc_gen0": TRTLLM_GC_GEN0_THRESHOLD}  # as TensorRT-LLM's executor loop runs; vLLM: Python's default
    if backend != "SQLite":
        return [("TensorRT-LLM (binding promises, the default)", trt),
                ("TensorRT-LLM with lease_before_answer", {**trt, "lease_before_answer": True, "seed_offset": 250_000})]
    return [("TensorRT-LLM (binding promises, the default)", trt),
            ("TensorRT-LLM, policy store", {**trt, "policy": "store"}),
            ("TensorRT-LLM, view holding every donor", {**trt, "whole_view": True}),
            ("vLLM (retractable)", {"engine": VLLM, "seed_offset": 200_000}),
            ("TensorRT-LLM with lease_before_answer", {**trt, "lease_before_answer": True, "seed_offset": 250_000})]


def _table_rank(key: str) -> tuple[int, int]:
    backend, _, label = key.partition(" — ")
    return (0 if backend == "SQLite" else 1, TABLE_ORDER.index(label) if label in TABLE_ORDER else len(TABLE_ORDER))


def _dated_path(today: str) -> Path:
    """``results/connector-<date>.md``, or with the time appended when a run of that day is saved
    already (results are never overwritten)."""
    out = Path(__file__).parent / "results" / f"connector-{today}.md"
    stamp = f"{dt.datetime.now():%H%M}"
    suffixes = itertools.chain(["", f"-{stamp}"], (f"-{stamp}-{n}" for n in itertools.count(2)))
    return next(path for path in (out.with_name(f"connector-{today}{s}.md") for s in suffixes) if not path.exists())


def machine_speed(repeats: int = 300) -> float:
    """Median seconds to sum 32K Python ints: a pure-CPU yardstick printed with every table, since
    this VM's speed moves from run to run."""
    values, times = list(range(32_768)), []
    for _ in range(repeats):
        started = time.perf_counter()
        sum(values)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def write_table(results: dict, args, today: str) -> None:  # noqa: ANN001
    lines = [f"# KV Cache Connector — {today}", "",
             f"Machine: {os.cpu_count()} CPUs; its speed during this run: summing 32K Python ints took "
             f"{results['speed'][0] * 1e3:.3f} ms p50 before the lookups and {results['speed'][1] * 1e3:.3f} ms after "
             "(this VM's speed moves by up to ±50 % between runs: compare runs by it). Ledger: "
             f"{args.blocks:,} live blocks + ~{args.blocks:,} donor blocks (bulk SQL into the projections), "
             "policy `engine`. Harness model: 2 layers, 4 heads, 2 KV heads x 32 dims, fp32, 32 tokens/block, "
             "CPU (1 KiB of KV per token).", "",
             "## get_num_new_matched_tokens (DESIGN §7: 32K p99 ≤ 2 ms, 2K p99 ≤ 250 µs)", "",
             "| backend — engine (promises) | prompt | hit p50 | hit p99 | miss p50 | miss p99 "
             "| after idle: hit p99 / miss p99 "
             "| key hashing p50: a whole-prompt hit (connector v1: every key chained) "
             "| lease write p50 / p99 (where) | leases written / hits (signals) | hits over 2 ms "
             "| lookups a GC collection ran in (gen0 threshold) | hit p99 / miss p99 of the others |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for backend, rows in sorted(results["lookups"].items(), key=lambda item: _table_rank(item[0])):
        for r in rows:
            over = sum(1 for x in r["hit"] + r["idle_hit"] if x > 0.002) / (len(r["hit"]) + len(r["idle_hit"]))
            lease = (f"{pct(r['lease'], .5) * 1e3:.3f} / {pct(r['lease'], .99) * 1e3:.3f} ms" if r["lease"] else "—")
            signals = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["stale_by_reason"].items()) if v)
            lines.append(f"| {backend} | {r['size']:,} | {pct(r['hit'], .5) * 1e3:.3f} ms | {pct(r['hit'], .99) * 1e3:.3f} ms "
                         f"| {pct(r['miss'], .5) * 1e3:.3f} ms | {pct(r['miss'], .99) * 1e3:.3f} ms "
                         f"| {pct(r['idle_hit'], .99) * 1e3:.3f} / {pct(r['idle_miss'], .99) * 1e3:.3f} ms "
                         f"| {statistics.median(r['keys']) * 1e3:.3f} ms ({statistics.median(r['keys_before']) * 1e3:.3f} ms) "
                         f"| {lease} ({r['where']}) | {r['leases_written']} / {r['hits']}"
                         f"{f' ({signals}; cumulative)' if signals else ''} | {over:.0%} "
                         f"| {r['gc_lookups']} of {len(r['hit']) + len(r['miss'])} ({r['gc_gen0']:,}) "
                         f"| {_ms(r['clean_hit'], .99)} / {_ms(r['clean_miss'], .99)} |")
    lines += ["", "Python's cyclic garbage collector: a collection runs on whichever thread allocates past its "
              "threshold; a full one of this process's heap took ~15 ms here (the 32K tails of the main columns, "
              "found by re-running with `gc.disable()`: 32K hit p99 16 ms -> 1.0 ms). TensorRT-LLM rows run "
              f"with its executor's `gc.set_threshold({TRTLLM_GC_GEN0_THRESHOLD})` "
              "(`TorchLlmArgs.garbage_collection_gen0_threshold`), vLLM's with Python's default (700); the last "
              "two columns count the timed lookups (main method) a collection ran in, and give the p99 of the "
              "others: the connector's own cost.", "",
              f"{args.repeats} hits and {args.repeats} misses per row and method. Lookups answer from the "
              "scheduler's donor view (memory; caught up from the ledger every 5 ms by a periodic job on the "
              "connector's ledger thread, which ran throughout); a hit pins the donor in the store and, on "
              "TensorRT-LLM (binding promises), secures its checksummed file (held open by the store: no system "
              "call). Each request then runs on as an engine's would: a hit's blocks are allocated, its "
              "metadata built, and the request finishes (what it held released). Where the ledger lease is "
              "written differs by row ('lease write' column): TensorRT-LLM (default) writes none (the secured "
              "file holds the bytes); vLLM's retractable promises write "
              "it after allocation and make build_connector_meta wait for it (untimed); `lease_before_answer` "
              "writes it inside the lookup, so it is in the hit's time (measured with "
              "`lease_in_lookup_timeout_s = 1.0`, not the default 50 ms, for the same reason as below). "
              "'Leases written / hits': `take_lease` calls timed in the row (both methods, 3 untimed warm-up hits "
              "each included) against its hits; signals are the scheduler's `semkv_stale_after_promise_total` "
              "(cumulative over the scheduler's rows). Main "
              "columns: the next lookup follows at once, as in an engine, with the background lease writes, "
              "releases and miss diagnoses running beside it on the connector's threads (all waited for every "
              "50 iterations, untimed). 'After idle': every "
              "background write is waited for before each lookup (the method of the 2026-11-29/30 tables), so "
              "the engine thread has just idled for a few ms (PostgreSQL: ~10 ms of lease writes per hit on this "
              "VM, where the server shares the 2 CPUs), after which this VM runs the next ~100 µs of Python up "
              "to 2x slower. 'Hits over 2 ms': both methods. Measured with `lookup_timeout_s = 1.0`; with the "
              "default 2 ms deadline a slow hit would still answer from the view (the deadline bounds ledger "
              "reads, which a loaded view does not make).", "",
              *[f"'View holding every donor': {note}." for note in sorted(
                  {r["note"] for rows in results["lookups"].values() for r in rows if r.get("note")})], "",
              "## TTFT on the harness model (prefill of doc + 64-token question, max_new_tokens=1)", "",
             "Cold: one run. Materialized (a fresh engine B each time, donor saved by engine A) and native device reuse "
             "(engine A, new question each time): median of 3. Materialized logits are asserted bit-identical to "
             "native reuse. Engines run TensorRT-LLM's executor loop (harness; binding promises, every layer "
             "loaded in `start_load_kv`). In-place write window: for each materialized load, the time from "
             "B's `get_num_new_matched_tokens` returning its hit to the end of B's `start_load_kv` that read, "
             "checksummed and copied the plan's last layer (the time in which only a write into the secured "
             "file itself could still change the promised bytes); p50 / max of the loads.", "",
              "| doc tokens | cold | materialized from A's donor | native device reuse (ideal) | speed-up | ideal speed-up "
              "| revalidation / copy | in-place write window p50 / max |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results.get("ttft", []):
        w = r["windows"]
        lines.append(f"| {r['size']:,} | {r['cold']:.3f} s | {r['materialized']:.3f} s | {r['native']:.3f} s "
                     f"| {r['cold'] / r['materialized']:.1f}x | {r['cold'] / r['native']:.1f}x "
                     f"| {r['revalidation'] * 1e3:.2f} ms / {r['copy'] * 1e3:.2f} ms = {r['revalidation'] / r['copy']:.1%} "
                     f"| {statistics.median(w) * 1e3:.2f} / {max(w) * 1e3:.2f} ms (n={len(w)}) |")
    s = results.get("synthetic")
    if s:
        lines += ["", "## Worker revalidation share, synthetic 32-layer pool (DESIGN §7: ≤ 5 % of the copy time)", "",
                  "| layers | plan tokens | bytes | load total | ledger revalidation (1 full + 1 per layer) | copy (read + checksum + copy) | share |",
                  "|---:|---:|---:|---:|---:|---:|---:|",
                  f"| {s['layers']} | {s['tokens']:,} | {s['bytes'] / 2**20:,.0f} MiB | {s['total'] * 1e3:.1f} ms "
                  f"| {s['revalidation'] * 1e3:.2f} ms | {s['copy'] * 1e3:.1f} ms | {s['revalidation'] / s['copy']:.1%} |"]
    for failure in results.get("failures", []):
        lines += ["", f"FAILED: {failure}"]
    out = args.out or _dated_path(today)
    text = "\n".join(lines) + "\n"
    if args.out is not None or not args.quick:  # a quick run is saved only where --out says
        out.write_text(text)
        print(f"saved {out}")
    print(text)


if __name__ == "__main__":
    main()
