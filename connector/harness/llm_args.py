"""REFERENCE ENGINE HARNESS — the ``llm_args`` object connector constructors receive.

Test and demo infrastructure only; never an engine for serving. Attribute names mirror
``tensorrt_llm.llmapi.llm_args.TorchLlmArgs`` and ``KvCacheConfig`` (NVIDIA/TensorRT-LLM
``tensorrt_llm/llmapi/llm_args.py``) for the fields a connector reads: ``model``, ``dtype``,
``kv_cache_config.tokens_per_block`` (default 32), ``kv_cache_config.enable_block_reuse``,
``max_seq_len``, ``max_num_tokens``, ``tensor_parallel_size``, ``enable_attention_dp``,
``kv_connector_config``, ``scheduler_config.capacity_scheduler_policy``. The harness-only
``harness_model_config`` holds the :class:`~connector.harness.model.ModelConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .model import ModelConfig

__all__ = ["HarnessLlmArgs", "KvCacheConfig", "KvCacheConnectorConfig", "SchedulerConfig"]


@dataclass(frozen=True)
class KvCacheConfig:
    """``tensorrt_llm.llmapi.KvCacheConfig`` fields the harness honours.

    Attributes:
        tokens_per_block: KV block size (tokens); must equal the model config's.
        max_tokens: GPU pool capacity (tokens, rounded down to whole blocks); None: room for
            ``max(4 * max_context, 1024)`` tokens.
        enable_block_reuse: device prefix reuse on/off.
        host_cache_size: host (secondary) pool size in BYTES; None/0 disables offload.
        onboard_blocks: must stay True (offloaded blocks are copied back before reuse).
        secondary_offload_min_priority: offload only blocks with priority >= this; None: 30.
        event_buffer_max_size: bounded KV-event buffer (events); 0 disables events.
        enable_partial_reuse: reuse the leading tokens of a partly matching stored block (always
            copied: ``copy_on_partial_reuse`` is accepted and changes nothing). TensorRT-LLM's default
            is True; the harness's is False, so ``num_computed_tokens`` is block-aligned unless asked.
        dtype: ``"auto"`` (fp32 here).
    """

    tokens_per_block: int = 32
    max_tokens: int | None = None
    enable_block_reuse: bool = True
    host_cache_size: int | None = None
    onboard_blocks: bool = True
    secondary_offload_min_priority: int | None = None
    event_buffer_max_size: int = 0
    enable_partial_reuse: bool = False
    copy_on_partial_reuse: bool = False
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if not self.onboard_blocks:
            raise ValueError("the harness supports onboard_blocks=True only")


@dataclass(frozen=True)
class KvCacheConnectorConfig:
    """``KvCacheConnectorConfig``: module imported with importlib, then the two class names."""

    connector_module: str
    connector_scheduler_class: str
    connector_worker_class: str


@dataclass(frozen=True)
class SchedulerConfig:
    """``SchedulerConfig``; connectors require ``GUARANTEED_NO_EVICT``."""

    capacity_scheduler_policy: str = "GUARANTEED_NO_EVICT"


@dataclass(frozen=True)
class HarnessLlmArgs:
    """The ``llm_args`` passed to ``KvCacheConnectorScheduler(llm_args)`` / ``...Worker(llm_args)``."""

    model: str
    harness_model_config: ModelConfig
    kv_cache_config: KvCacheConfig
    max_seq_len: int
    max_num_tokens: int
    kv_connector_config: KvCacheConnectorConfig | None = None
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    tokenizer: str | None = None
    skip_tokenizer_init: bool = True
    backend: str = "pytorch"
    dtype: str = "float32"
    max_batch_size: int = 1
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_attention_dp: bool = False
    cuda_graph_config: None = None
    disable_overlap_scheduler: bool = True
