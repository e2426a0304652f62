"""Donor saves on the engine's thread, before and after issue 25: what saving adds to the engine's thread.

On the reference harness (TensorRT-LLM's executor loop, the reference model, fp32, CPU), side by side
in one run, order rotating per repetition: two engines that differ only in ``save_copy``:

* ``engine_thread`` — the behaviour before 2026-12-05: ``get_finished`` copies the finished donor's
  blocks out of the KV pool (``index_select`` per layer) on the engine's thread;
* ``side`` — the engine's thread only queues the copy; a side worker copies the blocks into a reusable
  host buffer and ``get_finished`` reports the request once the copy has completed.

Each engine serves, per context length (8K and 32K tokens by default; a fresh random document each
time, so its prefill is cold), one donor request in two scenarios:

* ``busy`` — a companion request (64 tokens, decoding for longer than the donor's prefill) is live
  when the donor finishes, as on a serving engine: TensorRT-LLM will call ``get_finished`` again, so
  the side path never waits;
* ``idle`` — the donor alone: the engine blocks after its last iteration, so the side path waits in
  that ``get_finished`` for the copy (a wait that delays no other request: none is live).

Measured per donor: its own prefill (submission to first token, ``GenerationResult.prefill_seconds``)
and the engine's thread time in the worker's save work from submission until the engine reported the
donor's id (``SemKvWorker.save_engine_seconds``: ``get_finished`` and ``wait_for_save`` gathers,
enqueues and waits), as a share of that prefill; ``idle`` also the part spent waiting for the copy
(``save_wait_seconds``); and how long the donor's blocks stayed held after the iteration that
finished it (the price of reporting only once copied: the side copy competes with the engine for
the CPU). The engines' own block reuse is off (every prefill is cold).

Usage: ``python tools/bench_saves.py [--tokens 8192,32768] [--reps 3]``; prints the table and writes
it to ``tools/results/saves-YYYY-MM-DD.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connector.harness import HarnessLLM, HarnessTransformer, KvCacheConfig  # noqa: E402
from connector.metrics import ConnectorMetrics  # noqa: E402
from connector.scheduler import SemKvScheduler  # noqa: E402
from connector.worker import SemKvWorker  # noqa: E402
from ledger.migrate import upgrade  # noqa: E402
from tools.bench_connector import TPB, model_config, settings  # noqa: E402

MODES = ("engine_thread", "side")
SCENARIOS = ("busy", "idle")
COMPANION_TOKENS = 64
MAX_NUM_TOKENS = 2048


def make_engine(cfg, model, db: str, store: Path, mode: str, max_tokens: int) -> HarnessLLM:  # noqa: ANN001
    s, m = settings(db, store, f"saves-{mode}", save_copy=mode), ConnectorMetrics()
    sched = type("S", (SemKvScheduler,), {"__init__": lambda self, a: SemKvScheduler.__init__(self, a, settings=s, metrics=m)})
    work = type("W", (SemKvWorker,), {"__init__": lambda self, a: SemKvWorker.__init__(self, a, settings=s, metrics=m)})
    kvc = KvCacheConfig(tokens_per_block=TPB, max_tokens=max_tokens, enable_block_reuse=False)
    llm = HarnessLLM(cfg, kv_cache_config=kvc, kv_connector=(sched, work), max_num_tokens=MAX_NUM_TOKENS, model=model)
    llm.semkv_metrics = m
    return llm


def one_donor(llm: HarnessLLM, doc: list[int], companion: list[int] | None) -> dict:
    """Serve ``doc`` as a donor (with ``companion`` live beside it, or alone); engine-thread save time
    until the engine reported the donor's id."""
    worker: SemKvWorker = llm.connector.workers[0]
    engine0, wait0 = worker.save_engine_seconds, worker.save_wait_seconds
    rid = llm.submit(doc, 1)
    if companion is not None:
        chunks = -(-len(doc) // MAX_NUM_TOKENS)
        llm.submit(companion, chunks + 16)
    loop = llm._loop  # the harness's executor: whether the donor's blocks are still held
    finished_at = None
    while not loop.runs[rid].done or rid in loop.pinned:
        if not llm.step():
            raise RuntimeError(f"the engine went idle with donor {rid} pending")
        if finished_at is None and loop.runs[rid].done:
            finished_at = time.perf_counter()  # after the iteration that finished it
    held = 0.0 if finished_at is None else time.perf_counter() - finished_at
    out = {"prefill": llm.result(rid).prefill_seconds, "engine": worker.save_engine_seconds - engine0,
           "wait": worker.save_wait_seconds - wait0, "held": held}
    llm.run_until_idle(timeout_s=3600)
    assert llm.pending_transfers() == [], llm.pending_transfers()
    assert worker.flush(120)
    m = llm.semkv_metrics
    failed = {o: m.value("semkv_donor_saves_total", outcome=o) for o in ("failed", "queue_full", "layout_mismatch")}
    assert not any(failed.values()), f"a save did not complete: {failed}"  # a skipped copy would flatter the figures
    return out


def bench(tokens_list: list[int], reps: int, root: Path) -> dict:
    db = f"sqlite:///{root / 'ledger.db'}"
    upgrade(db)
    gen = torch.Generator().manual_seed(2026_12_05)
    results: dict = {}
    for tokens in tokens_list:
        cfg = model_config(tokens + 2 * COMPANION_TOKENS)
        model = HarnessTransformer(cfg)
        max_tokens = 2 * (tokens + 4 * COMPANION_TOKENS)
        engines = {mode: make_engine(cfg, model, db, root / f"store-{tokens}-{mode}", mode, max_tokens) for mode in MODES}
        rows = {(mode, sc): [] for mode in MODES for sc in SCENARIOS}
        try:
            for rep in range(reps):
                order = MODES if rep % 2 == 0 else MODES[::-1]
                for mode in order:
                    for scenario in SCENARIOS:
                        doc = torch.randint(1, cfg.vocab_size, (tokens,), generator=gen).tolist()
                        companion = (torch.randint(1, cfg.vocab_size, (COMPANION_TOKENS,), generator=gen).tolist()
                                     if scenario == "busy" else None)
                        r = one_donor(engines[mode], doc, companion)
                        rows[(mode, scenario)].append(r)
                        print(f"{tokens} {mode:13s} {scenario}: prefill {r['prefill']:.3f} s, engine-thread save "
                              f"{r['engine'] * 1e3:.2f} ms ({100 * r['engine'] / r['prefill']:.3f} %), waited "
                              f"{r['wait'] * 1e3:.2f} ms, blocks held after the finishing iteration "
                              f"{r['held'] * 1e3:.1f} ms", flush=True)
            kv_bytes = engines["side"].kv_cache[0].numel() * engines["side"].kv_cache.element_size() * (tokens // TPB)
            results[tokens] = {"rows": rows, "donor_bytes": kv_bytes,
                               "buffers": engines["side"].connector.workers[0].host_buffers.allocated}
        finally:
            for llm in engines.values():
                llm.connector.workers[0].close()
                llm.connector.scheduler.close()
    return results


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def write_table(results: dict, args, started: str, ended: str, load: str) -> Path:  # noqa: ANN001
    day = started[:10]
    out = args.out or Path(__file__).resolve().parent / "results" / f"saves-{day}.md"
    lines = [f"# Donor saves on the engine's thread: before / after (issue 25) — {day}", "",
             f"`python tools/bench_saves.py --tokens {args.tokens} --reps {args.reps}`, {started}–{ended} UTC "
             f"(`date -u`); load average at start / end: {load}. Machine: 2 vCPUs shared with other agents and a "
             "CI run; every ratio below compares runs of the same process, interleaved (order rotating).", "",
             "Harness: TensorRT-LLM's non-overlap executor loop, the reference model (2 layers, 2 KV heads x 32, "
             f"fp32, {TPB} tokens per block), CPU, `max_num_tokens` {MAX_NUM_TOKENS}, engines' own block reuse off. "
             "Engine-thread save time = `SemKvWorker.save_engine_seconds` from the donor's submission until the "
             "engine reported its id (all `get_finished`/`wait_for_save` save work: copies, enqueues, waits). "
             "Medians over the repetitions; the share is per run, then the median.", "",
             "| tokens | donor KV | scenario | save_copy | runs | donor prefill (s) | engine-thread save (ms) | "
             "share of prefill | of which copying/waiting because the engine may idle (ms) | "
             "blocks held after the finishing iteration (ms) |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for tokens, res in results.items():
        for scenario in SCENARIOS:
            for mode in MODES:
                rows = res["rows"][(mode, scenario)]
                shares = [100 * r["engine"] / r["prefill"] for r in rows]
                lines.append(f"| {tokens:,} | {res['donor_bytes'] / 2**20:.0f} MiB | {scenario} | `{mode}` | {len(rows)} "
                             f"| {_med([r['prefill'] for r in rows]):.2f} | {1e3 * _med([r['engine'] for r in rows]):.2f} "
                             f"| {_med(shares):.3f} % | {1e3 * _med([r['wait'] for r in rows]):.2f} "
                             f"| {1e3 * _med([r['held'] for r in rows]):.1f} |")
    lines += ["", "Host buffers the side copier allocated per engine (reused across donors): "
              + ", ".join(f"{t:,} tokens: {r['buffers']}" for t, r in results.items()) + ".", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="8192,32768", help="donor prompt lengths, comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    load_start = "%.2f %.2f %.2f" % os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="semkv-bench-saves-") as tmp:
        results = bench([int(t) for t in args.tokens.split(",")], args.reps, Path(tmp))
    ended = dt.datetime.now(dt.timezone.utc).strftime("%H:%M")
    load = f"{load_start} / " + "%.2f %.2f %.2f" % os.getloadavg()
    print(f"wrote {write_table(results, args, started, ended, load)}")


if __name__ == "__main__":
    main()
