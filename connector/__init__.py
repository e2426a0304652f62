"""semkv-ledger's KV Cache Connector for TensorRT-LLM (and, through a thin adapter, vLLM).

Load it in TensorRT-LLM with::

    from tensorrt_llm.llmapi import KvCacheConfig
    from tensorrt_llm.llmapi.llm_args import KvCacheConnectorConfig
    llm = LLM(model=..., backend="pytorch", cuda_graph_config=None, disable_overlap_scheduler=True,
              kv_cache_config=KvCacheConfig(enable_block_reuse=True, event_buffer_max_size=16384),
              kv_connector_config=KvCacheConnectorConfig(connector_module="connector",
                                                         connector_scheduler_class="SemKvScheduler",
                                                         connector_worker_class="SemKvWorker"))

with ``TRTLLM_SEMKV_CONFIG=/etc/semkv/connector.toml`` in the environment (see
:mod:`connector.settings` and ``connector/README.md``, which also has the trtllm-serve YAML). Module map:

    settings      ConnectorSettings (TOML + TRTLLM_SEMKV_* env), refuses mode "experimental"
    namespace     namespace digests over every field that changes KV bytes; chained content keys
    layouts       parallel layouts (TP, PP, CP, attention DP, sliding windows, MLA): served or refused
    plan          LoadPlan, SaveInstruction, ConnectorMetadata (picklable, bounded)
    donor_store   FileDonorStore: host-local, checksummed, atomically published donor bytes
    redis_store   RedisDonorStore: donor bytes on Redis for every host (content-addressed blocks, TTLs)
    lookup        deadline runner, background runner, miss diagnosis
    engine_contract  what the hosting engine does with a promise and a finished request
    spans         SpanFinder: the longest fresh donor span whose checksummed bytes this host holds
    promises      PromiseBook: request states, promises (pins, secured bytes, leases), plans, orphans
    saves         donor saves: armed at allocation (TensorRT-LLM) or shipped after finish (vLLM)
    donors        DonorRegistrar: finished requests become donors
    scheduler     SemKvScheduler (rank 0, or every attention-DP rank): the scheduler hooks, delegating
    worker        SemKvWorker (every rank): revalidated, checksummed loads; donor saves
    metrics       Prometheus metrics (semkv_*)
    _trtllm       import shim for TensorRT-LLM's base classes (newer path, 1.x path, local ABCs)
    vllm_connector SemKvVllmConnector: the same core behind vLLM's KVConnectorBase_V1
    _vllm         import shim for vLLM's connector base (local stand-ins when vLLM is absent)
    discovery/    semantic donor discovery (evidence and telemetry only; [discovery] settings)
    placement/    placement advice API and HTTP service (`semkv-ledger serve`)
    harness/      REFERENCE ENGINE HARNESS (tests and demos only)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["SemKvScheduler", "SemKvWorker"]

if TYPE_CHECKING:
    from connector.scheduler import SemKvScheduler
    from connector.worker import SemKvWorker


def __getattr__(name: str) -> Any:
    # Lazy: importing ``connector.harness`` or ``connector.settings`` must not pull in the ledger client.
    if name == "SemKvScheduler":
        from connector.scheduler import SemKvScheduler

        return SemKvScheduler
    if name == "SemKvWorker":
        from connector.worker import SemKvWorker

        return SemKvWorker
    raise AttributeError(f"module 'connector' has no attribute {name!r}")
