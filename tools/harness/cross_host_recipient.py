"""Engine B of the cross-host test, as a process of its own (run inside a network namespace by
tests/connector/test_cross_host_netns.py): a reference-harness engine with its own store directory,
its own consumer daemon on its own loopback, the shared PostgreSQL ledger (``--db``) and the Redis
donor store (``--redis-url``). It waits for the donor of ``--doc`` to be staged, serves doc +
question, runs the same requests on a native engine (its own reuse, no connector) and prints one
line ``RESULT <json>``: what it materialized, whether its logits, tokens and KV equal the native ones, where
the load read from, and whether the machine's loopback Redis answers from here.

    python -m tools.harness.cross_host_recipient --db URL --redis-url URL --prefix P --root DIR
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tools.harness.fleet import MODEL, Fleet, doc_tokens, native_engine
from tools.harness.redis_server import redis_answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--doc-seed", type=int, default=31)
    parser.add_argument("--question-seed", type=int, default=32)
    parser.add_argument("--doc-blocks", type=int, default=15)
    args = parser.parse_args()

    tpb = MODEL.tokens_per_block
    doc, question = doc_tokens(args.doc_blocks * tpb, seed=args.doc_seed), doc_tokens(40, seed=args.question_seed)
    fleet = Fleet(args.root, ("B",), db=args.db).start()
    try:
        b = fleet.engine("B", store_dir=args.root / "host-b", donor_store="redis", redis_url=args.redis_url,
                         redis_key_prefix=args.prefix, redis_timeout_s=10.0)
        deadline = time.monotonic() + 30
        while not _staged(b) and time.monotonic() < deadline:  # the view loads A's donor; B stages it from Redis
            fleet.sync()
            b.scheduler.flush()
        got = b.generate(doc + question, max_new_tokens=4)
        native = native_engine()
        native.generate(doc, 1)
        reference = native.generate(doc + question, 4)
        blocks = len(doc) // tpb
        print("RESULT " + json.dumps({
            "connector_tokens": got.num_connector_tokens,
            "native_reused_tokens": reference.num_reused_tokens,
            "logits_equal": bool(torch.equal(got.prefill_logits, reference.prefill_logits)),
            "tokens_equal": got.token_ids == reference.token_ids,
            "kv_equal": bool(torch.equal(b.llm.kv_cache[got.block_ids[:blocks]],
                                         native.kv_cache[reference.block_ids[:blocks]])),
            "loads_host_ram": b.metrics.value("semkv_load_seconds_count", source="host_ram"),
            "loads_local_file": b.metrics.value("semkv_load_seconds_count", source="local_file"),
            "misses": b.misses(),
            "loopback_redis_answers": redis_answers("redis://127.0.0.1:6379/0", 0.5),
            "store_dir_exists": (args.root / "host-b").exists(),
        }), flush=True)
    finally:
        fleet.stop()


def _staged(engine) -> bool:  # noqa: ANN001
    return engine.scheduler.store.staged_entries() > 0


if __name__ == "__main__":
    main()
