"""One REFERENCE ENGINE HARNESS process of ``semkv-ledger demo`` (test and demo infrastructure,
never an engine for serving).

It is wired the way an operator wires a TensorRT-LLM process: the connector is loaded through
``KvCacheConnectorConfig(connector_module="connector", …)`` with its settings in the TOML file named
by ``TRTLLM_SEMKV_CONFIG``, and the engine's KV events leave through the publisher bridge
(``consumer.bridge.KvEventPublisher``, ZMQ PUB + replay ROUTER on loopback). This module is a
composition root, like a user's serving script: it is the only place besides the demo that puts
the connector and the bridge in one process; neither package imports the other.

Commands arrive over a ``multiprocessing`` pipe as tuples; replies are plain picklable values.
"""

from __future__ import annotations

import os
import signal
import traceback
from multiprocessing.connection import Connection
from typing import Any

TOPIC = b"kv"


def engine_main(conn: Connection, engine_id: str, config_path: str, max_context: int) -> None:
    """Process entry point (spawned). Replies ``("ready", endpoint, replay_endpoint)`` first. Ignores
    SIGINT: a Ctrl-C reaches the whole process group, and the demo stops its engines itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TRTLLM_SEMKV_CONFIG"] = config_path
    try:
        engine = _DemoEngine(engine_id, max_context)
    except Exception:  # noqa: BLE001 - reported to the demo, which fails its check with the trace
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", engine.publisher.endpoint, engine.publisher.replay_endpoint))
    try:
        while True:
            command, *args = conn.recv()
            if command == "stop":
                break
            try:
                conn.send(("ok", getattr(engine, command)(*args)))
            except Exception:  # noqa: BLE001 - one failed command is reported, the process goes on
                conn.send(("error", traceback.format_exc()))
    finally:
        engine.close()
        conn.send(("stopped",))


class _DemoEngine:
    def __init__(self, engine_id: str, max_context: int) -> None:
        from connector.harness import HarnessLLM, KvCacheConfig, KvCacheConnectorConfig, ModelConfig
        from consumer.bridge import KvEventPublisher

        self.engine_id = engine_id
        self.model_config = ModelConfig(max_context=max_context)
        self.kv_cache_config = KvCacheConfig(tokens_per_block=self.model_config.tokens_per_block,
                                             event_buffer_max_size=16_384, max_tokens=4 * max_context)
        self.publisher = KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic=TOPIC)
        spec = KvCacheConnectorConfig(connector_module="connector", connector_scheduler_class="SemKvScheduler",
                                      connector_worker_class="SemKvWorker")
        self.llm = HarnessLLM(self.model_config, kv_cache_config=self.kv_cache_config, kv_connector=spec,
                              max_num_tokens=512)
        self.last = None
        self.pump()

    def pump(self) -> int:
        """Publish the engine's queued KV events as one batch; returns the last seq published (-1: none)."""
        events = self.llm.get_kv_cache_events(0)
        if events:
            self.publisher.publish(events)
        self.publisher.flush()
        return self.publisher.stats().next_seq - 1

    def generate(self, tokens: list[int], max_new_tokens: int, cache_salt: str | None) -> dict[str, Any]:
        """Serve one request, let the donor save finish, publish the events."""
        result = self.llm.generate(tokens, max_new_tokens, cache_salt=cache_salt)
        self.llm.wait_for_pending_transfers()
        self.llm.connector.workers[0].flush()
        self.llm.connector.scheduler.flush()
        self.last = (list(tokens), cache_salt, result)
        return {"num_prompt_tokens": len(tokens), "num_reused_tokens": result.num_reused_tokens,
                "num_connector_tokens": result.num_connector_tokens, "token_ids": list(result.token_ids),
                "prefill_seconds": result.prefill_seconds, "last_seq": self.pump()}

    def donor_view_seq(self) -> int | None:
        """The ledger seq this engine's connector's donor view reflects (refreshed in the background)."""
        return self.llm.connector.scheduler.donor_view_seq()

    def compare_with_native(self, prefix: list[int]) -> dict[str, Any]:
        """Recompute the last request on a connector-less engine whose device cache holds ``prefix``
        (TensorRT-LLM's own reuse path): prefill logits must be bit-identical."""
        import torch

        from connector.harness import HarnessLLM, KvCacheConfig

        tokens, salt, got = self.last
        native = HarnessLLM(self.model_config, kv_cache_config=KvCacheConfig(
            tokens_per_block=self.model_config.tokens_per_block, event_buffer_max_size=0,
            max_tokens=4 * self.model_config.max_context), max_num_tokens=512, model=self.llm.model)
        native.generate(prefix, 1, cache_salt=salt)
        reference = native.generate(tokens, len(got.token_ids), cache_salt=salt)
        same_start = reference.prefill_start == got.prefill_start
        identical = same_start and torch.equal(reference.prefill_logits, got.prefill_logits)
        cold = self.llm.model.forward_dense(tokens)[got.prefill_start:]
        return {"bit_identical_to_native_reuse": bool(identical), "same_tokens": reference.token_ids == got.token_ids,
                "max_abs_diff_vs_cold": float((cold - got.prefill_logits).abs().max())}

    def metrics(self) -> dict[str, Any]:
        m = self.llm.connector.scheduler.metrics
        self.llm.connector.scheduler.flush()
        return {"lookups": m.value("semkv_lookups_total", mode="exact_equivalent"),
                "promises": m.value("semkv_promises_total"),
                "materialized": m.value("semkv_exact_materialized_total"),
                "materialized_tokens": m.value("semkv_materialized_tokens_total"),
                "experimental_materialized": m.value("semkv_experimental_materialized_total"),
                "leases_held": m.value("semkv_leases_held"), "misses": m.misses_by_reason()}

    def close(self) -> None:
        self.pump()
        self.llm.connector.scheduler.close()
        self.llm.connector.workers[0].close()
        self.publisher.close()
