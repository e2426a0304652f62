"""Replay's fold alone (decode + :func:`ledger.apply.fold_rows`, the log's pages already read into
memory): this tree's ``ledger/apply.py`` against git revision ``--baseline``'s, in one process,
alternating which goes first, µs of CPU per log row.

Why: the rebuild's read and its fold share the machine's noise differently; this isolates the fold
(tools/results/ledger-replay-2026-12-05-1203.md, section 3). The baseline's ``apply.py`` is loaded
beside this tree's (it imports the same ``ledger.events``/``rows``/``types``, so a revision that
changed those cannot be compared this way).

Usage: ``python tools/bench_fold.py LEDGER.db --baseline 4ac4b26 [--rows N] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ledger import apply as this_tree  # noqa: E402
from ledger.db import sync_engine  # noqa: E402
from ledger.replay import iter_log_pages  # noqa: E402


def baseline_apply(revision: str, into: Path):  # noqa: ANN201 - a module
    """``ledger/apply.py`` of git ``revision``, imported as module ``apply_baseline``."""
    path = into / "apply_baseline.py"
    path.write_bytes(subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:ledger/apply.py"],
                                    check=True, capture_output=True).stdout)
    spec = importlib.util.spec_from_file_location("apply_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["apply_baseline"] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def fold_seconds(module, pages: list) -> float:  # noqa: ANN001
    """CPU seconds of folding ``pages`` into a fresh projection with ``module.fold_rows``."""
    proj = module.Projection()
    started = time.process_time()
    for page in pages:
        module.fold_rows(proj, page)
        proj.changes.clear()
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ledger", type=Path, help="a SQLite ledger file")
    parser.add_argument("--baseline", required=True, metavar="REV")
    parser.add_argument("--rows", type=int, default=10**9, help="at most this many log rows (whole pages)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = sync_engine(f"sqlite:///{args.ledger}")
    pages, rows = [], 0
    with engine.connect() as conn:
        for page in iter_log_pages(conn):
            pages.append(page)
            rows += len(page)
            if rows >= args.rows:
                break
    engine.dispose()
    with tempfile.TemporaryDirectory() as tmp:
        trees = [(args.baseline, baseline_apply(args.baseline, Path(tmp))), ("this tree", this_tree)]
        print(f"{rows:,} log rows; load average {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
        for round_ in range(1, args.rounds + 1):
            for name, module in (trees if round_ % 2 else trees[::-1]):
                seconds = fold_seconds(module, pages)
                print(f"round {round_} {name}: {seconds / rows * 1e6:.2f} µs/row = {rows / seconds:,.0f} rows/s of CPU",
                      flush=True)


if __name__ == "__main__":
    main()
