"""apply's per-block loops inline the u64 → i64 storage conversion for speed: the keys and digests
they store must be exactly ``ledger.types``' conversion, at its boundaries and for wide hashes."""

from ledger import events as ev
from ledger.apply import LogEntry, Projection, apply
from ledger.types import BlockKey, split_hash, u64_to_i64

HASHES = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, bytes(range(32))]
DIGESTS = [0, 2**63 - 1, 2**63, 2**64 - 1, 5, 2**64 - 2]


def _entry(seq: int, body: ev.AnyBody) -> LogEntry:
    return LogEntry(seq=seq, committed_at=0.0, body=body, type_name=ev.kind_of(body), engine_id="e",
                    attention_dp_rank=1, window_size=0, event_id=seq)


def test_stored_and_removed_blocks_use_the_one_conversion() -> None:
    proj = Projection()
    apply(proj, _entry(1, ev.EngineRegistered(engine_id="e", generation=1)))
    blocks = [ev.StoredBlock(h, 32, d) for h, d in zip(HASHES, DIGESTS, strict=True)]
    apply(proj, _entry(2, ev.BlockStored(parent_hash=None, blocks=blocks)))
    expected = {BlockKey("e", 1, 0, *split_hash(h)): u64_to_i64(d) for h, d in zip(HASHES, DIGESTS, strict=True)}
    assert {key: row.tokens_digest for key, row in proj.blocks.items()} == expected
    parents = [row.parent_hash for row in proj.blocks.values()]
    assert parents == [None] + [split_hash(h)[0] for h in HASHES[:-1]]
    apply(proj, _entry(3, ev.BlockRemoved(block_hashes=HASHES)))
    assert proj.blocks == {} and proj.counters[("e", "blocks_removed")] == len(HASHES)
