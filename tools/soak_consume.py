"""Soak: ``semkv-ledger consume`` under mixed good and hostile traffic with periodic kill -9s
(issue 18's acceptance: nothing lost, nothing twice, no crash loop, replay equal, RSS flat).

A publisher process (XPUB + replay ROUTER with a bounded replay buffer, like an engine) sends, paced
at ``--rate`` block events/s, the cyclic vLLM-dialect stream of ``tools/bench_consume.py``
(``make_stream``: stores of new blocks, removals in LRU order) and, every ``--hostile-every``-th
message, one hostile message of the kinds in :data:`HOSTILE` instead (each kind in turn): integers
no column holds, a cache salt too long, a partial block, an event nested 5,000 levels deep, an
unknown type, a whole payload that is not msgpack, a rank no column holds, a message over the
events limit. Every ``--kill-every-s`` seconds (± 30 %), except in the last ``--calm-tail-s``, the
consumer and its ledger writer process are killed with SIGKILL and started again at once; the
engine's replay buffer covers the downtime.

At the end the publisher stops, the consumer catches up (its source position reaches the last
seq), stops with SIGTERM, and the ledger is checked with plain SQL:

* every published message is one ``batch_received`` row, exactly once (one source epoch);
* every event is in the log or in ``dead_letters``, exactly once (events in = events logged + dead
  letters; a payload-level failure counts as one dead letter for its message);
* dead letters by reason equal what was sent, per hostile kind;
* ``semkv-ledger replay`` rebuilds projections equal to the live ones;
* RSS (consumer + writer, sampled every second) of each consumer life: the last life's peak within
  ``--rss-margin-mib`` of the first's, and under 1 MiB/min over the second half of the longest life
  (the calm tail).

Results: a Markdown report on stdout and in ``tools/results/soak-consume-<date>-<HHMM>.md``.

Usage: ``python tools/soak_consume.py [--seconds 600] [--rate 50000] [--kill-every-s 45]
[--db postgresql://…]`` (default: a fresh SQLite file in a scratch directory).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import msgspec
import zmq

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(TOOLS))
from bench_consume import CLI, _slope, free_port, make_stream, process_tree, rss_mib, scrape  # noqa: E402

from consumer.bridge import ReplayBuffer, ReplayStats, serve_replay_request  # noqa: E402
from consumer.wire import encode_frames  # noqa: E402

ENC = msgspec.msgpack.Encoder()
ENGINE_KINDS = ("engine_created", "block_stored", "block_removed", "block_updated", "all_blocks_cleared")
REPLAY_BUFFER = 100_000  # batches: minutes of downtime at the default rate


def _good() -> dict:
    """A harmless good event: the removal of a block nobody stored."""
    return {"type": "BlockRemoved", "block_hashes": [random.getrandbits(63)], "medium": "GPU"}


def _trt_stored(**block: object) -> dict:
    return {"event_id": 1, "window_size": 4096, "data": {"type": "stored", "parent_hash": None, "blocks": [
        {"type": "stored_block", "block_hash": 5, "tokens": [{"token_id": 1}], **block}]}}


def _between(bad: object) -> bytes:
    return ENC.encode([time.time(), [_good(), bad, _good()], 0])


def _deep() -> bytes:
    events = b"\x93" + ENC.encode(_good()) + b"\x91" * 5000 + b"\x01" + ENC.encode(_good())
    return b"\x93" + ENC.encode(time.time()) + events + ENC.encode(0)


def _over_limit() -> bytes:
    """65,537 one-byte "events": refused from the events array's header, never decoded."""
    return ENC.encode([time.time(), [1] * 65_537, 0])


HOSTILE: dict[str, tuple[object, int, str]] = {
    # kind: (payload maker, slots (events, or 1 for a payload-level failure), dead-letter reason)
    "lora_id 2**63 (b)": (lambda: _between({"type": "BlockStored", "block_hashes": [3], "parent_block_hash": None,
                                            "token_ids": [1, 2], "block_size": 2, "lora_id": 2**63}),
                          3, "value_out_of_range"),
    "event_id 2**63 (a)": (lambda: _between(_trt_stored() | {"event_id": 2**63}), 3, "value_out_of_range"),
    "window_size 2**31 (a)": (lambda: _between(_trt_stored() | {"window_size": 2**31}), 3, "value_out_of_range"),
    "priority 2**31 (a)": (lambda: _between(_trt_stored(priority=2**31)), 3, "value_out_of_range"),
    "cache_salt 401 chars (a)": (lambda: _between(_trt_stored(cache_salt="x" * 401)), 3, "value_out_of_range"),
    "partial block (c)": (lambda: _between(["BlockStored", [4], None, [1, 2, 3], 2]), 3, "schema_mismatch"),
    "nested 5,000 deep": (_deep, 3, "malformed_msgpack"),
    "unknown type (b)": (lambda: _between({"type": "BlockTeleported", "block_hashes": [1]}), 3,
                         "unknown_event_type"),
    "payload not msgpack": (lambda: b"\x93\xcb\x41\xd9" + b"\xc1" * 16, 1, "malformed_msgpack"),
    "rank 2**31": (lambda: ENC.encode([time.time(), [_good()], 2**31]), 1, "value_out_of_range"),
    "65,537 events": (_over_limit, 1, "message_over_limit"),
}


def publisher_main(conn, stream: list[bytes], events_per_message: int, rate_msgs: float, hostile_every: int) -> None:
    """Publish until told to stop; then report what was sent and keep serving replay."""
    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)
    pub.setsockopt(zmq.SNDHWM, 0)
    router.setsockopt(zmq.SNDHWM, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    conn.send((pub.bind_to_random_port("tcp://127.0.0.1"), router.bind_to_random_port("tcp://127.0.0.1")))
    buffer, stats = ReplayBuffer(REPLAY_BUFFER), ReplayStats()
    while not pub.poll(100) or pub.recv()[:1] != b"\x01":
        serve_replay_request(router, buffer, stats)
    kinds, sent = list(HOSTILE), Counter()
    slots, good = 0, 0
    started, seq = time.time(), 0
    while not conn.poll():
        if hostile_every and seq % hostile_every == hostile_every - 1:
            kind = kinds[(seq // hostile_every) % len(kinds)]
            make, kind_slots, _ = HOSTILE[kind]
            payload, sent[kind] = make(), sent[kind] + 1  # type: ignore[operator]
            slots += kind_slots
        else:
            payload = stream[good % len(stream)]
            good += 1
            slots += events_per_message
        frames = encode_frames(b"kv", seq, payload)
        buffer.append(seq, frames)
        pub.send_multipart(frames)
        seq += 1
        serve_replay_request(router, buffer, stats)
        delay = started + seq / rate_msgs - time.time()
        if delay > 0:
            time.sleep(delay)
    conn.recv()  # "halt"
    conn.send({"messages": seq, "good": good, "slots": slots, "hostile": dict(sent), "seconds": time.time() - started})
    while not conn.poll(0.01):  # "stop": the consumer caught up
        serve_replay_request(router, buffer, stats)
    pub.close(0)
    router.close(0)
    ctx.term()


class Consumer:
    """``semkv-ledger consume`` as a subprocess that can be killed and started again."""

    def __init__(self, db: str, ports: tuple[int, int], log: Path) -> None:
        self.db, self.ports, self.log = db, ports, log
        self.lives: list[list[tuple[float, float]]] = []  # per life: (seconds into the life, RSS MiB)
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.metrics_port = free_port()
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", CLI, "consume", "--db", self.db, "--engine-id", "soak", "--source-id", "soak",
                 "--endpoint", f"tcp://127.0.0.1:{self.ports[0]}", "--replay-endpoint",
                 f"tcp://127.0.0.1:{self.ports[1]}", "--metrics-port", str(self.metrics_port), "--log-level",
                 "warning"], stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        self.born = time.time()
        self.lives.append([])

    def sample(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"the consumer exited by itself with {self.proc.returncode} (see {self.log})")
        self.lives[-1].append((time.time() - self.born, rss_mib(self.proc.pid)))

    def kill9(self) -> None:
        assert self.proc is not None
        for pid in reversed(process_tree(self.proc.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(30)

    def position(self) -> int:
        return int(scrape(self.metrics_port, "semkv_consumer_batches_committed_total"))

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.terminate()
        return self.proc.wait(120)


def ledger_checks(db: str, sent: dict) -> dict:
    """What the ledger holds, beside what was sent."""
    from sqlalchemy import text

    from ledger.db import sync_engine

    engine = sync_engine(db)
    with engine.connect() as conn:
        one = lambda sql: conn.execute(text(sql)).scalar()  # noqa: E731
        kinds = ",".join(f"'{k}'" for k in ENGINE_KINDS)
        out = {
            "batches": one("SELECT count(*) FROM log WHERE kind = 'batch_received'"),
            "distinct_seqs": one("SELECT count(DISTINCT zmq_seq) FROM log WHERE kind = 'batch_received'"),
            "epochs": one("SELECT count(DISTINCT source_epoch) FROM log WHERE source_id IS NOT NULL"),
            "engine_events": one(f"SELECT count(*) FROM log WHERE kind IN ({kinds})"),
            "dead_letters": one("SELECT count(*) FROM dead_letters"),
            "duplicate_keys": one("SELECT count(*) FROM (SELECT 1 FROM log WHERE source_id IS NOT NULL AND "
                                  "batch_index IS NOT NULL GROUP BY source_id, source_epoch, zmq_seq, batch_index "
                                  "HAVING count(*) > 1) d"),
            "gaps": one("SELECT count(*) FROM log WHERE kind = 'gap_detected'"),
            "generation_bumps": one("SELECT count(*) FROM log WHERE kind = 'generation_bumped'"),
            "by_reason": dict(conn.execute(text("SELECT reason, count(*) FROM dead_letters GROUP BY reason")).all()),
        }
    engine.dispose()
    expected = Counter()
    for kind, count in sent["hostile"].items():
        expected[HOSTILE[kind][2]] += count
    out["expected_by_reason"] = dict(expected)
    out["slots_logged"] = out["engine_events"] + out["dead_letters"]
    return out


def replay_equal(db: str) -> tuple[bool, str]:
    done = subprocess.run([sys.executable, "-c", CLI, "replay", "--db", db, "--json"], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    return done.returncode == 0, (done.stdout or done.stderr).strip()[-400:]


def soak(args: argparse.Namespace, db: str, work: Path) -> tuple[dict, dict, list, Consumer]:
    subprocess.run([sys.executable, "-c", CLI, "migrate", "--db", db], check=True, capture_output=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    stream = make_stream(args.messages, args.events_per_message, args.blocks_per_event, cache_blocks=args.cache_blocks)
    per_message = args.events_per_message * args.blocks_per_event
    good_share = 1 - 1 / args.hostile_every if args.hostile_every else 1.0  # --rate counts good block events
    conn, child = mp.Pipe()
    publisher = mp.Process(target=publisher_main, args=(child, stream, args.events_per_message,
                                                        args.rate / per_message / good_share, args.hostile_every),
                           daemon=True)
    publisher.start()
    consumer = Consumer(db, conn.recv(), work / "consume.log")
    kills: list[float] = []
    started = time.time()
    next_kill = started + args.kill_every_s * random.uniform(0.7, 1.3)
    try:
        while time.time() - started < args.seconds:
            consumer.sample()
            calm = time.time() - started > args.seconds - args.calm_tail_s  # one long life at the end
            if args.kill_every_s and time.time() >= next_kill and not calm:
                consumer.kill9()
                kills.append(time.time() - started)
                consumer.start()
                next_kill = time.time() + args.kill_every_s * random.uniform(0.7, 1.3)
            time.sleep(1.0)
        conn.send("halt")
        sent = conn.recv()
        deadline = time.time() + 600
        while consumer.position() < 0 or not _caught_up(db, sent["messages"]):
            consumer.sample()
            if time.time() > deadline:
                raise TimeoutError("the consumer did not catch up within 10 minutes")
            time.sleep(1.0)
        sent["catch_up_s"] = time.time() - started - args.seconds
        sent["exit_code"] = consumer.stop()
    finally:
        with contextlib.suppress(OSError):
            conn.send("stop")
        publisher.join(10)
        if consumer.proc is not None and consumer.proc.poll() is None:
            consumer.kill9()
    return sent, ledger_checks(db, sent), kills, consumer


def _caught_up(db: str, messages: int) -> bool:
    from sqlalchemy import text

    from ledger.db import sync_engine

    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            last = conn.execute(text("SELECT max(last_seq) FROM sources")).scalar()
    finally:
        engine.dispose()
    return last is not None and last >= messages - 1


def report(args: argparse.Namespace, db: str, sent: dict, ledger: dict, kills: list, consumer: Consumer,
           replay: tuple[bool, str], load: tuple[float, ...]) -> tuple[str, bool]:
    per_message = args.events_per_message * args.blocks_per_event
    block_events = sent["good"] * per_message
    lives = [life for life in consumer.lives if life]
    peaks = [max(r for _, r in life) for life in lives]
    longest = max(lives, key=len)
    slope = 60 * _slope(longest[len(longest) // 2:])
    checks = {
        "every message logged once": ledger["batches"] == ledger["distinct_seqs"] == sent["messages"],
        "one source epoch": ledger["epochs"] == 1,
        "events in = events logged + dead letters": ledger["slots_logged"] == sent["slots"],
        "no duplicate idempotency key": ledger["duplicate_keys"] == 0,
        "dead letters by reason as sent": ledger["by_reason"] == ledger["expected_by_reason"],
        "no gap": ledger["gaps"] == 0,
        "replay equal": replay[0],
        f"RSS flat (last life's peak within {args.rss_margin_mib:.0f} MiB of the first's; under 1 MiB/min in "
        "the longest life's second half)": peaks[-1] - peaks[0] <= args.rss_margin_mib and slope < 1.0,
        "the daemon never exited by itself, clean exit at the end": sent["exit_code"] == 0,
    }
    lines = [
        f"# consumer soak {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}", "",
        f"Host: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}; load average {load[0]:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end. Ledger: {db.split('://')[0]}. Publisher paced at {args.rate:,} block "
        f"events/s ({args.events_per_message} events × {args.blocks_per_event} blocks a message, vLLM map dialect, "
        f"an engine cache of {args.cache_blocks:,} blocks), one hostile message every {args.hostile_every}, "
        f"SIGKILL of the consumer and its writer every {args.kill_every_s:.0f} s ± 30 % (none in the last "
        f"{args.calm_tail_s:.0f} s).", "",
        "| what | value |", "|---|---:|",
        f"| seconds published | {sent['seconds']:.0f} |",
        f"| messages (good / hostile) | {sent['messages']:,} ({sent['good']:,} / {sum(sent['hostile'].values()):,}) |",
        f"| good block events | {block_events:,} ({block_events / sent['seconds']:,.0f}/s) |",
        f"| events in (a payload-level failure counts 1) | {sent['slots']:,} |",
        f"| events logged + dead letters | {ledger['engine_events']:,} + {ledger['dead_letters']:,} = "
        f"{ledger['slots_logged']:,} |",
        f"| kill -9s | {len(kills)} (at {', '.join(f'{k:.0f}' for k in kills)} s) |",
        f"| catch-up after the publisher stopped | {sent['catch_up_s']:.1f} s |",
        f"| gaps / generation bumps | {ledger['gaps']} / {ledger['generation_bumps']} |",
        f"| RSS peak per life, MiB | {', '.join(f'{p:.0f}' for p in peaks)} |",
        f"| RSS slope in the longest life ({len(longest)} s) | {slope:+.2f} MiB/min (second half) |", "",
        "| hostile kind | sent | expected dead letter |", "|---|---:|---|",
        *[f"| {kind} | {sent['hostile'].get(kind, 0)} | `{HOSTILE[kind][2]}` |" for kind in HOSTILE], "",
        f"Dead letters by reason: {json.dumps(ledger['by_reason'], sort_keys=True)} "
        f"(expected {json.dumps(ledger['expected_by_reason'], sort_keys=True)}).", "",
        f"Replay: {'equal' if replay[0] else 'DIFFERENT'} ({replay[1][:200]}).", "",
        "| check | held |", "|---|---|", *[f"| {name} | {'yes' if ok else '**NO**'} |" for name, ok in checks.items()],
    ]
    return "\n".join(lines) + "\n", all(checks.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--rate", type=int, default=50_000, help="good block events/s")
    parser.add_argument("--kill-every-s", type=float, default=45)
    parser.add_argument("--hostile-every", type=int, default=50, help="one hostile message in this many")
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--events-per-message", type=int, default=8)
    parser.add_argument("--blocks-per-event", type=int, default=16)
    parser.add_argument("--cache-blocks", type=int, default=65_536)
    parser.add_argument("--calm-tail-s", type=float, default=180, help="no kill in the last this many seconds: "
                        "the RSS slope is measured in that last, long life")
    parser.add_argument("--rss-margin-mib", type=float, default=64)
    parser.add_argument("--db", help="ledger URL (default: a fresh SQLite file in a scratch directory)")
    parser.add_argument("--out", type=Path, help="report path (default tools/results/soak-consume-<date>-<HHMM>.md)")
    args = parser.parse_args()
    load = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="semkv-soak-"))
    db = args.db or f"sqlite:///{work / 'ledger.db'}"
    sent, ledger, kills, consumer = soak(args, db, work)
    text, ok = report(args, db, sent, ledger, kills, consumer, replay_equal(db), load)
    if ok:
        shutil.rmtree(work)
    else:
        print(f"kept {work} (the ledger and the consumer's log)", file=sys.stderr)
    out = args.out or TOOLS / "results" / f"soak-consume-{dt.datetime.now().strftime('%Y-%m-%d-%H%M')}.md"
    out.write_text(text)
    print(text)
    print(f"saved {out}", file=sys.stderr)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
