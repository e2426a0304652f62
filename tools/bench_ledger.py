"""Ledger writer benchmark (issue: event-sourced donor ledger; targets in DESIGN §7).

Measures, in one run and side by side:

* the apply rate of :class:`ledger.writer.LedgerWriter` (decode already done: normalized
  ``ReceivedBatch`` objects in, committed log rows + projections out) on SQLite and PostgreSQL,
  at 1, 64 and 1024 engine events per transaction;
* on SQLite, the writer (the sync recorder on its one dedicated pysqlite thread: one thread hop
  per transaction) against the writer it replaced (SQLAlchemy AsyncEngine + aiosqlite, the
  recorder under ``run_sync``: aiosqlite hops to its own thread once per statement), kept here
  as ``run_aiosqlite`` so that the two stay comparable side by side;
* a raw ``sqlite3.executemany`` of the same log rows into a bare table, same batch sizes, same
  synchronous=NORMAL/WAL settings (the ceiling: no decisions, no projections);
* the replay rate (``semkv-ledger replay`` rebuild, events/s).

Workload: a store/evict cycle like a serving engine: each event is a ``stored`` of a 4-block chain
or a ``removed`` of 4 earlier blocks (so 4 block events per engine event).

The machine is shared and noisy (2 CPUs): raw sqlite3 and each SQLite writer variant run ``--repeats``
times, interleaved in the same rounds, and the best rate of each is reported (so writer / raw is a
ratio of bests).

Usage: ``python tools/bench_ledger.py [--events 40000] [--repeats 2] [--no-postgres] [--out FILE]``;
prints a table and writes it to ``--out`` (default ``tools/results/ledger-YYYY-MM-DD.md``, overwritten).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ledger import recorder  # noqa: E402
from ledger.migrate import upgrade  # noqa: E402
from ledger.recorder import log_row  # noqa: E402
from ledger.replay import replay  # noqa: E402
from ledger.writer import LedgerWriter  # noqa: E402
from tools.harness.builders import batch, removed, stored  # noqa: E402

BLOCKS_PER_EVENT = 4


def make_batches(num_events: int, events_per_batch: int, engine_id: str = "bench-engine") -> list:
    """Batches of engine events, ``events_per_batch`` each, alternating store and evict."""
    events, next_hash, live = [], 1, []
    for i in range(num_events):
        if i % 2 == 0 or not live:
            hashes = list(range(next_hash, next_hash + BLOCKS_PER_EVENT))
            next_hash += BLOCKS_PER_EVENT
            live.append(hashes)
            events.append(stored(*[h * 0x9E3779B97F4A7C15 % 2**64 for h in hashes], event_id=i))
        else:
            hashes = live.pop(0)
            events.append(removed(*[h * 0x9E3779B97F4A7C15 % 2**64 for h in hashes], event_id=i))
    return [batch(seq, *events[start:start + events_per_batch], engine_id=engine_id)
            for seq, start in enumerate(range(0, num_events, events_per_batch))]


async def run_writer(db: str, batches: list) -> float:
    writer = await LedgerWriter.open(db)
    try:
        started = time.perf_counter()
        for b in batches:
            await writer.append([b])
        return time.perf_counter() - started
    finally:
        await writer.close()


async def run_aiosqlite(db: str, batches: list) -> float:
    """The same transactions through the writer's previous SQLite path: AsyncEngine on aiosqlite,
    ``recorder.append`` under ``run_sync`` (what ``LedgerWriter`` did before 2026-11-29)."""
    from ledger.db import async_engine

    engine = async_engine(db)
    try:
        started = time.perf_counter()
        for b in batches:
            async with engine.begin() as conn:
                await conn.run_sync(recorder.append, [b])
        return time.perf_counter() - started
    finally:
        await engine.dispose()


def run_raw_sqlite(path: Path, batches: list) -> float:
    """The same log rows through plain sqlite3.executemany (no decisions, no projections)."""
    from ledger.apply import LogEntry

    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("CREATE TABLE log (seq INTEGER PRIMARY KEY, committed_at REAL, kind TEXT, type_name TEXT, "
                 "engine_id TEXT, source_id TEXT, source_epoch INT, zmq_seq INT, batch_index INT, event_id INT, "
                 "attention_dp_rank INT, window_size INT, applied INT, body BLOB, payload BLOB, "
                 "UNIQUE (source_id, source_epoch, zmq_seq, batch_index))")
    rows_per_batch = []
    seq = 0
    for b in batches:  # build rows outside the timed loop
        rows = []
        for index, event in enumerate(b.events):
            seq += 1
            entry = LogEntry(seq=seq, committed_at=0.0, body=event.body, type_name=event.type_name,
                             engine_id=b.engine_id, source_id=b.source_id, source_epoch=1, zmq_seq=b.seq,
                             batch_index=index, event_id=event.event_id, payload=event.raw)
            rows.append(log_row(entry))
        rows_per_batch.append(rows)
    started = time.perf_counter()
    for rows in rows_per_batch:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT INTO log VALUES (" + ",".join("?" * 15) + ")", rows)
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - started
    conn.close()
    return elapsed


def pg_scratch() -> tuple[str, callable] | None:
    try:
        from tools.harness.postgres import create_pg_database, drop_pg_database

        url = create_pg_database()
        return url, lambda: drop_pg_database(url)
    except Exception as exc:  # noqa: BLE001 - the table says why PostgreSQL was skipped
        print(f"PostgreSQL skipped: {exc}", file=sys.stderr)
        return None


def sqlite_writer(tmp: Path, name: str, batches: list, aiosqlite: bool) -> tuple[float, str]:
    db = f"sqlite:///{tmp / name}"
    upgrade(db)
    return asyncio.run(run_aiosqlite(db, batches) if aiosqlite else run_writer(db, batches)), db


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=40_000, help="engine events per run (×4 block events)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per SQLite writer variant (best kept)")
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / f"ledger-{dt.date.today()}.md",
                        help="where the table goes (overwritten)")
    args = parser.parse_args()
    lines = [f"# Ledger apply and replay rates — {dt.date.today().isoformat()}", "",
             f"Machine: {os.cpu_count()} CPUs. {args.events} engine events per run, {BLOCKS_PER_EVENT} blocks each "
             "(store/evict alternating). Rates in block events/s (engine events/s in brackets); raw sqlite3 and the "
             f"SQLite writers: best of {args.repeats} interleaved runs each. Load average (1/5/15 min) "
             f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at the start.", "",
             "| events/txn | raw sqlite3 executemany | writer SQLite (dedicated thread) | previous writer (aiosqlite) "
             "| thread / aiosqlite | writer / raw | writer PostgreSQL (asyncpg) | replay (SQLite log) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for per_txn in (1, 64, 1024):
        n = min(args.events, 4000) if per_txn == 1 else args.events
        batches = make_batches(n, per_txn)
        block_events = n * BLOCKS_PER_EVENT
        with tempfile.TemporaryDirectory() as tmp:
            raws, written, aio = [], [], []
            for rep in range(args.repeats):  # interleaved; the order alternates so none always goes first
                # raw is best of --repeats too, in the same rounds: a ratio of the writer's best to one
                # raw run read the machine's noise as the writer's speed (0.29-0.55 on the same code)
                raws.append(run_raw_sqlite(Path(tmp) / f"raw-{rep}.db", batches))
                for use_aio in ((False, True) if rep % 2 == 0 else (True, False)):
                    seconds, name = sqlite_writer(Path(tmp), f"{'aio' if use_aio else 'writer'}-{rep}.db", batches,
                                                  aiosqlite=use_aio)
                    (aio if use_aio else written).append(seconds)
                    if not use_aio:
                        db = name  # replayed below
            raw_s, writer_s, aio_s = min(raws), min(written), min(aio)
            report = replay(db)
            assert report.equal
            replay_rate = report.events_per_second
        pg_rate = "skipped"
        scratch = None if args.no_postgres else pg_scratch()
        if scratch is not None:
            url, drop = scratch
            try:
                upgrade(url)
                pg_s = asyncio.run(run_writer(url, batches))
                pg_rate = f"{block_events / pg_s:,.0f} ({n / pg_s:,.0f})"
            finally:
                drop()
        row = (f"| {per_txn} | {block_events / raw_s:,.0f} ({n / raw_s:,.0f}) | {block_events / writer_s:,.0f} "
               f"({n / writer_s:,.0f}) | {block_events / aio_s:,.0f} ({n / aio_s:,.0f}) | {aio_s / writer_s:.2f} "
               f"| {raw_s / writer_s:.2f} | {pg_rate} | {replay_rate:,.0f} log rows/s |")
        print(row, flush=True)
        lines.append(row)
    lines += ["", f"Load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}.", "",
              "Raw sqlite3 inserts only the log rows; the writer also decides continuity, applies every event to",
              "the projections (blocks, streams, counters) and commits both in one transaction. Replay rate counts",
              "log rows (engine events plus batch and decision rows) rebuilt per second, excluding the diff."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
