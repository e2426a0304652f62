"""Read and write ZMQ message captures (the ``*.frames.bin`` format of ``shared/fixtures/README.md``).

A capture is a plain concatenation of messages, each laid out as::

    u64 BE  receive_time_ns      # wall clock (time.time_ns) when the message was received
    u32 BE  frame_count
    frame_count × (u32 BE length, length bytes)

There is no file header and no index, so captures can be appended to and concatenated (a
multi-run capture is just two captures back to back). ``semkv-ledger publish --from-file``
replays this format (``consumer/publish.py``); live KV-event messages are 3 frames
``[topic, seq as 8 bytes big-endian, msgpack payload]`` (reference/WIRE.md §B).

Errors: a file that ends inside a message raises :class:`CaptureFormatError`, which names the
byte offset of the message and of the missing field, so a half-written capture is never read as
a shorter valid one. A frame length (or frame count × 4 bytes) larger than the whole file is
either a capture cut inside that message or not a capture at all; the message's receive time
tells them apart (:func:`_recorded_time`: a capture's is a wall-clock time of this century, the
first 8 bytes of text, of a compressed file or of zeros are not), and the error says which.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

__all__ = ["CaptureFormatError", "CaptureWriter", "CapturedMessage", "encode_message", "read_capture"]

_MESSAGE_HEADER = struct.Struct(">QI")  # receive_time_ns, frame_count
_FRAME_HEADER = struct.Struct(">I")  # frame length
_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1
_RECORDED_NS_MIN = 946_684_800 * 10**9  # 2000-01-01 UTC: no capture was recorded before it
_RECORDED_NS_SLACK = 366 * 86_400 * 10**9  # a recording host's clock ahead of this one's by up to a year


class CaptureFormatError(ValueError):
    """The capture is truncated or malformed; ``offset`` is where the bad field starts (bytes)."""

    def __init__(self, message: str, *, path: str, offset: int) -> None:
        super().__init__(f"{path}: {message} at byte offset {offset}")
        self.path = path
        self.offset = offset


@dataclass(frozen=True, slots=True)
class CapturedMessage:
    """One recorded multipart message.

    Attributes:
        received_ns: receive time in nanoseconds since the Unix epoch (as recorded).
        frames: the message frames exactly as received (for a live KV-event message:
            ``[topic, seq8, payload]``).
    """

    received_ns: int
    frames: list[bytes]


def encode_message(frames: Iterable[bytes], received_ns: int) -> bytes:
    """Serialize one message in the capture layout.

    Raises:
        ValueError: ``received_ns`` outside ``[0, 2**64)``, more than 2**32-1 frames, or a frame
            longer than 2**32-1 bytes (the format's u64/u32 fields cannot hold them).
    """
    frame_list = [bytes(f) for f in frames]
    if not 0 <= received_ns <= _U64_MAX:
        raise ValueError(f"received_ns {received_ns} outside [0, 2**64)")
    if len(frame_list) > _U32_MAX:
        raise ValueError("too many frames for a u32 frame_count")
    parts = [_MESSAGE_HEADER.pack(received_ns, len(frame_list))]
    for frame in frame_list:
        if len(frame) > _U32_MAX:
            raise ValueError(f"frame of {len(frame)} bytes exceeds the u32 length field")
        parts.append(_FRAME_HEADER.pack(len(frame)))
        parts.append(frame)
    return b"".join(parts)


def read_capture(path: str | Path) -> Iterator[CapturedMessage]:
    """Yield the messages of a capture file in recorded order.

    The file is streamed (one message in memory at a time) and closed when the iterator is
    exhausted or closed.

    Raises:
        OSError: the file cannot be opened.
        CaptureFormatError: the file ends inside a message (the error names the offset).
    """
    name = str(path)
    with open(path, "rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        offset = 0
        while True:
            header = stream.read(_MESSAGE_HEADER.size)
            if not header:
                return  # clean end: exactly at a message boundary
            _check_length(header, _MESSAGE_HEADER.size, "message header", name, offset)
            received_ns, frame_count = _MESSAGE_HEADER.unpack(header)
            recorded = _recorded_time(received_ns)
            if frame_count * _FRAME_HEADER.size > size:
                raise _beyond_the_file(f"frame count {frame_count}: its lengths alone would need more than", size,
                                       recorded, name, offset + 8)
            message_offset = offset
            offset += _MESSAGE_HEADER.size
            frames: list[bytes] = []
            for index in range(frame_count):
                frame, offset = _read_frame(stream, name, offset, index, message_offset, size, recorded)
                frames.append(frame)
            yield CapturedMessage(received_ns=received_ns, frames=frames)


def _read_frame(stream: BinaryIO, name: str, offset: int, index: int, message_offset: int,
                size: int, recorded: bool) -> tuple[bytes, int]:
    where = f"frame {index} of the message starting at offset {message_offset}"
    raw_len = stream.read(_FRAME_HEADER.size)
    _check_length(raw_len, _FRAME_HEADER.size, f"length of {where}", name, offset)
    (length,) = _FRAME_HEADER.unpack(raw_len)
    if length > size:
        raise _beyond_the_file(f"frame length {length} of {where}: more than", size, recorded, name, offset)
    offset += _FRAME_HEADER.size
    frame = stream.read(length)
    _check_length(frame, length, f"body of {where} ({length} bytes)", name, offset)
    return frame, offset + length


def _recorded_time(received_ns: int) -> bool:
    """Whether ``received_ns`` reads as a receive time (ns since the epoch) a capture could hold:
    from 2000-01-01 to a year past this host's clock."""
    return _RECORDED_NS_MIN <= received_ns <= time.time_ns() + _RECORDED_NS_SLACK


def _beyond_the_file(what: str, size: int, recorded: bool, name: str, offset: int) -> CaptureFormatError:
    """A field asking for more bytes than the whole file holds: a capture cut inside this message
    when the message's receive time is one a capture holds, otherwise not a capture file."""
    if recorded:
        return CaptureFormatError(f"truncated capture ({what} the file's {size} bytes: cut inside this message)",
                                  path=name, offset=offset)
    return CaptureFormatError(f"not a capture file (bad {what} the file's {size} bytes)", path=name, offset=offset)


def _check_length(data: bytes, expected: int, what: str, name: str, offset: int) -> None:
    if len(data) != expected:
        raise CaptureFormatError(
            f"truncated capture: {what} needs {expected} bytes, only {len(data)} left",
            path=name,
            offset=offset,
        )


CAPTURE_MODE = 0o600
"""A capture holds the engines' prompt token ids (``BlockStored``): readable by its owner only,
like the ledger (ledger/db.py)."""


class CaptureWriter:
    """Append messages to a capture file.

    ``CaptureWriter(path)`` truncates an existing file; pass ``append=True`` to extend it (the
    format has no header, so appending yields a valid multi-run capture). Writes are buffered:
    call :meth:`flush` to make them visible to readers, :meth:`close` (or use ``with``) when done.

    The file is mode 0600 (:data:`CAPTURE_MODE`) whatever the umask: created so, and an existing
    file is narrowed to it before anything is written.

    Raises:
        OSError: the file cannot be opened, or (for a file of another user) its mode changed.
    """

    def __init__(self, path: str | Path, *, append: bool = False) -> None:
        self.path = Path(path)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
        fd = os.open(self.path, flags | getattr(os, "O_CLOEXEC", 0), CAPTURE_MODE)
        try:
            os.fchmod(fd, CAPTURE_MODE)  # an existing file keeps its mode; os.open's applies to new ones
            self._stream: BinaryIO | None = os.fdopen(fd, "ab" if append else "wb")
        except BaseException:
            os.close(fd)
            raise
        self.messages_written = 0

    def write(self, frames: Iterable[bytes], received_ns: int) -> None:
        """Append one message (see :func:`encode_message` for the errors)."""
        if self._stream is None:
            raise ValueError(f"{self.path}: capture writer is closed")
        self._stream.write(encode_message(frames, received_ns))
        self.messages_written += 1

    def flush(self) -> None:
        if self._stream is not None:
            self._stream.flush()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def __enter__(self) -> CaptureWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
