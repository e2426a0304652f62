"""Interleaved TTFT trials for the DESIGN §10 report (issue 24): each scenario's target run many times
on three engines side by side — cold (no connector), ``discovery_only`` and ``exact_equivalent``
(warm) — in a rotating order, so that drift on a shared machine falls on every mode alike.

The three target engines run with TensorRT-LLM's own block reuse OFF (``enable_block_reuse=False``):
every repetition is then the same experiment (a later one is not served by the engine's own prefix
cache), and what the warm engine gains is the connector's alone. Donors are made once, on engine A
(and H, which offloads them to host memory, for ``host_offload``), as ``tools/bench_discovery.py``
makes them. The warm engine's profitability gate is on (its default), so declines are part of what
is measured and counted.

Also: the ``high_load`` burst submitted at once, connector off (cold engine) and on (warm engine),
as requests/s and prompt tokens/s; and the warm engine's ``semkv_ttft_delta_seconds``.

Statistics: the median and its distribution-free 95 % interval (order statistics of a binomial
(n, ½): ranks ``n/2 ∓ 0.98 √n``), no normality assumed.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from connector.discovery.service import DiscoveryService
from connector.harness import KvCacheConfig, ModelConfig
from tools.harness.discovery_fleet import discovering_engine
from tools.harness.fleet import Engine, Fleet
from tools.workloads import Workload

__all__ = ["MODES", "Interval", "median_interval", "run_trials"]

MODES = ("cold", "discovery_only", "exact_equivalent")
TPB = 32


class Interval(NamedTuple):
    """A median and its ~95 % confidence interval (the sample's unit)."""

    median: float
    low: float
    high: float


def median_interval(values: list[float]) -> Interval:
    """The median of ``values`` with its distribution-free ~95 % confidence interval: the order
    statistics of ranks ``floor(n/2 - 0.98 √n)`` and ``ceil(1 + n/2 + 0.98 √n)`` (1-based; the normal
    approximation of a binomial (n, ½), rounded outwards), clamped to the sample (the whole range
    when ``n < 6``, where no narrower interval reaches 95 %). NaN when empty."""
    if not values:
        return Interval(math.nan, math.nan, math.nan)
    data, n = np.sort(np.asarray(values, dtype=float)), len(values)
    half = 0.98 * math.sqrt(n)
    low, high = max(1, math.floor(n / 2 - half)), min(n, math.ceil(1 + n / 2 + half))
    return Interval(float(np.median(data)), float(data[low - 1]), float(data[high - 1]))


def _engines(fleet: Fleet, service: DiscoveryService, text_of: Any, cfg: ModelConfig) -> dict[str, Engine]:
    """The three target engines, block reuse off, donors never registered by them."""
    pool = KvCacheConfig(tokens_per_block=TPB, event_buffer_max_size=65536, max_tokens=12 * cfg.max_context,
                         enable_block_reuse=False)
    common = {"model": cfg, "kv_cache_config": pool, "max_num_tokens": 2048}
    return {
        "cold": fleet.engine("C", connector=False, **common),
        "discovery_only": discovering_engine(fleet, "D", service, mode="discovery_only", text_of=text_of,
                                             min_donor_blocks=10**6, **common),
        "exact_equivalent": discovering_engine(fleet, "W", service, mode="exact_equivalent", text_of=text_of,
                                               min_donor_blocks=10**6, store_inline_verify_max_bytes=2**40, **common),
    }


def _mean(metrics: Any, histogram: str) -> float:
    """The mean of a histogram over all its label sets (NaN when empty)."""
    totals = {"_sum": 0.0, "_count": 0.0}
    for family in metrics.registry.collect():
        for sample in family.samples:
            suffix = sample.name.removeprefix(histogram)
            if suffix in totals and sample.name.startswith(histogram):
                totals[suffix] += sample.value
    return totals["_sum"] / totals["_count"] if totals["_count"] else math.nan


def _ttft(engine: Engine, tokens: list[int], salt: str | None) -> tuple[float, int]:
    result = engine.generate(tokens, cache_salt=salt)
    if engine.llm.connector is not None:
        engine.scheduler.flush()
    return result.prefill_seconds, result.num_connector_tokens


def _burst(engine: Engine, prompts: list[tuple[list[int], str | None]]) -> float:
    """Wall seconds to serve every prompt submitted at once (first token each)."""
    started = time.perf_counter()
    for tokens, salt in prompts:
        engine.llm.submit(tokens, cache_salt=salt)
    engine.llm.run_until_idle(timeout_s=600)
    seconds = time.perf_counter() - started
    engine.settle()
    return seconds


def run_trials(w: Workload, reps: int, root: Path, make_service: Any, setup_donors: Any,
               progress: Any = None) -> dict[str, Any]:
    """Run ``reps`` interleaved repetitions of every labelled target of ``w``.

    Args:
        make_service: ``db -> DiscoveryService`` (the benchmark's providers).
        setup_donors: ``(fleet, service, text_of, cfg) -> None``: makes the workload's donors (A, H).
        progress: called with ``(rep, reps)`` after each repetition (None: silent).

    Returns:
        ``{"ttft": {scenario: {mode: [seconds, ...]}}, "loaded": {scenario: [tokens, ...]},
        "burst": {"cold"|"exact_equivalent": [seconds, ...]}, "burst_requests", "burst_tokens",
        "misses", "declined", "ttft_delta": [accepted loads predicted, of which the load took longer than
        the predicted saving], "materialized", "materialized_tokens",
        "lookup_mean_s", "load_mean_s", "reps"}`` (misses and counters: the warm engine's, over every
        repetition and its warm-up).
    """
    ctx = w.context_tokens
    cfg = ModelConfig(max_context=max(2048, ctx + ctx // 2))
    texts = {tuple(p.tokens): p.text for p in w.prompts.values()}
    text_of = lambda req: texts.get(tuple(req.get_tokens(0)[: req.prompt_len]))  # noqa: E731
    fleet = Fleet(root, ("A", "H", "C", "D", "W")).start()
    service = make_service(fleet.db)
    try:
        setup_donors(fleet, service, text_of, cfg)
        engines = _engines(fleet, service, text_of, cfg)
        rng = np.random.default_rng(5)
        for engine in engines.values():  # warm-up: allocations, first ledger reads, the gate's first forwards
            for _ in range(3):
                _ttft(engine, rng.integers(1, 512, ctx).tolist(), None)
        ttft: dict[str, dict[str, list[float]]] = {}
        loaded: dict[str, list[int]] = {}
        burst: dict[str, list[float]] = {"cold": [], "exact_equivalent": []}
        high_load = [(list(w.prompt(lab.target).tokens), w.prompt(lab.target).cache_salt)
                     for lab in w.labels if lab.scenario == "high_load"]
        for rep in range(reps):
            order = MODES[rep % 3:] + MODES[: rep % 3]
            for lab in w.labels:
                p = w.prompt(lab.target)
                for mode in order:
                    seconds, tokens = _ttft(engines[mode], list(p.tokens), p.cache_salt)
                    ttft.setdefault(lab.scenario, {m: [] for m in MODES})[mode].append(seconds)
                    if mode == "exact_equivalent":
                        loaded.setdefault(lab.scenario, []).append(tokens)
            if high_load:
                for mode in (("cold", "exact_equivalent") if rep % 2 == 0 else ("exact_equivalent", "cold")):
                    burst[mode].append(_burst(engines[mode], high_load))
            if progress is not None:
                progress(rep + 1, reps)
        warm = engines["exact_equivalent"].metrics
        assert warm is not None
        return {
            "ttft": ttft, "loaded": loaded, "burst": burst, "burst_requests": len(high_load),
            "burst_tokens": sum(len(t) for t, _ in high_load), "misses": warm.misses_by_reason(),
            "declined": warm.counts_by_reason("semkv_backend_declined"),
            # a histogram with negative buckets has no _sum (prometheus-client): count, and how many ≤ 0
            "ttft_delta": [warm.value("semkv_ttft_delta_seconds_count"),
                           warm.value("semkv_ttft_delta_seconds_bucket", le="0.0")],
            "materialized": warm.value("semkv_exact_materialized_total"),
            "materialized_tokens": warm.value("semkv_materialized_tokens_total"), "reps": reps,
            "lookup_mean_s": _mean(warm, "semkv_lookup_seconds"), "load_mean_s": _mean(warm, "semkv_load_seconds"),
        }
    finally:
        service.close()
        fleet.stop()
