"""Harness engines whose :class:`SemKvScheduler` runs donor discovery, in a :class:`~tools.harness.fleet.Fleet`
(real SQLite ledger, real consumer daemon over loopback ZMQ, shared donor store). Used by the tests
and by ``tools/bench_discovery.py``.

:func:`discovering_engine` injects one shared :class:`DiscoveryService` (``SemKvScheduler(...,
discovery=service)``, as engines of one process would share it); an engine whose scheduler builds
its own service from its settings is just ``fleet.engine(..., discovery={"enabled": True, ...})``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from connector.discovery.service import DiscoveryService
from connector.harness import HarnessLLM, KvCacheConfig, ModelConfig
from connector.metrics import ConnectorMetrics
from connector.scheduler import SemKvScheduler
from connector.worker import SemKvWorker
from tools.harness.fleet import MODEL, Engine, Fleet, shared_model

__all__ = ["discovering_engine"]


def discovering_engine(fleet: Fleet, engine_id: str, service: DiscoveryService, *, mode: str,
                       text_of: Callable[[Any], str | None] | None = None, model: ModelConfig = MODEL,
                       kv_cache_config: KvCacheConfig | None = None, max_num_tokens: int = 256,
                       **overrides: Any) -> Engine:
    """An engine on ``engine_id``'s publisher whose ``SemKvScheduler`` uses the shared ``service``."""
    settings = fleet.connector_settings(engine_id, mode=mode, **overrides)
    metrics = ConnectorMetrics()

    def sched_init(self, llm_args):  # noqa: ANN001, ANN202
        SemKvScheduler.__init__(self, llm_args, settings=settings, metrics=metrics, discovery=service,
                                text_of=text_of)

    def worker_init(self, llm_args):  # noqa: ANN001, ANN202
        SemKvWorker.__init__(self, llm_args, settings=settings, metrics=metrics)

    spec = (type("BoundDiscoveryScheduler", (SemKvScheduler,), {"__init__": sched_init}),
            type("BoundWorker", (SemKvWorker,), {"__init__": worker_init}))
    kvc = kv_cache_config or KvCacheConfig(tokens_per_block=model.tokens_per_block, event_buffer_max_size=4096,
                                           max_tokens=4 * model.max_context)
    old = fleet.engines.get(engine_id)
    if old is not None:
        fleet.close_engine(old)
    llm = HarnessLLM(model, kv_cache_config=kvc, kv_connector=spec, max_num_tokens=max_num_tokens,
                     model=shared_model(model))
    engine = Engine(engine_id, llm, fleet.publishers[engine_id], metrics, settings,
                    last_seq=old.last_seq if old else -1)
    fleet.engines[engine_id] = engine
    return engine
