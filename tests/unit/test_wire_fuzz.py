"""Fuzzing consumer/wire.py: 10,000 messages (hypothesis: 500 random msgpack values and 300
edited event templates; seeded loops: 4,200 edited templates, 3,000 byte mutations of recorded
payloads, 2,000 random frame sets). decode_message never raises, and every event of a well-shaped
payload is either returned or dead-lettered, exactly once, in payload order."""

from __future__ import annotations

import copy
import random
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.wire import SEQ_END_MARKER, WireLimits, decode_message, encode_frames, event_indices, unpack_frames
from ledger.events import DeadLetter, ReceivedBatch
from ledger.types import DeadLetterReason

try:
    from ._capture_reader import FIXTURES, read_capture, shared_dir
except ImportError:  # rootdir-relative import mode without a package
    from _capture_reader import FIXTURES, read_capture, shared_dir

enc = msgspec.msgpack.encode
SETTINGS = settings(max_examples=500, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FRAME_REASONS = {DeadLetterReason.WRONG_FRAME_COUNT, DeadLetterReason.BAD_SEQ_FRAME,
                 DeadLetterReason.OVERSIZED_FRAME}
PAYLOAD_REASONS = {DeadLetterReason.MALFORMED_MSGPACK, DeadLetterReason.BAD_BATCH_SHAPE,
                   DeadLetterReason.VALUE_OUT_OF_RANGE}  # a NaN, infinite or negative batch ts


def check(frames: list[bytes]) -> ReceivedBatch | DeadLetter:
    """Decode and assert that everything received is accounted for exactly once."""
    out = decode_message(frames, source_id="s", engine_id="e", received_at=1.0)
    if isinstance(out, DeadLetter):
        assert out.reason in FRAME_REASONS
        assert unpack_frames(out.raw) == [bytes(f) for f in frames]
        return out
    assert isinstance(out, ReceivedBatch)
    payload = frames[2]
    whole = [d for d in out.dead_letters if d.batch_index is None]
    if whole:
        assert len(out.dead_letters) == 1 and out.events == []
        if whole[0].reason == DeadLetterReason.MESSAGE_OVER_LIMIT:  # an events header claiming too many
            assert whole[0].raw == bytes(payload[:WireLimits().oversized_keep_bytes])
        else:
            assert whole[0].reason in PAYLOAD_REASONS and whole[0].raw == payload
        return out
    items = msgspec.msgpack.decode(msgspec.msgpack.decode(payload, type=list[msgspec.Raw])[1],
                                   type=list[msgspec.Raw])
    assert len(out.events) + len(out.dead_letters) == len(items)
    dead_at = [d.batch_index for d in out.dead_letters]
    assert dead_at == sorted(set(dead_at))
    for letter in out.dead_letters:
        assert letter.raw == bytes(items[letter.batch_index]) and letter.seq == out.seq
    for index, event in zip(event_indices(out), out.events):
        assert event.raw == bytes(items[index])
    return out


def frames_for(payload: bytes) -> list[bytes]:
    return encode_frames(b"kv", 1, payload)


# ---------------------------------------------------------------------------------------------
# 1. Random msgpack values, as whole payloads and as events of a well-shaped batch
# ---------------------------------------------------------------------------------------------

leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.integers(-3, 300),
    st.floats(), st.text(max_size=12), st.binary(max_size=40), st.just(bytes(32)),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "stored", "removed",
                     "updated", "created", "type", "data", "event_id", "GPU", "ab" * 32]),
)
values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(
        st.sampled_from(["type", "data", "event_id", "block_hashes", "token_ids", "block_size",
                         "parent_block_hash", "parent_hash", "blocks", "tokens", "medium", "x"])
        | st.text(max_size=6), inner, max_size=6),
    max_leaves=12,
)


@SETTINGS
@given(st.one_of(values, st.tuples(st.floats() | st.integers(-(2**63), 2**64 - 1), st.lists(values, max_size=8),
                                   st.none() | st.integers(-2, 5)).map(list)))
def test_random_msgpack_never_raises(obj: Any):
    check(frames_for(enc(obj)))


# ---------------------------------------------------------------------------------------------
# 2. Structure-aware: valid templates of the three dialects with random edits at random paths
# ---------------------------------------------------------------------------------------------

TOKEN = {"type": "unique_token", "token_id": 7, "token_extra_id": 0}
TEMPLATES: list[Any] = [
    {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [2231, 0]}},
    {"event_id": 1, "window_size": 64, "data": {"type": "stored", "parent_hash": None, "blocks": [
        {"type": "stored_block", "block_hash": 9622824665191806685, "tokens": [TOKEN, TOKEN],
         "cache_level": 0, "priority": 35, "cache_salt": None, "mm_keys": []}]}},
    {"event_id": 2, "attention_dp_rank": 1, "data": {"type": "removed", "block_hashes": [1, 2**64 - 1]}},
    {"event_id": 3, "data": {"type": "updated", "block_hash": 5,
                             "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0}}},
    {"event_id": 4, "hash_algo": "v2_sha256", "data": {"type": "removed", "block_hashes": ["ab" * 32]}},
    {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
     "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None,
     "extra_keys": [["tenant-A"], None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
    {"type": "BlockRemoved", "block_hashes": [bytes(32)], "medium": "GPU", "group_idx": 0},
    {"type": "AllBlocksCleared"},
    ["BlockStored", [-1], 3, [1, 2], 2, None, "CPU", None, None, 0],
    ["BlockRemoved", [1, 2], "GPU"],
    ["AllBlocksCleared"],
]


def _paths(obj: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(obj, dict):
        for key, value in obj.items():
            out += _paths(value, (*path, key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            out += _paths(value, (*path, i))
    return out


def _edit(obj: Any, path: tuple, action: str, value: Any) -> Any:
    if not path:
        return value if action == "replace" else obj
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if action == "replace":
        parent[key] = value
    elif action == "delete":
        del parent[key]
    elif isinstance(parent[key], list):
        parent[key].append(value)
    elif isinstance(parent[key], dict):
        parent[key]["type" if isinstance(value, str) else "extra"] = value
    return obj


@st.composite
def edited_events(draw: st.DrawFn) -> Any:
    event = copy.deepcopy(draw(st.sampled_from(TEMPLATES)))
    for _ in range(draw(st.integers(0, 3))):
        path = draw(st.sampled_from(_paths(event)))
        action = draw(st.sampled_from(["replace", "delete", "append"]))
        event = _edit(event, path, action, draw(values))
    return event


@settings(SETTINGS, max_examples=300)  # slow to generate; the seeded loop below does the volume
@given(st.lists(edited_events(), max_size=6), st.none() | st.integers(0, 3))
def test_edited_templates_are_accounted_for(events: list[Any], rank: int | None):
    out = check(frames_for(enc([1.0, events] if rank is None else [1.0, events, rank])))
    assert isinstance(out, ReceivedBatch) and not [d for d in out.dead_letters if d.batch_index is None]


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 2 else 7)
    leaf = [None, rng.random() < 0.5, rng.randint(-(2**63), 2**64 - 1), rng.randint(-3, 40),
            rng.choice(["BlockStored", "stored", "GPU", "x", "ab" * 32]), rng.randbytes(rng.choice([0, 31, 32])),
            rng.random() * 1e20]
    if kind < 7:
        return leaf[kind]
    items = [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return items if kind == 7 else {rng.choice(["type", "data", "event_id", "tokens", "x"]): v for v in items}


def test_randomly_edited_templates_are_accounted_for():
    rng = random.Random(99)
    for _ in range(4200):
        events = []
        for _ in range(rng.randint(1, 6)):
            event = copy.deepcopy(rng.choice(TEMPLATES))
            for _ in range(rng.randint(0, 3)):
                path = rng.choice(_paths(event))
                event = _edit(event, path, rng.choice(["replace", "delete", "append"]), _random_value(rng))
            events.append(event)
        out = check(frames_for(enc([1.0, events, 0])))
        assert not [d for d in out.dead_letters if d.batch_index is None]


def test_unedited_templates_all_decode():
    out = check(frames_for(enc([1.0, TEMPLATES, 0])))
    assert out.dead_letters == [] and len(out.events) == len(TEMPLATES)


# ---------------------------------------------------------------------------------------------
# 3. Byte mutations of recorded payloads; 4. random frames
# ---------------------------------------------------------------------------------------------


def _recorded_payloads() -> list[bytes]:
    base = shared_dir() / FIXTURES
    out = [m.frames[2] for name in ("live.frames.bin", "replay_run1_dealer_from0.frames.bin")
           for m in read_capture(base / name) if len(m.frames) == 3 and m.frames[1] != SEQ_END_MARKER]
    return out + [enc([1.0, TEMPLATES, 0])]


def _mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        at = rng.randrange(len(buf) + 1)
        if op == 0 and buf:
            buf[min(at, len(buf) - 1)] = rng.randrange(256)
        elif op == 1:
            buf[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
        elif op == 2:
            del buf[at:at + rng.randint(1, 16)]
        elif op == 3:
            buf = buf[:at]
        else:  # msgpack type bytes where they hurt most
            buf[at:at] = bytes([rng.choice([0xC0, 0xC2, 0xC3, 0xCF, 0xD3, 0xDC, 0xDE, 0xC4, 0x90, 0x80])])
    return bytes(buf)


def test_mutated_recorded_payloads_never_raise():
    rng = random.Random(20261129)
    payloads = _recorded_payloads()
    kept = 0
    for _ in range(3000):
        out = check(frames_for(_mutate(rng, rng.choice(payloads))))
        kept += isinstance(out, ReceivedBatch) and bool(out.events)
    assert kept > 100  # mutations often leave most events decodable: isolation is exercised


def test_random_frames_never_raise():
    rng = random.Random(7)
    for _ in range(2000):
        count = rng.choice([0, 1, 2, 3, 3, 3, 3, 4, 5])
        frames = [rng.randbytes(rng.choice([0, 1, 7, 8, 8, 9, 40])) for _ in range(count)]
        if count == 3 and rng.random() < 0.5:
            frames[2] = bytes([rng.choice([0x92, 0x93, 0x94])]) + rng.randbytes(rng.randrange(60))
        check(frames)
