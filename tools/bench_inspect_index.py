"""``inspect block`` from the block index (ledger/block_index.py) on a large ledger, and what the index's
follower costs the writer, measured in one run.

1. Before: ``semkv-ledger inspect block HASH --json`` of the tree at ``--baseline REV`` (``git
   archive``; it searches the whole log) on ``--ledger`` (a SQLite ledger at REV's schema, built
   like tools/bench_replay.py's if missing, at ``--baseline-schema``), wall time and peak RSS of each fresh process
   (``/usr/bin/time``), and its ``block_history`` in process (first call and the best of 3).
2. The ledger copied, ``semkv-ledger migrate`` (0006: the empty index), ``semkv-ledger index``
   (the whole log indexed: wall, peak RSS, seconds holding the write lock).
3. After: the same commands and calls of this tree with the index complete, and with it
   ``--partial-seqs`` behind the head, and empty (watermark 0) (a follower one window behind: the tail searched).
4. The writer (:class:`ledger.writer.LedgerWriter`, the recorder on its one thread, ``--writer-events``
   engine events × 4 blocks, 1,024 per transaction, a new SQLite ledger per round) without a
   follower and with ``semkv-ledger index --follow`` running beside it in its own process, as the
   consumer's follower (quiet-first: ``--max-lag-seqs 100000``) and indexing whenever behind
   (``--max-lag-seqs 0``), order reversed every round, ``--repeats`` rounds each: block events/s of wall time and of the
   writer process's CPU time, the follower's lag when the writer ended and its catch-up after.

Usage: ``python tools/bench_inspect_index.py --ledger /tmp/ledger-2m7.db [--baseline main]
[--writer-events 200000] [--repeats 2] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ledger.block_index import index_state  # noqa: E402
from ledger.db import sync_engine  # noqa: E402
from ledger.migrate import upgrade  # noqa: E402
from tools.bench_ledger import BLOCKS_PER_EVENT, make_batches, run_writer  # noqa: E402
from tools.bench_replay import export_tree  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIRST = 0x9E3779B97F4A7C15 % 2**64  # make_batches' first block hash
NEVER = 0x1234_5678_9ABC_DEF0  # no event names it

IN_PROCESS = """
import json, resource, sys, time
sys.path.insert(0, '.')
from ledger.db import sync_engine
from ledger.stats import block_history
engine = sync_engine(sys.argv[1])
out = {}
with engine.connect() as conn:
    for name, h in json.loads(sys.argv[2]).items():
        times, rows = [], 0
        for _ in range(3):
            t = time.perf_counter(); rows = len(block_history(conn, h, 200)); times.append(time.perf_counter() - t)
        out[name] = {"first_ms": times[0] * 1e3, "best_ms": min(times) * 1e3, "rows": rows}
out["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def now() -> str:
    return f"{dt.datetime.now(dt.timezone.utc):%H:%M:%S}"


def timed(cmd: list[str], cwd: Path) -> tuple[float, float, subprocess.CompletedProcess]:
    """(wall s, peak RSS MB, result) of ``cmd`` under /usr/bin/time."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as out:
        result = subprocess.run(["/usr/bin/time", "-o", out.name, "-f", "%e %M", *cmd], cwd=cwd, capture_output=True,
                                text=True)
        wall, rss_kb = out.read().split()[-2:]
    return float(wall), int(rss_kb) / 1024, result


PYTHON = {ROOT: sys.executable}
"""The interpreter that runs each tree (the baseline's: ``--baseline-python``)."""


def cli(tree: Path) -> list[str]:
    return [PYTHON[tree], "-m", "ledger"]


def inspect_rows(name: str, tree: Path, db: str, hashes: dict[str, int]) -> list[str]:
    """Table rows: each hash's ``inspect block --json`` in a fresh process, and the in-process calls."""
    lines = []
    for label, h in hashes.items():
        wall, rss, result = timed([*cli(tree), "inspect", "block", str(h), "--db", db, "--json"], tree)
        rows = len(json.loads(result.stdout)["rows"]) if result.returncode == 0 else 0
        lines.append(f"| {name} | `inspect block` {label} (CLI, fresh process) | {wall * 1e3:,.0f} ms | {rss:,.0f} MB "
                     f"| {rows} | {load()} |")
        print(lines[-1], flush=True)
    out = subprocess.run([PYTHON[tree], "-c", IN_PROCESS, db, json.dumps(hashes)], cwd=tree, check=True,
                         capture_output=True, text=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    for label in hashes:
        m = measured[label]
        lines.append(f"| {name} | `block_history` {label} (in process; first call / best of 3) | "
                     f"{m['first_ms']:,.1f} / {m['best_ms']:,.1f} ms | {measured['max_rss_mb']:,.0f} MB (whole process) "
                     f"| {m['rows']} | {load()} |")
        print(lines[-1], flush=True)
    return lines


def set_watermark(db: str, seq: int) -> None:
    engine = sync_engine(db, writer=True)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("UPDATE index_watermarks SET seq = ? WHERE name = 'block_index'", (seq,))
    finally:
        engine.dispose()


def state(db: str):
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            return index_state(conn)
    finally:
        engine.dispose()


FOLLOWERS = {"off": None, "on, indexing whenever behind": 0, "on, quiet-first (the default)": 100_000}
"""Writer variants: no follower, or ``index --follow`` with this ``--max-lag-seqs``."""


def writer_round(variant: str, events: int, tmp: Path, round_: int, *, postgres: bool = False) -> str:
    """One writer run on a new ledger (SQLite, or a scratch PostgreSQL database), with or without a
    follower process beside it."""
    from tools.harness.postgres import create_pg_database, drop_pg_database

    path = tmp / f"writer-{round_}-{len(variant)}.db"
    db = create_pg_database() if postgres else f"sqlite:///{path}"
    try:
        return _writer_round(variant, events, db, round_)
    finally:
        if postgres:
            drop_pg_database(db)
        else:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)


def _writer_round(variant: str, events: int, db: str, round_: int) -> str:
    max_lag = FOLLOWERS[variant]
    follow = max_lag is not None
    upgrade(db)
    batches = make_batches(events, 1024)
    follower = None
    if follow:
        follower = subprocess.Popen([*cli(ROOT), "index", "--db", db, "--follow",
                                     "--interval-s", "0.05", "--max-lag-seqs", str(max_lag), "--json"], cwd=ROOT,
                                    stdout=subprocess.PIPE, text=True)
        time.sleep(1.5)  # its start-up (imports) before the writer begins
    cpu = time.process_time()
    wall = asyncio.run(run_writer(db, batches))
    cpu = time.process_time() - cpu
    behind = state(db)
    caught = ""
    if follower is not None:
        started = time.perf_counter()
        while state(db).lag and time.perf_counter() - started < 120:
            time.sleep(0.05)
        caught_s = time.perf_counter() - started
        follower.send_signal(signal.SIGTERM)
        report = json.loads(follower.communicate(timeout=60)[0])
        caught = (f"lag {behind.lag:,} of {behind.head:,} seqs at the writer's end, caught up {caught_s:.1f} s later; "
                  f"{report['windows']} windows; write lock held {report['lock_seconds']:.1f} s, waited for "
                  f"{report['lock_wait_seconds']:.1f} s, given up {report['lock_busy']}×")
    blocks = events * BLOCKS_PER_EVENT
    line = (f"| {round_} | {variant} | {blocks:,} | {wall:.2f} | {blocks / wall:,.0f} | {cpu:.2f} "
            f"| {blocks / cpu:,.0f} | {caught or '—'} | {load()} |")
    print(line, flush=True)
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ledger", type=Path, required=True, help="SQLite ledger at the baseline's schema (built if missing)")
    parser.add_argument("--events", type=int, default=2_700_000, help="engine events when building (×4 blocks)")
    parser.add_argument("--baseline", default="main", metavar="REV")
    parser.add_argument("--work", type=Path, default=Path("/tmp/semkv-bench-inspect-index.db"),
                        help="the migrated and indexed copy (overwritten)")
    parser.add_argument("--baseline-python", default=sys.executable,
                        help="the interpreter for the baseline tree: one whose installed migrations are the "
                             "baseline's (an editable install of this tree maps ledger.migrations to this tree's)")
    parser.add_argument("--baseline-schema", default="0005", help="the schema revision a built --ledger gets")
    parser.add_argument("--partial-seqs", type=int, default=10_000)
    parser.add_argument("--writer-events", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-inspect", action="store_true", help="only the writer rounds")
    parser.add_argument("--postgres-repeats", type=int, default=0,
                        help="also the writer on a scratch PostgreSQL ledger (127.0.0.1:5432), off and indexing "
                             "whenever behind, this many rounds (CPU: the client's only)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lines = [f"Started {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC on {os.cpu_count()} CPUs, load average "
             f"{load()}; baseline {args.baseline}.", ""]
    with tempfile.TemporaryDirectory(prefix="semkv-bench-inspect-") as tmp_name:
        tmp = Path(tmp_name)
        if not args.skip_inspect:
            lines += inspect_part(args, tmp)
        lines += ["", "## The writer with the follower off and on (SQLite, 1,024 events per transaction)", "",
                  "| round | follower | block events | wall s | block events/s (wall) | writer CPU s "
                  "| block events/s (CPU) | follower | load average |", "|---:|---|---:|---:|---:|---:|---:|---|---|"]
        for round_ in range(1, args.repeats + 1):
            for variant in (list(FOLLOWERS) if round_ % 2 else list(FOLLOWERS)[::-1]):
                lines.append(writer_round(variant, args.writer_events, tmp, round_))
        if args.postgres_repeats:
            lines += ["", "## The writer with the follower off and on (PostgreSQL, 1,024 events per transaction)", "",
                      "| round | follower | block events | wall s | block events/s (wall) | client CPU s "
                      "| block events/s (client CPU) | follower | load average |",
                      "|---:|---|---:|---:|---:|---:|---:|---|---|"]
            variants = ["off", "on, indexing whenever behind"]
            for round_ in range(1, args.postgres_repeats + 1):
                for variant in (variants if round_ % 2 else variants[::-1]):
                    lines.append(writer_round(variant, args.writer_events, tmp, round_, postgres=True))
    lines += ["", f"Ended {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC, load average {load()}."]
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")


def inspect_part(args: argparse.Namespace, tmp: Path) -> list[str]:
    if not args.ledger.exists():  # at the baseline's schema, which it must read
        upgrade(f"sqlite:///{args.ledger}", args.baseline_schema)
        seconds = asyncio.run(run_writer(f"sqlite:///{args.ledger}", make_batches(args.events, 256)))
        print(f"built {args.ledger}: {args.events:,} events in {seconds:.1f} s", flush=True)
    baseline = export_tree(args.baseline, tmp)
    PYTHON[baseline] = args.baseline_python
    source = f"sqlite:///{args.ledger}"
    head = state_before(source)
    hashes = {"first block": FIRST, "a block near the head": last_stored(args.events), "a hash never seen": NEVER}
    lines = [f"## `inspect block` on {args.ledger.name}: {head:,} log rows, {args.ledger.stat().st_size / 2**30:.2f} GiB",
             "", "| tree | what | wall | peak RSS | rows | load average |", "|---|---|---:|---:|---:|---|"]
    wall, rss, _ = timed([*cli(ROOT), "--help"], ROOT)
    lines.append(f"| this tree | `semkv-ledger --help` (the CLI's start-up alone, a yardstick) | {wall * 1e3:,.0f} ms "
                 f"| {rss:,.0f} MB | — | {load()} |")
    lines += inspect_rows(f"before ({args.baseline}, log search)", baseline, source, hashes)
    shutil.copyfile(args.ledger, args.work)
    args.work.chmod(0o600)
    db = f"sqlite:///{args.work}"
    wall, rss, result = timed([*cli(ROOT), "migrate", "--db", db], ROOT)
    lines += ["", f"`semkv-ledger migrate` of the copy ({now()}): {wall:.1f} s, peak RSS {rss:,.0f} MB: "
              f"{result.stdout.strip() or result.stderr.strip()}"]
    wall, rss, result = timed([*cli(ROOT), "index", "--db", db, "--json"], ROOT)
    report = json.loads(result.stdout)
    lines += ["", f"`semkv-ledger index` of the whole log ({now()}, load {load()}): {wall:.1f} s wall, peak RSS "
              f"{rss:,.0f} MB; {report['log_rows']:,} block event rows → {report['index_rows']:,} index rows "
              f"= {report['log_rows'] / report['seconds']:,.0f} log rows/s, in {report['windows']} windows of "
              f"10,000 seqs; write lock held {report['lock_seconds']:.1f} s "
              f"({report['lock_seconds'] / report['windows'] * 1e3:.0f} ms per window).", ""]
    lines += ["| tree | what | wall | peak RSS | rows | load average |", "|---|---|---:|---:|---:|---|"]
    lines += inspect_rows("after (index complete)", ROOT, db, hashes)
    set_watermark(db, head - args.partial_seqs)
    lines += inspect_rows(f"after (index {args.partial_seqs:,} seqs behind)", ROOT, db, hashes)
    set_watermark(db, 0)
    lines += inspect_rows("after (index empty: watermark 0)", ROOT, db, {"first block": FIRST})
    set_watermark(db, head)
    return lines


def state_before(db: str) -> int:
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            return conn.exec_driver_sql("SELECT max(seq) FROM log").scalar() or 0
    finally:
        engine.dispose()


def last_stored(events: int) -> int:
    """A block make_batches stores near the end of a ledger of ``events`` engine events."""
    i = events - 2 - (events % 2)  # the last even index: a stored event
    first_hash = i // 2 * BLOCKS_PER_EVENT + 1
    return first_hash * 0x9E3779B97F4A7C15 % 2**64


if __name__ == "__main__":
    main()
