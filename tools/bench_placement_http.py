"""`POST /v1/placement` over loopback HTTP: this tree's app against another revision's, one advisor,
side by side in one run (issue 22: advice worth asking on a routing path).

Both apps (``connector/placement/http.py`` of this tree, and of ``--baseline REV`` read with
``git show``) serve the SAME :class:`~connector.placement.advice.PlacementAdvisor` (live index over a
ledger of 8 engines' Dynamo-hashed prompts, as tools/bench_placement.py builds it) from two uvicorn
servers on 127.0.0.1; each query goes to both, the order alternating, and the answers must be equal.
So the difference is the HTTP layer alone (middleware, decoding, the thread hop, and with
``--baseline-stack`` uvicorn's HTTP parser and event loop), not the advice. This tree's app runs on
the stack ``semkv-ledger serve`` picks (:func:`connector.placement.cli.server_stack`); the baseline's on
the same unless ``--baseline-stack HTTP,LOOP`` names another (``h11,asyncio``: what serve ran on before
httptools and uvloop were dependencies, issue 22).

Usage: python tools/bench_placement_http.py --baseline REV [--baseline-stack HTTP,LOOP] [--queries 300]
[--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.util
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import msgspec
import uvicorn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from connector.placement.advice import PlacementAdvisor  # noqa: E402
from connector.placement.cli import server_stack  # noqa: E402
from connector.placement.http import create_app  # noqa: E402
from ledger.migrate import upgrade  # noqa: E402
from tools.bench_placement import _JSON, TPB, _nodelay, populate  # noqa: E402

HTTP_MODULE = "connector/placement/http.py"


def baseline_create_app(rev: str, workdir: Path):  # noqa: ANN201 - the other revision's create_app
    """``create_app`` of ``connector/placement/http.py`` at ``rev`` (imported under its own name)."""
    source = subprocess.run(["git", "show", f"{rev}:{HTTP_MODULE}"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout
    path = workdir / "baseline_placement_http.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_placement_http", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module.create_app


def serve(app, stack: tuple[str, str]) -> tuple[str, uvicorn.Server]:  # noqa: ANN001
    """``app`` on a loopback socket bound as ``semkv-ledger serve`` binds (IPPROTO_TCP: TCP_NODELAY),
    under uvicorn with ``stack`` = (http, loop)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    http, loop = stack
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", http=http, loop=loop))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="git revision whose placement app is compared")
    parser.add_argument("--baseline-stack", type=lambda v: tuple(v.split(",")), default=server_stack(),
                        help="uvicorn's http,loop for the baseline's app (default: serve's, as for this tree)")
    parser.add_argument("--queries", type=int, default=300, help="queries per prompt length (each to both apps)")
    parser.add_argument("--prompt-tokens", type=int, default=32_768)
    parser.add_argument("--seed", type=int, default=22)
    parser.add_argument("--out", type=Path, default=None,
                        help="results file (default tools/results/placement-http-DATE-HHMM.md)")
    args = parser.parse_args()
    started = dt.datetime.now(dt.timezone.utc)
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    out = args.out or REPO / "tools" / "results" / f"placement-http-{started:%Y-%m-%d-%H%M}.md"
    rng = random.Random(args.seed)
    prompts = [[[rng.randrange(50_000) for _ in range(args.prompt_tokens)] for _ in range(2)] for _ in range(8)]
    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{tmp}/ledger.db"
        upgrade(db)
        blocks = asyncio.run(populate(db, 8, prompts))
        advisor = PlacementAdvisor(db, tokens_per_block=TPB)
        stacks = {"baseline": args.baseline_stack, "this tree": server_stack()}
        servers = {f"baseline {args.baseline} ({'/'.join(stacks['baseline'])})":
                   serve(baseline_create_app(args.baseline, Path(tmp))(advisor), stacks["baseline"]),
                   f"this tree ({'/'.join(stacks['this tree'])})": serve(create_app(advisor), stacks["this tree"])}
        clients = {name: httpx.Client(base_url=url, timeout=60, transport=_nodelay())
                   for name, (url, _) in servers.items()}
        rows = []
        try:
            for length in (2048, args.prompt_tokens):
                times: dict[str, list[float]] = {name: [] for name in clients}
                for i in range(args.queries):
                    prompt = rng.choice(rng.choice(prompts))
                    body = msgspec.json.encode({"token_ids": prompt[: length - TPB] + [rng.randrange(50_000)
                                                                                       for _ in range(TPB)],
                                                "tokens_per_block": TPB, "max_semantic": 0})
                    answers = []
                    for name, client in (list(clients.items()) if i % 2 == 0 else list(clients.items())[::-1]):
                        t0 = time.perf_counter()
                        response = client.post("/v1/placement", content=body, headers=_JSON)
                        times[name].append(time.perf_counter() - t0)
                        response.raise_for_status()
                        answers.append({e["engine_id"]: e["live_blocks"] for e in response.json()["engines"]})
                    if answers[0] != answers[1]:
                        raise SystemExit(f"the two apps answered differently: {answers}")
                base, this = times.values()
                for name, values in times.items():
                    q = statistics.quantiles(values, n=100)
                    rows.append(f"| {length:,} | {name} | {statistics.median(values) * 1e3:.2f} | {q[89] * 1e3:.2f} "
                                f"| {q[98] * 1e3:.2f} | "
                                f"{statistics.median(values) / statistics.median(base):.2f} |")
                    print(rows[-1], flush=True)
        finally:
            for client in clients.values():
                client.close()
            for _, server in servers.values():
                server.should_exit = True
    ended = dt.datetime.now(dt.timezone.utc)
    lines = [f"# `POST /v1/placement` over HTTP: this tree vs {args.baseline} — {started:%Y-%m-%d %H:%M}–{ended:%H:%M} UTC",
             "", f"`python tools/bench_placement_http.py --baseline {args.baseline} --baseline-stack "
             f"{','.join(args.baseline_stack)} --queries {args.queries}`. "
             f"One live-index advisor over {blocks:,} blocks (8 engines, Dynamo hashes, {TPB} tokens per block), "
             "served by both apps on 127.0.0.1; every query to both, order alternating, answers equal. "
             f"Machine: {os.cpu_count()} CPUs shared with other work; load average at start {load_start}, at end "
             f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}. Client-observed latency (httpx, keep-alive).",
             "", "| prompt tokens | app | p50 (ms) | p90 (ms) | p99 (ms) | p50 / baseline's |",
             "|---:|---|---:|---:|---:|---:|", *rows]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
