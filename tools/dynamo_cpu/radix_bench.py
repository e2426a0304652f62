"""Dynamo's own answer to placement, timed, for ``tools/bench_placement.py --dynamo-python``.

Runs in the Dynamo venv (``tools/dynamo_cpu/setup_env.py``; nothing of this checkout is imported):
reads a JSON job on stdin — ``block_size``, ``engines`` (per engine, its prompts as ``[token_ids,
sequence_hashes]`` pairs: the tokens and the block hashes semkv-ledger's ledger holds for them, in
the order they were stored) and ``queries`` (token lists) — builds one ``dynamo._core.RadixTree`` from a ``stored`` event per prompt (worker id = the
engine's index; the event JSON of Dynamo's ``KvCacheEvent``), then answers every query twice, timing
each call with ``time.perf_counter``: from tokens (``compute_block_hash_for_seq`` then
``find_matches``, what Dynamo's router does with a request's tokens) and with the local hashes given
(``find_matches`` alone). Prints one JSON object: ``build_s``, ``from_tokens_s`` and
``hashes_given_s`` (per query, seconds) and ``scores`` (per query, ``{engine index: blocks}``).

RadixTree and compute_block_hash_for_seq: ai-dynamo 1.6.1 ``dynamo/_core.pyi`` (installed wheel).
"""

from __future__ import annotations

import gc
import json
import sys
import time

from dynamo._core import RadixTree, compute_block_hash_for_seq


def main() -> None:
    job = json.load(sys.stdin)
    block_size, tree = job["block_size"], RadixTree()
    started, event_id = time.perf_counter(), 0
    for worker, prompts in enumerate(job["engines"]):
        for tokens, sequence in prompts:
            event_id += 1
            local = compute_block_hash_for_seq(tokens, block_size)
            blocks = [{"block_hash": s, "tokens_hash": h} for h, s in zip(local, sequence)]
            tree.apply_event(worker, json.dumps({"event_id": event_id, "data": {"stored": {
                "parent_hash": None, "blocks": blocks}}}).encode())
    build_s = time.perf_counter() - started
    from_tokens, given, scores = [], [], []
    gc.disable()
    try:
        for tokens in job["queries"]:
            t0 = time.perf_counter()
            local = compute_block_hash_for_seq(tokens, block_size)
            answer = tree.find_matches(local)
            from_tokens.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            tree.find_matches(local)
            given.append(time.perf_counter() - t0)
            scores.append({str(worker): blocks for (worker, _dp_rank), blocks in answer.scores.items()})
    finally:
        gc.enable()
    json.dump({"build_s": build_s, "from_tokens_s": from_tokens, "hashes_given_s": given, "scores": scores}, sys.stdout)


if __name__ == "__main__":
    main()
