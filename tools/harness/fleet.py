"""A fleet of reference-harness engines sharing one SQLite ledger and one donor store, with their KV
events reaching the ledger through the real path — ``consumer.bridge``'s ``KvEventPublisher`` (ZMQ
PUB + replay ROUTER on loopback) → the consumer ``Daemon`` (SUB, replay DEALER, decoder, writer) →
the ledger. The connector and discovery tests (their ``fleet`` fixture) and
``tools/bench_discovery.py`` run on it.

Synchronisation is by condition, never by sleeping: :meth:`Fleet.sync` drains each engine's event
queue into its publisher and waits until the ledger's position for that source reached the last
published seq (a batch lost on the PUB/SUB join is recovered by the daemon's replay).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import func, select

from connector.harness import HarnessLLM, KvCacheConfig, ModelConfig
from connector.harness.trtllm_versions import TRTLLM_MAIN_2026, TrtllmVersion
from connector.engine_contract import VLLM
from connector.metrics import ConnectorMetrics
from connector.scheduler import SemKvScheduler
from connector.settings import ConnectorSettings, load_connector_settings
from connector.worker import SemKvWorker
from consumer.bridge import KvEventPublisher
from consumer.daemon import Daemon
from consumer.settings import ConsumerSettings, SourceSettings
from ledger.db import sync_engine
from ledger.migrate import upgrade
from ledger.client import LedgerClient
from ledger.schema import LeaseRow, SourceRow

MODEL = ModelConfig(max_context=2048)  # the default harness model, 2 layers, 32 tokens per block
LOOPBACK = "tcp://127.0.0.1:*"


def doc_tokens(n: int, seed: int = 1) -> list[int]:
    """A deterministic pseudo-document of ``n`` token ids in the harness vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, MODEL.vocab_size, (n,), generator=gen).tolist()


def bind_connector(settings: ConnectorSettings, metrics: ConnectorMetrics) -> tuple[type, type]:
    """Scheduler/worker classes that the harness constructs with its ``llm_args``, bound to settings."""

    def sched_init(self, llm_args):  # noqa: ANN001, ANN202
        SemKvScheduler.__init__(self, llm_args, settings=settings, metrics=metrics)

    def worker_init(self, llm_args):  # noqa: ANN001, ANN202
        SemKvWorker.__init__(self, llm_args, settings=settings, metrics=metrics)

    return (type("BoundScheduler", (SemKvScheduler,), {"__init__": sched_init}),
            type("BoundWorker", (SemKvWorker,), {"__init__": worker_init}))


@dataclass
class Engine:
    """One harness engine wired to the fleet; ``llm`` may be replaced by :meth:`Fleet.restart`."""

    engine_id: str
    llm: HarnessLLM
    publisher: KvEventPublisher
    metrics: ConnectorMetrics | None
    settings: ConnectorSettings | None
    last_seq: int = -1

    @property
    def scheduler(self) -> SemKvScheduler:
        return self.llm.connector.scheduler  # type: ignore[union-attr]

    @property
    def worker(self) -> SemKvWorker:
        return self.llm.connector.workers[0]  # type: ignore[union-attr]

    def generate(self, tokens: list[int], max_new_tokens: int = 1, **kw: Any):
        result = self.llm.generate(tokens, max_new_tokens, **kw)
        self.settle()
        return result

    def settle(self) -> None:
        """Let donor saves finish: none may be pending in the engine once it is idle (TensorRT-LLM
        runs no iteration then: ``wait_for_pending_transfers`` raises), then the worker's background
        writer and the scheduler's background work."""
        if self.llm.connector is None:
            return
        self.llm.wait_for_pending_transfers()
        self.worker.flush()
        self.scheduler.flush()

    def misses(self) -> dict[str, float]:
        assert self.metrics is not None
        self.scheduler.flush()
        return self.metrics.misses_by_reason()


@dataclass
class Fleet:
    """A ledger, a donor store, a consumer daemon (own thread + loop) and N engines' publishers."""

    root: Path
    engine_ids: tuple[str, ...]
    db: str = ""
    store_dir: Path = field(default_factory=Path)
    publishers: dict[str, KvEventPublisher] = field(default_factory=dict)
    engines: dict[str, Engine] = field(default_factory=dict)
    daemon: Daemon | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _stop: asyncio.Event | None = None
    _thread: threading.Thread | None = None
    _error: BaseException | None = None
    connector_defaults: dict[str, Any] = field(default_factory=dict)
    """Connector settings every engine gets unless a test overrides them."""

    def start(self) -> Fleet:
        """Start the consumer daemon; the ledger is ``db`` when given (migrated), else a new SQLite file."""
        if not self.db:
            self.db = f"sqlite:///{self.root / 'ledger.db'}"
            upgrade(self.db)
        self.store_dir = self.root / "donors"
        for engine_id in self.engine_ids:
            self.publishers[engine_id] = KvEventPublisher(LOOPBACK, LOOPBACK, topic=b"kv")
        sources = [SourceSettings(engine_id=e, endpoint=p.endpoint, replay_endpoint=p.replay_endpoint, topic="kv")
                   for e, p in self.publishers.items()]
        settings = ConsumerSettings(db=self.db, sources=sources, replay_timeout_s=1.0, idle_replay_s=0.2,
                                    batch_max_delay_ms=1.0)
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run_daemon, args=(settings, ready), daemon=True)
        self._thread.start()
        if not ready.wait(20) or self._error is not None:
            raise RuntimeError(f"consumer daemon did not start: {self._error!r}")
        self._reader = sync_engine(self.db)
        return self

    def _run_daemon(self, settings: ConsumerSettings, ready: threading.Event) -> None:
        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self.daemon = Daemon(settings, shutdown_trigger=self._stop.wait)
            task = asyncio.create_task(self.daemon.run())
            deadline = time.monotonic() + 15
            while not (self.daemon.ready.is_set() and self.daemon.sources
                       and all(s.running for s in self.daemon.sources)):
                if task.done() or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.005)
            ready.set()
            await task

        try:
            asyncio.run(main())
        except BaseException as exc:  # reported to start()/stop()
            self._error = exc
            ready.set()

    def connector_settings(self, engine_id: str, **overrides: Any) -> ConnectorSettings:
        values = {"db": self.db, "mode": "exact_equivalent", "engine_id": engine_id, "store_dir": self.store_dir,
                  "lookup_timeout_s": 1.0, "lease_ttl_s": 60.0, "store_capacity_bytes": 2**30,
                  # A loaded two-core CI machine has taken over the default 0.5 s to commit a lease
                  # (the plan then fails "late"); tests of that deadline set their own.
                  "lease_confirm_timeout_s": 10.0,
                  **self.connector_defaults, **overrides}
        return load_connector_settings(values, environ={})

    def engine(self, engine_id: str, *, connector: bool = True, model: ModelConfig = MODEL,
               kv_cache_config: KvCacheConfig | None = None, version: TrtllmVersion = TRTLLM_MAIN_2026,
               max_num_tokens: int = 256, **overrides: Any) -> Engine:
        """A new engine on ``engine_id``'s publisher (replaces a previous one: an engine restart),
        running the executor of TensorRT-LLM ``version``; ``overrides`` are connector settings."""
        kvc = kv_cache_config or KvCacheConfig(tokens_per_block=model.tokens_per_block, event_buffer_max_size=4096,
                                               max_tokens=4 * model.max_context)
        settings = metrics = spec = None
        if connector:
            settings, metrics = self.connector_settings(engine_id, **overrides), ConnectorMetrics()
            spec = bind_connector(settings, metrics)
        old = self.engines.get(engine_id)
        if old is not None:
            self.close_engine(old)
        llm = HarnessLLM(model, kv_cache_config=kvc, kv_connector=spec, max_num_tokens=max_num_tokens,
                         model=shared_model(model), trtllm_version=version)
        engine = Engine(engine_id, llm, self.publishers[engine_id], metrics, settings,
                        last_seq=old.last_seq if old else -1)
        self.engines[engine_id] = engine
        return engine

    def vllm_connector(self, engine_id: str, llm_args: Any, **overrides: Any) -> tuple[SemKvScheduler, SemKvWorker]:
        """A scheduler and a worker built as the vLLM adapter builds them (a promise may fail after
        the answer: vLLM recomputes), on this fleet's ledger and store; the test drives them in
        vLLM's call order and closes them (:func:`close_connector`)."""
        settings, metrics = self.connector_settings(engine_id, **overrides), ConnectorMetrics()
        return (SemKvScheduler(llm_args, settings=settings, metrics=metrics, engine=VLLM),
                SemKvWorker(llm_args, settings=settings, metrics=metrics, engine=VLLM))

    def restart(self, engine_id: str, **kw: Any) -> Engine:
        """Replace an engine by a new process-equivalent (its first event is ``created``)."""
        return self.engine(engine_id, **kw)

    def pump(self, engine: Engine, *, drop: int = 0) -> None:
        """Publish the engine's queued events; ``drop`` discards that many (TensorRT-LLM's bounded
        buffer losing events: an ``event_id`` jump the ledger must treat as lost state)."""
        events = engine.llm.get_kv_cache_events(0)
        events = events[drop:]
        if events:
            engine.last_seq = engine.publisher.publish(events)

    def sync(self, timeout_s: float = 20.0) -> None:
        """Everything every engine has emitted is in the ledger."""
        for engine in self.engines.values():
            self.pump(engine)
        for engine in self.engines.values():
            engine.publisher.flush()
            source_id = f"{engine.engine_id}@{engine.publisher.endpoint}"
            deadline = time.monotonic() + timeout_s
            while self._ledger_seq(source_id) < engine.last_seq:
                if self._error is not None:
                    raise RuntimeError(f"consumer daemon failed: {self._error!r}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"ledger did not reach seq {engine.last_seq} of {source_id}")
                time.sleep(0.002)
        for engine in self.engines.values():  # and every scheduler's donor view shows it
            if engine.llm.connector is not None:
                engine.scheduler.sync_view()

    def _ledger_seq(self, source_id: str) -> int:
        t = SourceRow.__table__
        with self._reader.connect() as conn:
            value = conn.execute(select(t.c.last_seq).where(t.c.source_id == source_id)).scalar()
        return -1 if value is None else value

    def ledger(self) -> LedgerClient:
        return LedgerClient(self.db)

    def leases_written(self) -> int:
        """Leases the ledger ever recorded (released ones keep their row)."""
        t = LeaseRow.__table__
        with self._reader.connect() as conn:
            return conn.execute(select(func.count()).select_from(t)).scalar_one()

    def held_leases(self) -> int:
        client = self.ledger()
        try:
            return client.held_leases()
        finally:
            client.close()

    def close_engine(self, engine: Engine) -> None:
        if engine.llm.connector is not None:
            with contextlib.suppress(Exception):
                engine.settle()
            engine.scheduler.close()
            engine.worker.close()

    def stop(self) -> None:
        for engine in self.engines.values():
            self.close_engine(engine)
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(30)
        for publisher in self.publishers.values():
            publisher.close()
        self._reader.dispose()


def native_engine(model: ModelConfig = MODEL) -> HarnessLLM:
    """A recipient's native-reuse path: the fleet's engine configuration, no connector."""
    kvc = KvCacheConfig(tokens_per_block=model.tokens_per_block, event_buffer_max_size=0,
                        max_tokens=4 * model.max_context)
    return HarnessLLM(model, kv_cache_config=kvc, max_num_tokens=256, model=shared_model(model))


def close_connector(scheduler: SemKvScheduler, worker: SemKvWorker) -> None:
    scheduler.close()
    worker.close()


_MODELS: dict[ModelConfig, Any] = {}


def shared_model(cfg: ModelConfig):  # noqa: ANN202
    """Weights are seeded, so engines may share one module (saves start-up time, same bits)."""
    from connector.harness import HarnessTransformer

    if cfg not in _MODELS:
        _MODELS[cfg] = HarnessTransformer(cfg)
    return _MODELS[cfg]

