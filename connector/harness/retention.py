"""REFERENCE ENGINE HARNESS — KV cache retention priorities (``KvCacheRetentionConfig``).

Test and demo infrastructure only; never an engine for serving. Mirrors
``tensorrt_llm.llmapi.KvCacheRetentionConfig`` / ``TokenRangeRetentionConfig`` (priority 0–100,
default 35) and ``KvCacheRetentionConfig::getPerBlockRetentionPriorityDuration`` in
``cpp/tensorrt_llm/executor/kvCacheRetentionConfig.cpp`` (NVIDIA/TensorRT-LLM): a context block
takes the priority of the token range that contains the block's FIRST token; blocks outside every
range keep the default. Decode blocks take ``decode_retention_priority``.

Not modelled: ``duration_ms`` expiry (priorities never revert to the default with time).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_RETENTION_PRIORITY",
    "MAX_RETENTION_PRIORITY",
    "MIN_RETENTION_PRIORITY",
    "KvCacheRetentionConfig",
    "TokenRangeRetentionConfig",
    "per_block_priorities",
]

MIN_RETENTION_PRIORITY = 0
MAX_RETENTION_PRIORITY = 100
DEFAULT_RETENTION_PRIORITY = 35


def _check_priority(priority: int) -> None:
    if not MIN_RETENTION_PRIORITY <= priority <= MAX_RETENTION_PRIORITY:
        raise ValueError(f"retention priority must be in [0, 100], got {priority}")


@dataclass(frozen=True)
class TokenRangeRetentionConfig:
    """Priority for tokens ``[token_start, token_end)`` (``token_end`` None: to the end).

    Raises:
        ValueError: negative start, empty range, or priority outside 0–100.
    """

    token_start: int
    token_end: int | None = None
    priority: int = DEFAULT_RETENTION_PRIORITY
    duration_ms: int | None = None

    def __post_init__(self) -> None:
        if self.token_start < 0 or (self.token_end is not None and self.token_end < 0):
            raise ValueError("Token indices must be non-negative.")
        if self.token_end is not None and self.token_start >= self.token_end:
            raise ValueError("Range must have a positive, non-zero length.")
        _check_priority(self.priority)


@dataclass(frozen=True)
class KvCacheRetentionConfig:
    """Per-request retention: sorted, non-overlapping token ranges plus a decode priority.

    Raises:
        ValueError: overlapping ranges or priorities outside 0–100.
    """

    token_range_retention_configs: list[TokenRangeRetentionConfig] = field(default_factory=list)
    decode_retention_priority: int = DEFAULT_RETENTION_PRIORITY
    decode_duration_ms: int | None = None

    def __post_init__(self) -> None:
        _check_priority(self.decode_retention_priority)
        ranges = sorted(self.token_range_retention_configs, key=lambda r: r.token_start)
        for left, right in zip(ranges, ranges[1:]):
            if left.token_end is None or left.token_end > right.token_start:
                raise ValueError("Token ranges must be non-overlapping.")
        object.__setattr__(self, "token_range_retention_configs", ranges)


def per_block_priorities(
    config: KvCacheRetentionConfig | None, tokens_per_block: int, num_tokens: int
) -> list[int | None]:
    """Priority of each context block of a ``num_tokens`` prompt; None means "not set" (default).

    Block ``i`` covers tokens ``[i*tokens_per_block, (i+1)*tokens_per_block)`` and takes the priority
    of the range containing token ``i*tokens_per_block``.
    """
    num_blocks = -(-num_tokens // tokens_per_block)
    if config is None:
        return [None] * num_blocks
    out: list[int | None] = []
    for i in range(num_blocks):
        start = i * tokens_per_block
        chosen: int | None = None
        for rng in config.token_range_retention_configs:
            if rng.token_start <= start and (rng.token_end is None or start < rng.token_end):
                chosen = rng.priority
                break
        out.append(chosen)
    return out
