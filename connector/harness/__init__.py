"""REFERENCE ENGINE HARNESS for semkv-ledger — test and demo infrastructure, never an engine for serving.

Reproduces, on the CPU, the parts of TensorRT-LLM the product touches, faithfully enough that a KV
Cache Connector that passes here works there, per TensorRT-LLM version: the KV cache manager's block
reuse, eviction, offload and KV-cache events (:mod:`.kv_cache_manager`, :mod:`.events`,
:mod:`connector.block_keys`), a small PyTorch transformer that reads and writes the paged pool with a
batched forward (:mod:`.model`), TensorRT-LLM's non-overlap executor loop running many requests
together (:mod:`.executor`) behind an ``LLM``-like facade (:mod:`.engine`), the connector manager
that calls the connector's hooks and enforces the runtime's rules (:mod:`.connector_driver`), and
the behaviours that differ between versions (:mod:`.trtllm_versions`). :mod:`.recording_connector`
is a test-only connector that records calls and injects faults.

Module map:
    retention           KvCacheRetentionConfig / TokenRangeRetentionConfig, per-block priorities
    events              KV-event dicts, bounded drop-oldest buffer, sync drain and async iterator
    kv_cache_manager    block pools, radix reuse, LRU-within-priority eviction, offload/onboard
    model               ModelConfig, HarnessTransformer (dense, paged and batched paged forward),
                        TensorParallel (heads and MLP split over torch.distributed ranks)
    request             LlmRequest (what a connector sees), LlmRequestState, GenerationResult
    llm_args            HarnessLlmArgs / KvCacheConfig (TorchLlmArgs attribute names)
    trtllm_versions     TrtllmVersion profiles: TRTLLM_1X, TRTLLM_MAIN_2026, TRTLLM_1X_TERMINATE
    connector_driver    KvCacheConnectorManager: hook calls, runtime checks, get_finished rules
    executor            PyExecutor._executor_loop: activation, scheduling, forward, terminations
    engine              HarnessLLM: submit/step/generate/cancel, results, events, async saves
    recording_connector test-only connector that records calls and injects behaviour
"""

from connector.block_keys import block_hash_chain, cache_salt_id, v1_block_key
from .connector_driver import AttentionOrderError, ConnectorContractError, ConnectorWorkerError
from .connector_driver import ExecutorStopped
from .engine import HarnessLLM
from .kv_cache_manager import KVCacheManager, KvCacheCapacityError
from .llm_args import HarnessLlmArgs, KvCacheConfig, KvCacheConnectorConfig
from .model import HarnessTransformer, ModelConfig, TensorParallel
from .request import GenerationResult, LlmRequest, LlmRequestState
from .retention import KvCacheRetentionConfig, TokenRangeRetentionConfig
from .trtllm_versions import TRTLLM_1X, TRTLLM_1X_TERMINATE, TRTLLM_MAIN_2026, TRTLLM_VERSIONS
from .trtllm_versions import TrtllmVersion

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
    "TRTLLM_1X",
    "TRTLLM_1X_TERMINATE",
    "TRTLLM_MAIN_2026",
    "TRTLLM_VERSIONS",
    "TensorParallel",
    "TokenRangeRetentionConfig",
    "TrtllmVersion",
    "block_hash_chain",
    "cache_salt_id",
    "v1_block_key",
]
