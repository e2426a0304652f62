"""``semkv-ledger replay`` on a large ledger: the rebuild's rate against an older tree's in the same run, the
whole audit's, and where the time goes.

Builds a SQLite ledger of ``--events`` engine events (4 blocks each, stored then evicted in turn,
256 per batch; tools/bench_ledger.py's ``make_batches``) through the real writer, or reuses
``--ledger`` when that file exists. Then ``--repeats`` rounds, each the rebuild (read the log, decode,
fold: :func:`ledger.replay.rebuild`) of this tree and, with ``--baseline REV``, of the tree at git
revision REV (``git archive`` into a temporary directory), each in a fresh process, alternating which
goes first, so that before and after share the machine's load; rates in log rows/s of wall time and
of the process's CPU time (less sensitive to the other core's load). Then one whole replay of this
tree (scratch write and diff, :func:`ledger.replay.replay`), which must be equal.
``--postgres-events N`` does the same on a PostgreSQL ledger of N engine events (a scratch database
on 127.0.0.1:5432, dropped afterwards). ``--profile`` runs this tree's rebuild once more under
cProfile and prints the functions with the most time of their own.

Usage: ``python tools/bench_replay.py [--events 2000000] [--ledger /tmp/replay-2m.db] [--repeats 2]
[--baseline b210640] [--postgres-events 0] [--profile]``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import datetime as dt
import json
import os
import pstats
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ledger.db import sync_engine  # noqa: E402
from ledger.migrate import upgrade  # noqa: E402
from ledger.replay import rebuild, replay  # noqa: E402
from tools.bench_ledger import make_batches, run_writer  # noqa: E402

EVENTS_PER_BATCH = 256
ROOT = Path(__file__).resolve().parents[1]

MEASURE = """
import json, sys, time
sys.path.insert(0, '.')
from ledger.db import sync_engine
from ledger.replay import rebuild
engine = sync_engine(sys.argv[1])
with engine.connect() as conn:
    wall, cpu = time.perf_counter(), time.process_time()
    _, rows, _ = rebuild(conn)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
engine.dispose()
print(json.dumps({"rows": rows, "wall": wall, "cpu": cpu}))
"""
"""One rebuild in a fresh process, run in the tree to measure (its ``ledger`` package)."""


def export_tree(revision: str, into: Path) -> Path:
    """The files of git ``revision`` of this repository, unpacked under ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision], check=True, capture_output=True).stdout
    tree = into / revision
    tree.mkdir()
    with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def measure(tree: Path, db: str) -> dict:
    """The rebuild of ``db`` by the ``ledger`` package of ``tree``: rows, wall and CPU seconds."""
    out = subprocess.run([sys.executable, "-c", MEASURE, db], cwd=tree, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(db: str, baseline: Path | None, repeats: int) -> list[str]:
    """Table rows: per round, this tree's rebuild and the baseline's, alternating which goes first."""
    lines = ["| round | tree | log rows | wall s | rows/s (wall) | CPU s | rows/s (CPU) | load average |",
             "|---:|---|---:|---:|---:|---:|---:|---|"]
    trees = [("this tree", ROOT)] + ([("baseline", baseline)] if baseline is not None else [])
    best: dict[str, float] = {}
    for round_ in range(1, repeats + 1):
        for name, tree in (trees if round_ % 2 else trees[::-1]):
            m = measure(tree, db)
            load = "/".join(f"{x:.2f}" for x in os.getloadavg())
            best[name] = max(best.get(name, 0.0), m["rows"] / m["cpu"])
            line = (f"| {round_} | {name} | {m['rows']:,} | {m['wall']:.1f} | {m['rows'] / m['wall']:,.0f} "
                    f"| {m['cpu']:.1f} | {m['rows'] / m['cpu']:,.0f} | {load} |")
            print(line, flush=True)
            lines.append(line)
    if baseline is not None:
        lines += ["", f"Best CPU-time rate, this tree / baseline: **{best['this tree'] / best['baseline']:.2f} x**"]
    return lines


def build(path: Path, events: int) -> None:
    """A ledger of ``events`` engine events at ``path``, written by :class:`ledger.writer.LedgerWriter`."""
    db = f"sqlite:///{path}"
    upgrade(db)
    seconds = asyncio.run(run_writer(db, make_batches(events, EVENTS_PER_BATCH)))
    print(f"built {path}: {events:,} events in {seconds:.1f} s", flush=True)


def profile_rebuild(db: str, top: int = 15) -> None:
    """The rebuild under cProfile; prints the ``top`` functions by their own time."""
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            profiler = cProfile.Profile()
            profiler.enable()
            rebuild(conn)
            profiler.disable()
    finally:
        engine.dispose()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=2_000_000, help="engine events when building (×4 blocks)")
    parser.add_argument("--ledger", type=Path, default=Path("/tmp/semkv-bench-replay.db"),
                        help="the ledger file: reused if it exists, else built")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of rebuilds (each tree once per round)")
    parser.add_argument("--baseline", metavar="REV", help="git revision to measure side by side (e.g. main)")
    parser.add_argument("--postgres-events", type=int, default=0,
                        help="also on a scratch PostgreSQL ledger of this many engine events (0: not)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", type=Path, help="also write the tables here (markdown)")
    args = parser.parse_args()
    lines = [f"Started {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC on {os.cpu_count()} CPUs, "
             f"load average {'/'.join(f'{x:.2f}' for x in os.getloadavg())}; baseline {args.baseline or 'none'}.", ""]
    if not args.ledger.exists():
        build(args.ledger, args.events)
    db = f"sqlite:///{args.ledger}"
    with tempfile.TemporaryDirectory(prefix="semkv-bench-replay-") as tmp:
        baseline = export_tree(args.baseline, Path(tmp)) if args.baseline else None
        lines += [f"## SQLite: {args.ledger} ({args.ledger.stat().st_size / 2**30:.2f} GiB)", ""]
        lines += compare(db, baseline, args.repeats)
        lines += ["", whole_replay(db)]
        if args.postgres_events:
            lines += ["", f"## PostgreSQL: {args.postgres_events:,} engine events", ""]
            lines += postgres(args.postgres_events, baseline, args.repeats)
    lines += ["", f"Ended {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC, load average "
              f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}."]
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    if args.profile:
        profile_rebuild(db)


def whole_replay(db: str) -> str:
    """``semkv-ledger replay`` of ``db`` by this tree, timed with its scratch write and diff: one
    line (printed too)."""
    started = time.perf_counter()
    report = replay(db)
    whole = time.perf_counter() - started
    line = (f"Whole replay of this tree: {report.events:,} log rows; rebuild {report.rebuild_seconds:.1f} s = "
            f"{report.events / report.rebuild_seconds:,.0f} rows/s; with the scratch write and the diff "
            f"{whole:.1f} s = {report.events / whole:,.0f} rows/s; equal: {report.equal}")
    print(line, flush=True)
    return line


def postgres(events: int, baseline: Path | None, repeats: int) -> list[str]:
    """The same comparison on a scratch PostgreSQL ledger of ``events`` engine events."""
    from tools.harness.postgres import create_pg_database, drop_pg_database

    url = create_pg_database()
    try:
        upgrade(url)
        seconds = asyncio.run(run_writer(url, make_batches(events, EVENTS_PER_BATCH)))
        print(f"built the PostgreSQL ledger: {events:,} events in {seconds:.1f} s", flush=True)
        lines = compare(url, baseline, repeats)
        return lines + ["", whole_replay(url)]
    finally:
        drop_pg_database(url)


if __name__ == "__main__":
    main()
