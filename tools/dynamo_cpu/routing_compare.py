"""Dynamo's routing with and without semkv-ledger's evidence, on one seeded workload (issue 22).

Passes over the SAME requests (seeded prompts, tokenized once by the fleet's tokenizer and sent
as token ids, in the same order, ``--concurrency`` at a time), each on a FRESH fleet of the same
shape (``--workers`` mocker workers of NVIDIA Dynamo 1.6.1, ``--num-gpu-blocks`` blocks each, the
frontend with ``--router-mode kv``, file discovery on loopback: :class:`tools.harness.dynamo_fleet.DynamoFleet`)
and a fresh SQLite ledger fed by ``semkv-ledger consume`` (every default setting,
``block_key_scheme = "dynamo"``):

* ``dynamo``: Dynamo's router alone. Before each request the ledger's advice is asked anyway
  (:class:`~connector.placement.advice.PlacementAdvisor`, live index) and recorded, so every pass
  pays the same client-side cost and the pass shows how often Dynamo's choice is in the advice's top set;
* ``semkv-hint``: the same, and when the advice singles out one engine
  (:func:`connector.placement.dynamo_hint.dynamo_hint`) the request names its worker in
  ``nvext.backend_instance_id``; other requests are left to Dynamo's router. A hinted request that
  Dynamo refuses is sent again without the hint (counted);
* ``semkv-cost`` (with ``--cost-pass``): before each request the frontend's per-worker load
  (``/metrics``: :func:`connector.placement.dynamo_hint.frontend_engine_load`) goes into a load-aware
  advice, and the ONE engine of lowest routing cost (the advisor's model of Dynamo's cost, the
  ledger's overlap) is named (``dynamo_hint(..., by_cost=True)``); ties are left to Dynamo. This is
  Dynamo's trade-off on the ledger's evidence, what its remote-indexer input would have given;
* ``dynamo-tuned`` (with ``--dynamo-tuned-args``): Dynamo alone, its frontend given those flags.

``--restart-frontend-after N``: in every pass, after the first N requests have been answered the
frontend (its KV router, whose index is in memory) is stopped with SIGTERM and started again on the
same port, the workers and the ledger untouched, and the pass goes on with the rest; the report adds
the ``--restart-window`` requests after the restart as their own table.
``--no-worker-local-indexer``: every worker started without that indexer (a Dynamo setting, on by
default; :func:`tools.harness.dynamo_fleet.mocker_config_without_local_indexer`), so that a restarted
router cannot restore its index from the workers; the ledger is fed from the workers' own KV event
streams as in every pass. Whether Dynamo's router
starts empty there is a fact of Dynamo, not of this tool: 1.6.1's router restores each worker's
blocks from the worker's own local KV indexer when it discovers the worker (router side:
ai-dynamo/dynamo ``lib/llm/src/kv_router/indexer/recovery/worker_query.rs``, ``WorkerQueryClient``,
"recovers each (worker_id, dp_rank) as it appears" by a tree dump; worker side: the
``worker_kv_query_source_*`` endpoint of ``dynamo_llm::kv_router::indexer::recovery::worker_query_endpoint``,
on by default: ``enable_local_indexer = True`` in the installed wheel's ``dynamo/mocker/config.py``
and ``dynamo/common/configuration/groups/runtime_args.py``); the restart window measures it.

Nothing waits for the ledger to catch up with the workers' events (the test group does:
tests/dynamo_cpu/test_dynamo_fleet.py): the advice is what a router-side caller would get at that
moment. Per pass: requests per worker slot, Dynamo's ``cached_tokens`` (its responses), overlap hit
rate (``nvext.timing.kv_hit_rate``, Dynamo's router's own estimate, and requests with any cached
token), TTFT (``nvext.timing.ttft_ms``, the mocker's simulated engine) and the client's latency;
between passes, per request, whether the routed worker slot is the same. Why a targeted request and
not Dynamo's remote-indexer input: :mod:`connector.placement.dynamo_hint`.

Usage (this project's venv; the Dynamo venv from ``tools/dynamo_cpu/setup_env.py``)::

    eval "$(python3 tools/dynamo_cpu/setup_env.py --print-env)"
    .venv/bin/python tools/dynamo_cpu/routing_compare.py --requests 1000 --concurrency 1 --out tools/results/...

Writes a markdown report (``--out``, default ``tools/results/dynamo-routing-<UTC date-HHMM>.md``)
and the per-request rows as JSONL beside it under ``--workdir``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from connector.placement.dynamo_hint import dynamo_hint, frontend_engine_load, nvext_hint  # noqa: E402
from tools.harness.dynamo_fleet import (  # noqa: E402
    BLOCK_SIZE, DynamoFleet, fleet_with_ledger, mocker_config_without_local_indexer, seeded_prompts)


@dataclasses.dataclass
class Row:
    """One request of one pass."""

    index: int
    prompt_tokens: int
    routed_engine: str | None
    cached_tokens: int
    kv_hit_rate: float | None
    ttft_ms: float | None
    latency_ms: float
    hint_engine: str | None
    """The engine the hint rule singles out (computed in both passes, sent in ``semkv-hint`` only)."""
    hint_sent: bool
    hint_refused: bool
    top_engines: list[str]
    best_blocks: int
    our_blocks_on_routed: int | None
    failed: str | None = None


@dataclasses.dataclass
class PassRun:
    """One pass's rows and, with ``--restart-frontend-after``, when its frontend restarted."""

    rows: list[Row]
    restart_after: int | None = None
    """Requests answered before the frontend's restart (None: no restart)."""
    restart_s: float | None = None
    """Seconds from the frontend's SIGTERM until the new one served the model."""


def run_pass(name: str, hint: str | None, token_ids: list[list[int]], args: argparse.Namespace, workdir: Path,
             concurrency: int, frontend_args: tuple[str, ...] = ()) -> PassRun:
    """One pass on a fresh fleet (its frontend given ``frontend_args`` too) and ledger, ``concurrency``
    requests in flight; its rows in request order. ``hint``: None (Dynamo alone), ``"evidence"``
    (the best-reuse hint) or ``"cost"`` (the lowest-cost hint, load from the frontend's /metrics).
    With ``args.restart_frontend_after`` (N), the first N requests are answered, the frontend is
    restarted (SIGTERM, then a new one on the same port: :meth:`DynamoFleet.restart_frontend`), and
    the rest follow."""
    root = workdir / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    worker_args: tuple[str, ...] = ()
    if args.no_worker_local_indexer:
        config = mocker_config_without_local_indexer(args.dynamo_python, Path(args.dynamo_model), args.num_gpu_blocks,
                                                     root / "mocker-no-local-indexer.json")
        worker_args = ("--extra-engine-args", str(config))
    fleet = DynamoFleet(root, args.dynamo_python, Path(args.dynamo_model), num_workers=args.workers,
                        num_gpu_blocks=args.num_gpu_blocks, frontend_args=frontend_args, worker_args=worker_args)
    with fleet_with_ledger(fleet, root) as advisor:
        engine_of = {w.instance_id: w.engine_id for w in fleet.workers}
        instance_of = {w.engine_id: w.instance_id for w in fleet.workers}
        rows: list[Row | None] = [None] * len(token_ids)
        lock, next_index = threading.Lock(), iter(range(len(token_ids)))

        def one(i: int) -> Row:
            tokens = token_ids[i]
            load = frontend_engine_load(fleet.metrics_text(), engine_of) if hint == "cost" else None
            with lock:  # one advisor (its live index) for every thread
                advice = advisor.advise(tokens, engine_load=load)
            known = {a.engine_id: a.live_blocks for a in advice.engines if a.fresh and a.live_blocks is not None}
            best = max(known.values(), default=0)
            top = sorted(e for e, blocks in known.items() if blocks == best)
            decisive = dynamo_hint(advice, instance_of, by_cost=hint == "cost")
            chosen = decisive if hint else None
            started = time.perf_counter()
            refused = False
            try:
                response = fleet.complete(tokens, max_tokens=args.max_tokens, nvext=nvext_hint(chosen))
            except httpx.HTTPStatusError:
                if chosen is None:
                    raise
                refused = True  # the worker may have just gone: let Dynamo choose
                response = fleet.complete(tokens, max_tokens=args.max_tokens)
            latency = 1000 * (time.perf_counter() - started)
            worker = response["nvext"]["worker_id"]["decode_worker_id"]
            timing = response["nvext"].get("timing") or {}
            usage = response.get("usage") or {}
            routed = engine_of.get(worker)
            return Row(i, len(tokens), routed, (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                       timing.get("kv_hit_rate"), timing.get("ttft_ms"), latency,
                       decisive.engine_id if decisive else None, chosen is not None, refused, top, best,
                       known.get(routed) if routed is not None else None)

        def worker_thread() -> None:
            while True:
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                try:
                    rows[i] = one(i)
                except (httpx.HTTPError, KeyError, ValueError) as exc:
                    rows[i] = Row(i, len(token_ids[i]), None, 0, None, None, 0.0, None, False, False, [], 0, None,
                                  failed=type(exc).__name__)

        def run_threads() -> None:
            threads = [threading.Thread(target=worker_thread) for _ in range(concurrency)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        started = time.monotonic()
        restart_after = args.restart_frontend_after
        restart_s = None
        if restart_after is not None:
            next_index = iter(range(restart_after))
            run_threads()  # every request before the restart answered
            restart_s = fleet.restart_frontend()
            print(f"{name}: frontend restarted after {restart_after} requests ({restart_s:.1f} s)", flush=True)
            next_index = iter(range(restart_after, len(token_ids)))
        run_threads()
        print(f"{name}, {concurrency} in flight: {len(token_ids)} requests in {time.monotonic() - started:.1f} s", flush=True)
        out = [r for r in rows if r is not None]
        with open(root / "rows.jsonl", "w") as f:
            for r in out:
                f.write(json.dumps(dataclasses.asdict(r)) + "\n")
        return PassRun(out, restart_after, restart_s)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summary(rows: list[Row], workers: int) -> dict:
    ok = [r for r in rows if r.failed is None]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    hit = [r.kv_hit_rate for r in ok if r.kv_hit_rate is not None]
    unhinted = [r for r in ok if not r.hint_sent]
    decisive = [r for r in ok if r.hint_engine is not None]
    return {
        "requests": len(rows), "ok": len(ok), "failed": collections.Counter(r.failed for r in rows if r.failed),
        "per_worker": [sum(r.routed_engine == f"dynamo-{i}" for r in ok) for i in range(workers)],
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "cached_tokens": sum(r.cached_tokens for r in ok),
        "with_cache": sum(r.cached_tokens > 0 for r in ok),
        "kv_hit_rate_mean": statistics.fmean(hit) if hit else float("nan"),
        "ttft_p50": pct(ttft, 0.5), "ttft_p95": pct(ttft, 0.95), "ttft_mean": statistics.fmean(ttft) if ttft else float("nan"),
        "latency_p50": pct([r.latency_ms for r in ok], 0.5), "latency_p95": pct([r.latency_ms for r in ok], 0.95),
        "decisive": len(decisive), "hinted": sum(r.hint_sent for r in ok), "hint_refused": sum(r.hint_refused for r in ok),
        "routed_as_hint": sum(r.routed_engine == r.hint_engine for r in decisive),
        "to_top": sum(r.routed_engine in r.top_engines for r in ok),
        "to_top_unhinted": (sum(r.routed_engine in r.top_engines for r in unhinted), len(unhinted)),
        "informed": sum(r.best_blocks > 0 for r in ok),
        "router_blind": sum(r.best_blocks > 0 and not r.kv_hit_rate for r in ok),
        "delivered_as_advised": sum(r.our_blocks_on_routed is not None and r.cached_tokens == r.our_blocks_on_routed * BLOCK_SIZE
                                    for r in ok),
        "available_tokens": sum(r.best_blocks * BLOCK_SIZE for r in ok),
        "routed_tokens": sum((r.our_blocks_on_routed or 0) * BLOCK_SIZE for r in ok),
    }


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


PASS_TITLES = {"dynamo": "Dynamo's router alone (`dynamo`)", "semkv-hint": "with semkv-ledger's hint (`semkv-hint`)",
               "semkv-cost": "Dynamo's cost, semkv-ledger's overlap (`semkv-cost`)",
               "dynamo-tuned": "Dynamo alone, tuned (`dynamo-tuned`)"}


def table(args: argparse.Namespace, passes: dict[str, list[Row]]) -> list[str]:
    """One concurrency's table (a column per pass) and the agreement lines."""
    s = {name: summary(rows, args.workers) for name, rows in passes.items()}

    def line(label: str, cell) -> str:  # noqa: ANN001 - cell: summary -> str
        return "| " + label + " | " + " | ".join(cell(name, s[name]) for name in passes) + " |"

    def cached(name: str, x: dict) -> str:
        return f"{x['cached_tokens']:,} / {x['prompt_tokens']:,} ({100 * x['cached_tokens'] / max(1, x['prompt_tokens']):.1f} %)"

    def as_hint(name: str, x: dict) -> str:
        if any(r.hint_sent for r in passes[name]):
            return f"{x['routed_as_hint']} (hint sent on {x['hinted']}, refused {x['hint_refused']})"
        return f"{x['routed_as_hint']} (Dynamo's own choice)"

    out = [
        "| | " + " | ".join(PASS_TITLES[name] for name in passes) + " |",
        "|---|" + "---:|" * len(passes),
        line("requests answered / failed", lambda n, x: f"{x['ok']} / {sum(x['failed'].values())}"),
        line("requests per worker (dynamo-0..)", lambda n, x: " / ".join(map(str, x["per_worker"]))),
        line("**cached tokens** (Dynamo's responses) / prompt tokens", cached),
        line("requests with any cached token", lambda n, x: str(x["with_cache"])),
        line("mean `kv_hit_rate` (Dynamo's router)", lambda n, x: f"{x['kv_hit_rate_mean']:.3f}"),
        line("**TTFT** p50 / p95 / mean (mocker, ms)", lambda n, x: f"{x['ttft_p50']:.1f} / {x['ttft_p95']:.1f} / {x['ttft_mean']:.1f}"),
        line("client latency p50 / p95 (ms)", lambda n, x: f"{x['latency_p50']:.1f} / {x['latency_p95']:.1f}"),
        line("advice informed (the ledger saw some overlap)", lambda n, x: str(x["informed"])),
        line("… of which Dynamo's choice had no overlap by its router (`kv_hit_rate` 0)", lambda n, x: str(x["router_blind"])),
        line("a hint names one engine (by evidence; in `semkv-cost` by cost)", lambda n, x: str(x["decisive"])),
        line("… routed to that engine", as_hint),
        line("routed to the advice's top set (all / of Dynamo's own choices)",
             lambda n, x: f"{x['to_top']} / {x['to_top_unhinted'][0]} of {x['to_top_unhinted'][1]}"),
        line("cached tokens == ledger's overlap on the routed worker × 16", lambda n, x: str(x["delivered_as_advised"])),
        line("available / routed tokens by the ledger (route join)",
             lambda n, x: f"{x['available_tokens']:,} / {x['routed_tokens']:,}"),
        "",
    ]
    for name, rows in passes.items():
        if any(r.hint_sent for r in rows):
            continue
        x = s[name]
        disagreed = [r for r in rows if r.failed is None and r.hint_engine is not None and r.routed_engine != r.hint_engine]
        out.append(f"- `{name}`: where the advice (asked just before the router decided, not sent) singled out one "
                   f"engine ({x['decisive']} requests), the router's own choice was that engine on **{x['routed_as_hint']}** "
                   f"({100 * x['routed_as_hint'] / max(1, x['decisive']):.1f} %); on the {len(disagreed)} others its "
                   f"choice held {sum((r.our_blocks_on_routed or 0) for r in disagreed):,} blocks by the ledger against "
                   f"{sum(r.best_blocks for r in disagreed):,} on the singled-out engine, and Dynamo reported "
                   f"{sum(r.cached_tokens for r in disagreed):,} cached tokens for them.")
    if "dynamo" in passes and "semkv-hint" in passes:
        both = [(x, y) for x, y in zip(passes["dynamo"], passes["semkv-hint"], strict=True)
                if x.failed is None and y.failed is None]
        same = sum(x.routed_engine == y.routed_engine for x, y in both)
        out.append(f"- Same worker slot for the same request in `dynamo` and `semkv-hint`: {same} of {len(both)} "
                   f"({100 * same / max(1, len(both)):.1f} %); slots are not comparable across passes once one routing "
                   "differs (a cold request's worker is a tie Dynamo breaks its own way, and later reuse follows it).")
    return out


def report(args: argparse.Namespace, runs: dict[int, dict[str, PassRun]], times: tuple[str, str],
           loads: tuple[str, str]) -> str:
    lines = [
        f"# Dynamo routing with semkv-ledger's evidence — {times[0][:10]}",
        "",
        f"Run {times[0]} – {times[1]} UTC: `tools/dynamo_cpu/routing_compare.py --requests {args.requests} "
        f"--workers {args.workers} --num-gpu-blocks {args.num_gpu_blocks} --concurrency "
        f"{' '.join(map(str, args.concurrency))} --seed {args.seed} --max-tokens {args.max_tokens}"
        + (" --cost-pass" if args.cost_pass else "")
        + (f" --dynamo-tuned-args='{args.dynamo_tuned_args}'" if args.dynamo_tuned_args else "")
        + (f" --restart-frontend-after {args.restart_frontend_after} --restart-window {args.restart_window}"
           if args.restart_frontend_after is not None else "")
        + (" --no-worker-local-indexer" if args.no_worker_local_indexer else "")
        + f"`; commit {git_commit()} (plus the working tree of this change).",
        f"Load average at start {loads[0]}, at end {loads[1]} ({os.cpu_count()} CPUs, {platform.platform()}; "
        "machine shared with other helpers).",
        "",
        "NVIDIA Dynamo 1.6.1 (frontend `--router-mode kv`, mocker workers, file discovery, loopback); every pass "
        "on a fresh fleet and a fresh SQLite ledger fed by `semkv-ledger consume`; the same seeded requests in the "
        "same order, as token ids. Method: the module docstring of `tools/dynamo_cpu/routing_compare.py`; the hint "
        "rule and why it is a targeted request (`nvext.backend_instance_id`) rather than Dynamo's remote-indexer "
        "input: `connector/placement/dynamo_hint.py`. TTFT is the mocker's simulated engine time "
        "(`nvext.timing.ttft_ms`), not a GPU's.",
        "",
    ]
    for concurrency, passes in runs.items():
        every = {name: run.rows for name, run in passes.items()}
        n = args.restart_frontend_after
        if n is None:
            lines += [f"## {args.requests} requests, {concurrency} in flight", "", *table(args, every), ""]
            continue
        window = min(args.requests, n + args.restart_window)
        restarts = ", ".join(f"`{name}` {run.restart_s:.1f} s" for name, run in passes.items() if run.restart_s is not None)
        lines += [
            f"## {args.requests} requests, {concurrency} in flight, the frontend restarted after request {n}", "",
            f"Frontend restart (SIGTERM until the new frontend served the model): {restarts}.", "",
            f"### The {window - n} requests after the restart (requests {n + 1}–{window})", "",
            *table(args, {name: rows[n:window] for name, rows in every.items()}), "",
            f"### The {min(n, args.restart_window)} requests before the restart (requests "
            f"{n - min(n, args.restart_window) + 1}–{n})", "",
            *table(args, {name: rows[n - min(n, args.restart_window):n] for name, rows in every.items()}), "",
            f"### All {args.requests} requests", "", *table(args, every), "",
        ]
    return "\n".join(lines)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Dynamo's routing with and without semkv-ledger's hint, one seeded workload.")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--num-gpu-blocks", type=int, default=256)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4], help="requests in flight; a run per value")
    parser.add_argument("--seed", type=int, default=22)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--dynamo-tuned-args", default="",
                        help="frontend flags of a third pass, Dynamo alone tuned (e.g. '--router-prefill-load-scale 4')")
    parser.add_argument("--cost-pass", action="store_true",
                        help="a pass hinted by Dynamo's cost with the ledger's overlap (load from the frontend's /metrics)")
    parser.add_argument("--restart-frontend-after", type=int, default=None, metavar="N",
                        help="in every pass, restart the frontend (SIGTERM, then a new one) after N requests")
    parser.add_argument("--no-worker-local-indexer", action="store_true",
                        help="workers without Dynamo's worker-local KV indexer (on by default), from which a "
                             "restarted router restores its index")
    parser.add_argument("--restart-window", type=int, default=100,
                        help="requests after (and before) the restart reported on their own (default 100)")
    parser.add_argument("--dynamo-python", default=os.environ.get("SEMKV_DYNAMO_PYTHON"))
    parser.add_argument("--dynamo-model", default=os.environ.get("SEMKV_DYNAMO_MODEL"))
    parser.add_argument("--workdir", type=Path, default=None,
                        help="fleet logs, ledgers and per-request rows (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.dynamo_python or not args.dynamo_model:
        parser.error("--dynamo-python/--dynamo-model (or SEMKV_DYNAMO_PYTHON/SEMKV_DYNAMO_MODEL from "
                     "tools/dynamo_cpu/setup_env.py --print-env) are required")
    if args.requests < 1 or args.workers < 2 or min(args.concurrency) < 1:
        parser.error("--requests >= 1, --workers >= 2, --concurrency >= 1")
    if args.restart_frontend_after is not None and not 1 <= args.restart_frontend_after < args.requests:
        parser.error("--restart-frontend-after N: 1 <= N < --requests")
    if args.restart_window < 1:
        parser.error("--restart-window >= 1")
    start = datetime.now(timezone.utc)
    out = args.out or REPO / "tools" / "results" / f"dynamo-routing-{start:%Y-%m-%d-%H%M}.md"
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dynamo-routing-"))
    workdir.mkdir(parents=True, exist_ok=True)
    loads = [loadavg()]
    prompts = list(seeded_prompts(args.seed, args.requests))
    token_ids = DynamoFleet(workdir / "tokenizer", args.dynamo_python, Path(args.dynamo_model)).tokenize(prompts)
    plan: list[tuple[str, str | None, tuple[str, ...]]] = [("dynamo", None, ()), ("semkv-hint", "evidence", ())]
    if args.cost_pass:
        plan.append(("semkv-cost", "cost", ()))
    if args.dynamo_tuned_args:
        plan.append(("dynamo-tuned", None, tuple(shlex.split(args.dynamo_tuned_args))))
    runs: dict[int, dict[str, PassRun]] = {}
    for concurrency in args.concurrency:
        runs[concurrency] = {name: run_pass(name, hint, token_ids, args, workdir / f"c{concurrency}", concurrency, extra)
                             for name, hint, extra in plan}
    loads.append(loadavg())
    end = datetime.now(timezone.utc)
    text = report(args, runs, (f"{start:%Y-%m-%d %H:%M}", f"{end:%H:%M}"), (loads[0], loads[1]))
    out.write_text(text)
    print(text)
    print(f"written {out}; per-request rows under {workdir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
