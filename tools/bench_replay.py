"""``semkv-ledger replay`` on a large ledger: the rebuild's rate, the whole audit's, and where the time goes.

Builds a SQLite ledger of ``--events`` engine events (4 blocks each, stored then evicted in turn,
256 per batch; tools/bench_ledger.py's ``make_batches``) through the real writer, or reuses
``--ledger`` when that file exists, then runs :func:`ledger.replay.replay` ``--repeats`` times:
the rebuild (read the log, decode, fold) in log rows/s, and the whole replay with the scratch
write and the diff. ``--profile`` runs the rebuild once more under cProfile and prints the functions
with the most time of their own.

To compare two trees, run this file from each (a git worktree with ``ledger/migrations`` linked to
its own ``migrations/``) on the same ``--ledger``, alternating.

Usage: ``python tools/bench_replay.py [--events 2000000] [--ledger /tmp/replay-2m.db] [--repeats 2] [--profile]``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ledger.db import sync_engine  # noqa: E402
from ledger.migrate import upgrade  # noqa: E402
from ledger.replay import rebuild, replay  # noqa: E402
from tools.bench_ledger import make_batches, run_writer  # noqa: E402

EVENTS_PER_BATCH = 256


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
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if not args.ledger.exists():
        build(args.ledger, args.events)
    db = f"sqlite:///{args.ledger}"
    for _ in range(args.repeats):
        started = time.perf_counter()
        report = replay(db)
        whole = time.perf_counter() - started
        print(f"replay: {report.events:,} log rows; rebuild {report.rebuild_seconds:.1f} s = "
              f"{report.events / report.rebuild_seconds:,.0f} rows/s; with the scratch write and the diff "
              f"{whole:.1f} s = {report.events / whole:,.0f} rows/s; equal {report.equal}", flush=True)
    if args.profile:
        profile_rebuild(db)


if __name__ == "__main__":
    main()
