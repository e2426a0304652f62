"""An engine run publishing KV events on the wire in dialect (a) or (b), for continuity tests.

:class:`EngineRun` stamps seqs from 0 (and, in dialect (a), ``event_id``s from 0) as one engine
process does, and returns each batch as the ZMQ frames ``[topic, seq8, payload]`` it would send
(reference/WIRE.md): dialect ``"trt"`` = (a), TensorRT-LLM LLM-API dicts with ``event_id`` and
``data.type``; dialect ``"vllm"`` = (b), vLLM maps tagged ``type``, no ``event_id`` (as Dynamo and
TensorRT-LLM's native publisher send them); ``"vllm-array"``: vLLM's own tagged positional arrays.
:func:`received` decodes frames with the consumer's real decoder (``consumer.wire``).
"""

from __future__ import annotations

import itertools
from typing import Any

import msgspec

from consumer.wire import decode_message, encode_frames
from ledger import events as ev

DIALECTS = ("trt", "vllm")
BLOCK_SIZE = 16
WINDOW = 32  # dialect (a) window_size
_ENC = msgspec.msgpack.Encoder()
_ts = itertools.count(1_700_000_000)  # distinct batch timestamps: distinct payloads, distinct digests
Op = tuple[str, list[int]]  # ("stored" | "removed", hashes)


class EngineRun:
    """One run of one engine. ``payload(*ops)`` encodes a batch of events, ``batch(*ops)`` stamps
    the next seq on it. Ops: ``("stored", [h, …])`` (a chain) and ``("removed", [h, …])``."""

    def __init__(self, dialect: str, topic: bytes = b"kv") -> None:
        if dialect not in (*DIALECTS, "vllm-array"):
            raise ValueError(dialect)
        self.dialect, self.topic = dialect, topic
        self.next_seq = 0
        self.next_event_id = 0

    def events(self, *ops: Op) -> list[Any]:
        return [self._event(kind, hashes) for kind, hashes in ops]

    def payload(self, *ops: Op) -> bytes:
        return _ENC.encode([float(next(_ts)), self.events(*ops), 0])

    def batch(self, *ops: Op) -> list[bytes]:
        frames = encode_frames(self.topic, self.next_seq, self.payload(*ops))
        self.next_seq += 1
        return frames

    def _event(self, kind: str, hashes: list[int]) -> dict[str, Any] | list[Any]:
        if self.dialect == "vllm-array":  # vLLM's own encoding: tagged positional arrays (WIRE.md §B)
            if kind == "stored":
                return ["BlockStored", hashes, None, list(range(BLOCK_SIZE * len(hashes))), BLOCK_SIZE, None, "GPU"]
            return ["BlockRemoved", hashes, "GPU"]
        if self.dialect == "vllm":
            if kind == "stored":
                return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                        "token_ids": list(range(BLOCK_SIZE * len(hashes))), "block_size": BLOCK_SIZE,
                        "lora_id": None, "medium": "GPU"}
            return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}
        if kind == "stored":
            data: dict[str, Any] = {"type": "stored", "parent_hash": None, "blocks": [_trt_block(h) for h in hashes]}
        else:
            data = {"type": "removed", "block_hashes": hashes}
        event = {"event_id": self.next_event_id, "data": data, "window_size": WINDOW}
        self.next_event_id += 1
        return event


def _trt_block(h: int) -> dict[str, Any]:
    tokens = [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in range(BLOCK_SIZE)]
    return {"type": "stored_block", "block_hash": h, "tokens": tokens, "cache_level": 0, "priority": 35}


def received(frames: list[bytes], engine_id: str = "engine-a", source_id: str | None = None, *,
             late: bool = False, new_run: bool = False) -> ev.ReceivedBatch:
    """Frames decoded as the consumer decodes them, with the judgements its replay would pass on."""
    batch = decode_message(frames, source_id=source_id or f"{engine_id}@tcp://127.0.0.1:5557", engine_id=engine_id,
                           received_at=0.0)
    assert isinstance(batch, ev.ReceivedBatch) and not batch.dead_letters, batch
    return msgspec.structs.replace(batch, late=late, new_run=new_run)
