"""Placement advice latency: the ledger's tables against the in-memory live index, side by side.

A SQLite ledger holds ``--engines`` Dynamo workers (block-key scheme ``dynamo``, logged as the
consumer logs it), each with ``--prompts-per-engine`` cached prompts of ``--prompt-tokens`` tokens
(16 tokens per block): ``engines × prompts × prompt-tokens / 16`` live blocks, written through the
real recorder. Each query is a cached prompt's first N tokens (N = 2K or the whole prompt) with a
fresh tail of one block, asked of two advisors on the same ledger in alternation, one query at a
time: ``PlacementAdvisor(live_index=False)`` (one statement per engine and stream per 64 blocks, the
code before issue #22's index) and ``PlacementAdvisor()`` (the index, caught up before every answer:
``refresh_s`` 0), once from tokens (Dynamo's hashes computed per engine) and once with the block
hashes given; then the same over HTTP (``semkv-ledger serve``'s app under uvicorn, on the HTTP
parser and event loop serve picks (:func:`connector.placement.cli.server_stack`), on a loopback
socket, one server per advisor, httpx with a kept connection, the body encoded by msgspec inside the
timing, as a router client would send it). Garbage collection is off while
timing (in process). Both answers are compared (every engine's overlap); a difference stops the run.
With ``--dynamo-python`` (default ``$SEMKV_DYNAMO_PYTHON``, set by ``tools/dynamo_cpu/setup_env.py
--print-env``) the same blocks and in-process queries are also given to Dynamo 1.6.1's own
``RadixTree`` in its venv (tools/dynamo_cpu/radix_bench.py: from tokens, its block hashing and
``find_matches``; hashes given, ``find_matches`` alone), its scores checked equal to the index's; and
the HTTP rows are also asked of Dynamo's standalone KV indexer (``python -m dynamo.indexer``, fed the
same blocks over ZMQ: :class:`DynamoIndexer`), the same bodies interleaved with ours, its answers
checked equal to the live index's.

In process this tree also asks with the token ids as a uint32 numpy array (made outside the timing,
as a tokenizer hands them out; ``advise`` hashes it from its buffer). The HTTP rows of this tree also
ask the live index's service with the token ids packed (``token_ids_le32``, packed from the list
inside the timing; printed in the table against Dynamo's indexer; ``--no-packed`` leaves both out). With
``--baseline REV`` the bench at revision REV (exported with ``git archive``) runs first with the same
arguments and seed, each run with its own Dynamo figures: before and after in one run
(``--baseline-after``: the baseline second).

Usage: ``python tools/bench_placement.py [--engines 8] [--prompts-per-engine 16]
[--prompt-tokens 32768] [--queries 300] [--dynamo-python PATH] [--baseline REV [--baseline-after]]``;
prints a markdown table of p50 / p99 in ms, and with Dynamo's indexer a second one of the HTTP rows:
p50 / p90 / p99 of the live index's service and of Dynamo's, and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
from array import array
import contextlib
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec
import numpy as np
import socket
import threading
import uvicorn
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connector.block_keys import dynamo_block_hashes  # noqa: E402
from connector.placement.advice import PlacementAdvisor  # noqa: E402
from connector.placement.cli import server_stack  # noqa: E402
from connector.placement.http import create_app  # noqa: E402
from ledger.migrate import upgrade  # noqa: E402
from ledger.writer import LedgerWriter  # noqa: E402
from tools.harness.builders import batch, stored  # noqa: E402

TPB = 16
BLOCKS_PER_EVENT = 256
_JSON = {"content-type": "application/json"}


async def populate(db: str, engines: int, prompts: list[list[list[int]]]) -> int:
    """Store each engine's prompts' chains (Dynamo hashes) through the recorder; returns blocks."""
    writer = await LedgerWriter.open(db)
    total = 0
    try:
        for e in range(engines):
            engine_id, seq = f"worker-{e}", 0
            for prompt in prompts[e]:
                chain = dynamo_block_hashes(prompt, TPB)
                for start in range(0, len(chain), BLOCKS_PER_EVENT):
                    part = chain[start : start + BLOCKS_PER_EVENT]
                    item = batch(seq, stored(*part, parent=chain[start - 1] if start else None, num_tokens=TPB,
                                             type_name="BlockStored"), engine_id=engine_id)
                    if seq == 0:
                        item = msgspec.structs.replace(item, block_key_scheme="dynamo")
                    await writer.append([item])
                    seq += 1
                    total += len(part)
    finally:
        await writer.close()
    return total


def overlaps(advice) -> dict:  # noqa: ANN001
    return {a.engine_id: (a.live_blocks, a.generation, a.status) for a in advice.engines}


def serve(advisor: PlacementAdvisor) -> tuple[str, uvicorn.Server, threading.Thread]:
    """The placement app on a loopback socket (a thread): (base URL, server, thread)."""
    # proto IPPROTO_TCP as `semkv-ledger serve` binds it (getaddrinfo): asyncio sets TCP_NODELAY only on
    # such sockets, and without it a response's second write waits out the client's delayed ACK (~40 ms)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    http, loop = server_stack()  # uvicorn's HTTP parser and event loop as `semkv-ledger serve` picks them
    server = uvicorn.Server(uvicorn.Config(create_app(advisor), log_level="warning", lifespan="off", http=http,
                                          loop=loop))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


def percentiles(seconds: list[float]) -> tuple[float, float]:
    """(p50, p99) in ms."""
    return statistics.median(seconds) * 1e3, statistics.quantiles(seconds, n=100)[98] * 1e3


def quantiles_ms(seconds: list[float]) -> tuple[float, float, float]:
    """(p50, p90, p99) in ms."""
    q = statistics.quantiles(seconds, n=100)
    return statistics.median(seconds) * 1e3, q[89] * 1e3, q[98] * 1e3


def row(case: str, times: dict[str, list[float]]) -> tuple[str, tuple[float, float], tuple[float, float]]:
    p = {name: percentiles(v) for name, v in times.items()}
    return case, p["ledger tables"], p["live index"]


def dynamo_radix_tree(python: str, prompts: list[list[list[int]]], queries: list[list[int]]) -> dict:
    """Dynamo's ``RadixTree`` built from the same stored blocks and asked the same queries, in its
    own venv (tools/dynamo_cpu/radix_bench.py): its per-query times and scores."""
    job = {"block_size": TPB, "queries": queries,
           "engines": [[[prompt, dynamo_block_hashes(prompt, TPB)] for prompt in engine] for engine in prompts]}
    script = Path(__file__).resolve().parent / "dynamo_cpu" / "radix_bench.py"
    done = subprocess.run([python, str(script)], input=json.dumps(job), capture_output=True, text=True,
                          timeout=1800, check=False, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    if done.returncode != 0:
        raise SystemExit(f"Dynamo's RadixTree run failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


class DynamoIndexer:
    """Dynamo 1.6.1's standalone KV indexer (``python -m dynamo.indexer``, HTTP-only mode: it
    subscribes to each worker's ZMQ KV event endpoint itself; no distributed runtime) in its venv,
    fed the same stored blocks as the ledger over ZMQ in vLLM's KV event format (Dynamo's listener
    computes each block's local hash from its token ids), asked ``POST /query`` with a request's
    token ids. Options and routes: ``python -m dynamo.indexer --help`` of the installed wheel."""

    def __init__(self, python: str, prompts: list[list[list[int]]]) -> None:
        self.context = zmq.Context()
        self.publishers = [self.context.socket(zmq.PUB) for _ in prompts]
        ports = [pub.bind_to_random_port("tcp://127.0.0.1") for pub in self.publishers]
        http = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        http.bind(("127.0.0.1", 0))
        port = http.getsockname()[1]
        http.close()
        workers = ",".join(f"{w}=tcp://127.0.0.1:{p}" for w, p in enumerate(ports))
        self.process = subprocess.Popen(
            [python, "-m", "dynamo.indexer", "--workers", workers, "--block-size", str(TPB), "--port", str(port),
             "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60, transport=_nodelay())
        self._wait(lambda: self.client.get("/health").status_code == 200, "its /health")
        time.sleep(1.0)  # its ZMQ subscribers connect after /health: a message before that is lost
        for worker, engine in enumerate(prompts):
            self._publish(worker, engine)
        for worker, engine in enumerate(prompts):  # every worker's last prompt whole: all of it arrived
            self._wait(lambda: self.scores(engine[-1]).get(worker) == len(engine[-1]) // TPB, f"worker {worker}")

    def _publish(self, worker: int, engine: list[list[int]]) -> None:
        seq = 0
        for prompt in engine:
            chain = [h - 2**64 if h >= 2**63 else h for h in dynamo_block_hashes(prompt, TPB)]
            for start in range(0, len(chain), BLOCKS_PER_EVENT):
                event = ["BlockStored", chain[start:start + BLOCKS_PER_EVENT], chain[start - 1] if start else None,
                         prompt[start * TPB:(start + BLOCKS_PER_EVENT) * TPB], TPB, None, "GPU"]
                self.publishers[worker].send_multipart(
                    [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), [event], 0])])
                seq += 1

    def _wait(self, ready, what: str, timeout_s: float = 120.0) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if ready():
                    return
            time.sleep(0.2)
        raise SystemExit(f"Dynamo's standalone indexer: {what} not ready in {timeout_s:.0f} s")

    def query(self, tokens: list[int]) -> httpx.Response:
        return self.client.post("/query", content=msgspec.json.encode({"token_ids": tokens, "model_name": "default"}),
                                headers=_JSON)

    def scores(self, tokens: list[int]) -> dict[int, int]:
        """Per worker, the leading blocks it holds (the answer counts tokens)."""
        return {int(w): tokens_matched // TPB
                for w, by_rank in self.query(tokens).json()["scores"].items() for tokens_matched in by_rank.values()}

    def close(self) -> None:
        self.client.close()
        self.process.terminate()
        self.process.wait(10)
        for pub in self.publishers:
            pub.close(0)
        self.context.term()


def _le32(tokens: list[int]) -> bytes:
    """Token ids as ``token_ids_le32``'s bytes (u32 little-endian; msgspec sends bytes as base64)."""
    packed = array(next(code for code in "IL" if array(code).itemsize == 4), tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _nodelay() -> httpx.HTTPTransport:
    return httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])


def check_dynamo_agrees(scores: list[dict[str, int]], answers: list) -> None:  # noqa: ANN001
    """Every engine's overlap from the live index equals Dynamo's score for its worker (engine
    ``worker-i`` is Dynamo's worker ``i``; a worker Dynamo does not list holds 0 blocks)."""
    for theirs, ours in zip(scores, answers, strict=True):
        mine = {a.engine_id: a.live_blocks for a in ours.engines}
        dynamo = {f"worker-{w}": blocks for w, blocks in theirs.items()}
        if any(blocks != dynamo.get(engine, 0) for engine, blocks in mine.items()):
            raise SystemExit(f"the live index and Dynamo's RadixTree disagree: {mine} vs {dynamo}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--prompts-per-engine", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32_768)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--seed", type=int, default=22)
    parser.add_argument("--dynamo-python", default=os.environ.get("SEMKV_DYNAMO_PYTHON"),
                        help="the Dynamo venv's python (tools/dynamo_cpu/setup_env.py; default "
                             "$SEMKV_DYNAMO_PYTHON): time Dynamo's RadixTree on the same blocks and queries")
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="first run this bench as it is at git revision REV (its tree exported with git "
                             "archive), with the same arguments and seed, then this tree's: before and after "
                             "in one run, each with its own Dynamo figures")
    parser.add_argument("--no-packed", action="store_true",
                        help="leave out the rows this tree added: the HTTP row with token_ids_le32 and the in-process "
                             "rows from a uint32 array (for a tree without them)")
    parser.add_argument("--baseline-after", action="store_true",
                        help="run the baseline after this tree's run instead of before (alternate the order "
                             "between runs: the machine's load drifts)")
    args = parser.parse_args()
    if args.baseline and not args.baseline_after:
        run_baseline(args.baseline)
    try:
        bench(args)
    finally:
        if args.baseline and args.baseline_after:
            run_baseline(args.baseline)


def bench(args: argparse.Namespace) -> None:
    """This tree's run (see the module docstring)."""
    print(f"this tree: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC, load {_load()}", flush=True)
    packed_body = not args.no_packed
    rng = random.Random(args.seed)
    prompts = [[[rng.randrange(50_000) for _ in range(args.prompt_tokens)] for _ in range(args.prompts_per_engine)]
               for _ in range(args.engines)]
    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{Path(tmp) / 'ledger.db'}"
        upgrade(db)
        started = time.perf_counter()
        blocks = asyncio.run(populate(db, args.engines, prompts))
        print(f"ledger: {args.engines} engines, {blocks} live blocks, written in {time.perf_counter() - started:.1f} s")
        started = time.perf_counter()
        indexed = PlacementAdvisor(db, tokens_per_block=TPB)
        print(f"index loaded in {time.perf_counter() - started:.2f} s ({indexed.index.blocks()} blocks)")
        direct = PlacementAdvisor(db, tokens_per_block=TPB, live_index=False)
        rows, dynamo_rows, http_rows = [], {}, []
        try:
            for label, length in (("2K tokens", 2048), (f"{args.prompt_tokens // 1024}K tokens", args.prompt_tokens)):
                queries = [rng.choice(rng.choice(prompts))[: length - TPB] + [rng.randrange(50_000) for _ in range(TPB)]
                           for _ in range(args.queries)]
                index_answers = []
                for mode in ("from tokens", "block hashes given", "from a uint32 array")[: 2 if args.no_packed else 3]:
                    times = {"ledger tables": [], "live index": []}
                    given = mode == "block hashes given"
                    gc.disable()
                    try:
                        for tokens in queries:
                            hashes = dynamo_block_hashes(tokens, TPB) if given else None
                            if mode == "from a uint32 array":  # as a tokenizer hands them out: not timed
                                tokens = np.array(tokens, dtype=np.uint32)
                            answers = []
                            for name, advisor in (("ledger tables", direct), ("live index", indexed)):
                                t0 = time.perf_counter()
                                answers.append(advisor.advise(tokens, block_hashes=hashes))
                                times[name].append(time.perf_counter() - t0)
                            if overlaps(answers[0]) != overlaps(answers[1]):
                                raise SystemExit(f"the two answers differ: {overlaps(answers[0])} {overlaps(answers[1])}")
                            if mode == "from tokens":  # Dynamo's scores are checked against these answers
                                index_answers.append(answers[1])
                            elif mode == "from a uint32 array":
                                from_list = index_answers[len(times["live index"]) - 1]
                                if overlaps(answers[1]) != overlaps(from_list):
                                    raise SystemExit("the answers from an array and from a list differ")
                    finally:
                        gc.enable()
                    rows.append(row(f"{label}, {mode}", times))
                if args.dynamo_python:
                    dynamo = dynamo_radix_tree(args.dynamo_python, prompts, queries)
                    check_dynamo_agrees(dynamo["scores"], index_answers)
                    dynamo_rows[f"{label}, from tokens"] = percentiles(dynamo["from_tokens_s"])
                    dynamo_rows[f"{label}, block hashes given"] = percentiles(dynamo["hashes_given_s"])
            servers = {name: serve(advisor) for name, advisor in (("ledger tables", direct), ("live index", indexed))}
            clients = {name: httpx.Client(base_url=url, timeout=60, transport=_nodelay())
                       for name, (url, _, _) in servers.items()}
            indexer = DynamoIndexer(args.dynamo_python, prompts) if args.dynamo_python else None
            try:
                for label, length in (("2K tokens", 2048), (f"{args.prompt_tokens // 1024}K tokens", args.prompt_tokens)):
                    times = {name: [] for name in servers}
                    packed_times: list[float] = []
                    dynamo_times = []
                    for _ in range(args.queries):
                        prompt = rng.choice(rng.choice(prompts))
                        body = {"token_ids": prompt[: length - TPB] + [rng.randrange(50_000) for _ in range(TPB)],
                                "tokens_per_block": TPB, "max_semantic": 0}
                        answers = []
                        for name, client in clients.items():
                            t0 = time.perf_counter()
                            response = client.post("/v1/placement", content=msgspec.json.encode(body),
                                                   headers=_JSON)
                            times[name].append(time.perf_counter() - t0)
                            answers.append({e["engine_id"]: e["live_blocks"] for e in response.json()["engines"]})
                        if packed_body:  # the same ids packed (token_ids_le32), packed inside the timing
                            t0 = time.perf_counter()
                            packed = {"token_ids_le32": _le32(body["token_ids"]), "tokens_per_block": TPB,
                                      "max_semantic": 0}
                            response = clients["live index"].post("/v1/placement", content=msgspec.json.encode(packed),
                                                                  headers=_JSON)
                            packed_times.append(time.perf_counter() - t0)
                            answers.append({e["engine_id"]: e["live_blocks"] for e in response.json()["engines"]})
                        if any(answer != answers[0] for answer in answers[1:]):
                            raise SystemExit(f"the HTTP answers differ: {answers}")
                        if indexer is not None:
                            t0 = time.perf_counter()
                            response = indexer.query(body["token_ids"])
                            dynamo_times.append(time.perf_counter() - t0)
                            theirs = {int(w): t // TPB for w, ranks in response.json()["scores"].items()
                                      for t in ranks.values()}
                            if any(blocks != theirs.get(int(e.split("-")[1]), 0) for e, blocks in answers[1].items()):
                                raise SystemExit(f"Dynamo's indexer and the live index differ: {theirs} {answers[1]}")
                    rows.append(row(f"{label}, from tokens, over HTTP", times))
                    if dynamo_times:
                        dynamo_rows[f"{label}, from tokens, over HTTP"] = percentiles(dynamo_times)
                        http_rows.append((label, times["live index"], dynamo_times))
                        if packed_times:
                            http_rows.append((f"{label}, packed (token_ids_le32)", packed_times, dynamo_times))
            finally:
                if indexer is not None:
                    indexer.close()
                for client in clients.values():
                    client.close()
                for _, server, thread in servers.values():
                    server.should_exit = True
                    thread.join(10)
        finally:
            indexed.close()
            direct.close()
    print("\n| query | ledger tables p50 / p99 (ms) | live index p50 / p99 (ms) | p99 ratio | "
          "Dynamo p50 / p99 (ms) | live index / Dynamo p99 |")
    print("|---|---:|---:|---:|---:|---:|")
    for case, before, after in rows:
        theirs = dynamo_rows.get(case)
        dynamo_cells = (f"{theirs[0]:.3f} / {theirs[1]:.3f} | {after[1] / theirs[1]:.1f}×" if theirs else "— | —")
        print(f"| {case} | {before[0]:.3f} / {before[1]:.3f} | {after[0]:.3f} / {after[1]:.3f} | "
              f"{before[1] / after[1]:.1f}× | {dynamo_cells} |")
    print(f"\nthis tree done: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC, load {_load()}")
    if http_rows:
        print("\n| over HTTP, from tokens | live index p50 / p90 / p99 (ms) | Dynamo's indexer p50 / p90 / p99 (ms) "
              "| ratio p50 / p90 / p99 |")
        print("|---|---:|---:|---:|")
        for label, ours, theirs in http_rows:
            a, b = quantiles_ms(ours), quantiles_ms(theirs)
            print(f"| {label} | {' / '.join(f'{x:.3f}' for x in a)} | {' / '.join(f'{x:.3f}' for x in b)} | "
                  f"{' / '.join(f'{x / y:.2f}×' for x, y in zip(a, b))} |")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_baseline(rev: str) -> None:
    """This bench as it is at ``rev``, with this run's arguments but ``--baseline``, in a tree
    exported from git (its own code, this interpreter): printed before this tree's run."""
    repo = Path(__file__).resolve().parents[1]
    argv, skip = [], False
    for arg in sys.argv[1:]:
        if skip or arg.startswith("--baseline="):
            skip = False
            continue
        if arg == "--baseline":
            skip = True
            continue
        if arg not in ("--no-packed", "--baseline-after"):
            argv.append(arg)
    with tempfile.TemporaryDirectory() as tree:
        archive = subprocess.run(["git", "archive", rev], cwd=repo, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        print(f"baseline {rev}: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC, load {_load()}", flush=True)
        done = subprocess.run([sys.executable, str(Path(tree) / "tools" / "bench_placement.py"), *argv], cwd=tree,
                              env={**os.environ, "PYTHONPATH": tree}, check=False)
        if done.returncode:
            raise SystemExit(f"the baseline's run failed (exit {done.returncode})")
        print(f"baseline {rev} done: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC, load {_load()}\n",
              flush=True)


if __name__ == "__main__":
    main()
