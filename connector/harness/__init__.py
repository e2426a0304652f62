"""REFERENCE ENGINE HARNESS for semkv-ledger — test and demo infrastructure, never an engine for serving.

Reproduces, on the CPU, the parts of TensorRT-LLM the product touches, faithfully enough that a KV
Cache Connector that passes here works there: the KV cache manager's block reuse, eviction, offload
and KV-cache events (:mod:`.kv_cache_manager`, :mod:`.events`, :mod:`.block_hash`), a small PyTorch
transformer that reads and writes the paged pool (:mod:`.model`), and an ``LLM``-like engine that
drives a connector in TensorRT-LLM's call order and enforces its rules (:mod:`.engine`,
:mod:`.connector_driver`). :mod:`.recording_connector` is a test-only connector that records calls.

Module map:
    block_hash          v1_block_key (WIRE.md §A.1), cache salt id, block chains
    retention           KvCacheRetentionConfig / TokenRangeRetentionConfig, per-block priorities
    events              KV-event dicts, bounded drop-oldest buffer, sync drain and async iterator
    kv_cache_manager    block pools, radix reuse, LRU-within-priority eviction, offload/onboard
    model               ModelConfig, HarnessTransformer (dense and paged forward)
    request             LlmRequest (what a connector sees), LlmRequestState, GenerationResult
    llm_args            HarnessLlmArgs / KvCacheConfig (TorchLlmArgs attribute names)
    connector_driver    the runtime side of the connector API and its rule checks
    engine              HarnessLLM: generate(), events, executor-loop order
    recording_connector test-only connector that records calls and injects behaviour
"""

from .block_hash import block_hash_chain, cache_salt_id, v1_block_key
from .connector_driver import AttentionOrderError, ConnectorContractError, ConnectorWorkerError
from .engine import ExecutorStopped, HarnessLLM
from .kv_cache_manager import KVCacheManager, KvCacheCapacityError
from .llm_args import HarnessLlmArgs, KvCacheConfig, KvCacheConnectorConfig
from .model import HarnessTransformer, ModelConfig
from .request import GenerationResult, LlmRequest, LlmRequestState
from .retention import KvCacheRetentionConfig, TokenRangeRetentionConfig

__all__ = [
    "AttentionOrderError",
    "ConnectorContractError",
    "ConnectorWorkerError",
    "ExecutorStopped",
    "GenerationResult",
    "HarnessLLM",
    "HarnessLlmArgs",
    "HarnessTransformer",
    "KVCacheManager",
    "KvCacheCapacityError",
    "KvCacheConfig",
    "KvCacheConnectorConfig",
    "KvCacheRetentionConfig",
    "LlmRequest",
    "LlmRequestState",
    "ModelConfig",
    "TokenRangeRetentionConfig",
    "block_hash_chain",
    "cache_salt_id",
    "v1_block_key",
]
