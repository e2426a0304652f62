"""Donor registration while a consumer writes the same ledger: the engine's thread and the donors kept.

Before 2026-12-05 ``request_finished`` wrote ``donor_registered`` on the engine's thread, waiting at
most ``register_lock_wait_s`` (0.25 s) for SQLite's write lock; past it the request was not a donor.
Now the engine's thread only decides (reads) and the connector's ledger thread writes (waiting up to
5 s), and the worker publishes the bytes once the registration is in (connector/saves.py).

One run, per tree (this one, and ``--baseline REV`` exported with ``git archive`` and run from a copy
of this script in a fresh process), per scenario:

* ``quiet`` — the engine alone on its SQLite ledger;
* ``consumer`` — a consumer-like writer process (the product's ``LedgerWriter``) appending
  ``--writer-events`` engine events (× 4 blocks) per transaction as fast as it can to the same file,
  so the write lock is held most of the time, in transactions of the size a consumer under a burst
  commits.

The engine (the reference harness's TensorRT-LLM executor loop, default connector settings, block reuse
off) serves ``--donors`` requests of fresh random ``--tokens``-token documents one after another; each
is a donor. Measured: the engine thread's time in ``request_finished`` per donor (p50 / p99 / max),
and at the end (everything flushed) the donors in the ledger by state and the connector's
``semkv_donors_not_registered_total`` by reason.

Usage: ``python tools/bench_registration.py [--baseline REV] [--donors 40] [--tokens 1024]``; writes
``tools/results/registration-YYYY-MM-DD-HHMM.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import multiprocessing as mp
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCENARIOS = ("quiet", "consumer")


def _consumer(db: str, events: int, stop, commits) -> None:  # noqa: ANN001
    """A writer process appending batches of ``events`` engine events until ``stop`` is set."""
    from ledger.writer import LedgerWriter
    from tools.bench_ledger import make_batches
    from tools.harness.builders import batch

    cycle = [b.events for b in make_batches(8 * events, events, engine_id="consumer-load")]  # stores, then evictions

    async def run() -> None:
        writer = await LedgerWriter.open(db)
        seq = 0
        try:
            while not stop.is_set():
                await writer.append([batch(seq, *cycle[seq % len(cycle)], engine_id="consumer-load")])
                seq += 1
                commits.value += 1
        finally:
            await writer.close()

    asyncio.run(run())


def _serve(root: Path, scenario: str, donors: int, tokens: int, writer_events: int) -> dict:
    """One engine serving ``donors`` donors (with the consumer writing, for ``consumer``)."""
    import torch

    from connector.harness import HarnessLLM, HarnessTransformer, KvCacheConfig
    from connector.metrics import ConnectorMetrics
    from connector.scheduler import SemKvScheduler
    from connector.worker import SemKvWorker
    from ledger.migrate import upgrade
    from tools.bench_connector import TPB, model_config, settings

    db = f"sqlite:///{root / f'{scenario}.db'}"
    upgrade(db)
    s, m = settings(db, root / f"store-{scenario}", "registration-bench"), ConnectorMetrics()
    finish_s: list[float] = []

    class Timed(SemKvScheduler):
        def __init__(self, llm_args) -> None:  # noqa: ANN001
            super().__init__(llm_args, settings=s, metrics=m)

        def request_finished(self, request, cache_block_ids):  # noqa: ANN001, ANN201
            started = time.perf_counter()
            try:
                return super().request_finished(request, cache_block_ids)
            finally:
                finish_s.append(time.perf_counter() - started)

    work = type("W", (SemKvWorker,), {"__init__": lambda self, a: SemKvWorker.__init__(self, a, settings=s, metrics=m)})
    cfg = model_config(tokens + 64)
    kvc = KvCacheConfig(tokens_per_block=TPB, max_tokens=4 * (tokens + 64), enable_block_reuse=False)
    llm = HarnessLLM(cfg, kv_cache_config=kvc, kv_connector=(Timed, work), max_num_tokens=2048,
                     model=HarnessTransformer(cfg))
    spawn = mp.get_context("spawn")  # a fresh interpreter: no copy of the engine's threads
    stop, commits = spawn.Event(), spawn.Value("q", 0)
    consumer = None
    if scenario == "consumer":
        consumer = spawn.Process(target=_consumer, args=(db, writer_events, stop, commits))
        consumer.start()
        while commits.value < 3:  # writing steadily before the first donor
            time.sleep(0.05)
    gen = torch.Generator().manual_seed(2026_12_05)
    started = time.perf_counter()
    try:
        for _ in range(donors):
            llm.generate(torch.randint(1, cfg.vocab_size, (tokens,), generator=gen).tolist(), 1)
        served_s = time.perf_counter() - started
    finally:
        stop.set()
        if consumer is not None:
            consumer.join(60)
    llm.run_until_idle(timeout_s=600)
    worker, scheduler = llm.connector.workers[0], llm.connector.scheduler
    worker.flush(120)
    scheduler.flush(120)
    worker.flush(120)
    with sqlite3.connect(db.removeprefix("sqlite:///")) as conn:
        states = dict(conn.execute("SELECT state, count(*) FROM donors GROUP BY state").fetchall())
    not_registered = {reason: m.value("semkv_donors_not_registered_total", reason=reason)
                      for reason in ("ledger_busy", "ledger_error")}
    worker.close()
    scheduler.close()
    ordered = sorted(finish_s)
    return {"scenario": scenario, "donors": donors, "served_s": served_s, "consumer_commits": commits.value,
            "finish_p50_ms": 1e3 * statistics.median(ordered),
            "finish_p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "finish_max_ms": 1e3 * ordered[-1], "donor_states": states,
            "not_registered": {k: int(v) for k, v in not_registered.items() if v}}


def inner(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-registration-"))
    try:
        rows = [_serve(root, scenario, args.donors, args.tokens, args.writer_events) for scenario in SCENARIOS]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("RESULT " + json.dumps(rows))


def _run_tree(tree: Path, args: argparse.Namespace) -> list[dict]:
    script = tree / "tools" / "bench_registration.py"
    if not script.exists():
        shutil.copy(Path(__file__), script)
    out = subprocess.run([sys.executable, str(script), "--inner", "--donors", str(args.donors), "--tokens",
                          str(args.tokens), "--writer-events", str(args.writer_events)],
                         cwd=tree, capture_output=True, text=True, timeout=3600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"{tree}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def _export(rev: str) -> Path:
    root = Path(tempfile.mkdtemp(prefix=f"bench-registration-{rev}-"))
    archive = subprocess.run(["git", "archive", rev], capture_output=True, check=True,
                             cwd=Path(__file__).resolve().parents[1]).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a revision to measure side by side (git archive)")
    parser.add_argument("--donors", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--writer-events", type=int, default=1024, help="engine events per consumer transaction")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.inner:
        return inner(args)
    started, load0 = dt.datetime.now(dt.timezone.utc), _load()
    here = Path(__file__).resolve().parents[1]
    trees = {"this tree": here}
    if args.baseline:
        trees[f"baseline {args.baseline}"] = _export(args.baseline)
    results = {name: _run_tree(tree, args) for name, tree in trees.items()}
    ended, load1 = dt.datetime.now(dt.timezone.utc), _load()
    lines = [f"# Donor registration under a writing consumer — {started:%Y-%m-%d %H:%M}–{ended:%H:%M} UTC", "",
             f"`python tools/bench_registration.py --donors {args.donors} --tokens {args.tokens} --writer-events "
             f"{args.writer_events}{' --baseline ' + args.baseline if args.baseline else ''}` (method: the script's "
             f"docstring). Host: {os.cpu_count()} CPUs; load average {load0} at the start, {load1} at the end.", "",
             "| tree | scenario | consumer commits | request_finished p50 / p99 / max (ms, engine thread) "
             "| donors in the ledger (by state) | not registered (by reason) | served in (s) |",
             "|---|---|---:|---|---|---|---:|"]
    for name, rows in results.items():
        for r in rows:
            lines.append(f"| {name} | {r['scenario']} | {r['consumer_commits']} | {r['finish_p50_ms']:.2f} / "
                         f"{r['finish_p99_ms']:.2f} / {r['finish_max_ms']:.2f} | {r['donor_states']} of {r['donors']} | "
                         f"{r['not_registered'] or '—'} | {r['served_s']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = args.out or here / "tools" / "results" / f"registration-{started:%Y-%m-%d-%H%M}.md"
    out.write_text(text)
    print(f"written {out}")


if __name__ == "__main__":
    main()
