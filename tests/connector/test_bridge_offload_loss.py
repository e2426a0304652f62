"""The publisher bridge never skips a lost drain silently (issue: host offload can lose events).

TensorRT-LLM's ``KVCacheEventSerializer._updated_to_json`` dereferences the ``priority`` diff of an
``updated`` event, and the C++ ``updated`` event of a host offload sets only ``cache_level``: the
serializer raises ``AttributeError: 'NoneType' object has no attribute 'new_value'`` after the
events were drained from the engine's queue (NVIDIA/TensorRT-LLM ``tensorrt_llm/_utils.py``, read
in the stored versions; reference/TRTLLM_CONNECTOR.md). :class:`TrtllmSerializing` reproduces that on
the reference engine harness's real offload events; the real bridge, publisher, consumer daemon and
SQLite ledger do the rest.
"""

from __future__ import annotations

import time
from typing import Any

from connector.harness import KvCacheConfig
from consumer.bridge import LlmEventBridge
from ledger.types import GenerationReason
from tools.harness.fleet import MODEL, Fleet, doc_tokens

TPB = MODEL.tokens_per_block


class TrtllmSerializing:
    """An engine's ``get_kv_cache_events`` as TensorRT-LLM's serializer answers it: the queue is
    drained first, then an offload ``updated`` event (``priority`` None) raises, losing the drain.
    (TensorRT-LLM fails on every such event; failing on the first is enough here, and lets a later
    drain carry the next seq.)"""

    def __init__(self, llm: Any) -> None:
        self.llm, self.lost = llm, 0

    def get_kv_cache_events(self, timeout: float | None = 2) -> list[dict[str, Any]]:
        events = self.llm.get_kv_cache_events(timeout)
        if not self.lost and any(e["data"]["type"] == "updated" and e["data"].get("priority") is None
                                 for e in events):
            self.lost += len(events)
            raise AttributeError("'NoneType' object has no attribute 'new_value'")
        return events


def test_an_offload_the_serializer_cannot_encode_bumps_the_generation(fleet: Fleet) -> None:
    # 6 GPU blocks and a host tier: a third 2-block prompt evicts the first prompt's blocks to host
    kvc = KvCacheConfig(tokens_per_block=TPB, max_tokens=6 * TPB, host_cache_size=8 * TPB * MODEL.kv_bytes_per_token,
                        event_buffer_max_size=4096)
    a = fleet.engine("A", connector=False, kv_cache_config=kvc)
    source = TrtllmSerializing(a.llm)
    bridge = LlmEventBridge(source, a.publisher, close_publisher=False, poll_timeout_s=0.01, max_backoff_s=0.02)
    ledger, source_id = fleet.ledger(), f"A@{a.publisher.endpoint}"
    try:
        bridge.start()
        a.llm.generate(doc_tokens(2 * TPB + 1, seed=1))
        wait_for(lambda: fleet._ledger_seq(source_id) >= 0 and ledger.engine("A") is not None)
        before = ledger.engine("A").generation
        a.llm.generate(doc_tokens(2 * TPB + 1, seed=2))
        a.llm.generate(doc_tokens(2 * TPB + 1, seed=3))  # offloads the first prompt's blocks
        wait_for(lambda: source.lost > 0 and bridge.seq_gaps_marked == 1)
        a.llm.generate(doc_tokens(2 * TPB + 1, seed=4))  # a later batch shows the gap to the consumer
        wait_for(lambda: ledger.engine("A").generation > before)
        engine = ledger.engine("A")
        assert engine.generation_reason == GenerationReason.SEQ_GAP
        assert bridge.poll_errors >= 1 and a.publisher.stats().lost_upstream == 1
    finally:
        bridge.close()
        ledger.close()


def wait_for(condition: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)
