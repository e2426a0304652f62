"""What the decoder refuses for its size (issue 18): every integer at every boundary in every
dialect, values no ledger column holds, events nested too deeply for msgspec, messages over the
per-message limits; and what it keeps (``lora_name``)."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import pytest

from consumer.wire import WireLimits, decode_message, encode_frames
from ledger.events import BlockStored, ReceivedBatch
from ledger.types import DeadLetterReason as R
from tests.wire_fields import BOUNDARIES, FIELDS, Field, batch_of, good_event

enc = msgspec.msgpack.encode
HASH_FIELDS = {"block_hash", "parent_hash", "parent_block_hash", "removed_hash"}


def decode(events: list[Any], rank: int | None = 0, limits: WireLimits = WireLimits()) -> ReceivedBatch:
    out = decode_message(encode_frames(b"kv", 3, enc([1.5, events, rank])), source_id="s", engine_id="e",
                         received_at=1.0, limits=limits)
    assert isinstance(out, ReceivedBatch)
    return out


@pytest.mark.parametrize(("field", "value"), list(itertools.product(FIELDS, BOUNDARIES)),
                         ids=lambda x: f"{x.dialect}-{x.name}" if isinstance(x, Field) else str(x))
def test_every_integer_at_every_boundary_is_accepted_or_a_dead_letter_alone(field: Field, value: int):
    events, rank = batch_of(field, value, good_event(field.dialect))
    out = decode(events, rank)
    if field.batch_level:
        if field.valid(value):
            assert (len(out.events), out.dead_letters) == (1, [])
        else:
            assert [d.reason for d in out.dead_letters] == [R.VALUE_OUT_OF_RANGE] and out.events == []
        return
    if field.valid(value) and not (field.structural and value != 4):
        assert out.dead_letters == [] and len(out.events) == 3
        return
    assert [d.batch_index for d in out.dead_letters] == [1]  # alone: both siblings were applied
    assert [e.batch_index for e in out.events] == [0, 2]
    expected = R.HASH_OUT_OF_RANGE if field.name in HASH_FIELDS else R.VALUE_OUT_OF_RANGE
    if field.structural and field.valid(value):
        expected = R.SCHEMA_MISMATCH  # fits the column, but 4 token ids are not blocks of that size
    assert out.dead_letters[0].reason == expected, out.dead_letters[0].detail


def _salted(dialect: str, salt: str) -> dict:
    if dialect == "a":
        return {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": [
            {"type": "stored_block", "block_hash": 1, "tokens": [{"token_id": 1}], "cache_salt": salt}]}}
    return {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1],
            "block_size": 1, "extra_keys": [[salt]]}


@pytest.mark.parametrize("dialect", ["a", "b"])
def test_a_cache_salt_longer_than_its_column_is_a_dead_letter(dialect: str):
    assert [d.reason for d in decode([_salted(dialect, "s" * 401)]).dead_letters] == [R.VALUE_OUT_OF_RANGE]
    kept = decode([_salted(dialect, "s" * 400)])
    assert kept.dead_letters == [] and kept.events[0].body.blocks[0].cache_salt == "s" * 400


def test_an_event_nested_deeper_than_msgspec_recurses_is_a_dead_letter_alone():
    good = good_event("b")
    deep = b"\x91" * 5000 + b"\x01"
    payload = b"\x93" + enc(1.5) + b"\x93" + enc(good) + deep + enc(good) + enc(0)
    out = decode_message(encode_frames(b"kv", 3, payload), source_id="s", engine_id="e", received_at=1.0)
    assert isinstance(out, ReceivedBatch)
    assert [e.batch_index for e in out.events] == [0, 2]
    assert [(d.batch_index, d.reason) for d in out.dead_letters] == [(1, R.MALFORMED_MSGPACK)]
    assert out.dead_letters[0].raw == deep


def test_a_payload_that_is_not_msgpack_after_a_deep_event_is_still_one_dead_letter():
    payload = b"\x93" + enc(1.5) + b"\x92" + b"\x91" * 5000 + b"\x01" + b"\xc1"
    out = decode_message(encode_frames(b"kv", 3, payload), source_id="s", engine_id="e", received_at=1.0)
    assert [d.reason for d in out.dead_letters] == [R.MALFORMED_MSGPACK] and out.events == []


def _stored_map(blocks: int, block_size: int = 2) -> dict:
    return {"type": "BlockStored", "block_hashes": list(range(1, blocks + 1)), "parent_block_hash": None,
            "token_ids": [7] * (blocks * block_size), "block_size": block_size}


@pytest.mark.parametrize(("events", "limits", "what"), [
    ([good_event("b")] * 5, WireLimits(max_events_per_message=4), "4 events"),
    ([_stored_map(3), _stored_map(3)], WireLimits(max_blocks_per_message=5), "5 blocks"),
    ([_stored_map(2, 8), _stored_map(2, 8)], WireLimits(max_tokens_per_message=31), "31 tokens"),
    # one event over 64 KiB: counted from its headers before it is decoded
    ([_stored_map(40_000, 1)], WireLimits(max_blocks_per_message=39_999), "39999 blocks"),
    ([_stored_map(1, 70_000)], WireLimits(max_tokens_per_message=69_999), "69999 tokens"),
    ([["BlockStored", list(range(1, 40_001)), None, [7] * 40_000, 1]], WireLimits(max_blocks_per_message=39_999),
     "39999 blocks"),
])
def test_a_message_over_a_limit_is_one_dead_letter_that_keeps_its_head(events, limits, what):
    payload = enc([1.5, events, 0])
    out = decode_message(encode_frames(b"kv", 3, payload), source_id="s", engine_id="e", received_at=1.0,
                         limits=limits)
    assert isinstance(out, ReceivedBatch) and out.events == []
    letter, = out.dead_letters
    assert letter.reason == R.MESSAGE_OVER_LIMIT and what.split()[0] in letter.detail, letter.detail
    assert letter.raw == payload[:limits.oversized_keep_bytes] and letter.batch_index is None
    fits = decode_message(encode_frames(b"kv", 3, payload), source_id="s", engine_id="e", received_at=1.0)
    assert fits.dead_letters == [] and len(fits.events) == len(events)  # the defaults let it through


def test_a_dialect_a_event_over_64_kib_is_counted_before_it_is_decoded():
    tokens = [{"token_id": 1}] * 20_000  # ~300 KiB in one event
    event = {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": [
        {"type": "stored_block", "block_hash": 1, "tokens": tokens}]}}
    out = decode([event], limits=WireLimits(max_tokens_per_message=19_999))
    assert [d.reason for d in out.dead_letters] == [R.MESSAGE_OVER_LIMIT]


def test_vllm_lora_name_is_kept_in_the_normalized_event():
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1],
             "block_size": 1, "lora_id": 3, "lora_name": "sql-adapter"}
    body = decode([event]).events[0].body
    assert isinstance(body, BlockStored) and (body.lora_id, body.lora_name) == (3, "sql-adapter")
