"""Walk msgpack bytes without decoding them: object boundaries and array lengths, iteratively.

Why not a library: msgspec (and ``msgspec.Raw``) find an object's end recursively, bounded by
Python's recursion limit (about 1,000 levels: ``RecursionError``); msgpack-python's unpacker has a
fixed 1,024-level stack (``StackError``). One absurdly nested event would then take its whole batch
with it, good siblings included. This module keeps a count of pending objects instead of a stack,
so depth costs nothing but the bytes that express it. It runs only on the error path and before a
large message is decoded (``consumer/wire.py``), never per event in the steady state.

Format: the msgpack specification (github.com/msgpack/msgpack, ``spec.md``).
"""

from __future__ import annotations

from typing import Final

__all__ = ["ScanError", "array_header", "skip_object"]

# header byte -> bytes of the whole object (fixed-size types)
_FIXED: Final[dict[int, int]] = {
    0xC0: 1, 0xC2: 1, 0xC3: 1,  # nil, false, true
    0xCA: 5, 0xCB: 9,  # float32, float64
    0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9,  # uint8..64
    0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9,  # int8..64
    0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18,  # fixext 1..16 (type byte + data)
}
_SIZED: Final[dict[int, tuple[int, int]]] = {  # header byte -> (length field bytes, extra bytes before data)
    0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0),  # bin 8/16/32
    0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),  # ext 8/16/32 (+ type byte)
    0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0),  # str 8/16/32
}
_CONTAINERS: Final[dict[int, tuple[int, int]]] = {  # header byte -> (length field bytes, children per entry)
    0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2),
}


class ScanError(ValueError):
    """The bytes are not msgpack (truncated, the reserved byte 0xc1), or the walk exceeded its budget."""


def _length(buf: bytes | memoryview, pos: int, size: int) -> int:
    if pos + size > len(buf):
        raise ScanError(f"truncated length field at byte {pos}")
    return int.from_bytes(buf[pos:pos + size], "big")


def _header(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """The object header at ``pos``: (bytes up to the next object, child objects it contains)."""
    head = buf[pos]
    if head <= 0x7F or head >= 0xE0:  # positive / negative fixint
        return 1, 0
    if head <= 0x8F:  # fixmap
        return 1, 2 * (head & 0x0F)
    if head <= 0x9F:  # fixarray
        return 1, head & 0x0F
    if head <= 0xBF:  # fixstr
        return 1 + (head & 0x1F), 0
    if head in _FIXED:
        return _FIXED[head], 0
    if head in _SIZED:
        size, extra = _SIZED[head]
        return 1 + size + extra + _length(buf, pos + 1, size), 0
    if head in _CONTAINERS:
        size, per_entry = _CONTAINERS[head]
        return 1 + size, per_entry * _length(buf, pos + 1, size)
    raise ScanError(f"byte 0x{head:02x} at {pos} starts no msgpack object")


def skip_object(buf: bytes | memoryview, pos: int, budget: int) -> int:
    """The offset just past the object that starts at ``pos``.

    Args:
        buf: msgpack bytes.
        pos: offset of the object's first byte.
        budget: at most this many objects (nested ones included) are walked.

    Raises:
        ScanError: truncated or invalid msgpack, or more than ``budget`` objects.
    """
    pending = 1
    end = len(buf)
    while pending:
        if pos >= end:
            raise ScanError(f"truncated: {pending} object(s) missing at byte {pos}")
        budget -= 1
        if budget < 0:
            raise ScanError("object budget exhausted")
        step, children = _header(buf, pos)
        pos += step
        pending += children - 1
    if pos > end:
        raise ScanError(f"truncated: the last object ends past byte {end}")
    return pos


def array_header(buf: bytes | memoryview, pos: int = 0) -> tuple[int, int] | None:
    """``(length, offset of the first element)`` of the array at ``pos``; None if no array starts there.

    Raises:
        ScanError: a truncated length field.
    """
    if pos >= len(buf):
        return None
    head = buf[pos]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F, pos + 1
    if head in (0xDC, 0xDD):
        size = 2 if head == 0xDC else 4
        return _length(buf, pos + 1, size), pos + 1 + size
    return None
