"""Shared set-up of the REFERENCE ENGINE HARNESS tests: a tiny model, recording-connector engines,
cold references and donors.

Bit-identity: the prefill chunk grid is ``CHUNK`` tokens from position 0 and every promise ends on a
chunk boundary, so the chunks a connector engine computes are exactly a cold engine's last chunks,
over KV computed by the same chunks in the donor engine.
"""

from __future__ import annotations

from typing import Any

import torch

from connector.harness import HarnessLLM, KvCacheConfig, ModelConfig, TrtllmVersion
from connector.harness import TRTLLM_MAIN_2026
from connector.harness.recording_connector import RecordingPlan, donor_from_engine
from connector.harness.recording_connector import make_recording_connector

CFG = ModelConfig(vocab_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=64, tokens_per_block=8, max_context=512)
CHUNK = 32
NUM_BLOCKS = 128
LAYER_CYCLE = ["wait_for_layer_load", "save_kv_layer"] * CFG.num_layers
FORWARD = ["build_connector_meta", "bind_connector_meta", "start_load_kv", *LAYER_CYCLE, "wait_for_save"]
"""The connector calls of one iteration that forwards (one worker)."""


def kvc(**kw: Any) -> KvCacheConfig:
    """A pool of ``NUM_BLOCKS`` blocks of 8 tokens with events on."""
    return KvCacheConfig(tokens_per_block=8, max_tokens=NUM_BLOCKS * 8, event_buffer_max_size=1000, **kw)


def prompt(n: int, seed: int) -> list[int]:
    """``n`` deterministic token ids."""
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def connected(plan: RecordingPlan, *, workers: int = 1, version: TrtllmVersion = TRTLLM_MAIN_2026,
              **kw: Any) -> HarnessLLM:
    """An engine with the recording connector (``workers`` ranks) modelling ``version``."""
    scheduler_cls, worker_cls = make_recording_connector(plan)
    llm = HarnessLLM(CFG, kv_cache_config=kvc(), kv_connector=(scheduler_cls, [worker_cls] * workers),
                     max_num_tokens=CHUNK, trtllm_version=version, **kw)
    plan.lock_probe = llm.kv_cache_manager.lock_held_by_current_thread
    return llm


def plain(**kw: Any) -> HarnessLLM:
    """An engine without a connector."""
    return HarnessLLM(CFG, kv_cache_config=kvc(**kw), max_num_tokens=CHUNK)


def cold(tokens: list[int], max_new_tokens: int = 2, **kw: Any):
    """The result of a cold prefill (no reuse, no connector)."""
    return plain(enable_block_reuse=False).generate(tokens, max_new_tokens, **kw)


def donor(tokens: list[int], **kw: Any):
    """A donor copying ``tokens``' stored blocks out of a fresh engine that served them."""
    engine = plain()
    engine.generate(tokens, **kw)
    return donor_from_engine(engine, tokens, **kw)


def calls(plan: RecordingPlan, hook: str) -> list[tuple]:
    """The recorded calls of one hook, in order."""
    return [c for c in plan.calls if c[0] == hook]


def stored_hashes(llm: HarnessLLM) -> set[int]:
    """Hashes of every block a ``stored`` event reported (drains the events)."""
    return {b["block_hash"] for e in llm.get_kv_cache_events(0) if e["data"]["type"] == "stored"
            for b in e["data"]["blocks"]}
