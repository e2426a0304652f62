"""Donor store benchmark (issue 25): where a donor's bytes live, and what that costs a load.

Measures, side by side in one run, on loopback:

1. **Stores** (no engine): one synthetic donor of an 8B-class layout — 32 layers, 8 KV heads x 128,
   bfloat16, 32 tokens per block: 4 MiB per block, ``--blocks`` blocks — saved and read back through
   each store as the connector does it:

   * ``host_ram``: a :class:`~connector.redis_store.RedisDonorStore` entry staged in this process
     (what a TensorRT-LLM promise reads), read layer by layer with each layer's checksum;
   * ``local_file``: :class:`~connector.donor_store.FileDonorStore` in ``--store-dir`` (default
     ``/dev/shm``; page cache warm), read layer by layer with each layer's checksum;
   * ``redis``: the same Redis entry read by a store that has not staged it (another host, or
     vLLM's worker): every block fetched, checked against its address, assembled, layers checked.

   Save and read throughput (GB/s, 1 GB = 10^9 bytes), and per-block read latency p50/p99: the bytes
   of one block (every layer) from the store into this process, with their xxh3-128 checksum (for
   Redis one ``GET``; for the file one ``pread`` per layer; for host RAM one copy per layer).
2. **Loads on the harness at 32K tokens** (TensorRT-LLM's executor loop, the reference model, fp32,
   CPU): engine A saves the document's donor (once into a file store, once into Redis); a fresh
   engine B serves document + question, its load reading the bytes from each source, beside A's
   own device reuse of the document (the ideal) and a cold prefill. ``host_ram``: B's scheduler
   staged the Redis entry beforehand (its background checksum; the staging time is reported);
   ``redis``: B's worker given a store of its own, so the load fetches from Redis (what vLLM's worker
   does; a TensorRT-LLM load never does, it cannot survive a failed fetch). Logits are checked
   bit-identical to the native reuse in every run.

Usage: ``python tools/bench_donor_store.py [--blocks 32] [--tokens 32768] [--redis-url URL]``; prints
the tables and writes them to ``tools/results/donor-store-YYYY-MM-DD.md``. The Redis server must
answer (the machine's 127.0.0.1:6379 by default); the benchmark uses a key prefix of its own and
deletes its keys.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connector.donor_store import FileDonorStore  # noqa: E402
from connector.harness import HarnessLLM, HarnessTransformer, KvCacheConfig  # noqa: E402
from connector.metrics import ConnectorMetrics  # noqa: E402
from connector.redis_store import REF_SUFFIX, RedisDonorStore, _parse_manifest  # noqa: E402
from connector.scheduler import SemKvScheduler  # noqa: E402
from connector.worker import SemKvWorker  # noqa: E402
from ledger.db import sync_engine  # noqa: E402
from ledger.migrate import upgrade  # noqa: E402
from tools.bench_connector import TPB, _saved_donors, model_config, pump, settings  # noqa: E402
from tools.harness.redis_server import SHARED_REDIS_URL, delete_prefix, scratch_prefix  # noqa: E402

GB = 1e9
LAYERS, KV_HEADS, HEAD_DIM, ITEMSIZE = 32, 8, 128, 2  # bfloat16
BLOCK_ELEMS = KV_HEADS * HEAD_DIM * TPB
TIMEOUT_S = 30.0  # Redis timeout: a benchmark on a busy machine measures, it does not fail over


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---------------------------------------------------------------------------------------------
# 1. stores
# ---------------------------------------------------------------------------------------------


def synthetic_donor(blocks: int) -> tuple[list[np.ndarray], dict]:
    rng = np.random.default_rng(7)
    layer_bytes = blocks * 2 * BLOCK_ELEMS * ITEMSIZE
    layers = [rng.integers(0, 256, layer_bytes, dtype=np.uint8) for _ in range(LAYERS)]
    header = {"namespace": "bench", "num_layers": LAYERS, "kv_factor": 2, "block_elems": BLOCK_ELEMS,
              "dtype": "bfloat16", "itemsize": ITEMSIZE, "num_blocks": blocks, "tokens_per_block": TPB}
    return layers, header


def read_all(reader) -> int:  # noqa: ANN001
    n = 0
    for layer in range(reader.header.num_layers):
        n += memoryview(reader.read_layer(layer)).nbytes
    return n


def bench_stores(blocks: int, reps: int, samples: int, store_dir: Path, redis_url: str) -> list[dict]:
    layers, header = synthetic_donor(blocks)
    size = sum(layer.nbytes for layer in layers)
    prefix = scratch_prefix()
    rows = []
    try:
        file_store = FileDonorStore(store_dir, 64 * 2**30)
        saver = RedisDonorStore(redis_url, store_dir / "bench-host-a", key_prefix=prefix, ttl_s=600, timeout_s=TIMEOUT_S)
        remote = RedisDonorStore(redis_url, store_dir / "bench-host-b", key_prefix=prefix, ttl_s=600, timeout_s=TIMEOUT_S)
        saves = {"local_file": [], "redis": []}
        for rep in range(reps):
            started = time.perf_counter()
            file_entry = file_store.put(f"bench-{rep}", layers, header)
            saves["local_file"].append(time.perf_counter() - started)
            if rep:
                file_store.evict(f"bench-{rep - 1}", "bench", force=True)
            delete_prefix(redis_url, prefix)  # a fresh write each time (not a shared-blocks refresh)
            started = time.perf_counter()
            redis_entry = saver.put(f"bench-{rep}", layers, header)
            saves["redis"].append(time.perf_counter() - started)
        reads: dict[str, list[float]] = {"host_ram": [], "local_file": [], "redis": []}
        for _ in range(reps):
            for source, store, entry in (("host_ram", saver, redis_entry), ("local_file", file_store, file_entry),
                                         ("redis", remote, redis_entry)):
                started = time.perf_counter()
                with store.open(entry.ref, entry.checksum) as reader:
                    assert reader.source == source, (reader.source, source)
                    assert read_all(reader) == size
                reads[source].append(time.perf_counter() - started)
        per_block = block_latencies(blocks, samples, saver, file_store, file_entry, remote, redis_entry)
        for source in ("host_ram", "local_file", "redis"):
            read = statistics.median(reads[source])
            save = statistics.median(saves[source]) if source in saves else None
            lat = per_block[source]
            rows.append({"source": source, "bytes": size, "read_s": read, "read_gbs": size / read / GB,
                         "save_gbs": size / save / GB if save else None,
                         "block_p50_us": pct(lat, 0.5) * 1e6, "block_p99_us": pct(lat, 0.99) * 1e6})
            print(f"store {source}: read {size / read / GB:.2f} GB/s"
                  + (f", save {size / save / GB:.2f} GB/s" if save else "")
                  + f"; per-block p50 {pct(lat, 0.5) * 1e6:.0f} us p99 {pct(lat, 0.99) * 1e6:.0f} us", flush=True)
        file_store.evict(f"bench-{reps - 1}", "bench", force=True)
        saver.close()
        remote.close()
    finally:
        delete_prefix(redis_url, prefix)
    return rows


def block_latencies(blocks: int, samples: int, saver: RedisDonorStore, file_store: FileDonorStore, file_entry,
                    remote: RedisDonorStore, redis_entry) -> dict[str, list[float]]:  # noqa: ANN001
    """Seconds to bring one block (every layer) into this process and checksum it, per source."""
    rng = random.Random(3)
    block_bytes = 2 * BLOCK_ELEMS * ITEMSIZE
    out: dict[str, list[float]] = {"host_ram": [], "local_file": [], "redis": []}
    staged = saver.open(redis_entry.ref, redis_entry.checksum)
    raw = remote.redis.get(remote._manifest_key(redis_entry.ref.removesuffix(REF_SUFFIX)))
    manifest_blocks = _parse_manifest(raw, redis_entry.ref).blocks
    namespace = staged.header.namespace
    reader = file_store.open(file_entry.ref, file_entry.checksum)
    buf = np.empty((LAYERS, block_bytes), dtype=np.uint8)
    view = memoryview(buf).cast("B")
    try:
        for _ in range(samples):
            b = rng.randrange(blocks)
            started = time.perf_counter()
            for layer in range(LAYERS):
                buf[layer] = staged.read_layer(layer, verify=False)[b]
            xxhash.xxh3_128_hexdigest(buf)
            out["host_ram"].append(time.perf_counter() - started)
            started = time.perf_counter()
            for layer in range(LAYERS):
                os.preadv(reader.fileno(), [view[layer * block_bytes:(layer + 1) * block_bytes]],
                          reader._offset + layer * reader.header.layer_bytes + b * block_bytes)
            xxhash.xxh3_128_hexdigest(buf)
            out["local_file"].append(time.perf_counter() - started)
            started = time.perf_counter()
            value = remote.redis.get(remote._block_key(namespace, manifest_blocks[b]))
            assert value is not None and xxhash.xxh3_128_hexdigest(value) == manifest_blocks[b]
            out["redis"].append(time.perf_counter() - started)
    finally:
        reader.close()
    return out


# ---------------------------------------------------------------------------------------------
# 2. loads on the harness
# ---------------------------------------------------------------------------------------------


def bench_loads(tokens: int, reps: int, store_dir: Path, redis_url: str) -> dict:
    root = Path(tempfile.mkdtemp(prefix="semkv-bench-store-"))
    db = f"sqlite:///{root / 'ledger.db'}"
    upgrade(db)
    writer = sync_engine(db, writer=True)
    prefix = scratch_prefix()
    cfg = model_config(tokens + 256)
    kvc = KvCacheConfig(tokens_per_block=TPB, max_tokens=2 * (tokens + 256), event_buffer_max_size=1_000_000)
    model = HarnessTransformer(cfg)
    gen = torch.Generator().manual_seed(11)
    doc = torch.randint(1, cfg.vocab_size, (tokens,), generator=gen).tolist()
    questions = [torch.randint(1, cfg.vocab_size, (64,), generator=gen).tolist() for _ in range(reps + 2)]
    stores = {"file": {"store_dir": store_dir / "bench-loads-file"},
              "redis": {"donor_store": "redis", "redis_url": redis_url, "redis_key_prefix": prefix, "redis_timeout_s": TIMEOUT_S,
                        "store_dir": store_dir / "bench-loads-redis-a"}}
    engines: list[HarnessLLM] = []

    def make_engine(engine_id: str | None, **kw) -> HarnessLLM:  # noqa: ANN003
        s, m = settings(db, kw.pop("store_dir"), engine_id, **kw), ConnectorMetrics()
        sched = type("S", (SemKvScheduler,), {"__init__": lambda self, a: SemKvScheduler.__init__(self, a, settings=s, metrics=m)})
        work = type("W", (SemKvWorker,), {"__init__": lambda self, a: SemKvWorker.__init__(self, a, settings=s, metrics=m)})
        llm = HarnessLLM(cfg, kv_cache_config=kvc, kv_connector=(sched, work), max_num_tokens=2048, model=model)
        llm.semkv_metrics = m
        engines.append(llm)
        return llm

    out: dict = {"tokens": tokens, "cold": [], "sources": {}}
    try:
        natives = []
        for kind, kw in stores.items():  # A saves the document's donor into each store (a cold prefill each)
            a = make_engine(f"A-{kind}", **kw)
            cold = a.generate(doc + questions[0], 1)
            out["cold"].append(cold.prefill_seconds)
            a.connector.workers[0].flush()
            pump(writer, a, f"A-{kind}@bench", f"A-{kind}", [0])
            for q in questions[1:reps + 1]:
                native = a.generate(doc + q, 1)  # A's own device reuse of the document: the ideal
                assert native.num_reused_tokens == tokens
                natives.append(native)
                a.connector.workers[0].flush()  # its donor save must not run during the next measured prefill
        out["native"] = [n.prefill_seconds for n in natives]
        # every request A served is a donor (the cold one and its native runs): B checks them all beforehand
        file_donors, redis_donors = _saved_donors(db, "A-file"), _saved_donors(db, "A-redis")
        for source in ("host_ram", "local_file", "redis"):
            runs, loads, stages = [], [], []
            for rep in range(reps):
                q = questions[1 + rep]
                if source == "local_file":
                    b = make_engine(None, **stores["file"])
                    for _, ref, checksum in file_donors:  # as its background checksum does
                        b.connector.scheduler.store.verify(ref, checksum)
                else:
                    b = make_engine(None, **{**stores["redis"], "store_dir": store_dir / f"bench-loads-b-{source}-{rep}"})
                    for _, ref, checksum in redis_donors:  # staged from Redis, off the engine's path
                        b.connector.scheduler.store.verify(ref, checksum)
                    # what that staging costs (B's view started it at construction already): a store of its own
                    stager = RedisDonorStore(redis_url, store_dir / f"bench-loads-stage-{source}-{rep}", key_prefix=prefix,
                                             timeout_s=TIMEOUT_S)
                    started = time.perf_counter()
                    stager.verify(redis_donors[0][1], redis_donors[0][2])
                    stages.append(time.perf_counter() - started)
                    stager.close()
                    if source == "redis":  # the worker reads Redis at load time (as vLLM's worker process would)
                        worker = b.connector.workers[0]
                        worker.store.close()
                        worker.store = RedisDonorStore(redis_url, store_dir / f"bench-loads-w-{rep}", key_prefix=prefix,
                                                       ledger=worker.ledger, timeout_s=TIMEOUT_S)
                b.connector.scheduler.flush()  # nothing of B's background work runs during the measured request
                got = b.generate(doc + q, 1)
                assert got.num_connector_tokens == tokens, (source, got.num_connector_tokens, b.semkv_metrics.misses_by_reason())
                native = natives[rep]  # A-file's and A-redis's native runs of doc + q are the same
                assert torch.equal(got.prefill_logits, native.prefill_logits), f"{source}: materialized != native reuse"
                m = b.semkv_metrics
                assert m.value("semkv_load_seconds_count", source=source) == 1, source
                runs.append(got.prefill_seconds)
                loads.append(m.value("semkv_load_seconds_sum", source=source))
                b.connector.workers[0].close()
                b.connector.scheduler.close()
                engines.remove(b)
            out["sources"][source] = {"prefill": runs, "load": loads, "stage": stages}
            print(f"load {source}: prefill p50 {statistics.median(runs):.3f} s, load p50 {statistics.median(loads):.3f} s"
                  + (f", staging from Redis p50 {statistics.median(stages):.3f} s" if stages else ""), flush=True)
    finally:
        for llm in engines:
            llm.connector.workers[0].close()
            llm.connector.scheduler.close()
        writer.dispose()
        delete_prefix(redis_url, prefix)
    return out


# ---------------------------------------------------------------------------------------------
# table
# ---------------------------------------------------------------------------------------------


def write_table(stores: list[dict], loads: dict, args, started: str, ended: str) -> Path:  # noqa: ANN001
    med = statistics.median
    lines = [f"# Donor store benchmark — {started[:10]}", "",
             f"`python tools/bench_donor_store.py --blocks {args.blocks} --tokens {args.tokens}`, run "
             f"{started} → {ended} (UTC, `date`). The machine was busy: 2 cores shared with four other agents' "
             "builds and tests, so absolute figures are noisy; the columns of each table ran side by side "
             "in one run and compare with each other. Redis 7 on loopback (127.0.0.1), no persistence.", "",
             f"## Stores on loopback: one donor of {stores[0]['bytes'] / 2**20:.0f} MiB "
             f"({args.blocks} blocks of 4 MiB: 32 layers, 8 KV heads x 128, bf16, 32 tokens per block)", "",
             "| source | read (GB/s) | save (GB/s) | per-block read p50 | per-block read p99 |", "|---|---|---|---|---|"]
    for r in stores:
        save = f"{r['save_gbs']:.2f}" if r["save_gbs"] else "— (staged by the save)"
        lines.append(f"| {r['source']} | {r['read_gbs']:.2f} | {save} | {r['block_p50_us']:.0f} µs | "
                     f"{r['block_p99_us']:.0f} µs |")
    lines += ["", "Read: open + every layer with its checksum, as a load reads it (medians of "
              f"{args.reps}). Per-block: one block's 4 MiB (every layer) into this process plus its xxh3-128 "
              f"({args.samples} random blocks). local_file is {args.store_dir} (page cache warm). Save: "
              "file = write + fsync + rename; redis = every block (SET NX) and the manifest.", "",
              f"## Loads on the harness at {loads['tokens']:,} tokens (TensorRT-LLM executor loop, reference "
              "model: 2 layers, fp32, CPU)", "",
              "| | prefill (TTFT) p50 | of which the load | vs ideal local reuse |", "|---|---|---|---|"]
    native = med(loads["native"])
    lines.append(f"| cold prefill | {med(loads['cold']):.3f} s | — | {med(loads['cold']) / native:.1f}x |")
    lines.append(f"| ideal local reuse (the engine's own cache) | {native:.3f} s | — | 1.0x |")
    for source, r in loads["sources"].items():
        stage = f" (staging from Redis beforehand, off the engine's path: {med(r['stage']):.3f} s)" if source == "host_ram" else ""
        lines.append(f"| materialized, bytes from {source}{stage} | {med(r['prefill']):.3f} s | "
                     f"{med(r['load']):.3f} s | {med(r['prefill']) / native:.2f}x |")
    raw = "; ".join(f"{source} " + ", ".join(f"{p:.3f}/{l:.3f}" for p, l in zip(r["prefill"], r["load"], strict=True))
                    for source, r in loads["sources"].items())
    lines += ["", f"Every run, prefill/load in seconds: {raw}; native reuse "
              + ", ".join(f"{v:.3f}" for v in loads["native"]) + "; cold " + ", ".join(f"{v:.3f}" for v in loads["cold"])
              + ". Staging from Redis: " + ", ".join(f"{v:.3f}" for r in loads["sources"].values() for v in r["stage"]) + " s."]
    lines += ["", f"{len(loads['native'])} native runs, {len(next(iter(loads['sources'].values()))['prefill'])} "
              "materialized runs per source (a fresh engine B each), logits bit-identical to the native reuse "
              "in every run; load = `semkv_load_seconds` of the run. host_ram: the Redis entry staged by B's "
              "scheduler (what a TensorRT-LLM promise holds); redis: B's worker fetches at load time (vLLM's "
              "worker process); local_file: the file store's entry (page cache warm).", ""]
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"donor-store-{started[:10]}.md"
    if out.exists() and not args.out:  # a second run of the day keeps the first
        out = out.with_name(f"donor-store-{started[:10]}-{started[11:].replace(':', '')}.md")
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=32, help="blocks of the synthetic donor (4 MiB each)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--samples", type=int, default=300, help="per-block latency samples per source")
    parser.add_argument("--tokens", type=int, default=32768, help="document size of the harness loads")
    parser.add_argument("--load-reps", type=int, default=3)
    parser.add_argument("--redis-url", default=SHARED_REDIS_URL)
    parser.add_argument("--store-dir", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir()
                        else Path(tempfile.gettempdir()))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    with tempfile.TemporaryDirectory(dir=args.store_dir, prefix="semkv-bench-") as tmp:
        stores = bench_stores(args.blocks, args.reps, args.samples, Path(tmp), args.redis_url)
        loads = bench_loads(args.tokens, args.load_reps, Path(tmp), args.redis_url)
    ended = dt.datetime.now(dt.timezone.utc).strftime("%H:%M")
    print(f"wrote {write_table(stores, loads, args, started, ended)}")


if __name__ == "__main__":
    main()
