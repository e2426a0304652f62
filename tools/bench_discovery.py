"""Discovery and placement benchmark over the RFC scenarios (issue 6; DESIGN §2 rules 2 and 4, §7).

Runs the labelled workload of ``tools/workloads.py`` (CPython stdlib text, see its docstring)
through reference-harness engines in a ``tools.harness.fleet.Fleet``, as the connector tests (SQLite ledger, consumer
daemon over loopback ZMQ, shared donor store): donors on engine A (and H, which offloads them to
host memory for ``host_offload``), targets on engine B, once with B in ``discovery_only`` and once
in ``exact_equivalent``; every engine's ``SemKvScheduler`` runs discovery with one shared
``DiscoveryService`` (``SemKvScheduler(..., discovery=service)``; providers exact, chunks, minhash
and, with the ``semantic`` extra, embedding; prompt text allowed). Reports, as a markdown table and a PNG plot under ``tools/results/``:

* per scenario: cold TTFT (discovery_only, nothing loaded), warm TTFT (exact_equivalent),
  materialized plans and tokens, whether discovery (exact span) or a semantic candidate was found;
* totals: discovery-only hit rate, semantic placement rate, backend-declined, load latency, and
  the negative controls' materializations (must be 0; the run fails otherwise);
* discovery precision / recall per provider against the labels;
* provider lookup latency at 1K / 10K / 100K indexed donors (filler donors: random token arrays
  of 256 tokens and, for the embedding index, random unit vectors; queries: the workload's
  targets; the query embedding itself is reported separately);
* the hard deadline: caller-observed time of an inline lookup whose provider never answers;
* route-advice overhead: ``PlacementAdvisor.advise`` and ``POST /v1/placement`` over loopback HTTP;
* the DESIGN §10 report (issue 24): every scenario ``--reps`` times (30) on a cold, a discovery_only and
  a warm engine side by side, interleaved, medians with 95 % intervals, the high-load burst's
  throughput with the connector on and off, and a PNG of TTFT against context length
  (tools/reuse_trials.py). The run fails if a negative control is materialized.

Usage: ``python tools/bench_discovery.py [--ctx 1024] [--reps 30] [--long [--long-reps 3]]
[--sizes 1000,10000,100000] [--no-semantic]``. ``--long`` adds 8K/16K/32K contexts (system_prompt,
rag_reordered, agent_tools, unrelated) to the trials and the TTFT plot.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connector.discovery.chunks import BlockChunkProvider  # noqa: E402
from connector.discovery.minhash import MinHashProvider  # noqa: E402
from connector.discovery.service import DiscoveryService  # noqa: E402
from connector.discovery.settings import DiscoverySettings  # noqa: E402
from connector.discovery.types import DonorRecord, Query, readonly_tokens  # noqa: E402
from connector.harness import KvCacheConfig, LlmRequest, ModelConfig  # noqa: E402
from connector.placement.advice import PlacementAdvisor  # noqa: E402
from tools.discovery_report import (negatives_materialized, plot, plot_ttft, report, slower_scenarios,  # noqa: E402
                                    trials_report)
from tools.reuse_trials import run_trials  # noqa: E402
from tools.harness.discovery_fleet import discovering_engine  # noqa: E402
from tools.harness.fleet import Fleet  # noqa: E402
from tools.workloads import NEGATIVE_SCENARIOS, Workload, build_workload  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TPB = 32
LONG_SCENARIOS = ("system_prompt", "rag_reordered", "agent_tools", "unrelated")


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def semantic_model() -> Any:
    try:
        from connector.discovery.embedding import load_sentence_model

        return load_sentence_model()
    except Exception as exc:  # noqa: BLE001 - the extra is optional; reported in the results
        print(f"embedding provider unavailable: {exc}", file=sys.stderr)
        return None


def make_service(db: str, model: Any) -> DiscoveryService:
    s = DiscoverySettings(providers=("exact", "chunks", "minhash"), allow_prompt_text=True, background_timeout_s=2.0)
    providers = [BlockChunkProvider(s), MinHashProvider(s)]
    from connector.discovery.exact import LedgerPrefixProvider

    providers.insert(0, LedgerPrefixProvider(s, db=db))
    if model is not None:
        from connector.discovery.embedding import EmbeddingProvider

        providers.append(EmbeddingProvider(s, model=model))
    return DiscoveryService(s, db=db, providers=providers)


def counter_sum(metrics: Any, name: str) -> float:
    return sum(s.value for m in metrics.registry.collect() for s in m.samples if s.name == name)


# ---------------------------------------------------------------------------------------------
def make_donors(w: Workload, fleet: Fleet, service: DiscoveryService, text_of: Any, cfg: ModelConfig) -> int:
    """The workload's donors on engines A and H (H keeps room for one request, so its donors go to host
    memory, level 1, for ``host_offload``); returns how many blocks H offloaded."""
    ctx = w.context_tokens
    pool = KvCacheConfig(tokens_per_block=TPB, event_buffer_max_size=65536, max_tokens=4 * cfg.max_context)
    a = discovering_engine(fleet, "A", service, mode="exact_equivalent", text_of=text_of, model=cfg,
                           kv_cache_config=pool, max_num_tokens=2048)
    h_tokens = -(-2 * ctx // TPB) * TPB + 2 * TPB  # room for one request: older blocks go to host memory
    small = KvCacheConfig(tokens_per_block=TPB, event_buffer_max_size=65536, max_tokens=h_tokens,
                          host_cache_size=cfg.kv_bytes_per_token * 16 * ctx)
    h = discovering_engine(fleet, "H", service, mode="exact_equivalent", text_of=text_of, model=cfg,
                           kv_cache_config=small, max_num_tokens=2048)
    for key in w.donors:
        p = w.prompt(key)
        (h if key.startswith("host_offload/") else a).generate(list(p.tokens), cache_salt=p.cache_salt)
    rng = np.random.default_rng(3)
    for _ in range(3 if any(k.startswith("host_offload/") for k in w.donors) else 0):
        h.generate(rng.integers(1, 512, ctx).tolist())  # push H's donor blocks to host memory (level 0 -> 1)
    fleet.sync()
    service.flush()
    return h.llm.kv_cache_manager.num_stored_blocks(cache_level=1)


def run_mode(mode: str, w: Workload, model: Any, root: Path, route: bool) -> dict[str, Any]:
    """Donors on A/H, every target on B in ``mode``; per-target results and B's counters."""
    ctx = w.context_tokens
    cfg = ModelConfig(max_context=max(2048, ctx + ctx // 2))
    texts = {tuple(p.tokens): p.text for p in w.prompts.values()}
    text_of = lambda req: texts.get(tuple(req.get_tokens(0)[: req.prompt_len]))  # noqa: E731
    fleet = Fleet(root, ("A", "H", "B")).start()
    service = make_service(fleet.db, model)
    keys = {tuple(p.tokens[: len(p.tokens) // TPB * TPB]): k for k, p in w.prompts.items() if k in w.donors}
    donor_keys: dict[str, str | None] = {}  # ledger donor id (a uuid) -> workload donor key
    register = service.register_donor

    def remember(rec: DonorRecord) -> bool:
        donor_keys[rec.donor_id] = keys.get(tuple(rec.token_ids.tolist()))
        return register(rec)

    service.register_donor = remember  # type: ignore[method-assign]
    out: dict[str, Any] = {"targets": []}
    try:
        pool = KvCacheConfig(tokens_per_block=TPB, event_buffer_max_size=65536, max_tokens=4 * cfg.max_context)
        out["offloaded_blocks"] = make_donors(w, fleet, service, text_of, cfg)
        rng = np.random.default_rng(3)
        b = discovering_engine(fleet, "B", service, mode=mode, text_of=text_of, model=cfg, kv_cache_config=pool,
                               max_num_tokens=2048, min_donor_blocks=10**6,
                               store_inline_verify_max_bytes=2**40)  # first load checksums inline (in TTFT)
        b.generate(rng.integers(1, 512, ctx).tolist())  # warm-up (allocations, first ledger reads); no donor
        b.scheduler.flush()
        m = b.metrics
        before = {p.name: service.metrics.value("semkv_semantic_placement_total", provider=p.name)
                  for p in service.providers}
        for lab in w.labels:
            p = w.prompt(lab.target)
            hits = m.value("semkv_discovery_only_hits_total")
            result = b.generate(list(p.tokens), cache_salt=p.cache_salt)
            b.scheduler.flush()
            out["targets"].append({"scenario": lab.scenario, "ttft_s": result.prefill_seconds,
                                   "loaded": result.num_connector_tokens, "negative": lab.negative,
                                   "exact_found": m.value("semkv_discovery_only_hits_total") > hits})
        out.update(
            n=len(w.labels), discovery_hits=m.value("semkv_discovery_only_hits_total"),
            semantic=sum(service.metrics.value("semkv_semantic_placement_total", provider=p.name) - before[p.name]
                         for p in service.providers),
            materialized=m.value("semkv_exact_materialized_total"),
            materialized_tokens=m.value("semkv_materialized_tokens_total"),
            declined=counter_sum(m, "semkv_backend_declined_total"),
            load_sum=counter_sum(m, "semkv_load_seconds_sum"), load_count=counter_sum(m, "semkv_load_seconds_count"),
            experimental=m.value("semkv_experimental_materialized_total"), misses=m.misses_by_reason())
        ns_of = lambda p: b.scheduler.namespace.for_request(  # noqa: E731
            LlmRequest(0, list(p.tokens), 1, cache_salt=p.cache_salt)).digest
        if mode == "discovery_only":
            out["quality"] = precision_recall(service, w, ns_of, b.scheduler.model_id, donor_keys)
        if route:
            out["route"] = route_advice(fleet.db, service, w, ns_of, b.scheduler.model_id)
        return out
    finally:
        service.close()
        fleet.stop()


def _trials(w: Workload, reps: int, model: Any, root: Path) -> dict[str, Any]:
    """Interleaved cold / discovery_only / warm TTFT trials of ``w`` (tools/reuse_trials.py)."""
    root.mkdir()
    print(f"interleaved TTFT trials, {w.context_tokens}-token contexts, {reps} repetitions …", file=sys.stderr)

    def donors(fleet: Fleet, service: DiscoveryService, text_of: Any, cfg: ModelConfig) -> None:
        make_donors(w, fleet, service, text_of, cfg)

    return run_trials(w, reps, root, lambda db: make_service(db, model), donors,
                      lambda rep, total: print(f"  repetition {rep}/{total}", file=sys.stderr))


def precision_recall(service: DiscoveryService, w: Workload, ns_of: Any, model_id: str,
                     donor_keys: dict[str, str | None]) -> dict[str, dict]:
    """Per provider: its best fresh answer per target against the labels."""
    stats = {p.name: {"tp": 0, "fp": 0, "expected": 0, "found_expected": 0} for p in service.providers}
    for lab in w.labels:
        p = w.prompt(lab.target)
        matches = service.candidates(list(p.tokens), p.text, model_id, ns_of(p), deadline_s=5.0)
        best: dict[str, str] = {}
        for m in matches:
            best.setdefault(m.provider, donor_keys.get(m.donor_id) or m.donor_id)
        for name, st in stats.items():
            got = best.get(name)
            expected = name in lab.expected_providers
            st["expected"] += expected
            if got is not None:
                correct = lab.related and got == lab.donor
                st["tp" if correct else "fp"] += 1
                st["found_expected"] += expected and correct
    return stats


def route_advice(db: str, service: DiscoveryService, w: Workload, ns_of: Any, model_id: str) -> dict[str, float]:
    """Python API and HTTP (uvicorn on loopback) latency of placement advice for every target."""
    import httpx
    import uvicorn

    from connector.placement.http import create_app

    advisor = PlacementAdvisor(db, discovery=service, semantic_timeout_s=0.05)
    api, api_semantic, http = [], [], []
    bodies = [{"token_ids": list(w.prompt(lab.target).tokens), "namespace": ns_of(w.prompt(lab.target)),
               "model_id": model_id} for lab in w.labels]
    for _ in range(5):
        for body in bodies:
            started = time.perf_counter()
            advisor.advise(body["token_ids"])
            api.append(time.perf_counter() - started)
            started = time.perf_counter()
            advisor.advise(body["token_ids"], namespace=body["namespace"], model_id=model_id)
            api_semantic.append(time.perf_counter() - started)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # proto 6: asyncio sets TCP_NODELAY
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(advisor, discovery=service), log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=10) as client:
            for _ in range(10):
                for body in bodies:
                    started = time.perf_counter()
                    assert client.post("/v1/placement", json=body).status_code == 200
                    http.append(time.perf_counter() - started)
    finally:
        server.should_exit = True
        thread.join(10)
        advisor.close()
    return {"api_p50": pct(api, 50), "api_p99": pct(api, 99), "api_sem_p50": pct(api_semantic, 50),
            "api_sem_p99": pct(api_semantic, 99), "http_p50": pct(http, 50), "http_p99": pct(http, 99),
            "http_n": len(http)}


# ---------------------------------------------------------------------------------------------
def provider_scaling(w: Workload, sizes: list[int], model: Any) -> dict[str, dict[int, tuple[float, float]]]:
    """p50/p99 of ``candidates`` per provider with ``size`` donors indexed (workload donors + filler)."""
    s = DiscoverySettings()
    rng = np.random.default_rng(7)
    out: dict[str, dict[int, tuple[float, float]]] = {"chunks": {}, "minhash": {}}
    if model is not None:
        out["embedding"] = {}
        out["embedding (query embed)"] = {}
    queries = [Query(readonly_tokens(w.prompt(lab.target).tokens), w.prompt(lab.target).text, "m", "0" * 32, TPB)
               for lab in w.labels]
    for size in sizes:
        providers: dict[str, Any] = {"chunks": BlockChunkProvider(s), "minhash": MinHashProvider(s)}
        emb = None
        if model is not None:
            from connector.discovery.embedding import EmbeddingProvider

            emb = EmbeddingProvider(s, model=model)
        real = [DonorRecord(k, "A", "0" * 32, "m", readonly_tokens(p.tokens[: len(p.tokens) // TPB * TPB]), TPB,
                            text=p.text) for k, p in ((k, w.prompt(k)) for k in w.donors)]
        started = time.perf_counter()
        for i in range(size):
            rec = real[i] if i < len(real) else DonorRecord(f"f{i}", "A", "0" * 32, "m",
                                                            readonly_tokens(rng.integers(1, 512, 256)), TPB)
            for p in providers.values():
                p.index(rec)
            if emb is not None:
                if i < len(real):
                    emb.index(rec)
                else:
                    vec = rng.standard_normal(384).astype(np.float32)
                    emb.index_vector(rec, vec / np.linalg.norm(vec))
        for p in providers.values():
            p.flush(True)
        print(f"  indexed {size} donors in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        if emb is not None:
            providers["embedding"] = emb
            embed_times = []
            for q in queries:
                t0 = time.perf_counter()
                emb.prepare(q)
                embed_times.append(time.perf_counter() - t0)
            out["embedding (query embed)"][size] = (pct(embed_times, 50), pct(embed_times, 99))
        for name, p in providers.items():
            times = []
            for _ in range(5):
                for q in queries:
                    t0 = time.perf_counter()
                    p.candidates(q, 4)
                    times.append(time.perf_counter() - t0)
            out[name][size] = (pct(times, 50), pct(times, 99))
    return out


def deadline_bound(root: Path, deadline_s: float = 0.002, n: int = 500) -> dict[str, float]:
    """Caller-observed inline lookup time when the only provider never answers (hangs)."""
    from ledger.migrate import upgrade

    class Hung:
        name, generation, needs_text = "hung", 1, False
        release = threading.Event()

        def candidates(self, query, limit):  # noqa: ANN001, ANN201
            self.release.wait(30)
            return []

        def index(self, donor): ...  # noqa: ANN001
        def forget(self, donor_id): ...  # noqa: ANN001
        def prepare(self, query): ...  # noqa: ANN001
        def flush(self, force=True): ...  # noqa: ANN001
        def close(self): self.release.set()  # noqa: E704

    db = f"sqlite:///{root / 'deadline.db'}"
    upgrade(db)
    hung = Hung()
    service = DiscoveryService(DiscoverySettings(lookup_timeout_s=deadline_s, provider_queue_max=n + 1), db=db,
                               providers=[hung])
    tokens = list(range(1, 2049))
    times = []
    try:
        for _ in range(20):  # warm-up: first ledger reads, first metric labels
            service.lookup(tokens, None, "m", "0" * 32)
        for _ in range(n):
            t0 = time.perf_counter()
            assert service.lookup(tokens, None, "m", "0" * 32) is None
            times.append(time.perf_counter() - t0)
        timeouts = service.metrics.value("semkv_discovery_outcomes_total", provider="hung", outcome="timeout") - 20
    finally:
        hung.release.set()
        service.close()
    return {"deadline": deadline_s, "p50": pct(times, 50), "p99": pct(times, 99), "max": max(times),
            "timeouts": timeouts, "n": n}


# ---------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ctx", type=int, default=1024, help="target context (tokens) of the default run")
    parser.add_argument("--load", type=int, default=8, help="targets of the high_load burst")
    parser.add_argument("--reps", type=int, default=30, help="interleaved TTFT repetitions per scenario")
    parser.add_argument("--long", action="store_true", help="also 8K/16K/32K contexts (slow)")
    parser.add_argument("--long-reps", type=int, default=3,
                        help="repetitions at 8K/16K/32K (a 32K prefill takes ~30-50 s on the harness here)")
    parser.add_argument("--sizes", default="1000,10000,100000", help="indexed donors for the latency sweep")
    parser.add_argument("--no-semantic", action="store_true", help="skip the embedding provider")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    sizes = [int(s) for s in args.sizes.split(",")]
    model = None if args.no_semantic else semantic_model()
    workload = build_workload(args.ctx, load=args.load)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        runs = {}
        for mode in ("discovery_only", "exact_equivalent"):
            print(f"scenarios, {mode} …", file=sys.stderr)
            (root / mode).mkdir()
            runs[mode] = run_mode(mode, workload, model, root / mode, route=mode == "exact_equivalent")
        trials = _trials(workload, args.reps, model, root / "trials")
        long_trials = {}
        if args.long:
            for size in (8192, 16384, 32768):
                w = build_workload(size, scenarios=LONG_SCENARIOS)
                long_trials[size] = _trials(w, args.long_reps, model, root / f"trials-{size}")
        print("provider latency sweep …", file=sys.stderr)
        scaling = provider_scaling(workload, sizes, model)
        bound = deadline_bound(root)
    for run in runs.values():
        if negatives_materialized(run) or run["experimental"]:
            raise SystemExit("a negative control was materialized: DESIGN §2 violated")
    for t in (trials, *long_trials.values()):
        if any(sum(t["loaded"].get(name, [])) for name in NEGATIVE_SCENARIOS):
            raise SystemExit("a negative control was materialized in the trials: DESIGN §2 violated")
    text = report(args.ctx, runs, scaling, bound, sizes, model is not None)
    text += trials_report(args.ctx, trials, runs, long_trials)
    slower = slower_scenarios(trials)
    text += ("\nNo scenario's warm median is slower than cold beyond the 95 % intervals.\n" if not slower else
             f"\nWarm slower than cold beyond the 95 % intervals: {', '.join(slower)}.\n")
    text += f"\nRun time: {time.perf_counter() - started:.0f} s (`python tools/bench_discovery.py" + \
            (" --long" if args.long else "") + "`).\n"
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"discovery-{dt.date.today().isoformat()}"
    stem.with_suffix(".md").write_text(text)
    plot(stem.with_suffix(".png"), runs, scaling, sizes, bound)
    plot_ttft(stem.with_name(stem.name + "-ttft.png"), {args.ctx: trials, **long_trials})
    print(text)
    print(f"wrote {stem}.md and {stem}.png", file=sys.stderr)


if __name__ == "__main__":
    main()
