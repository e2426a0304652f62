"""Where the consumer's CPU goes per block event, in one process: wire decode, the writer
process's request encode/decode, and the recorder's transaction split into SQLite calls and our
Python; then the floor, bare sqlite3 on the ``blocks`` table alone.

Stream: ``tools/bench_consume.make_stream`` (vLLM map dialect, 8 events × 16 blocks per message,
half stored / half removed, a 65,536-block cache evicting in LRU order), passed twice (the second
pass in the cache's steady state), ``--messages-per-txn`` messages per transaction, through
``ledger.sqlite_writer.SQLiteWriterConnection`` (what the writer process runs) on a fresh SQLite
ledger. CPU time (``time.process_time``) around each stage and each driver call. Run it from the
tree to measure (``cd TREE && python /path/to/tools/bench_consume_parts.py``: ``sys.path`` starts
with the working directory), the trees in turn: the machine is shared.

The floor (``--raw``): bare ``sqlite3``, the ``blocks`` table's columns and primary key WITHOUT
ROWID as ``ledger.schema`` declares it, ``--live`` rows, then transactions of 512 sorted DELETEs of
the oldest and 512 sorted INSERTs of new random-hash rows (WAL, synchronous=NORMAL, 64 MiB cache).

Usage: ``python tools/bench_consume_parts.py [--messages 2000] [--messages-per-txn 8] [--raw]``
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.getcwd())


def timed(spent: Counter[str], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        started = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.process_time() - started
    return call


def parts(messages: int, per_txn: int) -> None:
    from sqlalchemy.engine.default import DefaultDialect

    from consumer.wire import decode_message, encode_frames
    from ledger import db as ledger_db
    from ledger.migrate import upgrade
    from ledger.sqlite_writer import LedgerFiles, SQLiteWriterConnection
    from ledger.writer_process import _tune_gc, decode_append, encode_append
    from tools.bench_consume import make_stream

    spent: Counter[str] = Counter()
    sql_parts: Counter[str] = Counter()
    ledger_db.Sql.many_positional = timed(sql_parts, "SQLite executemany (INSERT/DELETE)", ledger_db.Sql.many_positional)
    ledger_db.Sql.all = timed(sql_parts, "SQLite SELECT (block loads)", ledger_db.Sql.all)
    ledger_db.Sql.one = timed(sql_parts, "SQLite SELECT one (engine, source, max seq)", ledger_db.Sql.one)
    DefaultDialect.do_commit = timed(sql_parts, "SQLite COMMIT", DefaultDialect.do_commit)
    LedgerFiles.check = timed(sql_parts, "ledger file checks", LedgerFiles.check)
    payloads = make_stream(messages, 8, 16, cache_blocks=65_536)
    db = f"sqlite:///{tempfile.mkdtemp()}/parts.db"
    upgrade(db)
    writer = SQLiteWriterConnection(db)
    writer.connect()
    _tune_gc()  # as the writer process does
    for n in range(2):
        for start in range(0, messages, per_txn):
            frames = [encode_frames(b"kv", n * messages + s, payloads[s]) for s in range(start, start + per_txn)]
            items = timed(spent, "wire decode", lambda: [decode_message(f, source_id="b", engine_id="bench",
                                                                        received_at=0.0) for f in frames])()
            data = timed(spent, "writer request encode", encode_append)(items, None)
            decoded, now = timed(spent, "writer request decode", decode_append)(data)
            timed(spent, "recorder transaction", writer.append)(decoded, now)
    writer.close()
    block_events = 2 * messages * 8 * 16
    for name, seconds in sql_parts.most_common():
        print(f"{1e6 * seconds / block_events:6.2f} µs/block event  {name}")
    python = spent["recorder transaction"] - sum(sql_parts.values())
    print(f"{1e6 * python / block_events:6.2f} µs/block event  recorder Python (decide, apply, rows, glue)")
    for name in ("wire decode", "writer request encode", "writer request decode"):
        print(f"{1e6 * spent[name] / block_events:6.2f} µs/block event  {name}")
    print(f"{1e6 * sum(spent.values()) / block_events:6.2f} µs/block event  total")


def raw_floor(live: int, per_txn: int = 512, transactions: int = 200) -> None:
    path = tempfile.mktemp(suffix=".db")
    conn = sqlite3.connect(path, isolation_level=None)
    for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "cache_size=-65536"):
        conn.execute(f"PRAGMA {pragma}")
    conn.execute("CREATE TABLE blocks (engine_id TEXT, attention_dp_rank INT, window_size INT, block_hash INT, "
                 "block_hash_ext BLOB, parent_hash INT, parent_hash_ext BLOB, num_tokens INT, tokens_digest INT, "
                 "cache_level INT, priority INT, cache_salt TEXT, lora_id INT, state TEXT, generation INT, "
                 "store_count INT, stored_seq INT, updated_seq INT, PRIMARY KEY (engine_id, attention_dp_rank, "
                 "window_size, block_hash, block_hash_ext)) WITHOUT ROWID")

    def h(i: int) -> int:
        return (i * 0x9E3779B97F4A7C15) % 2**64 - 2**63

    def row(i: int) -> tuple:
        return ("bench", 0, 0, h(i), b"", h(i - 1), None, 16, h(i + 7), 0, None, None, None, "live", 1, 1, i, i)

    insert = "INSERT INTO blocks VALUES (" + ",".join("?" * 18) + ")"
    conn.execute("BEGIN")
    conn.executemany(insert, [row(i) for i in range(live)])
    conn.execute("COMMIT")
    spent: Counter[str] = Counter()
    for t in range(transactions):
        first = live + t * per_txn
        rows = sorted(row(i) for i in range(first, first + per_txn))
        keys = sorted(("bench", 0, 0, h(i), b"") for i in range(first - live, first - live + per_txn))
        conn.execute("BEGIN IMMEDIATE")
        timed(spent, "DELETE", conn.executemany)(
            "DELETE FROM blocks WHERE engine_id=? AND attention_dp_rank=? AND window_size=? AND block_hash=? "
            "AND block_hash_ext=? AND state='live'", keys)
        timed(spent, "INSERT", conn.executemany)(insert, rows)
        timed(spent, "COMMIT", conn.execute)("COMMIT")
    conn.close()
    os.unlink(path)
    n = transactions * per_txn
    print(f"raw blocks table, {live:,} live rows: INSERT {1e6 * spent['INSERT'] / n:.2f} µs/row, DELETE "
          f"{1e6 * spent['DELETE'] / n:.2f} µs/row, COMMIT {1e6 * spent['COMMIT'] / (2 * n):.2f} µs/block event; "
          f"{1e6 * sum(spent.values()) / (2 * n):.2f} µs per block event in all")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=2000, help="messages of 128 block events (> 512)")
    parser.add_argument("--messages-per-txn", type=int, default=8)
    parser.add_argument("--raw", action="store_true", help="also the bare sqlite3 floor of the blocks table")
    parser.add_argument("--live", type=int, default=65_536, help="live rows of the raw floor")
    args = parser.parse_args()
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    parts(args.messages, args.messages_per_txn)
    if args.raw:
        raw_floor(args.live)
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
