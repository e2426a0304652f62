"""REFERENCE ENGINE HARNESS — the request object a KV Cache Connector sees, and generation results.

Test and demo infrastructure only; never an engine for serving. :class:`LlmRequest` carries the
attributes connectors read on TensorRT-LLM's ``LlmRequest`` (nanobind ``bindings.internal.
batch_manager.LlmRequest`` plus the Python subclass in ``tensorrt_llm/_torch/pyexecutor/
llm_request.py``; TRTLLM_CONNECTOR.md): ``request_id``, ``get_tokens(0)``, ``prompt_len``,
``state``, ``context_current_position``, ``context_chunk_size``, ``lora_task_id``,
``cache_salt_id``, ``cache_salt``, ``is_generation_only_request``, ``multimodal_hashes``,
``py_request_id``, ``kv_cache_retention_config``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from connector.block_keys import cache_salt_id as compute_cache_salt_id
from .retention import KvCacheRetentionConfig

__all__ = ["GenerationResult", "LlmRequest", "LlmRequestState"]


class LlmRequestState(enum.Enum):
    """Subset of ``tensorrt_llm.bindings.LlmRequestState`` the connector path uses."""

    CONTEXT_INIT = "CONTEXT_INIT"
    GENERATION_IN_PROGRESS = "GENERATION_IN_PROGRESS"
    GENERATION_COMPLETE = "GENERATION_COMPLETE"
    DISAGG_GENERATION_TRANS_IN_PROGRESS = "DISAGG_GENERATION_TRANS_IN_PROGRESS"
    """Parked: waiting for an asynchronous connector load."""
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = "DISAGG_CONTEXT_TRANS_IN_PROGRESS"
    """Finished, blocks pinned: waiting for an asynchronous connector save."""
    DISAGG_CONTEXT_COMPLETE = "DISAGG_CONTEXT_COMPLETE"
    """Finished; every worker reported its asynchronous save (``end_transfer``)."""


@dataclass(eq=False)
class LlmRequest:
    """A request as the connector sees it. Mutated only by the harness engine.

    Attributes:
        request_id: engine-local id (``py_request_id`` is the same value).
        prompt_token_ids: the prompt.
        max_new_tokens: tokens to generate (greedy).
        lora_task_id: LoRA task id mixed into block hashes, or None.
        cache_salt: tenant salt string, or None.
        kv_cache_retention_config: per-request retention, or None.
        context_current_position: tokens whose KV is valid (device reuse + connector + computed).
        context_chunk_size: tokens in the current context chunk.
        output_token_ids: generated tokens so far.
    """

    request_id: int
    prompt_token_ids: list[int]
    max_new_tokens: int
    lora_task_id: int | None = None
    cache_salt: str | None = None
    kv_cache_retention_config: KvCacheRetentionConfig | None = None
    state: LlmRequestState = LlmRequestState.CONTEXT_INIT
    context_current_position: int = 0
    context_chunk_size: int = 0
    is_generation_only_request: bool = False
    is_dummy_request: bool = False
    multimodal_hashes: list[list[int]] | None = None
    py_num_connector_matched_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def py_request_id(self) -> int:
        """Python-side request id (same as ``request_id`` here)."""
        return self.request_id

    @property
    def prompt_len(self) -> int:
        """Prompt length (tokens)."""
        return len(self.prompt_token_ids)

    @property
    def cache_salt_id(self) -> int | None:
        """1.1/1.2 salt id: first 8 bytes of BLAKE3(salt), little-endian; None without a salt."""
        return compute_cache_salt_id(self.cache_salt) if self.cache_salt is not None else None

    @property
    def context_remaining_length(self) -> int:
        """Prompt tokens not yet in the cache."""
        return self.prompt_len - self.context_current_position

    def get_tokens(self, beam: int = 0) -> list[int]:
        """A copy of every token of beam ``beam`` (prompt, then generated).

        Raises:
            IndexError: ``beam`` != 0 (beam search is not modelled).
        """
        if beam != 0:
            raise IndexError("the harness models beam width 1 only")
        return [*self.prompt_token_ids, *self.output_token_ids]

    def get_num_tokens(self, beam: int = 0) -> int:
        """Number of tokens of beam ``beam``."""
        return len(self.get_tokens(beam))


@dataclass
class GenerationResult:
    """What :meth:`connector.harness.engine.HarnessLLM.generate` returns.

    Attributes:
        request_id: the engine-local request id.
        token_ids: generated tokens (greedy), ``max_new_tokens`` of them.
        prefill_logits: logits ``[num_computed_prompt_tokens, vocab]`` of the prompt positions
            this request COMPUTED, from ``prefill_start`` on (reused and connector-loaded
            positions have none; a request cancelled mid-prefill has fewer rows).
        prefill_start: first computed prompt position = ``num_reused_tokens +
            num_connector_tokens`` (tokens).
        num_reused_tokens: prompt tokens served by the engine's own block reuse (device match).
        num_connector_tokens: prompt tokens the connector promised and loaded.
        prefill_seconds: wall time from submission to the end of the context phase (queueing,
            scheduling, loads, all chunks), seconds; 0 when the prefill never completed.
        block_ids: the request's GPU block ids when it finished.
        finish_reason: ``"length"`` (``max_new_tokens`` reached) or ``"cancelled"``. A request
            that failed raises instead of returning a result (``"error"`` is reserved for it).
    """

    request_id: int
    token_ids: list[int]
    prefill_logits: torch.Tensor
    prefill_start: int
    num_reused_tokens: int
    num_connector_tokens: int
    prefill_seconds: float
    block_ids: list[int]
    finish_reason: str = "length"

    @property
    def last_logits(self) -> torch.Tensor:
        """Logits ``[vocab]`` at the last prompt position (the first generated token's)."""
        return self.prefill_logits[-1]
