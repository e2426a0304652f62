"""An idle probe answered after live messages queued up yields to them (newcomer finding 5).

The idle probe asks the engine's replay socket for anything after the ledger's last batch while the
SUB is quiet. If the engine keeps publishing and restarts before it answers (or a multi-run capture
is published at once by ``semkv-ledger publish --speed 0``), the answer holds the NEW run while the
SUB already queued the rest of the OLD run: passed on first, the answer made the old run's batches
look late (``late_from_another_run`` dead letters) or like more restarts, so the same traffic gave
different ledgers run to run. Now a live message waiting before the answer wins: the probe is
dropped and the live path judges the messages in the order the engine sent them.

Real ZMQ on loopback: the daemon in process, an XPUB for live batches and a replay ROUTER whose
answers this test releases, so the order of events is the one a racing engine produces.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import zmq

from consumer.bridge import ReplayBuffer, ReplayStats, serve_replay_request
from ledger.replay import replay
from tests.engine_runs import EngineRun
from tests.integration.consumer.daemon_support import (DaemonRun, FaultPublisher, ledger_counts, migrated_db,
                                                       read_rows, settings_for, subscribed, wait_until)

ENGINE = "worker-0"


class HeldReplay:
    """A replay ROUTER on a thread: it answers from :attr:`buffer` every request once released,
    and until then holds the requests that arrive (:meth:`wait_held` says one is waiting)."""

    def __init__(self) -> None:
        self.buffer = ReplayBuffer(1000)
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind("tcp://127.0.0.1:0")
        self.endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.answering = threading.Event()
        self.answering.set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        stats = ReplayStats()
        while not self._stop.is_set():
            if self.answering.is_set() and self._router.poll(10):
                with self._lock:
                    serve_replay_request(self._router, self.buffer, stats)
            else:
                time.sleep(0.005)

    def wait_held(self, timeout_s: float = 10.0) -> None:
        """Stop answering and wait until a request is held."""
        self.answering.clear()
        deadline = time.monotonic() + timeout_s
        while not self._router.poll(10, zmq.POLLIN):
            if time.monotonic() > deadline:
                raise AssertionError("no replay request came")

    def append(self, seq: int, frames: list[bytes]) -> None:
        with self._lock:
            self.buffer.append(seq, frames)

    def clear(self) -> None:
        with self._lock:
            self.buffer.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._router.close(linger=0)
        self._ctx.term()


def send(pub: FaultPublisher, held: HeldReplay, run: EngineRun, count: int) -> None:
    for _ in range(count):
        seq = run.next_seq
        frames = pub.publish(seq, run.payload(("stored", [hash((id(run), seq)) % 2**63])), buffer=False)
        held.append(seq, frames)
        run.next_seq += 1


async def test_a_probe_answered_after_live_messages_does_not_reorder_runs(tmp_path: Path) -> None:
    db, path = migrated_db(tmp_path)
    held = HeldReplay()
    pub = FaultPublisher(replay=False)
    try:
        source = {"engine_id": ENGINE, "endpoint": pub.endpoint, "replay_endpoint": held.endpoint}
        async with DaemonRun(settings_for(db, source, idle_replay_s=0.1, replay_timeout_s=10.0)) as run:
            await subscribed(pub, run)
            first_run = EngineRun("trt")
            send(pub, held, first_run, 3)
            await wait_until(lambda: ledger_counts(path, ENGINE).batches == 3, 10, "the first batches")
            await asyncio.to_thread(held.wait_held)  # an idle probe asks from seq 2; its answer waits
            send(pub, held, first_run, 2)  # the old run goes on (seqs 3, 4) ...
            held.clear()  # ... the engine restarts: its replay buffer holds the new run only
            second_run = EngineRun("trt")
            send(pub, held, second_run, 2)  # seqs 0, 1, live too
            await asyncio.sleep(0.3)  # no observable condition: the four live messages reach the SUB's queue
            held.answering.set()  # the probe's answer comes only now, after them
            await wait_until(lambda: ledger_counts(path, ENGINE).batches == 7, 10, "every batch")
            await run.stop()
    finally:
        pub.close()
        held.close()
    counts = ledger_counts(path, ENGINE)
    assert counts.dead_letters_by_reason == {}, counts.dead_letters_by_reason
    assert counts.bumps() == {"seq_reset": 1}, counts.counters
    logged = read_rows(path, "SELECT source_epoch, zmq_seq FROM log WHERE kind = 'batch_received' ORDER BY seq")
    assert logged == [(1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (2, 0), (2, 1)]
    assert replay(db).equal
