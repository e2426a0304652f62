"""TensorRT-LLM ``v1_block_key`` hashing in Python: this tree's ``connector/block_keys.py`` against git
revision ``--baseline``'s, in one process, alternating which goes first, µs of CPU per call.

Why: placement advice (a request's TensorRT-LLM block keys), donor registration without
``RequestData.block_hashes`` and the reference harness's KV cache manager (the C++ hasher's
replica, charged to every harness engine's TTFT) all hash token ids with it
(tools/results/block-keys-DATE.md).

Rows: ``block_hash_chain`` of a 2K and a 32K-token prompt (the advice path); one 32-token
``v1_block_key`` after another with its parent (the harness's per-block store); the harness's
``RequestData.block_hashes`` of a new request (the per-block loop before, ``v1_block_keys`` now).

Usage: ``python tools/bench_block_keys.py --baseline REV [--rounds 5] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from connector import block_keys as this_tree  # noqa: E402

TPB = 32


def baseline_module(revision: str, into: Path) -> ModuleType:
    """``connector/block_keys.py`` of git ``revision``, imported as module ``block_keys_baseline``."""
    path = into / "block_keys_baseline.py"
    path.write_bytes(subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:connector/block_keys.py"],
                                    check=True, capture_output=True).stdout)
    spec = importlib.util.spec_from_file_location("block_keys_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def workloads(module: ModuleType, tokens_2k: list[int], tokens_32k: list[int]) -> dict[str, Callable[[], object]]:
    """The calls timed, by row name (each returns its hashes, compared between the two modules)."""
    def per_block() -> list[int]:
        parent, out = 0, []
        for start in range(0, len(tokens_2k), TPB):
            parent = module.v1_block_key(tokens_2k[start : start + TPB], parent)
            out.append(parent)
        return out

    def harness_commit() -> list[int]:  # connector/harness/kv_cache_manager.py: block_hashes of a new request
        if hasattr(module, "v1_block_keys"):
            return module.v1_block_keys(tokens_2k, TPB, len(tokens_2k) // TPB)
        return per_block()  # the harness before v1_block_keys

    return {
        "block_hash_chain, 2K tokens": lambda: module.block_hash_chain(tokens_2k, TPB),
        "block_hash_chain, 32K tokens": lambda: module.block_hash_chain(tokens_32k, TPB),
        "block_hash_chain, 2K tokens, cache_salt": lambda: module.block_hash_chain(tokens_2k, TPB, cache_salt="t"),
        "v1_block_key per 32-token block, 2K tokens": per_block,
        "harness: RequestData.block_hashes of a new 2K-token request": harness_commit,
    }


def cpu_us(call: Callable[[], object], repeats: int) -> float:
    """Median CPU µs of ``call`` over ``repeats`` calls."""
    samples = []
    for _ in range(repeats):
        started = time.process_time_ns()
        call()
        samples.append((time.process_time_ns() - started) / 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, metavar="REV")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20, help="calls per row and round")
    parser.add_argument("--out", type=Path, help="results file (markdown); default: print only")
    args = parser.parse_args()
    import random

    rng = random.Random(0)
    tokens_32k = [rng.randrange(0, 128_000) for _ in range(32_768)]
    tokens_2k = tokens_32k[:2048]
    with tempfile.TemporaryDirectory() as tmp:
        modules = {"baseline": baseline_module(args.baseline, Path(tmp)), "this tree": this_tree}
        calls = {name: workloads(m, tokens_2k, tokens_32k) for name, m in modules.items()}
        for row in calls["this tree"]:
            assert calls["this tree"][row]() == calls["baseline"][row](), f"{row}: hashes differ"
        started, load_before = datetime.now(timezone.utc), os.getloadavg()
        results: dict[str, dict[str, list[float]]] = {row: {n: [] for n in modules} for row in calls["this tree"]}
        for rnd in range(args.rounds):
            order = list(modules) if rnd % 2 == 0 else list(reversed(modules))
            for row in results:
                for name in order:
                    results[row][name].append(cpu_us(calls[name][row], args.repeats))
        ended, load_after = datetime.now(timezone.utc), os.getloadavg()
    lines = [f"# v1_block_key hashing — {started:%Y-%m-%d %H:%M}–{ended:%H:%M} UTC", "",
             f"`tools/bench_block_keys.py --baseline {args.baseline} --rounds {args.rounds} --repeats {args.repeats}`: "
             f"median CPU µs per call in each round, rounds alternating which module goes first; hashes equal. "
             f"Load average {load_before[0]:.1f} → {load_after[0]:.1f} on {os.cpu_count()} CPUs.", "",
             f"| call | baseline {args.baseline} (µs, median of rounds [min, max]) | this tree | this / baseline |",
             "|---|---:|---:|---:|"]
    for row, by_module in results.items():
        base, mine = (statistics.median(by_module[n]) for n in ("baseline", "this tree"))
        spread = {n: f"{statistics.median(v):,.0f} [{min(v):,.0f}, {max(v):,.0f}]" for n, v in by_module.items()}
        lines.append(f"| {row} | {spread['baseline']} | {spread['this tree']} | {mine / base:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
