"""Every integer an engine event carries, per wire dialect, and a way to set it: the catalog the
range tests walk (tests/unit/test_wire_ranges.py decodes each case; tests/integration/consumer/
test_daemon_integer_ranges.py sends them to a running daemon over ZMQ).

A :class:`Field` builds one event (or one batch element: ``rank``) with ``value`` at its place and
every other value valid. ``column`` names the ledger.schema ``STORED_FIELDS`` entry it lands in
(None: it is only kept in the log's raw bytes), ``floor`` the smallest valid value (ids, counts and
levels are never negative; token ids and vLLM's signed hashes may be), ``ceiling`` the largest a
non-column field may take.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ledger.schema import integer_range

U64_MAX = 2**64 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
BOUNDARIES = (I64_MIN, -(2**31) - 1, -(2**31), -1, 0, 1, 2**31 - 1, 2**31, I64_MAX, 2**63, U64_MAX)
"""Every integer msgpack can carry lies in [-2**63, 2**64); these are the edges of int32, int64 and
uint64 and of the non-negative values."""


@dataclass(frozen=True)
class Field:
    dialect: str  # "a" TensorRT-LLM LLM-API dicts, "b" tagged maps, "c" positional arrays
    name: str
    build: Callable[[int], Any]  # value -> event (or, for "rank", the batch's rank)
    column: str | None = None
    floor: int = 0
    ceiling: int = U64_MAX
    structural: bool = False  # a valid value may still be refused for the event's shape (block_size)

    def valid(self, value: int) -> bool:
        """Would the decoder accept ``value`` here (all else valid)?"""
        high = integer_range(self.column)[1] if self.column else self.ceiling
        return self.floor <= value <= high

    @property
    def batch_level(self) -> bool:
        return self.name == "rank"


def _trt(data: dict, **top: Any) -> dict:
    return {"event_id": top.pop("event_id", 7), "data": data, "window_size": top.pop("window_size", 32), **top}


def _trt_block(**fields: Any) -> dict:
    tokens = [{"type": "unique_token", "token_id": fields.pop("token_id", 5),
               "token_extra_id": fields.pop("token_extra_id", 0)}]
    return {"type": "stored_block", "block_hash": fields.pop("block_hash", 11), "tokens": tokens,
            "cache_level": 0, "priority": 35, "cache_salt": None, **fields}


def _trt_stored(parent: int | None = None, **block: Any) -> dict:
    return _trt({"type": "stored", "parent_hash": parent, "blocks": [_trt_block(**block)]})


def _trt_updated(**diff: Any) -> dict:
    return _trt({"type": "updated", "block_hash": 11, **diff})


def _diff(new: int, old: int = 0) -> dict:
    return {"type": "event_diff", "new_value": new, "old_value": old}


def _map_stored(**fields: Any) -> dict:
    return {"type": "BlockStored", "block_hashes": [fields.pop("block_hash", 11)],
            "parent_block_hash": fields.pop("parent", None), "token_ids": [fields.pop("token_id", 5)] * 4,
            "block_size": 4, "lora_id": None, "medium": "GPU", **fields}


def _array_stored(**fields: Any) -> list:
    m = _map_stored(**fields)
    return ["BlockStored", m["block_hashes"], m["parent_block_hash"], m["token_ids"], m["block_size"],
            m["lora_id"], m["medium"], None, None, m.get("group_idx"), "full_attention",
            m.get("kv_cache_spec_sliding_window")]


def _vllm(name: str, build: Callable[..., Any], dialect: str) -> list[Field]:
    """The integers of dialects (b) and (c): the same fields, as a map or positionally."""
    def stored_with(**kw: Any) -> Callable[[int], Any]:
        key, = kw
        return lambda v: build(**{key: v})

    def sized(v: int) -> Any:
        event = _map_stored(block_size=v)
        if dialect == "c":
            return ["BlockStored", [11], None, [5] * 4, v]
        return event

    return [
        Field(dialect, "block_hash", stored_with(block_hash=0), floor=I64_MIN),
        Field(dialect, "parent_block_hash", stored_with(parent=0), floor=I64_MIN),
        Field(dialect, "token_id", stored_with(token_id=0), floor=I64_MIN, ceiling=I64_MAX),
        Field(dialect, "block_size", sized, column="num_tokens", floor=1, structural=True),
        Field(dialect, "lora_id", stored_with(lora_id=0), column="lora_id"),
        Field(dialect, "group_idx", stored_with(group_idx=0)),
        Field(dialect, "kv_cache_spec_sliding_window", stored_with(kv_cache_spec_sliding_window=0)),
        Field(dialect, "removed_hash", (lambda v: {"type": "BlockRemoved", "block_hashes": [v], "medium": "GPU"})
              if dialect == "b" else (lambda v: ["BlockRemoved", [v], "GPU"]), floor=I64_MIN),
        Field(dialect, "rank", lambda v: v, column="attention_dp_rank"),
    ]


FIELDS: list[Field] = [
    Field("a", "event_id", lambda v: _trt_stored() | {"event_id": v}, column="event_id"),
    Field("a", "window_size", lambda v: _trt_stored() | {"window_size": v}, column="window_size"),
    Field("a", "attention_dp_rank", lambda v: _trt_stored() | {"attention_dp_rank": v}, column="attention_dp_rank"),
    Field("a", "layer_group_id", lambda v: _trt_stored() | {"layer_group_id": v}),
    Field("a", "block_hash", lambda v: _trt_stored(block_hash=v)),
    Field("a", "parent_hash", lambda v: _trt_stored(parent=v)),
    Field("a", "token_id", lambda v: _trt_stored(token_id=v), floor=I64_MIN, ceiling=I64_MAX),
    Field("a", "token_extra_id", lambda v: _trt_stored(token_extra_id=v), floor=I64_MIN, ceiling=I64_MAX),
    Field("a", "cache_level", lambda v: _trt_stored(cache_level=v), column="cache_level"),
    Field("a", "priority", lambda v: _trt_stored(priority=v), column="priority"),
    Field("a", "lora_id", lambda v: _trt_stored(lora_id=v), column="lora_id"),
    Field("a", "updated_cache_level", lambda v: _trt_updated(cache_level=_diff(v)), column="cache_level"),
    Field("a", "updated_priority_old", lambda v: _trt_updated(priority=_diff(0, v)), column="priority"),
    Field("a", "removed_hash", lambda v: _trt({"type": "removed", "block_hashes": [v]})),
    Field("a", "num_blocks_per_cache_level",
          lambda v: _trt({"type": "created", "num_blocks_per_cache_level": [v, 0]})),
    Field("a", "rank", lambda v: v, column="attention_dp_rank"),
    *_vllm("b", _map_stored, "b"),
    *_vllm("c", _array_stored, "c"),
]
"""Every case. (A hash of dialect (a) is an unsigned 64-bit int; of (b)/(c) a signed or unsigned
one: msgpack carries nothing wider, so no hash value here is refused for its range except a
negative one in (a).)"""


def batch_of(field: Field, value: int, good: Any) -> tuple[list[Any], int | None]:
    """The events and rank of a batch holding ``field`` = ``value`` between two ``good`` events
    (for ``rank``: the rank itself, beside one good event)."""
    if field.batch_level:
        return [good], value
    return [good, field.build(value), good], 0


def good_event(dialect: str) -> Any:
    """A valid event of ``dialect`` (a removal of an unknown block: applies, changes nothing)."""
    if dialect == "a":
        return _trt({"type": "removed", "block_hashes": [99]})
    if dialect == "b":
        return {"type": "BlockRemoved", "block_hashes": [99], "medium": "GPU"}
    return ["BlockRemoved", [99], "GPU"]
