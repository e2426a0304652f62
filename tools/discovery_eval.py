"""Discovery evaluated at scale (issue 24, DESIGN §10): precision/recall per provider on labelled pairs,
lookup latency at 100k–1M indexed donors, and the hard deadline with both cores busy.

1. **Precision / recall.** :func:`tools.discovery_pairs.build_pairs` (8 classes, ≥ 1,000 pairs).
   Every pair's donor is registered in a real SQLite ledger (saved, under its namespace) and in a
   :class:`~connector.discovery.service.DiscoveryService` running the product's four providers
   (``exact``, ``chunks``, ``minhash``, ``embedding``; prompt text allowed); all donors share one
   index, so a target can also be attributed to another pair's donor. Each target is looked up with
   :meth:`DiscoveryService.candidates` (background deadline 30 s: quality, not speed, is measured
   here); a provider's answer is its best FRESH match (``service``), and, beside it, its best match
   before the ledger check (``raw``: :meth:`candidates` of the provider itself). Scoring
   (:func:`score`): a positive pair answered with its donor is a true positive; answered with
   another donor, a false positive AND a false negative; unanswered, a false negative. A negative
   pair answered at all is a false positive. Intervals: Wilson 95 % (``scipy.stats.binomtest(k,
   n).proportion_ci(method="wilson")``; Wilson, JASA 22 (1927) 209–212).
2. **Lookup latency at scale.** Each provider alone, its ``candidates`` timed on the lookup thread's
   work for the first ``--queries`` targets, with the pairs' donors plus synthetic filler donors
   indexed: 64 random token ids each (uniform over the vocabulary, ``numpy.random.default_rng``;
   read-only row views of one array), and for the embedding index random unit vectors (standard
   normal, normalised) instead of embedded text. The query embedding (done off the path) is timed
   separately; the embedding search is timed as shipped and with BLAS on one thread
   (``threadpoolctl``), interleaved. The block-chunk provider is bulk-loaded with its snapshot rebuild throttle raised
   (one rebuild at the end): its online indexer re-sorts the whole snapshot every 50 ms, which at a
   million donors would dominate the load, and it is lookups that are measured here.
3. **Hard deadline under load.** A service with ``chunks``, ``minhash`` and ``embedding`` (queries
   prepared, as the scheduler path requires) over the ``--deadline-size`` index, ``lookup_timeout_s``
   = 2 ms, :meth:`DiscoveryService.lookup` inline as the scheduler calls it: the caller's time, idle
   and with one CPU-burner process per core (``python -c "while True: pass"``), interleaved in one
   run; again with BLAS on one thread; and with a provider that never answers (the deadline alone).

Embeddings: every donor and target text is embedded once (:func:`embed_all`) with torch on
``--torch-threads`` threads (default 1: on a busy 2-core machine two intra-op threads were 4-7x
slower, measured by :func:`thread_check` and reported) and handed to the providers.

Usage: ``python tools/discovery_eval.py [--per-class 125] [--sizes 100000,1000000]
[--minhash-sizes 100000,300000] [--queries 200] [--deadline-size 100000] [--skip pr,scale,deadline]
[--torch-threads 1] [--no-semantic] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import logging
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.discovery_pairs import MODEL_ID, NEGATIVE_CLASSES, PAIR_CLASSES, POSITIVE_CLASSES, Pair, PairSet, \
    build_pairs  # noqa: E402

__all__ = ["Counts", "score", "wilson"]

RESULTS = Path(__file__).resolve().parent / "results"
TPB = 32
PROVIDERS = ("exact", "chunks", "minhash", "embedding")


def wilson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of ``k`` successes in ``n`` trials (scipy); ``(nan, nan)`` when ``n == 0``."""
    if n == 0:
        return math.nan, math.nan
    from scipy.stats import binomtest

    ci = binomtest(k, n).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


@dataclasses.dataclass
class Counts:
    """Confusion counts of one provider over a set of pairs (a positive answered with a wrong donor
    counts once in ``fp`` and once in ``fn``)."""

    tp: int = 0
    fp: int = 0
    fn: int = 0
    tn: int = 0
    pairs: int = 0

    @property
    def precision(self) -> float:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else math.nan

    @property
    def recall(self) -> float:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else math.nan

    @property
    def precision_ci(self) -> tuple[float, float]:
        return wilson(self.tp, self.tp + self.fp)

    @property
    def recall_ci(self) -> tuple[float, float]:
        return wilson(self.tp, self.tp + self.fn)

    @property
    def answered(self) -> int:
        """Pairs the provider answered (with any donor): each answer is exactly one TP or one FP."""
        return self.tp + self.fp


def score(labels: Iterable[tuple[str, str, bool, str]], answers: Mapping[str, str | None]) -> dict[str, Counts]:
    """Confusion counts per class and ``"all"`` / ``"positive"`` / ``"negative"`` totals.

    Args:
        labels: ``(pair_id, class, positive, donor_id)`` per pair.
        answers: pair_id -> the donor id the provider answered for the pair's target, or None.
    """
    out: dict[str, Counts] = {}
    for pair_id, cls, positive, donor_id in labels:
        got = answers.get(pair_id)
        for key in (cls, "all", "positive" if positive else "negative"):
            c = out.setdefault(key, Counts())
            c.pairs += 1
            if positive:
                if got == donor_id:
                    c.tp += 1
                else:
                    c.fn += 1
                    c.fp += got is not None
            elif got is None:
                c.tn += 1
            else:
                c.fp += 1
    return out


# --------------------------------------------------------------------------------------------- helpers
def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def log(msg: str) -> None:
    print(f"[{dt.datetime.now(dt.UTC):%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def donor_id(pair: Pair) -> str:
    return f"{pair.pair_id}/donor"


def record(pair: Pair, *, with_text: bool = True) -> Any:
    from connector.discovery.types import DonorRecord, readonly_tokens

    tokens = pair.donor.tokens[: len(pair.donor.tokens) // TPB * TPB]
    return DonorRecord(donor_id(pair), "A", pair.donor_namespace, MODEL_ID, readonly_tokens(tokens), TPB,
                       text=pair.donor.text if with_text else None)


def seed_ledger(db: str, pairs: Iterable[Pair]) -> None:
    """Every pair's donor registered and saved in the ledger at ``db`` (content keys under its namespace)."""
    import xxhash

    from connector.namespace import Namespace, content_keys
    from ledger import events as ev
    from ledger.client import LedgerClient

    client = LedgerClient(db)
    try:
        for pair in pairs:
            tokens = list(pair.donor.tokens)
            n = len(tokens) // TPB
            client.register_donor(ev.DonorRegistered(
                donor_id=donor_id(pair), namespace=pair.donor_namespace, engine_id="A", generation=1,
                content_keys=content_keys(Namespace(pair.donor_namespace, {}), tokens, TPB, n),
                block_hashes=[xxhash.xxh64_intdigest(f"{pair.pair_id}/{i}".encode()) for i in range(n)],
                num_tokens=n * TPB, tokens_per_block=TPB))
            client.mark_donor_saved(donor_id(pair), store_ref=f"{pair.pair_id}.kv", checksum="0" * 16, size_bytes=1)
    finally:
        client.close()


def semantic_model() -> Any:
    try:
        from connector.discovery.embedding import load_sentence_model

        return load_sentence_model()
    except Exception as exc:  # noqa: BLE001 - the extra is optional; the results say it was missing
        log(f"embedding provider unavailable: {exc}")
        return None


def build_providers(settings: Any, db: str, model: Any, names: Iterable[str]) -> list[Any]:
    from connector.discovery.chunks import BlockChunkProvider
    from connector.discovery.embedding import EmbeddingProvider
    from connector.discovery.exact import LedgerPrefixProvider
    from connector.discovery.minhash import MinHashProvider

    make: dict[str, Callable[[], Any]] = {
        "exact": lambda: LedgerPrefixProvider(settings, db=db), "chunks": lambda: BlockChunkProvider(settings),
        "minhash": lambda: MinHashProvider(settings), "embedding": lambda: EmbeddingProvider(settings, model=model)}
    return [make[n]() for n in names if n != "embedding" or model is not None]


@dataclasses.dataclass
class Embedded:
    """Every donor's and target's vector, computed once by :meth:`EmbeddingProvider.embed` (the
    product's windows and mean-pooling), handed to providers by ``index_vector`` and the query cache
    (the vectors their own ``index``/``prepare`` would compute)."""

    donors: dict[str, np.ndarray]
    targets: dict[str, np.ndarray]
    seconds: list[float]


def embed_all(ps: PairSet, model: Any) -> Embedded | None:
    if model is None:
        return None
    from connector.discovery.embedding import EmbeddingProvider
    from connector.discovery.settings import DiscoverySettings

    emb = EmbeddingProvider(DiscoverySettings(), model=model)
    donors, targets, seconds = {}, {}, []
    for k, pair in enumerate(ps.pairs):
        donors[donor_id(pair)] = emb.embed(pair.donor.text)
        t0 = time.perf_counter()
        targets[pair.pair_id] = emb.embed(pair.target.text)
        seconds.append(time.perf_counter() - t0)
        if k % 200 == 199:
            log(f"  embedded {k + 1} pairs")
    return Embedded(donors, targets, seconds)


def thread_check(ps: PairSet, model: Any, n: int = 8) -> dict[int, float]:
    """Mean seconds of one ``embed`` with torch on 2 threads and on 1 (the same texts, this run)."""
    import torch

    from connector.discovery.embedding import EmbeddingProvider
    from connector.discovery.settings import DiscoverySettings

    emb = EmbeddingProvider(DiscoverySettings(), model=model)
    texts = [p.target.text for p in ps.pairs[:: max(1, len(ps.pairs) // n)][:n]]
    out = {}
    for threads in (2, 1, 2, 1):
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        for text in texts:
            emb.embed(text)
        out.setdefault(threads, []).append((time.perf_counter() - t0) / len(texts))
    return {k: min(v) for k, v in out.items()}


def cache_query(provider: Any, text: str, vector: np.ndarray) -> None:
    """Put a query's vector in the embedding provider's query cache (what ``prepare`` does)."""
    from connector.discovery.embedding import _text_key

    provider._remember(_text_key(text), vector)


# --------------------------------------------------------------------------------------------- 1. P/R
def precision_recall(ps: PairSet, root: Path, model: Any, vecs: Embedded | None) -> dict[str, Any]:
    from connector.discovery.service import DiscoveryService
    from connector.discovery.settings import DiscoverySettings
    from connector.discovery.types import Query, readonly_tokens
    from ledger.migrate import upgrade

    db = f"sqlite:///{root / 'pairs.db'}"
    upgrade(db)
    started = time.perf_counter()
    seed_ledger(db, ps.pairs)
    log(f"ledger: {len(ps.pairs)} donors in {time.perf_counter() - started:.1f} s")
    settings = DiscoverySettings(providers=PROVIDERS, allow_prompt_text=True, embedding_cache_size=4 * len(ps.pairs),
                                 index_queue_max=4 * len(ps.pairs), max_indexed_donors=10 * len(ps.pairs))
    providers = build_providers(settings, db, model, PROVIDERS)
    for provider in providers:
        if provider.name == "embedding":
            for pair in ps.pairs:
                provider.index_vector(record(pair), vecs.donors[donor_id(pair)])
                cache_query(provider, pair.target.text, vecs.targets[pair.pair_id])
    service = DiscoveryService(settings, db=db, providers=providers)
    service_answers: dict[str, dict[str, str | None]] = {p.name: {} for p in providers}
    raw_answers: dict[str, dict[str, str | None]] = {p.name: {} for p in providers}
    try:
        started = time.perf_counter()
        for pair in ps.pairs:
            while not service.register_donor(record(pair, with_text=False)):  # embedding: indexed above
                time.sleep(0.01)
        assert service.flush(1800), "indexing did not finish"
        index_s = time.perf_counter() - started
        log(f"indexed {len(ps.pairs)} donors in {index_s:.1f} s: {service.indexed()}")
        started = time.perf_counter()
        for k, pair in enumerate(ps.pairs):
            t = pair.target
            matches = service.candidates(list(t.tokens), t.text, MODEL_ID, pair.target_namespace,
                                         tokens_per_block=TPB, deadline_s=30.0)
            for provider in providers:
                best = next((m.donor_id for m in matches if m.provider == provider.name), None)
                service_answers[provider.name][pair.pair_id] = best
                raw = provider.candidates(Query(readonly_tokens(t.tokens), t.text, MODEL_ID, pair.target_namespace,
                                                TPB), settings.candidates_per_provider)
                raw_answers[provider.name][pair.pair_id] = raw[0].donor_id if raw else None
            if k % 200 == 199:
                log(f"  {k + 1} targets looked up")
        lookup_s = time.perf_counter() - started
        outcomes = {name: service.metrics.value("semkv_discovery_outcomes_total", provider=name, outcome="timeout")
                    for name in service_answers}
    finally:
        service.close()
    labels = [(p.pair_id, p.cls, p.positive, donor_id(p)) for p in ps.pairs]
    return {"service": {n: score(labels, a) for n, a in service_answers.items()},
            "raw": {n: score(labels, a) for n, a in raw_answers.items()},
            "service_other": {n: other_donor_answers(ps, a) for n, a in service_answers.items()},
            "raw_other": {n: other_donor_answers(ps, a) for n, a in raw_answers.items()},
            "index_s": index_s, "lookup_s": lookup_s, "timeouts": outcomes}


def other_donor_answers(ps: PairSet, answers: Mapping[str, str | None], block: int = TPB) -> tuple[int, int]:
    """``(answers naming another pair's donor, of which the donor shares a token-exact run of at least
    ``block`` tokens with the target)``: the corpus repeats itself (CPython's pure-Python twins such as
    ``_pyio``/``io`` carry the same docstrings), so some of these false positives are real shared text."""
    from connector.discovery.tokens import align_segments

    donors = {donor_id(p): p for p in ps.pairs}
    other = shared = 0
    for pair in ps.pairs:
        got = answers.get(pair.pair_id)
        if got is None or got == donor_id(pair) or got not in donors:
            continue
        other += 1
        target = np.asarray(pair.target.tokens, dtype=np.int64)
        source = np.asarray(donors[got].donor.tokens, dtype=np.int64)
        shared += bool(align_segments(target, source, anchor=8, min_tokens=block))
    return other, shared


# --------------------------------------------------------------------------------------------- 2. scale
def filler_tokens(n: int, vocab: int, seed: int = 7) -> np.ndarray:
    """``int64[n, 64]`` random token ids in ``[1, vocab)``, read-only (row views are shared, not copied)."""
    arr = np.random.default_rng(seed).integers(1, vocab, size=(n, 64), dtype=np.int64)
    arr.flags.writeable = False
    return arr


def index_at_scale(name: str, size: int, ps: PairSet, model: Any, settings: Any, vecs: Embedded | None) -> Any:
    """A provider with the pairs' donors plus filler up to ``size`` donors indexed."""
    from connector.discovery import chunks as chunks_module
    from connector.discovery.types import DonorRecord

    (provider,) = build_providers(settings, "", model, [name])
    real = [record(p) for p in ps.pairs]
    filler = filler_tokens(max(0, size - len(real)), ps.vocab_size)
    throttle = chunks_module._REBUILD_S
    chunks_module._REBUILD_S = 1e9  # bulk load: one snapshot rebuild at the end (see the module docstring)
    rng = np.random.default_rng(11)
    try:
        for rec in real:
            if name == "embedding":
                provider.index_vector(rec, vecs.donors[rec.donor_id])
            else:
                provider.index(rec)
        for i in range(len(filler)):
            rec = DonorRecord(f"f{i}", "A", rec.namespace, MODEL_ID, filler[i], TPB)
            if name == "embedding":
                if i % 65536 == 0:
                    block = rng.standard_normal((min(65536, len(filler) - i), 384)).astype(np.float32)
                    block /= np.linalg.norm(block, axis=1, keepdims=True)
                provider.index_vector(rec, block[i % 65536])
            else:
                provider.index(rec)
        provider.flush(True)
    finally:
        chunks_module._REBUILD_S = throttle
    return provider


def scale_latency(ps: PairSet, model: Any, vecs: Embedded | None, sizes: list[int], minhash_sizes: list[int],
                  n_queries: int, budget_s: float) -> dict[str, Any]:
    from connector.discovery.settings import DiscoverySettings
    from connector.discovery.types import Query, readonly_tokens

    settings = DiscoverySettings(allow_prompt_text=True, embedding_cache_size=4 * len(ps.pairs))
    targets = [ps.pairs[i] for i in np.linspace(0, len(ps.pairs) - 1, n_queries).astype(int)]
    queries = [Query(readonly_tokens(p.target.tokens), p.target.text, MODEL_ID, p.target_namespace, TPB)
               for p in targets]
    embed_times = vecs.seconds if vecs is not None else []
    rows: dict[tuple[str, int], dict[str, float]] = {}
    deadline = time.monotonic() + budget_s
    plan = [(name, size) for size in sorted(set(sizes) | set(minhash_sizes)) for name in ("chunks", "minhash", "embedding")
            if (size in minhash_sizes if name == "minhash" else size in sizes) and (name != "embedding" or model)]
    from threadpoolctl import threadpool_limits

    for name, size in plan:
        if time.monotonic() > deadline:
            rows[(name, size)] = {"skipped": 1.0}
            log(f"scale {name} {size}: skipped (time budget)")
            continue
        gc.collect()
        started = time.perf_counter()
        provider = index_at_scale(name, size, ps, model, settings, vecs)
        index_s = time.perf_counter() - started
        if name == "embedding":
            for p in targets:  # the query embedding is done off the path (prepare)
                cache_query(provider, p.target.text, vecs.targets[p.pair_id])
        # the embedding search is a BLAS matrix-vector product: as shipped (BLAS's own thread count) and
        # with BLAS on one thread, interleaved in the same run
        variants = [(name, None), (f"{name} (BLAS 1 thread)", 1)] if name == "embedding" else [(name, None)]
        series: dict[str, list[float]] = {label: [] for label, _ in variants}
        hits = 0
        for rep in range(2):
            for label, blas in variants:
                limit = threadpool_limits(blas, user_api="blas") if blas else None
                try:
                    for q in queries:
                        t0 = time.perf_counter()
                        found = provider.candidates(q, settings.candidates_per_provider)
                        series[label].append(time.perf_counter() - t0)
                        hits += bool(found) and rep == 0 and blas is None
                finally:
                    if limit is not None:
                        limit.restore_original_limits()
        for label, times in series.items():
            rows[(label, size)] = {"p50": pct(times, 50), "p99": pct(times, 99), "max": max(times), "n": len(times),
                                   "index_s": index_s, "rss_mib": rss_mib(), "answered": hits,
                                   "load": os.getloadavg()[0]}
            log(f"scale {label} {size}: p50 {rows[(label, size)]['p50'] * 1e3:.2f} ms p99 "
                f"{rows[(label, size)]['p99'] * 1e3:.2f} ms (index {index_s:.0f} s, maxrss {rss_mib():.0f} MiB)")
        provider.close()
        del provider
        gc.collect()
    return {"rows": rows, "embed_p50": pct(embed_times, 50), "embed_p99": pct(embed_times, 99),
            "n_queries": len(queries)}


# --------------------------------------------------------------------------------------------- 3. deadline
def _hung_provider():  # noqa: ANN202 - tools.bench_deadline's provider that never answers (until closed)
    from tools.bench_deadline import HungProvider

    return HungProvider()


def burners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait(10)


DEADLINE_LABELS = ("real", "real_blas1", "hung")


def deadline_under_load(ps: PairSet, model: Any, vecs: Embedded | None, root: Path, size: int, n_queries: int,
                        rounds: int, labels: tuple[str, ...] = DEADLINE_LABELS) -> dict[str, Any]:
    """Caller-observed inline lookup times per ``labels`` entry: ``real`` (the providers as shipped),
    ``real_blas1`` (BLAS on one thread), ``real_switch`` (``sys.setswitchinterval(0.0005)`` instead of
    Python's 5 ms), ``hung`` (one provider that never answers)."""
    from connector.discovery.service import DiscoveryService
    from connector.discovery.settings import DiscoverySettings
    from ledger.migrate import upgrade

    db = f"sqlite:///{root / 'deadline.db'}"
    upgrade(db)
    seed_ledger(db, ps.pairs)
    settings = DiscoverySettings(allow_prompt_text=True, embedding_cache_size=4 * len(ps.pairs),
                                 provider_queue_max=4, lookup_timeout_s=0.002)
    targets = [ps.pairs[i] for i in np.linspace(0, len(ps.pairs) - 1, n_queries).astype(int)]
    names = [n for n in ("chunks", "minhash", "embedding") if n != "embedding" or model is not None]

    def indexed() -> list[Any]:  # a service closes its providers: each real run gets its own
        built = [index_at_scale(n, size, ps, model, settings, vecs) for n in names]
        for p in built:
            if p.name == "embedding":
                for t in targets:
                    cache_query(p, t.target.text, vecs.targets[t.pair_id])
        return built
    out: dict[str, Any] = {"size": size, "providers": names, "labels": labels}
    cores = os.cpu_count() or 2
    from threadpoolctl import threadpool_limits

    hung_settings = settings.model_copy(update={"provider_queue_max": 100_000})  # never skipped at submission
    switch = sys.getswitchinterval()
    for label in labels:
        hung = _hung_provider()
        provs = [hung] if label == "hung" else indexed()
        service = DiscoveryService(hung_settings if label == "hung" else settings, db=db, providers=provs)
        limit = threadpool_limits(1, user_api="blas") if label == "real_blas1" else None
        if label == "real_switch":  # a waiting caller gets the GIL back sooner from a provider thread running Python
            sys.setswitchinterval(0.0005)
        series: dict[str, list[float]] = {"idle": [], "busy": []}
        loads: dict[str, list[float]] = {"idle": [], "busy": []}
        try:
            for t in targets[:20]:  # warm-up: first ledger reads, first metric labels
                service.lookup(list(t.target.tokens), t.target.text, MODEL_ID, t.target_namespace)
            for _ in range(rounds):
                for mode in ("idle", "busy"):
                    procs = burners(cores) if mode == "busy" else []
                    try:
                        time.sleep(0.5 if procs else 0.2)
                        for t in targets:
                            tokens = np.asarray(t.target.tokens, dtype=np.int64)
                            t0 = time.perf_counter()
                            service.lookup(tokens, t.target.text, MODEL_ID, t.target_namespace)
                            series[mode].append(time.perf_counter() - t0)
                            time.sleep(0.002)  # a scheduler iteration between lookups
                        loads[mode].append(os.getloadavg()[0])
                    finally:
                        stop(procs)
            timeouts = {p.name: service.metrics.value("semkv_discovery_outcomes_total", provider=p.name,
                                                      outcome="timeout") for p in provs}
            hits = {p.name: service.metrics.value("semkv_discovery_outcomes_total", provider=p.name, outcome="hit")
                    for p in provs}
        finally:
            sys.setswitchinterval(switch)
            if limit is not None:
                limit.restore_original_limits()
            hung.release.set()
            service.close()
        out[label] = {mode: {"p50": pct(v, 50), "p99": pct(v, 99), "max": max(v), "n": len(v),
                             "load": max(loads[mode])} for mode, v in series.items()}
        out[label]["timeouts"] = timeouts
        out[label]["hits"] = hits
    return out


# --------------------------------------------------------------------------------------------- report
def _ci(lo_hi: tuple[float, float]) -> str:
    lo, hi = lo_hi
    return "—" if math.isnan(lo) else f"[{lo:.3f}, {hi:.3f}]"


def _f(x: float) -> str:
    return "—" if math.isnan(x) else f"{x:.3f}"


def pr_tables(result: Mapping[str, Mapping[str, Counts]], title: str) -> list[str]:
    lines = [f"#### {title}: overall", "",
             "| provider | pairs answered | TP | FP | FN | TN | precision [95 % CI] | recall over all positives [95 % CI] |",
             "|---|---|---|---|---|---|---|---|"]
    for name, counts in result.items():
        c = counts["all"]
        lines.append(f"| {name} | {c.answered}/{c.pairs} | {c.tp} | {c.fp} | {c.fn} | {c.tn} | {_f(c.precision)} {_ci(c.precision_ci)} | "
                     f"{_f(c.recall)} {_ci(c.recall_ci)} |")
    lines += ["", f"#### {title}: per class (positives: recall; negatives: false-positive rate = FP / pairs)", "",
              "| class | " + " | ".join(f"{n}" for n in result) + " |", "|---|" + "---|" * len(result)]
    for cls in PAIR_CLASSES:
        cells = []
        for counts in result.values():
            c = counts.get(cls, Counts())
            if cls in POSITIVE_CLASSES:
                cells.append(f"R {_f(c.recall)} {_ci(c.recall_ci)}; P {_f(c.precision)} ({c.tp}/{c.pairs}, FP {c.fp})")
            else:
                cells.append(f"FPR {_f(c.fp / c.pairs if c.pairs else math.nan)} {_ci(wilson(c.fp, c.pairs))} "
                             f"({c.fp}/{c.pairs})")
        lines.append(f"| {cls}{' (−)' if cls in NEGATIVE_CLASSES else ''} | " + " | ".join(cells) + " |")
    return lines + [""]


def write_report(path: Path, args: argparse.Namespace, ps: PairSet, started: str, load_start: str,
                 pr: dict[str, Any] | None, scale: dict[str, Any] | None, dl: dict[str, Any] | None,
                 threads: dict[int, float] | None = None) -> None:
    ended = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [f"# Discovery evaluated at scale — {started[:10]}", "",
             f"- run: {started} → {ended}; load average at start {load_start}, at end {load_average()} "
             f"(`os.getloadavg()`, 1/5/15 min)",
             f"- machine: {os.cpu_count()} CPUs, shared with other helpers' builds/tests and a CI run (the "
             f"load average says how busy); Python {sys.version.split()[0]}",
             f"- command: `python tools/discovery_eval.py {' '.join(sys.argv[1:])}`",
             f"- pairs: `tools/discovery_pairs.py` seed {ps.seed}, ~{ps.ctx}-token prompts, vocabulary "
             f"{ps.vocab_size}, {len(ps.pairs)} pairs: " + ", ".join(f"{c} {n}" for c, n in ps.counts().items())]
    if threads:
        lines.append(f"- embedding (all-MiniLM-L6-v2, `EmbeddingProvider.embed`) per text, this run, same 8 texts: "
                     f"**{threads[2] * 1e3:.0f} ms with torch on 2 threads, {threads[1] * 1e3:.0f} ms on 1** "
                     f"(the machine's other load makes 2 intra-op threads wait on each other); this run used "
                     f"`torch.set_num_threads({args.torch_threads})`")
    lines.append("")
    if pr is not None:
        lines += ["## 1. Precision and recall per provider", "",
                  "Method: tools/discovery_eval.py's docstring (one shared index of every pair's donor; best "
                  "answer per provider per target; Wilson 95 % intervals). `service` = what the product returns "
                  "(after the ledger's freshness/namespace check); `raw` = the provider alone.",
                  f"Indexing {len(ps.pairs)} donors took {pr['index_s']:.0f} s, the lookups {pr['lookup_s']:.0f} s; "
                  f"timeouts at the 30 s evaluation deadline: {pr['timeouts']}.", ""]
        for key, title in (("service", "service (fresh, namespace-checked)"),
                           ("raw", "raw provider (before the ledger check)")):
            lines += pr_tables(pr[key], title)
            lines += ["Answers naming ANOTHER pair's donor (counted as false positives above), and how many of "
                      f"those donors share a token-exact run of ≥ {TPB} tokens with the target (real shared text: "
                      "the corpus repeats itself): " + ", ".join(
                          f"{n} {o} ({sh} sharing)" for n, (o, sh) in pr[f"{key}_other"].items()), ""]
    if scale is not None:
        lines += ["## 2. Lookup latency at scale", "",
                  f"`candidates()` of each provider alone (the provider thread's work, no deadline), "
                  f"{scale['n_queries']} real targets × 2, the pairs' {len(ps.pairs)} donors + synthetic filler "
                  f"(64 random token ids each; random unit vectors for the embedding index). Query embedding "
                  f"(off the path, `EmbeddingProvider.embed`): p50 {scale['embed_p50'] * 1e3:.1f} ms, "
                  f"p99 {scale['embed_p99'] * 1e3:.1f} ms.", "",
                  "| provider | indexed donors | p50 ms | p99 ms | max ms | targets answered | index time s | "
                  "max RSS MiB | load |", "|---|---|---|---|---|---|---|---|---|"]
        for (name, size), r in scale["rows"].items():
            if "skipped" in r:
                lines.append(f"| {name} | {size:,} | skipped (time budget) | | | | | | |")
                continue
            lines.append(f"| {name} | {size:,} | {r['p50'] * 1e3:.3f} | {r['p99'] * 1e3:.3f} | {r['max'] * 1e3:.2f} | "
                         f"{r['answered']}/{scale['n_queries']} | {r['index_s']:.0f} | {r['rss_mib']:.0f} | "
                         f"{r['load']:.1f} |")
        lines.append("")
    if dl is not None:
        lines += ["## 3. The hard deadline with both cores busy", "",
                  f"`DiscoveryService.lookup` inline (as the scheduler calls it), `lookup_timeout_s` = 2 ms, "
                  f"providers {', '.join(dl['providers'])} over {dl['size']:,} indexed donors (queries prepared), "
                  f"and a provider that never answers; idle and with one `while True: pass` process per core "
                  f"({os.cpu_count()}), interleaved rounds. Target (DESIGN §7): caller p99 ≤ 3 ms with both cores busy.",
                  "", "| providers | CPU burners | lookups | caller p50 ms | caller p99 ms | max ms | load (1 min, max) |",
                  "|---|---|---|---|---|---|---|"]
        for label in dl["labels"]:
            for mode in ("idle", "busy"):
                r = dl[label][mode]
                lines.append(f"| {label} | {'one per core' if mode == 'busy' else 'none'} | {r['n']} | {r['p50'] * 1e3:.3f} | {r['p99'] * 1e3:.3f} | "
                             f"{r['max'] * 1e3:.2f} | {r['load']:.1f} |")
        lines += ["", f"Timeouts counted by the service (real providers, all rounds): {dl['real']['timeouts']}; "
                  f"hits: {dl['real']['hits']}."] + [
                  f"`{label}`: timeouts {dl[label]['timeouts']}, hits {dl[label]['hits']}." for label in dl["labels"]
                  if label.startswith("real_")] + ["`real_blas1`: BLAS on one thread (`threadpoolctl.threadpool_limits"
                  "(1, 'blas')`); `real_switch`: `sys.setswitchinterval(0.0005)` (Python's default 0.005 s).", ""]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-class", type=int, default=125)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--minhash-sizes", default="100000,300000")
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--scale-budget-s", type=float, default=900)
    ap.add_argument("--deadline-size", type=int, default=100_000)
    ap.add_argument("--deadline-rounds", type=int, default=3)
    ap.add_argument("--deadline-labels", default=",".join(DEADLINE_LABELS),
                    help="real, real_blas1, real_switch, hung (see deadline_under_load)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: pr,scale,deadline")
    ap.add_argument("--no-semantic", action="store_true")
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    skip = set(filter(None, args.skip.split(",")))
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    load_start = load_average()
    out = args.out or RESULTS / f"discovery-eval-{started[:10]}.md"
    ps = build_pairs(args.per_class, seed=args.seed)
    log(f"{len(ps.pairs)} pairs: {ps.counts()}")
    model = None if args.no_semantic else semantic_model()
    threads = None
    if model is not None:
        import torch

        threads = thread_check(ps, model)
        torch.set_num_threads(args.torch_threads)
        log(f"embed s/text by torch threads: {threads}; using {args.torch_threads}")
    vecs = embed_all(ps, model)
    pr = scale = dl = None
    with tempfile.TemporaryDirectory(prefix="semkv-disceval-") as tmp:
        if "pr" not in skip:
            pr = precision_recall(ps, Path(tmp), model, vecs)
            write_report(out, args, ps, started, load_start, pr, scale, dl, threads)
        if "deadline" not in skip:
            dl = deadline_under_load(ps, model, vecs, Path(tmp), args.deadline_size, args.queries, args.deadline_rounds,
                                     tuple(args.deadline_labels.split(",")))
            write_report(out, args, ps, started, load_start, pr, scale, dl, threads)
        if "scale" not in skip:
            scale = scale_latency(ps, model, vecs, [int(s) for s in args.sizes.split(",") if s],
                                  [int(s) for s in args.minhash_sizes.split(",") if s], args.queries,
                                  args.scale_budget_s)
    write_report(out, args, ps, started, load_start, pr, scale, dl, threads)
    print(out)


if __name__ == "__main__":
    main()
