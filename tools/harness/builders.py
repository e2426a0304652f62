"""Small constructors for ledger inputs (normalized events, batches), for the tests and
``tools/bench_ledger.py``."""

from __future__ import annotations

import itertools

import msgspec
import xxhash

from ledger import events as ev

_digests = itertools.count(1)


def block(block_hash: ev.BlockHash, num_tokens: int = 4, **fields) -> ev.StoredBlock:
    return ev.StoredBlock(block_hash=block_hash, num_tokens=num_tokens, tokens_digest=num_tokens, **fields)


def stored(*hashes: ev.BlockHash, parent: ev.BlockHash | None = None, event_id: int | None = None,
           type_name: str = "stored", window_size: int = 0, dp_rank: int = 0, **fields) -> ev.EngineEvent:
    body = ev.BlockStored(parent_hash=parent, blocks=[block(h, **fields) for h in hashes])
    return _event(body, type_name, event_id, window_size, dp_rank)


def removed(*hashes: ev.BlockHash, event_id: int | None = None, type_name: str = "removed", **kw) -> ev.EngineEvent:
    return _event(ev.BlockRemoved(block_hashes=list(hashes)), type_name, event_id, **kw)


def updated(block_hash: ev.BlockHash, *, cache_level: tuple[int, int] | None = None,
            priority: tuple[int, int] | None = None, event_id: int | None = None, **kw) -> ev.EngineEvent:
    body = ev.BlockUpdated(block_hash=block_hash,
                           cache_level=ev.LevelDiff(*cache_level) if cache_level else None,
                           priority=ev.LevelDiff(*priority) if priority else None)
    return _event(body, "updated", event_id, **kw)


def created(event_id: int | None = 0, **kw) -> ev.EngineEvent:
    return _event(ev.EngineCreated(num_blocks_per_cache_level=[100, 0]), "created", event_id, **kw)


def cleared(**kw) -> ev.EngineEvent:
    return _event(ev.AllBlocksCleared(), "AllBlocksCleared", None, **kw)


def _event(body, type_name: str, event_id: int | None, window_size: int = 0, dp_rank: int = 0) -> ev.EngineEvent:
    raw = msgspec.msgpack.encode({"type": type_name, "event_id": event_id, "n": next(_digests)})
    return ev.EngineEvent(body=body, type_name=type_name, raw=raw, event_id=event_id, window_size=window_size,
                          attention_dp_rank=dp_rank)


def batch(seq: int, *events: ev.EngineEvent, engine_id: str = "engine-a", source_id: str | None = None,
          ts: float = 1.0, digest: int | None = None) -> ev.ReceivedBatch:
    """A received batch; the digest covers the events' raw bytes unless given."""
    if digest is None:
        digest = xxhash.xxh3_64_intdigest(b"".join(e.raw for e in events) + seq.to_bytes(8, "big"))
    return ev.ReceivedBatch(source_id=source_id or f"{engine_id}@tcp://127.0.0.1:5557", engine_id=engine_id,
                            seq=seq, ts=ts, digest=digest, events=list(events))


def record(db: str, *transactions: list[ev.ReceivedBatch]) -> None:
    """Append batches to the ledger at ``db`` through the real writer, one ledger transaction per
    argument (a list of batches)."""
    import asyncio

    from ledger.writer import LedgerWriter

    async def run() -> None:
        writer = await LedgerWriter.open(db)
        try:
            for batches in transactions:
                await writer.append(batches)
        finally:
            await writer.close()

    asyncio.run(run())


def downgrade(db: str, revision: str) -> None:
    """Take the ledger at ``db`` down to schema ``revision`` (Alembic's downgrade, in one
    transaction): a ledger as an earlier version left it, for migration tests."""
    from alembic import command

    from ledger.db import sync_engine
    from ledger.migrate import alembic_config

    engine = sync_engine(db, writer=True)
    try:
        with engine.begin() as conn:
            config = alembic_config()
            config.attributes["connection"] = conn
            command.downgrade(config, revision)
    finally:
        engine.dispose()
