"""Benchmark: block events/s from a local ZMQ publisher into the ledger (DESIGN §7: ≥ 100k/s, flat RSS).

Runs, each against the same pre-encoded vLLM-dialect stream (``--events-per-message`` events of
``--blocks-per-event`` blocks, half BlockStored of new blocks, half BlockRemoved of the blocks an
engine whose KV cache holds ``--cache-blocks`` blocks evicts; ``make_stream``):

* ``discard``     a SUB that receives and drops every message (the transport's ceiling);
* ``decode``      a SUB that also runs ``consumer.wire.decode_message``;
* ``sqlite``      ``semkv-ledger consume`` (a subprocess) into a fresh SQLite file, with its default
                  ledger writer process and again with ``--writer-thread`` (side by side);
* ``postgresql``  the same into a scratch database created on ``--pg-url`` and dropped afterwards;
* ``append-only`` in-process ``LedgerWriter.append`` of pre-decoded batches (no ZMQ, no daemon; the
                  writer thread, whose process has no GC tuning: see ledger/writer_process.py),
                  in a child process, then the same stream again under new seqs: the cache's
                  steady state (every removal deletes a row committed in an earlier
                  transaction), what the soak's repeating publisher runs into;

then a soak: the consumer against a publisher paced at ``--soak-rate`` block events/s (default 50 %
of the SQLite burst rate: the sustained rate on a growing ledger is lower than a burst into a fresh
one) for ``--soak-s`` seconds, RSS sampled every second; flat RSS needs a backlog near 0 (a backlog
waits in ZMQ's queues, bounded by the HWMs, and shows up as RSS).

Rates are block events (blocks stored + blocks removed) divided by the time from the publisher's
first send to the last message received (discard/decode) or committed (consumer: polled from its
``/metrics`` every 50 ms). ``--profile`` samples the SQLite consumer with py-spy (if installed)
and lists where its time goes. Results: a Markdown table on stdout and in
``tools/results/consume-YYYY-MM-DD.md``.

Before/after a change: ``--baseline-tree DIR`` (a copy of the repository taken before it) runs the
SQLite consume and append-only measurements from both trees, ``--repeats`` rounds interleaved,
and reports the best run of each with every run listed (the machine is shared and noisy). Every
consumer runs as ``python -c 'from ledger.cli import main; main()' consume …`` with
``PYTHONPATH`` set to its tree, this tree included, so both sides start the same way.

Usage: ``python tools/bench_consume.py [--messages 2000] [--cache-blocks 65536] [--soak-s 60] [--profile]``
(``--cache-blocks`` must hold fewer blocks than the stream stores: 64 per message)
(``--soak-s 600 --rss-log rss.csv`` for the 10-minute soak;
``--baseline-tree /tmp/before --only-sqlite --soak-s 0`` for a before/after comparison).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import msgspec
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from consumer.bridge import ReplayBuffer, ReplayStats, serve_replay_request  # noqa: E402
from consumer.wire import decode_message, encode_frames  # noqa: E402

MiB = 2**20


# ---------------------------------------------------------------------------------------------
# the stream
# ---------------------------------------------------------------------------------------------


def make_stream(messages: int, events: int, blocks: int, block_size: int = 16,
                cache_blocks: int = 65_536) -> list[bytes]:
    """Payloads ``[ts, events, 0]`` of an engine whose KV cache holds ``cache_blocks`` blocks and
    evicts in LRU order: each message stores ``events // 2`` runs of ``blocks`` new blocks and
    removes the runs that message ``i - cache_blocks / (stored blocks per message)`` stored.

    The stream is cyclic (message ``i`` evicts what message ``(i - D) mod messages`` stored), so a
    publisher that sends it again (the soak, append-only's later passes) continues the same cache:
    every block it stores again was evicted before. On the very first pass the first ``D`` messages
    remove blocks not stored yet (``removed_unknown``: the cache filling up).

    Raises:
        ValueError: a cache of fewer blocks than one message stores, or of the whole stream.
    """
    runs = events // 2
    per_message = runs * blocks
    distance = cache_blocks // per_message
    if not 1 <= distance < messages:
        raise ValueError(f"--cache-blocks {cache_blocks} must hold 1 to {messages - 1} messages of "
                         f"{per_message} stored blocks")

    def run_hashes(message: int, run: int) -> list[int]:
        first = message * per_message + run * blocks
        return [(first + i) * 0x9E3779B97F4A7C15 % 2**64 for i in range(blocks)]

    enc, out = msgspec.msgpack.Encoder(), []
    tokens = list(range(block_size * blocks))
    for m in range(messages):
        evs = []
        for run in range(runs):
            evs.append({"type": "BlockStored", "block_hashes": run_hashes(m, run), "parent_block_hash": None,
                        "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": "GPU"})
            evs.append({"type": "BlockRemoved", "block_hashes": run_hashes((m - distance) % messages, run),
                        "medium": "GPU"})
        out.append(enc.encode([time.time(), evs, 0]))
    return out


# ---------------------------------------------------------------------------------------------
# child processes: publisher, discarding/decoding subscriber
# ---------------------------------------------------------------------------------------------


def publisher_main(conn, messages: int, events: int, blocks: int, cache_blocks: int, rate_msgs: float,
                   repeat: bool) -> None:
    """XPUB + replay ROUTER on ephemeral ports; start once subscribed; report (t_first, t_last)."""
    payloads = make_stream(messages, events, blocks, cache_blocks=cache_blocks)
    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)
    pub.setsockopt(zmq.SNDHWM, 0)
    router.setsockopt(zmq.SNDHWM, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    ports = pub.bind_to_random_port("tcp://127.0.0.1"), router.bind_to_random_port("tcp://127.0.0.1")
    conn.send(ports)
    buffer, stats = ReplayBuffer(100_000), ReplayStats()
    while not pub.poll(100) or pub.recv()[:1] != b"\x01":
        serve_replay_request(router, buffer, stats)
    t_first, seq, n = time.time(), 0, 0
    while n < messages or repeat:
        frames = encode_frames(b"kv", seq, payloads[n % messages])
        buffer.append(seq, frames)
        pub.send_multipart(frames)
        seq, n = seq + 1, n + 1
        if rate_msgs:
            serve_replay_request(router, buffer, stats)
            delay = t_first + n / rate_msgs - time.time()
            if delay > 0:
                time.sleep(delay)
        if repeat and conn.poll():
            break
    conn.send((t_first, time.time(), seq))
    while not conn.poll(0.01):  # keep serving replay until told to stop
        serve_replay_request(router, buffer, stats)
    pub.close(0)
    router.close(0)
    ctx.term()


def subscriber_main(conn, port: int, messages: int, decode: bool) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.subscribe(b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    conn.send("ready")
    for _ in range(messages):
        frames = sub.recv_multipart()
        if decode:
            decode_message(frames, source_id="s", engine_id="e", received_at=0.0)
    conn.send(time.time())
    sub.close(0)
    ctx.term()


class Publisher:
    def __init__(self, args: argparse.Namespace, rate_msgs: float = 0.0, repeat: bool = False) -> None:
        self.conn, child = mp.Pipe()
        self.proc = mp.Process(target=publisher_main, args=(child, args.messages, args.events_per_message,
                                                            args.blocks_per_event, args.cache_blocks, rate_msgs, repeat),
                                daemon=True)
        self.proc.start()
        self.port, self.replay_port = self.conn.recv()

    def finish(self) -> tuple[float, float, int]:
        return self.conn.recv()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send("stop")
        self.proc.join(10)


def run_subscriber(args: argparse.Namespace, decode: bool) -> float:
    pub = Publisher(args)
    conn, child = mp.Pipe()
    proc = mp.Process(target=subscriber_main, args=(child, pub.port, args.messages, decode), daemon=True)
    proc.start()
    conn.recv()
    t_first, _, _ = pub.finish()
    t_done = conn.recv()
    proc.join(10)
    pub.close()
    return t_done - t_first


# ---------------------------------------------------------------------------------------------
# the consumer daemon as a subprocess
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, name: str) -> float:
    with contextlib.suppress(OSError):
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        for line in body.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return -1.0


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the consumer and its ledger writer process)."""
    tree, i = [pid], 0
    while i < len(tree):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{tree[i]}/task").iterdir():
                tree += [int(c) for c in (task / "children").read_text().split()]
        i += 1
    return tree


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants."""
    total = 0.0
    for member in process_tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
    return total


CLI = "import sys; sys.argv[0] = 'semkv-ledger'; from ledger.cli import main; main()"


def tree_env(tree: Path) -> dict[str, str]:
    """The environment of a child that must import ``ledger``/``consumer`` from ``tree``."""
    return {**os.environ, "PYTHONPATH": str(tree)}


def migrate_in(tree: Path, db: str) -> None:
    """``semkv-ledger migrate`` with ``tree``'s code (a baseline's daemon refuses a newer schema)."""
    subprocess.run([sys.executable, "-c", CLI, "migrate", "--db", db], cwd=tree, env=tree_env(tree), check=True,
                   capture_output=True)


class Consumer:
    """``semkv-ledger consume`` as a subprocess, importing the code of ``tree`` (default: this one)."""

    def __init__(self, db: str, pub: Publisher, args: argparse.Namespace, tree: Path = REPO,
                 extra: tuple[str, ...] = ()) -> None:
        self.metrics_port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-c", CLI, "consume", "--db", db, "--engine-id", "bench",
                                      "--endpoint", f"tcp://127.0.0.1:{pub.port}", "--replay-endpoint",
                                      f"tcp://127.0.0.1:{pub.replay_port}", "--metrics-port", str(self.metrics_port),
                                      "--metrics-host", "127.0.0.1", "--batch-max-events", str(args.batch_max_events),
                                      "--log-level", "warning", *extra], stderr=subprocess.DEVNULL, cwd=tree,
                                     env=tree_env(tree))
        self.rss: list[float] = []

    def wait_batches(self, n: int, timeout_s: float) -> float:
        """Poll /metrics until ``n`` batches are committed; returns the wall time then."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if scrape(self.metrics_port, "semkv_consumer_batches_committed_total") >= n:
                return time.time()
            if self.proc.poll() is not None:
                raise RuntimeError(f"the consumer exited with {self.proc.returncode} before committing {n} batches")
            self.rss.append(rss_mib(self.proc.pid))
            time.sleep(0.05)
        raise TimeoutError(f"consumer did not commit {n} batches in {timeout_s} s")

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(60)


def run_consumer(db: str, args: argparse.Namespace, profile_to: Path | None = None,
                 tree: Path = REPO, extra: tuple[str, ...] = ()) -> tuple[float, float]:
    """(seconds from first send to last commit, peak RSS MiB); ``extra``: more ``consume`` flags."""
    migrate_in(tree, db)
    pub = Publisher(args)
    consumer = Consumer(db, pub, args, tree, extra)
    spy = None
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if profile_to is not None and Path(py_spy).exists():
        while scrape(consumer.metrics_port, "semkv_consumer_transactions_total") < 0:  # imports done
            time.sleep(0.02)
        spy = subprocess.Popen([py_spy, "record", "--pid", str(consumer.proc.pid), "--format", "raw", "-r", "200",
                                "-o", str(profile_to), "--nonblocking", "--subprocesses"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        t_first, _, _ = pub.finish()
        t_done = consumer.wait_batches(args.messages, args.timeout_s)
    finally:
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
        consumer.stop()
        pub.close()
    return t_done - t_first, max(consumer.rss, default=0.0)


APPEND_ONLY_CHILD = """import asyncio, sys, time
import msgspec
from consumer.wire import decode_message, encode_frames
from ledger.migrate import upgrade
from ledger.writer import LedgerWriter

db, stream, per_tx, passes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
payloads = msgspec.msgpack.decode(open(stream, "rb").read())
upgrade(db)

async def go():
    writer = await LedgerWriter.open(db)
    for n in range(passes):
        batch = [decode_message(encode_frames(b"kv", n * len(payloads) + s, p), source_id="b", engine_id="bench",
                                received_at=0.0) for s, p in enumerate(payloads)]
        started = time.perf_counter()
        for i in range(0, len(batch), per_tx):
            await writer.append(batch[i:i + per_tx])
        print(time.perf_counter() - started, flush=True)
    await writer.close()

asyncio.run(go())
"""


def run_append_only(db: str, args: argparse.Namespace, passes: int = 1, tree: Path = REPO) -> list[float]:
    """Seconds per pass to append the stream with ``LedgerWriter.append`` (writer thread; no ZMQ,
    no daemon) in a child process importing ``tree``'s code. Pass ``n`` sends the stream again under
    new seqs, so from the second pass on the cache is in its steady state (every stored block is new
    to the projection or was evicted, every removal deletes a row of an earlier transaction).
    Both trees of a before/after comparison append the same payloads (written to a file here)."""
    payloads = make_stream(args.messages, args.events_per_message, args.blocks_per_event,
                           cache_blocks=args.cache_blocks)
    per_tx = max(1, args.batch_max_events // args.events_per_message)
    with tempfile.NamedTemporaryFile(suffix=".msgpack") as stream:
        stream.write(msgspec.msgpack.encode(payloads))
        stream.flush()
        out = subprocess.run([sys.executable, "-c", APPEND_ONLY_CHILD, db, stream.name, str(per_tx), str(passes)],
                             cwd=tree, env=tree_env(tree), check=True, capture_output=True, text=True)
    return [float(line) for line in out.stdout.split()]


def compare_trees(work: Path, args: argparse.Namespace) -> list[tuple]:
    """Consume and append-only on SQLite, this tree against ``--baseline-tree``, ``--repeats`` times
    interleaved (the order alternates per round); best run of each, every run listed."""
    trees = {"this tree": REPO, "baseline": args.baseline_tree.resolve()}
    consume: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
    append: dict[str, list[float]] = {name: [] for name in trees}
    steady: dict[str, list[float]] = {name: [] for name in trees}
    for rnd in range(args.repeats):
        order = list(trees) if rnd % 2 == 0 else list(reversed(trees))
        for name in order:
            tag = f"{name.replace(' ', '-')}-{rnd}"
            consume[name].append(run_consumer(f"sqlite:///{work}/consume-{tag}.db", args, tree=trees[name]))
            first, again = run_append_only(f"sqlite:///{work}/append-{tag}.db", args, passes=2, tree=trees[name])
            append[name].append(first)
            steady[name].append(again)
            print(f"round {rnd} {name}: consume {consume[name][-1][0]:.2f} s, append-only {first:.2f} s, "
                  f"again {again:.2f} s", file=sys.stderr, flush=True)
    rows = []
    for name in trees:
        seconds = [s for s, _ in consume[name]]
        runs = ", ".join(f"{s:.2f}" for s in seconds)
        rows.append((f"sqlite (consume), {name}: best of {args.repeats} ({runs} s)", min(seconds),
                     f"{max(r for _, r in consume[name]):.1f}"))
    for label, times in (("append-only", append), ("append-only again (steady state)", steady)):
        for name in trees:
            runs = ", ".join(f"{s:.2f}" for s in times[name])
            rows.append((f"sqlite {label}, {name}: best of {args.repeats} ({runs} s)", min(times[name]), None))
    return rows


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants, all their threads."""
    total = 0.0
    for member in process_tree(pid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def cpu_by_thread(pid: int) -> Counter[str]:
    """User + system CPU seconds of ``pid``'s process tree by where it runs: ``writer process``
    (every descendant), and the consumer's threads by their kernel name (``comm``: the main
    thread is the event loop, ``ZMQbg/IO/0`` libzmq's I/O thread, ``asyncio_N`` the executor that
    runs the block-index follower and the writer's hand-off, the rest the metrics server's)."""
    out: Counter[str] = Counter()
    tick = os.sysconf("SC_CLK_TCK")
    for member in process_tree(pid):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{member}/task").iterdir():
                with contextlib.suppress(OSError):
                    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                    if member != pid:
                        label = "writer process"
                    elif int(task.name) == pid:
                        label = "main thread (event loop: receive, decode, source)"
                    else:
                        label = "thread " + (task / "comm").read_text().strip()
                    out[label] += (int(fields[11]) + int(fields[12])) / tick
    return out


def compare_paced(work: Path, args: argparse.Namespace, rate: float) -> list[tuple[str, dict]]:
    """Paced runs of ``--paced-s`` at ``rate``, this tree against ``--baseline-tree``, interleaved."""
    trees = {"this tree": REPO, "baseline": args.baseline_tree.resolve()}
    out = []
    for rnd in range(args.repeats):
        for name in (list(trees) if rnd % 2 == 0 else list(reversed(trees))):
            result = soak(f"sqlite:///{work}/paced-{name.replace(' ', '-')}-{rnd}.db", args, rate, trees[name],
                          seconds=args.paced_s)
            out.append((f"{name}, {rnd}", {**result, "target": rate}))
            print(f"paced {rnd} {name}: CPU {result['cpu_percent']:.1f} %", file=sys.stderr, flush=True)
    return out


def soak(db: str, args: argparse.Namespace, rate_block_events: float, tree: Path = REPO,
         seconds: float | None = None, rss_log: Path | None = None) -> dict:
    """Paced publisher for ``seconds`` (default ``soak_s``) from the moment the consumer serves
    /metrics; RSS every second; CPU time of the consumer over that span; backlog (published -
    committed) at the end."""
    seconds = args.soak_s if seconds is None else seconds
    migrate_in(tree, db)
    per_msg = args.events_per_message * args.blocks_per_event
    pub = Publisher(args, rate_msgs=rate_block_events / per_msg, repeat=True)
    consumer = Consumer(db, pub, args, tree)
    while scrape(consumer.metrics_port, "semkv_consumer_transactions_total") < 0:  # imports done, serving
        if consumer.proc.poll() is not None:
            raise RuntimeError(f"the consumer exited with {consumer.proc.returncode} before serving /metrics")
        time.sleep(0.05)
    samples: list[tuple[float, float]] = []
    committed_at: list[tuple[float, float]] = []  # (wall clock, batches committed) per sample
    started, cpu_started = time.time(), cpu_s(consumer.proc.pid)
    threads_started = cpu_by_thread(consumer.proc.pid)
    committed_before = scrape(consumer.metrics_port, "semkv_consumer_batches_committed_total")
    while time.time() - started < seconds:
        samples.append((time.time() - started, rss_mib(consumer.proc.pid)))
        committed_at.append((time.time(), scrape(consumer.metrics_port, "semkv_consumer_batches_committed_total")))
        time.sleep(1.0)
    committed = scrape(consumer.metrics_port, "semkv_consumer_batches_committed_total")
    transactions = scrape(consumer.metrics_port, "semkv_consumer_transactions_total")
    cpu = cpu_s(consumer.proc.pid) - cpu_started
    threads = cpu_by_thread(consumer.proc.pid)
    threads.subtract(threads_started)
    pub.conn.send("halt")
    t_first, t_last, sent = pub.finish()
    gaps = scrape(consumer.metrics_port, "semkv_consumer_gaps_total")
    consumer.stop()
    pub.close()
    rate_msgs = rate_block_events / per_msg
    backlog = [max(0.0, min(sent, rate_msgs * (wall - t_first)) - done) for wall, done in committed_at]  # msgs
    if rss_log is not None:
        rss_log.write_text("t_s,rss_mib,backlog_msgs\n" + "".join(f"{t:.1f},{r:.2f},{b:.0f}\n"
                                                                  for (t, r), b in zip(samples, backlog)))
    half = [(t, r) for t, r in samples if t >= seconds / 2] or samples
    return {"seconds": t_last - t_first, "block_events": sent * per_msg, "committed_per_s":
            committed * per_msg / (t_last - t_first), "backlog": int(sent - committed),
            "cpu_percent": 100 * cpu / seconds,
            "cpu_us_per_block_event": 1e6 * cpu / max(1.0, (committed - committed_before) * per_msg),
            "cpu_us_by_thread": {name: 1e6 * s / max(1.0, (committed - committed_before) * per_msg)
                                 for name, s in threads.most_common() if s > 0},
            "events_per_txn": committed * args.events_per_message / max(1.0, transactions),
            "backlog_max": max(backlog, default=0.0), "rss_start": samples[0][1],
            "rss_first": half[0][1], "rss_last": half[-1][1], "rss_max": max(r for _, r in samples),
            "slope": 60 * _slope(half), "slope_all": 60 * _slope(samples), "gaps": gaps}


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope (MiB/s) of (t, rss) points."""
    n = len(points)
    if n < 2:
        return 0.0
    mt, mr = sum(t for t, _ in points) / n, sum(r for _, r in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (r - mr) for t, r in points) / var if var else 0.0


# ---------------------------------------------------------------------------------------------
# databases, profile, report
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def postgres_scratch(admin_url: str):
    import psycopg

    name = f"semkv_bench_{os.getpid()}"
    with psycopg.connect(admin_url, autocommit=True, connect_timeout=3) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield admin_url.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


PROFILE_PARTS = [  # (label, path fragments): a sample counts for a part if any frame of its stack matches
    ("ledger transaction, all of it (ledger/sqlite_writer.py, writer process or thread)",
     ("ledger/sqlite_writer.py",)),
    ("  request decode in the writer process (ledger/writer_process.py)", ("decode_append",)),
    ("  parent: request encode and send (ledger/writer_process.py)", ("Child.append",)),
    ("  decide + apply (ledger/decide.py, apply.py)", ("ledger/decide.py", "ledger/apply.py")),
    ("  SQLAlchemy (compile, params, results)", ("sqlalchemy/",)),
    ("  driver calls: SQLite + binding (ledger/db.py Sql)", ("ledger/db.py",)),
    ("consumer: receive, track, decode (consumer/source.py)", ("consumer/source.py",)),
    ("  wire decode (consumer/wire.py)", ("consumer/wire.py",)),
    ("consumer: writer task, metrics (consumer/daemon.py)", ("consumer/daemon.py",)),
    ("event loop waiting (selectors)", ("selectors.py",)),
]


def summarize_profile(path: Path, top: int = 12) -> list[tuple[str, float]]:
    """py-spy raw (collapsed) stacks -> inclusive share per part, then the top leaf functions."""
    parts: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        leaves[stack.rsplit(";", 1)[-1]] += n
        for label, fragments in PROFILE_PARTS:
            if any(f in stack for f in fragments):
                parts[label] += n
    if not total:
        return []
    rows = [(label, 100.0 * parts[label] / total) for label, _ in PROFILE_PARTS]
    return rows + [(f"leaf: {leaf}", 100.0 * n / total) for leaf, n in leaves.most_common(top)]


def _thread_labels(paced: Sequence[tuple[str, dict]]) -> list[str]:
    """Every thread label of the paced runs, the costliest first (merged over runs)."""
    total: Counter[str] = Counter()
    for _, r in paced:
        total.update(r["cpu_us_by_thread"])
    return [name for name, _ in total.most_common()]


def report(rows: list[tuple], soak_row: dict | None, profile: list[tuple[str, float]], args,
           load_start: tuple[float, ...], paced: list[tuple[str, dict]] = ()) -> str:
    per_msg = args.events_per_message * args.blocks_per_event
    total = args.messages * per_msg
    lines = [f"# consume benchmark {dt.date.today().isoformat()}", "",
             f"Host: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, load average (1/5/15 min) "
             f"{' '.join(f'{x:.1f}' for x in load_start)} at the start, "
             f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end. Stream: {args.messages} messages × "
             f"{args.events_per_message} events × {args.blocks_per_event} blocks = {total:,} block events "
             f"(vLLM map dialect, half stored / half removed: an engine cache of {args.cache_blocks:,} blocks evicting "
             f"in LRU order); batch_max_events {args.batch_max_events}.", "",
             "| run | block events/s | seconds | vs discard | peak RSS MiB |", "|---|---:|---:|---:|---:|"]
    base = next((r[1] for r in rows if r[0] == "discard" and r[1]), None)
    for name, seconds, rss in rows:
        if seconds is None:
            lines.append(f"| {name} | skipped: {rss} | | | |")
            continue
        rate = total / seconds
        ratio = f"{base / seconds:.3f}" if base else ""
        lines.append(f"| {name} | {rate:,.0f} | {seconds:.2f} | {ratio} | {rss or ''} |")
    if paced:
        lines += ["", f"Paced ({args.paced_s:.0f} s per run, SQLite, publisher at {paced[0][1]['target']:,.0f} block "
                  "events/s, interleaved): the consumer's CPU (all threads) while keeping up; transactions are "
                  "small when the consumer is not saturated.", "",
                  "| tree, round | committed /s | backlog at end (msgs) | events/txn | consumer CPU % | "
                  "CPU µs per block event |", "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {name} | {r['committed_per_s']:,.0f} | {r['backlog']} | {r['events_per_txn']:.1f} | "
                  f"{r['cpu_percent']:.1f} | {r['cpu_us_per_block_event']:.2f} |" for name, r in paced]
        lines += ["", "Where that CPU ran (µs per block event committed; threads named by the kernel):", "",
                  "| tree, round | " + " | ".join(name for name in _thread_labels(paced)) + " |",
                  "|---|" + "---:|" * len(_thread_labels(paced))]
        lines += [f"| {name} | " + " | ".join(f"{r['cpu_us_by_thread'].get(label, 0.0):.2f}"
                                              for label in _thread_labels(paced)) + " |" for name, r in paced]
    if soak_row:
        lines += ["", f"Soak ({args.soak_s:.0f} s, SQLite, publisher paced at {soak_row['target']:,.0f} block "
                  "events/s; RSS of the consumer and its ledger writer process sampled every second from the moment it serves /metrics; "
                  "slope: least squares over the second half (whole run in brackets)):", "",
                  "| published | committed /s | backlog at end (max) msgs | events/txn | consumer CPU % | "
                  "RSS at start MiB | RSS at half MiB | RSS at end MiB | RSS max MiB | RSS slope MiB/min | gaps |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
                  f"| {soak_row['block_events']:,} | {soak_row['committed_per_s']:,.0f} | {soak_row['backlog']} "
                  f"({soak_row['backlog_max']:.0f}) | "
                  f"{soak_row['events_per_txn']:.1f} | {soak_row['cpu_percent']:.1f} | "
                  f"{soak_row['rss_start']:.1f} | {soak_row['rss_first']:.1f} | {soak_row['rss_last']:.1f} | "
                  f"{soak_row['rss_max']:.1f} | {soak_row['slope']:+.2f} ({soak_row['slope_all']:+.2f}) | "
                  f"{soak_row['gaps']:.0f} |"]
    if profile:
        lines += ["", "py-spy (200 Hz, all threads, start-up excluded), SQLite consumer: % of samples", "",
                  "| where | % |", "|---|---:|"]
        lines += [f"| {name.replace('  ', '&nbsp;&nbsp;')} | {share:.1f} |" for name, share in profile]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--events-per-message", type=int, default=8)
    parser.add_argument("--blocks-per-event", type=int, default=16)
    parser.add_argument("--cache-blocks", type=int, default=65_536,
                        help="blocks the simulated engine's KV cache holds (removals evict LRU at this distance)")
    parser.add_argument("--batch-max-events", type=int, default=1024)
    parser.add_argument("--soak-s", type=float, default=60.0)
    parser.add_argument("--soak-rate", type=float, default=None, help="block events/s (default 50%% of SQLite)")
    parser.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--profile", action="store_true", help="sample the SQLite consumer with py-spy")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="a copy of the repository (e.g. before a change): SQLite consume and append-only run "
                             "from both trees, interleaved, --repeats times each")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per tree with --baseline-tree")
    parser.add_argument("--only-sqlite", action="store_true",
                        help="skip discard/decode/PostgreSQL (with --baseline-tree: only the comparison)")
    parser.add_argument("--rss-log", type=Path, default=None, help="write the soak's RSS samples here (CSV)")
    parser.add_argument("--paced-s", type=float, default=0.0,
                        help="with --baseline-tree: also paced runs this long per tree (consumer CPU at a fixed rate; "
                             "--soak-rate, default 50%% of this tree's burst rate)")
    parser.add_argument("--out", type=Path, default=REPO / "tools" / "results" / f"consume-{dt.date.today()}.md")
    args = parser.parse_args()
    mp.set_start_method("spawn")
    work = Path(tempfile.mkdtemp(prefix="semkv-bench-"))
    load_start = os.getloadavg()
    rows: list[tuple] = []
    if not args.only_sqlite:
        rows += [("discard", run_subscriber(args, decode=False), None),
                 ("decode", run_subscriber(args, decode=True), None)]
    profile_file = work / "spy.txt" if args.profile else None
    paced: list[tuple[str, dict]] = []
    if args.baseline_tree is not None:
        rows += compare_trees(work, args)
        sqlite_s = next(row[1] for row in rows if row[0].startswith("sqlite (consume), this tree"))
        if args.paced_s > 0:
            paced = compare_paced(work, args, args.soak_rate or 0.5 * args.messages * args.events_per_message
                                  * args.blocks_per_event / sqlite_s)
    else:
        sqlite_s, rss = run_consumer(f"sqlite:///{work}/bench.db", args, profile_file)
        rows.append(("sqlite (consume)", sqlite_s, f"{rss:.1f}"))
        thread_s, rss = run_consumer(f"sqlite:///{work}/bench-thread.db", args, extra=("--writer-thread",))
        rows.append(("sqlite (consume, --writer-thread)", thread_s, f"{rss:.1f}"))
        first, again = run_append_only(f"sqlite:///{work}/append.db", args, passes=2)
        rows.append(("sqlite append-only (writer thread)", first, None))
        rows.append(("sqlite append-only, same stream again (the cache's steady state)", again, None))
    if args.only_sqlite:
        pass
    elif args.no_postgres:
        rows.append(("postgresql (consume)", None, "--no-postgres"))
    else:
        try:
            with postgres_scratch(args.pg_url) as pg:
                seconds, rss = run_consumer(pg, args)
                rows.append(("postgresql (consume)", seconds, f"{rss:.1f}"))
            with postgres_scratch(args.pg_url) as pg:
                rows.append(("postgresql append-only", run_append_only(pg, args)[0], None))
        except Exception as exc:  # noqa: BLE001 - the report says why PostgreSQL was skipped
            rows.append(("postgresql (consume)", None, type(exc).__name__))
    soak_row = None
    if args.soak_s > 0:
        total = args.messages * args.events_per_message * args.blocks_per_event
        target = args.soak_rate or 0.5 * total / sqlite_s
        soak_row = {**soak(f"sqlite:///{work}/soak.db", args, target, rss_log=args.rss_log), "target": target}
    profile = summarize_profile(profile_file) if profile_file and profile_file.exists() else []
    text = report(rows, soak_row, profile, args, load_start, paced)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
