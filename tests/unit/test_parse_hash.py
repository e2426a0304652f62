"""Block hashes as operators type them (``semkv-ledger inspect block HASH``)."""

from __future__ import annotations

import pytest

from ledger.types import format_hash, parse_hash

WIDE = bytes(range(32))


@pytest.mark.parametrize(("text", "expected"), [
    ("5", 5), ("0x10", 16), ("0X10", 16), (str(2**64 - 7), 2**64 - 7), ("-7", 2**64 - 7),
    (WIDE.hex(), WIDE), (WIDE.hex().upper(), WIDE), ("0x" + WIDE.hex(), WIDE), ("0X" + WIDE.hex().upper(), WIDE),
    (f"  {WIDE.hex()}  ", WIDE), ("0123", 123), ("-0", 0),
])
def test_every_notation_of_a_hash_parses_to_it(text: str, expected) -> None:
    assert parse_hash(text) == expected


@pytest.mark.parametrize("value", [0, 5, 2**63, 2**64 - 1, WIDE])
def test_format_hash_output_parses_back(value) -> None:
    assert parse_hash(format_hash(value)) == value


@pytest.mark.parametrize("text", ["zzz", "", "0x", str(2**64), "0x" + "g" * 64, "0x" + WIDE.hex() + "00",
                                  # what Python's int(text, 0) took besides the notations above
                                  "+5", "1_000", "0b101", "0o17", "-0x5", "\u0663", "0x" + "a" * 62])
def test_anything_else_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        parse_hash(text)
