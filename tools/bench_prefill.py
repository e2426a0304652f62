"""Prefill time vs prompt length on the REFERENCE ENGINE HARNESS: cold, and with a fully reused prefix.

The harness (``connector.harness``) is test and demo infrastructure, never an engine for serving;
these figures are the CPU baseline that the connector's time-to-first-token gains are measured
against on the same harness, not a statement about TensorRT-LLM on a GPU.

For each prompt length: a fresh random prompt is prefilled cold (no reuse possible), then the same
prompt again, which reuses every full block of ``prompt[:-1]`` through native block reuse and
computes only the tail (at least one token). ``prefill_seconds`` covers scheduling, reuse matching
and every prefill chunk up to the first generated token.

Usage::

    .venv/bin/python tools/bench_prefill.py [--lengths 2048,8192,16384,32768] [--chunk 2048]
        [--threads 1] [--reused-repeats 3] [--out tools/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connector.harness import HarnessLLM, KvCacheConfig, ModelConfig  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2048,8192,16384,32768",
                        help="comma-separated prompt lengths (tokens)")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk, max_num_tokens (tokens)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in a forward")
    parser.add_argument("--reused-repeats", type=int, default=3,
                        help="runs of the reused prefill per length (median reported)")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                        help="folder for prefill-YYYY-MM-DD.md")
    return parser.parse_args(argv)


def build_engine(max_len: int, chunk: int, threads: int) -> HarnessLLM:
    """One engine whose GPU pool holds the longest prompt plus slack."""
    cfg = ModelConfig(max_context=max_len + 64)
    engine = HarnessLLM(cfg, kv_cache_config=KvCacheConfig(tokens_per_block=cfg.tokens_per_block,
                                                           max_tokens=max_len + 4096),
                        max_num_tokens=chunk)
    engine.model.num_threads = threads
    return engine


def measure(engine: HarnessLLM, length: int, repeats: int, generator: torch.Generator) -> dict:
    """Cold prefill once, then the fully reused prefill ``repeats`` times (median)."""
    prompt = torch.randint(0, engine.model_config.vocab_size, (length,), generator=generator).tolist()
    cold = engine.generate(prompt, max_new_tokens=1)
    reused = [engine.generate(prompt, max_new_tokens=1) for _ in range(repeats)]
    if any(not torch.allclose(r.last_logits, cold.last_logits, atol=1e-4, rtol=1e-4) for r in reused):
        raise AssertionError(f"reused prefill of {length} tokens changed the logits")
    reused_s = statistics.median(r.prefill_seconds for r in reused)
    return {"length": length, "cold_s": cold.prefill_seconds, "reused_s": reused_s,
            "reused_tokens": reused[0].num_reused_tokens}


def render(rows: list[dict], args: argparse.Namespace, cfg: ModelConfig, loads: tuple, wall_s: float) -> str:
    """The markdown report."""
    lines = [
        f"# Prefill time vs prompt length — reference engine harness ({dt.date.today().isoformat()})",
        "",
        "REFERENCE ENGINE HARNESS (CPU, test/demo infrastructure, not a serving engine). Baseline for",
        "the connector's TTFT gains on the same harness.",
        "",
        f"- model: `{cfg.name}` — {cfg.num_layers} layers, {cfg.num_heads} query heads / "
        f"{cfg.num_kv_heads} KV heads × {cfg.head_dim}, hidden {cfg.hidden_size}, MLP "
        f"{cfg.intermediate_size} ({cfg.mlp}), vocab {cfg.vocab_size}, fp32, seed {cfg.seed}",
        f"- KV: {cfg.tokens_per_block} tokens per block, {cfg.kv_bytes_per_token} bytes per token",
        f"- prefill chunk (max_num_tokens): {args.chunk} tokens; torch intra-op threads: {args.threads}",
        f"- machine: {os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}; load average at start/end: {loads[0]:.2f} / {loads[1]:.2f} "
        "(other jobs share these cores)",
        f"- reused: median of {args.reused_repeats} runs; cold: one run; whole benchmark {wall_s:.0f} s",
        "",
        "| prompt tokens | cold prefill (s) | cold tokens/s | reused tokens | reused prefill (s) | speed-up |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['length']} | {r['cold_s']:.3f} | {r['length'] / r['cold_s']:.0f} | "
                     f"{r['reused_tokens']} | {r['reused_s']:.4f} | {r['cold_s'] / r['reused_s']:.0f}× |")
    lines += ["", "Reused runs' last-position logits agree with the cold run within 1e-4 (the tail is",
              "computed as a shorter chunk than in the cold run, so agreement is to fp32 rounding).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    engine = build_engine(max(lengths), args.chunk, args.threads)
    generator = torch.Generator().manual_seed(args.seed)
    engine.generate(torch.randint(0, 512, (512,), generator=generator).tolist())  # warm-up
    rows = []
    for length in lengths:
        rows.append(measure(engine, length, args.reused_repeats, generator))
        print(f"{length:>6} tokens: cold {rows[-1]['cold_s']:.3f} s, reused {rows[-1]['reused_s']:.4f} s",
              flush=True)
    report = render(rows, args, engine.model_config, (load_start, os.getloadavg()[0]),
                    time.perf_counter() - started)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"prefill-{dt.date.today().isoformat()}.md"
    path.write_text(report)
    print(report)
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
