"""Prometheus metrics of the KV Cache Connector (DESIGN §8), names ``semkv_*``.

One :class:`ConnectorMetrics` per engine: scheduler and worker of the same engine share it when they
live in one process (pass the same object); otherwise each process has its own and Prometheus
scrapes each rank (``metrics_port + rank``). By default a metrics object owns a private
``CollectorRegistry`` so several engines can run in one process (tests); :func:`process_metrics`
returns the process-wide one registered on prometheus-client's global ``REGISTRY``.

Counters are distinct, never collapsed into one "hit" (DESIGN §8):

* every lookup is counted (``semkv_lookups_total{mode}``) and ends as exactly one of: a promise
  (``semkv_promises_total``, ``semkv_promised_tokens_total``), a discovery-only hit (telemetry,
  ``semkv_discovery_only_hits_total``), or a miss ``semkv_lookup_misses_total{reason}``; a miss is
  also counted in its DESIGN category: ``semkv_stale_donor_total{reason}``,
  ``semkv_namespace_mismatch_total{field}``, ``semkv_provider_timeout_total`` (lookup deadline) or
  ``semkv_backend_declined_total{reason}`` (everything the connector declines by itself);
* ``semkv_exact_materialized_total`` / ``semkv_materialized_tokens_total`` count only after the
  worker copied EVERY layer of a plan; ``semkv_experimental_materialized_total`` exists and stays 0;
* ``semkv_load_failures_total{reason}``: plans that failed after the promise (vLLM recomputes
  them; on TensorRT-LLM only the bytes' own checks can fail a plan, and that stops the executor);
  ``semkv_stale_after_promise_total{reason}``: TensorRT-LLM promises the ledger called stale after
  the answer, loaded from their secured bytes; ``semkv_orphaned_requests_total``: requests the
  engine dropped without ``request_finished``; ``semkv_leases_held`` (gauge, promises this process
  holds: a store pin from the answer, plus on TensorRT-LLM the donor's secured file and on vLLM a
  ledger lease once the blocks are allocated).

Histograms (seconds): lookup, metadata build, load by ``source`` — where the bytes came from:
``host_ram`` (a Redis entry staged in this process before the promise), ``local_file`` (the file
store: page cache, /dev/shm or disk), ``redis`` (fetched from the server at load time) —,
revalidation (ledger re-checks in the worker; ``semkv_revalidations_total{answer}`` counts those
read vs. answered unchanged), donor save, and ``semkv_ttft_delta_seconds``: per
accepted materialization, the prefill time the profitability gate predicted it saves minus its
measured load time (:mod:`connector.profit`; an estimate of cold TTFT minus warm TTFT, since a
request is never run both ways). A load the gate declines is a miss ``unprofitable`` (also
``semkv_backend_declined_total{reason="unprofitable"}``).
"""

from __future__ import annotations

import logging
import threading

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["ConnectorMetrics", "MissCategory", "process_metrics", "serve_metrics"]

log = logging.getLogger(__name__)

_FAST = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
_SLOW = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_DELTA = (-1.0, -0.25, -0.05, -0.01, -0.0025, -0.0005, 0.0, 0.0005, 0.0025, 0.01, 0.05, 0.25, 1.0, 5.0)
_TOKENS = (32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

_STALE = {"donor_restarted", "donor_quarantined", "donor_generation_mismatch", "donor_blocks_removed",
          "donor_evicted", "donor_expired", "donor_not_saved", "donor_unknown", "lease_expired",
          "lease_refused", "checksum_mismatch", "store_missing"}


class MissCategory:
    """DESIGN §8 category of a miss reason."""

    STALE = "stale"
    NAMESPACE = "namespace"
    TIMEOUT = "timeout"
    DECLINED = "declined"
    NONE = "none"

    @staticmethod
    def of(reason: str) -> str:
        if reason in _STALE:
            return MissCategory.STALE
        if reason == "namespace_mismatch":
            return MissCategory.NAMESPACE
        if reason == "timeout":
            return MissCategory.TIMEOUT
        if reason in ("no_donor", "too_short", "discovery_only"):
            return MissCategory.NONE
        return MissCategory.DECLINED


class ConnectorMetrics:
    """All connector metrics, registered on :attr:`registry` (a private one unless given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.lookups = Counter("semkv_lookups_total", "get_num_new_matched_tokens calls", ("mode",), registry=r)
        self.lookup_seconds = Histogram("semkv_lookup_seconds", "Duration of get_num_new_matched_tokens",
                                        ("mode",), buckets=_FAST, registry=r)
        self.misses = Counter("semkv_lookup_misses_total", "Lookups answered (0, False), by reason",
                              ("reason",), registry=r)
        self.promises = Counter("semkv_promises_total", "Lookups answered with n > 0 tokens", registry=r)
        self.promised_tokens = Counter("semkv_promised_tokens_total", "Tokens promised to the engine", registry=r)
        self.discovery_hits = Counter("semkv_discovery_only_hits_total",
                                      "discovery_only/placement lookups that found a fresh donor (not loaded)",
                                      registry=r)
        self.discovery_tokens = Counter("semkv_discovery_only_tokens_total",
                                        "Tokens such donors could have provided", registry=r)
        self.placement_advice = Counter("semkv_placement_advice_total",
                                        "placement-mode advice: a fresh donor lives on another engine",
                                        ("donor_engine_id",), registry=r)
        self.semantic_lookups = Counter("semkv_semantic_lookups_total",
                                        "Discovery lookups run by the scheduler ([discovery] enabled; evidence only)", registry=r)
        self.materialized = Counter("semkv_exact_materialized_total",
                                    "Plans whose every layer was copied (exact-equivalent)", registry=r)
        self.materialized_tokens = Counter("semkv_materialized_tokens_total",
                                           "Tokens materialized (every layer copied)", registry=r)
        self.materialized_tokens_hist = Histogram("semkv_materialized_tokens_per_plan", "Tokens materialized per plan",
                                                  buckets=_TOKENS, registry=r)
        self.experimental_materialized = Counter("semkv_experimental_materialized_total",
                                                 "Approximate (Mode 4) materializations: always 0", registry=r)
        self.backend_declined = Counter("semkv_backend_declined_total", "Misses the connector declined itself",
                                        ("reason",), registry=r)
        self.stale_donor = Counter("semkv_stale_donor_total", "Misses on a stale donor or store entry",
                                   ("reason",), registry=r)
        self.namespace_mismatch = Counter("semkv_namespace_mismatch_total",
                                          "Misses where a donor of the same text lives in another namespace",
                                          ("field",), registry=r)
        self.provider_timeout = Counter("semkv_provider_timeout_total", "Lookups past their hard deadline",
                                        registry=r)
        self.load_failures = Counter("semkv_load_failures_total", "Promised loads that failed in the worker",
                                     ("reason",), registry=r)
        self.promises_broken = Counter("semkv_promises_broken_total",
                                       "Promises whose ledger lease was refused or late; their plan ships failed",
                                       ("reason",), registry=r)
        self.stale_after_promise = Counter(
            "semkv_stale_after_promise_total",
            "TensorRT-LLM: the ledger said a donor was stale (or could not say) after its promise; the "
            "secured, checksummed bytes were loaded anyway (a freshness signal, not a failure)", ("reason",),
            registry=r)
        self.orphans_released = Counter(
            "semkv_orphaned_requests_total",
            "Requests the engine dropped without request_finished, released after request_orphan_timeout_s",
            registry=r)
        self.leases_held = Gauge("semkv_leases_held",
                                 "Promises this process holds (store pin; TensorRT-LLM: secured file; vLLM: ledger lease)",
                                 registry=r)
        self.leases_released = Counter("semkv_leases_released_total", "Leases released, by reason", ("reason",),
                                       registry=r)
        self.metadata_build_seconds = Histogram("semkv_metadata_build_seconds", "build_connector_meta duration",
                                                buckets=_FAST, registry=r)
        self.load_seconds = Histogram("semkv_load_seconds",
                                      "Plan load time: the worker's own work on the plan (first check, store open, each layer's "
                                      "revalidation, read and copy, summed; not the engine's forward between layers), "
                                      "by where the bytes came from: "
                                      "host_ram (staged in this process), local_file (file store), redis",
                                      ("source",), buckets=_SLOW, registry=r)
        self.ttft_delta_seconds = Histogram(
            "semkv_ttft_delta_seconds",
            "Accepted materializations: the prefill time the load was predicted to save minus the load's "
            "measured time (seconds; > 0: the request was faster than cold by about this much)",
            buckets=_DELTA, registry=r)
        self.revalidation_seconds = Histogram("semkv_revalidation_seconds", "Worker ledger revalidation, per check",
                                              buckets=_FAST, registry=r)
        self.revalidations = Counter(
            "semkv_revalidations_total",
            "Worker ledger revalidations by how they were answered: read (the freshness statement) or "
            "unchanged (the ledger's change counter showed no commit since the previous fresh answer "
            "of the same load, and no expiry passed)", ("answer",), registry=r)
        self.donors_registered = Counter("semkv_donors_registered_total", "Donors registered in the ledger",
                                         registry=r)
        self.donors_not_registered = Counter("semkv_donors_not_registered_total",
                                             "Finished requests the ledger did not take as donors, by reason",
                                             ("reason",), registry=r)
        self.donor_saves = Counter("semkv_donor_saves_total", "Donor saves by outcome", ("outcome",), registry=r)
        self.save_seconds = Histogram("semkv_save_seconds", "Donor save duration (gather to ledger)",
                                      buckets=_SLOW, registry=r)
        self.telemetry_dropped = Counter("semkv_telemetry_dropped_total",
                                         "Background telemetry jobs dropped (queue full)", registry=r)
        # read at scrape time from the scheduler (set_function; the last scheduler of the process wins)
        self.ledger_backlog_seconds = Gauge(
            "semkv_ledger_backlog_seconds",
            "How long the connector's ledger thread's oldest job (lease write, release, view catch-up) has "
            "waited or run; lookups miss with ledger_busy past half of lease_confirm_timeout_s", registry=r)
        self.donor_view_age_seconds = Gauge(
            "semkv_donor_view_age_seconds",
            "Seconds since the scheduler's donor view was last caught up with the ledger (-1: no view)", registry=r)

    def record_miss(self, reason: str, field: str | None = None) -> None:
        """Count one miss under ``reason`` and its DESIGN §8 category."""
        self.misses.labels(reason=reason).inc()
        category = MissCategory.of(reason)
        if category == MissCategory.STALE:
            self.stale_donor.labels(reason=reason).inc()
        elif category == MissCategory.NAMESPACE:
            self.namespace_mismatch.labels(field=field or "unknown").inc()
        elif category == MissCategory.TIMEOUT:
            self.provider_timeout.inc()
        elif category == MissCategory.DECLINED:
            self.backend_declined.labels(reason=reason).inc()

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample (0.0 when absent); for tests and benchmarks."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def misses_by_reason(self) -> dict[str, float]:
        """``{reason: count}`` of ``semkv_lookup_misses_total``."""
        return self.counts_by_reason("semkv_lookup_misses")

    def counts_by_reason(self, counter: str) -> dict[str, float]:
        """``{reason: count}`` of the counter named ``counter`` (without ``_total``), cumulative."""
        out = {}
        for metric in self.registry.collect():
            if metric.name == counter:
                for sample in metric.samples:
                    if sample.name.endswith("_total"):
                        out[sample.labels["reason"]] = sample.value
        return out


_process_lock = threading.Lock()
_process_metrics: ConnectorMetrics | None = None
_served_ports: set[int] = set()


def process_metrics() -> ConnectorMetrics:
    """The process-wide metrics on prometheus-client's global ``REGISTRY`` (created once)."""
    global _process_metrics
    with _process_lock:
        if _process_metrics is None:
            _process_metrics = ConnectorMetrics(REGISTRY)
        return _process_metrics


def serve_metrics(metrics: ConnectorMetrics, port: int, host: str = "127.0.0.1") -> None:
    """Serve ``/metrics`` for ``metrics.registry`` on ``host:port`` (once per port per process). A
    port past 65535 (``metrics_port`` + a high rank) is logged and not served.

    Raises:
        OSError: the address cannot be bound (in use, not this host's).
    """
    if port > 65535:
        log.error("semkv: no /metrics server: port %d (metrics_port + this process's rank) is past 65535", port)
        return
    with _process_lock:
        if port in _served_ports:
            return
        start_http_server(port, addr=host, registry=metrics.registry)
        _served_ports.add(port)
