"""An independent subscriber to the Dynamo workers' KV events: the yardstick the ledger is checked
against. Plain pyzmq and msgspec, nothing from semkv-ledger: one SUB per worker (connected to its
PUB on 127.0.0.1) and a DEALER to its replay ROUTER, which fills every hole in the seqs it sees —
a first message above seq 0 (the ZMQ slow joiner; a restarted worker heard of late) or a jump.

Wire (``../shared/reference/DYNAMO_CPU.md``): live frames ``[topic, seq u64 BE, msgpack [ts,
[events], dp_rank]]``, events are maps tagged by ``type`` (``BlockStored`` with ``block_hashes``,
``BlockRemoved`` with ``block_hashes``, ``AllBlocksCleared``); replay: DEALER sends ``[b"", start
seq]``, the ROUTER answers ``[b"", topic, seq, payload]`` per buffered message, then the end
marker (seq -1, empty payload). A worker that restarts starts again at seq 0: a seq at or below the
last one with another payload begins a new run, and so does a message stamped after the test
stopped the worker (:meth:`IndependentSubscriber.stopped`; the engine's timestamps are this
machine's clock).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import msgspec
import zmq

END_MARKER = (2**64 - 1).to_bytes(8, "big")
REPLAY_TIMEOUT_MS = 2000


@dataclass
class Run:
    """One run (process lifetime) of a worker: its messages by seq, as received (raw payload)."""

    payloads: dict[int, bytes] = field(default_factory=dict)
    events: dict[int, list[dict]] = field(default_factory=dict)

    @property
    def last_seq(self) -> int:
        return max(self.payloads, default=-1)

    def add(self, seq: int, payload: bytes) -> None:
        self.payloads[seq] = payload
        self.events[seq] = msgspec.msgpack.decode(payload)[1]

    def live_blocks(self) -> set[int]:
        """Block hashes stored and not removed since, applying the run's events in seq order."""
        live: set[int] = set()
        for seq in sorted(self.events):
            for event in self.events[seq]:
                kind = event.get("type")
                if kind == "BlockStored":
                    live.update(event["block_hashes"])
                elif kind == "BlockRemoved":
                    live.difference_update(event["block_hashes"])
                elif kind == "AllBlocksCleared":
                    live.clear()
        return live


@dataclass
class WorkerRecord:
    """Everything heard from one worker's slot, run by run (the last run is the current one)."""

    runs: list[Run] = field(default_factory=lambda: [Run()])
    replayed: int = 0
    """Messages this subscriber got by replay (not live)."""
    stopped_at: float | None = None
    """Wall-clock time the test stopped the worker, until its new run's first message."""

    @property
    def current(self) -> Run:
        return self.runs[-1]

    def live_blocks(self) -> frozenset[int]:
        """The current run's live blocks; none once the worker was stopped (its cache went with its
        process) until its new run publishes."""
        return frozenset() if self.stopped_at is not None else frozenset(self.current.live_blocks())

    def messages(self) -> int:
        return sum(len(run.payloads) for run in self.runs)

    def events(self) -> int:
        return sum(len(events) for run in self.runs for events in run.events.values())


class IndependentSubscriber:
    """Records every KV-event message of ``sources`` (``{engine_id: (endpoint, replay_endpoint)}``)
    on a thread of its own until :meth:`close`. Read the records under :attr:`lock`."""

    def __init__(self, sources: dict[str, tuple[str, str]]) -> None:
        self.records = {engine_id: WorkerRecord() for engine_id in sources}
        self.lock = threading.Lock()
        self._ctx = zmq.Context()
        self._subs: dict[zmq.Socket, str] = {}
        self._replay = dict(sources)
        for engine_id, (endpoint, _replay) in sources.items():
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVHWM, 0)  # never drop: the test reads everything
            sub.connect(endpoint)
            self._subs[sub] = engine_id
        self.error: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="independent-subscriber", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        poller = zmq.Poller()
        for sub in self._subs:
            poller.register(sub, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sub, _ in poller.poll(100):
                    topic, seq, payload = sub.recv_multipart()
                    self._receive(self._subs[sub], int.from_bytes(seq, "big"), payload)
        except Exception as exc:  # noqa: BLE001 - kept and raised by snapshot(), in the test's thread
            self.error = exc

    def _receive(self, engine_id: str, seq: int, payload: bytes) -> None:
        record = self.records[engine_id]
        run = record.current
        if seq in run.payloads and run.payloads[seq] == payload:
            return  # already had it by replay
        restarted = record.stopped_at is not None and msgspec.msgpack.decode(payload)[0] > record.stopped_at
        if restarted or (run.payloads and seq <= run.last_seq):
            with self.lock:
                if run.payloads:
                    record.runs.append(Run())  # the worker restarted: its seq starts again
                record.stopped_at = None
            run = record.current
        expected = run.last_seq + 1
        if seq > expected:
            self._fill(engine_id, expected, seq)
        with self.lock:
            run.add(seq, payload)

    def _fill(self, engine_id: str, start: int, until: int) -> None:
        """Ask the worker's replay ROUTER for ``[start, until)`` and add what it answers."""
        record, run = self.records[engine_id], self.records[engine_id].current
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self._replay[engine_id][1])
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while dealer.poll(REPLAY_TIMEOUT_MS):
                frames = dealer.recv_multipart()
                seq, payload = frames[-2], frames[-1]
                if seq == END_MARKER:
                    return
                number = int.from_bytes(seq, "big")
                if start <= number < until and number not in run.payloads:
                    with self.lock:
                        run.add(number, payload)
                        record.replayed += 1
            raise RuntimeError(f"{engine_id}: replay of [{start}, {until}) got no end marker")
        finally:
            dealer.close()

    def stopped(self, engine_id: str) -> None:
        """The test stopped this worker (its process has exited): a message stamped later is of a
        new run. (The seqs alone tell it too, unless the new run passed the old one's last seq
        before the SUB reconnected; the old run's last messages may still be on their way.)"""
        with self.lock:
            self.records[engine_id].stopped_at = time.time()

    def snapshot(self) -> dict[str, tuple[int, int, frozenset[int]]]:
        """Per engine: (messages, events, live block hashes of the current run, :meth:`WorkerRecord.live_blocks`).

        Raises:
            RuntimeError: the subscriber's thread failed (a replay without an end marker, a frame
                it could not read): it is no yardstick any more.
        """
        if self.error is not None:
            raise RuntimeError(f"the independent subscriber failed: {self.error!r}") from self.error
        with self.lock:
            return {engine_id: (r.messages(), r.events(), r.live_blocks()) for engine_id, r in self.records.items()}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sub in self._subs:
            sub.close(0)
        self._ctx.term()
