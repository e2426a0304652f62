"""The connector's lookup alone, for before/after comparisons of one tree against another.

``get_num_new_matched_tokens`` of TensorRT-LLM's default configuration (binding promises, donor
view, freshness policy ``engine``) timed one call at a time, with garbage collection off and the
background work waited for every 20 calls outside the timing: ``--lookups`` hits (a donor holds the
whole prompt) and as many misses (a random prompt), p50 and p90 in µs. The ledger is a SQLite file
with ``--blocks`` bulk blocks (tools/bench_connector.py's ``populate``) and one lookup donor saved
through the real connector path.

tools/bench_connector.py measures the lookup as an engine runs it (the next lookup beside the
previous request's background work, 200 per row): its 2K-token p50 moves by ±10 µs from run to run
here, more than the code changes it is meant to judge. This script removes what it can of that noise,
so that two trees run back to back can be told apart by a few µs: copy this file into each tree's
``tools/`` (a git worktree; it imports the tree it sits in) and run it there, alternating trees.

Usage: ``python tools/bench_lookup_alone.py [--tokens 2048] [--lookups 3000] [--blocks 20000]``;
prints one line ``lookup hit p50 … µs p90 … µs, miss p50 … µs p90 … µs``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench_connector import (  # noqa: E402
    TPB,
    ConnectorMetrics,
    LlmRequest,
    SemKvScheduler,
    _checksum,
    add_lookup_donor,
    llm_args,
    model_config,
    populate,
    settings,
)
from connector.engine_contract import TENSORRT_LLM  # noqa: E402
from ledger.migrate import upgrade  # noqa: E402

FLUSH_EVERY = 20
"""Background work (lease releases, miss diagnosis) is waited for every this many lookups, untimed."""


def timed_lookups(sched: SemKvScheduler, prompts: list[list[int]]) -> list[float]:
    """Seconds per ``get_num_new_matched_tokens`` call, one request per prompt (each finished after)."""
    out = []
    gc.disable()
    try:
        for i, prompt in enumerate(prompts):
            request = LlmRequest(10 + i, prompt, 1)
            started = time.perf_counter()
            sched.get_num_new_matched_tokens(request, 0)
            out.append(time.perf_counter() - started)
            sched.request_finished(request, [])
            if i % FLUSH_EVERY == 0:
                sched.flush()
    finally:
        gc.enable()
    sched.flush()
    return out


def _us(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q * 100) - 1] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens (whole blocks of 32 hit)")
    parser.add_argument("--lookups", type=int, default=3000, help="hits, and as many misses")
    parser.add_argument("--blocks", type=int, default=20_000, help="bulk blocks in the ledger")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        db = f"sqlite:///{root / 'ledger.db'}"
        upgrade(db)
        cfg = model_config(args.tokens + 1024)
        sched = SemKvScheduler(llm_args(cfg, 4096), settings=settings(db, root / "donors", "bench-B"),
                               metrics=ConnectorMetrics(), engine=TENSORRT_LLM)
        try:
            gen = torch.Generator().manual_seed(7)
            tokens = torch.randint(1, cfg.vocab_size, (args.tokens,), generator=gen).tolist()
            hit_prompt = tokens + [1, 2, 3]
            namespace = sched.namespace.for_request(LlmRequest(0, hit_prompt, 1))
            populate(db, namespace.digest, args.blocks)
            layout = (cfg.num_layers, 2, cfg.num_kv_heads * cfg.head_dim * TPB)
            donor_id = add_lookup_donor(db, sched.ledger, sched.store, namespace, tokens, layout, seed=args.tokens)
            sched.store.verify(f"{donor_id}.kv", _checksum(db, donor_id))
            sched.sync_view()
            check = LlmRequest(1, hit_prompt, 1)
            matched, _ = sched.get_num_new_matched_tokens(check, 0)
            sched.request_finished(check, [])
            if matched != args.tokens // TPB * TPB:  # every timed "hit" would be a miss
                raise SystemExit(f"the lookup donor was not found: {sched.metrics.misses_by_reason()}")
            miss_prompt = torch.randint(1, cfg.vocab_size, (args.tokens + 3,), generator=gen).tolist()
            timed_lookups(sched, [hit_prompt, miss_prompt] * 5)  # warm-up
            hits = timed_lookups(sched, [hit_prompt] * args.lookups)
            misses = timed_lookups(sched, [miss_prompt] * args.lookups)
        finally:
            sched.close()
    print(f"lookup hit p50 {_us(hits, .5):.1f} µs p90 {_us(hits, .9):.1f} µs, "
          f"miss p50 {_us(misses, .5):.1f} µs p90 {_us(misses, .9):.1f} µs")


if __name__ == "__main__":
    main()
