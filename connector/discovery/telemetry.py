"""Discovery telemetry (DESIGN §8): Prometheus metrics ``semkv_discovery_*`` and one structlog line per lookup.

Kept apart from the connector's own counters: a discovery hit is never a promise, a semantic
candidate is never materialized, so ``semkv_semantic_placement_total`` (what a semantic provider
would have suggested, from which provider) and ``semkv_exact_materialized_total`` (the worker copied
every layer; :mod:`connector.metrics`) can never be confused.

Per provider and lookup, exactly one outcome (``semkv_discovery_outcomes_total{provider,outcome}``):

* ``hit`` — at least one fresh candidate (the best one is the provider's answer);
* ``miss`` — no candidate, or every candidate dropped (drops are counted separately below);
* ``timeout`` — the provider had not answered when the deadline passed, or its queue was full;
* ``error`` — it raised (logged with the request id);
* ``policy_denied`` — not run: prompt text not allowed or absent for a text provider, unknown
  namespace, model not allowed;
* ``not_prepared`` — an inline text lookup whose query embedding was not cached yet.

Candidates dropped after the ledger check: ``semkv_discovery_dropped_total{provider,reason}`` with
reason ``stale`` (not saved, evicted, quarantined, generation mismatch, expired, unknown) or
``namespace_mismatch`` (another namespace or cache salt). Indexing:
``semkv_discovery_index_total{outcome}`` (``indexed``, ``queue_full``, ``generation_mismatch``,
``stale``, ``no_text``, ``error``), ``semkv_discovery_index_queue_depth``,
``semkv_discovery_indexed_donors{provider}``, ``semkv_embedding_seconds``.
"""

from __future__ import annotations

import threading

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from connector.discovery.types import Match

__all__ = ["DiscoveryMetrics", "log_lookup", "metrics_for"]

_FAST = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_SLOW = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

log = structlog.get_logger("connector.discovery")


class DiscoveryMetrics:
    """All discovery metrics on :attr:`registry` (a private one unless given; pass the connector's
    ``ConnectorMetrics.registry`` to serve them on the same ``/metrics``)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.lookups = Counter("semkv_discovery_lookups_total", "Discovery lookups, by where they ran",
                               ("path",), registry=r)
        self.outcomes = Counter("semkv_discovery_outcomes_total", "Per-provider lookup outcomes",
                                ("provider", "outcome"), registry=r)
        self.dropped = Counter("semkv_discovery_dropped_total",
                               "Candidates dropped after the ledger check (never shown as hits)",
                               ("provider", "reason"), registry=r)
        self.provider_seconds = Histogram("semkv_discovery_provider_seconds",
                                          "Provider lookup duration on its own thread (finished ones)",
                                          ("provider",), buckets=_FAST, registry=r)
        self.lookup_seconds = Histogram("semkv_discovery_lookup_seconds",
                                        "Caller-observed lookup duration (bounded by the deadline)", ("path",),
                                        buckets=_FAST, registry=r)
        self.exact_hits = Counter("semkv_discovery_exact_hits_total",
                                  "Lookups whose best fresh match is exact_equivalent (evidence, not a promise)",
                                  registry=r)
        self.semantic_placement = Counter("semkv_semantic_placement_total",
                                          "Lookups whose best fresh match is a semantic candidate (never materialized)",
                                          ("provider",), registry=r)
        self.semantic_placement_tokens = Counter("semkv_semantic_placement_tokens_total",
                                                 "Token-exact tokens those semantic candidates share with the target",
                                                 ("provider",), registry=r)
        self.async_dropped = Counter("semkv_discovery_lookups_dropped_total",
                                     "Telemetry lookups dropped because the discovery queue was full", registry=r)
        self.index = Counter("semkv_discovery_index_total", "Donor registrations by indexing outcome", ("outcome",),
                             registry=r)
        self.index_queue = Gauge("semkv_discovery_index_queue_depth", "Registrations waiting for the indexer",
                                 registry=r)
        self.indexed = Gauge("semkv_discovery_indexed_donors", "Donors in each provider's index", ("provider",),
                             registry=r)
        self.wait_priority = Counter("semkv_discovery_wait_priority_total",
                                     "Inline lookups by the caller's scheduling during the wait (wait_priority = fifo)",
                                     ("result",), registry=r)
        self.provider_exits = Counter("semkv_discovery_provider_exits_total",
                                      "Provider processes that exited before the service closed (provider_isolation)",
                                      ("provider",), registry=r)
        self.embedding_seconds = Histogram("semkv_embedding_seconds", "Sentence-embedding duration (off the path)",
                                           buckets=_SLOW, registry=r)

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample (0.0 when absent); for tests and benchmarks."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def outcome_counts(self) -> dict[tuple[str, str], float]:
        """``{(provider, outcome): count}``."""
        out: dict[tuple[str, str], float] = {}
        for metric in self.registry.collect():
            if metric.name == "semkv_discovery_outcomes":
                for sample in metric.samples:
                    if sample.name.endswith("_total"):
                        out[(sample.labels["provider"], sample.labels["outcome"])] = sample.value
        return out


_shared_lock = threading.Lock()
_shared: dict[int, tuple[CollectorRegistry, DiscoveryMetrics]] = {}


def metrics_for(registry: CollectorRegistry) -> DiscoveryMetrics:
    """The one :class:`DiscoveryMetrics` registered on ``registry`` (created on first use), so that
    several services counting on one registry (e.g. the process-wide one) do not register twice."""
    with _shared_lock:
        entry = _shared.get(id(registry))
        if entry is None or entry[0] is not registry:
            entry = (registry, DiscoveryMetrics(registry))
            _shared[id(registry)] = entry
        return entry[1]


def log_lookup(*, request_id: str | None, path: str, elapsed_s: float, outcomes: dict[str, str],
               dropped: dict[str, int], best: Match | None) -> None:
    """One structured line per lookup: what would have been reused, from which donor, which buckets."""
    fields = {"request_id": request_id, "path": path, "elapsed_us": round(elapsed_s * 1e6, 1),
              "outcomes": outcomes}
    if dropped:
        fields["dropped"] = dropped
    if best is not None:
        fields.update(donor_id=best.donor_id, donor_engine_id=best.donor_engine_id, provider=best.provider,
                      match_type=best.match_type, reusable_tokens=best.reusable_token_count,
                      segments=len(best.segments), similarity=best.similarity_bucket,
                      token_overlap=best.token_overlap_bucket, confidence=best.confidence_bucket,
                      provider_generation=best.provider_generation)
    log.info("semkv.discovery.lookup", **fields)
