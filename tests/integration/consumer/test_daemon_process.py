"""``semkv-ledger consume`` as a real process: refusing an unmigrated ledger, SIGTERM (commit what was
received, exit 0), and SIGKILL mid-batch 20 times then a restart (every event exactly once)."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.consumer.daemon_support import EVENTS_PER_BATCH, FaultPublisher, PayloadMaker, ledger_counts, migrated_db
from ledger.replay import replay

ENGINE = "trt-0"
_SCRIPT = Path(sys.executable).with_name("semkv-ledger")
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-c", "from ledger.cli import main; main()"]


class Consumer:
    """A ``semkv-ledger consume`` subprocess whose JSON log lines (stderr) are collected."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([*CLI, "consume", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=os.getcwd())
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def events(self) -> list[dict]:
        out = []
        for line in list(self.lines):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def wait_event(self, name: str, timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for event in self.events():
                if event.get("event") == name:
                    return event
            if self.proc.poll() is not None:
                break
            time.sleep(0.01)
        raise AssertionError(f"no {name} log line; stderr:\n{''.join(self.lines)[-3000:]}")

    def finish(self, timeout_s: float = 30.0) -> int:
        code = self.proc.wait(timeout_s)
        self._reader.join(5)
        return code


def source_args(db: str, pub: FaultPublisher, *extra: str) -> list[str]:
    return ["--db", db, "--engine-id", ENGINE, "--endpoint", pub.endpoint, "--replay-endpoint",
            str(pub.replay_endpoint), "--replay-timeout-s", "2", *extra]


def batches_in(path: Path) -> int:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        return conn.execute("SELECT count(*) FROM log WHERE kind = 'batch_received'").fetchone()[0]
    except sqlite3.OperationalError:  # a writer is recovering the WAL of a killed process
        return -1
    finally:
        conn.close()


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def metric(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_ledger_in_a_missing_directory_is_one_line_and_exit_2(tmp_path):
    refused = Consumer("--db", str(tmp_path / "no-such-dir" / "ledger.db"), "--engine-id", ENGINE)
    assert refused.finish() == 2
    assert "directory" in "".join(refused.lines) and "Traceback" not in "".join(refused.lines)


@pytest.mark.parametrize("writer", ["--writer-process", "--writer-thread"])
def test_a_ledger_this_user_cannot_write_is_refused_at_start(tmp_path, writer):
    """SQLite opens a read-only file and fails only at its first write: the daemon must not start,
    then retry that write forever. ``chattr +i`` makes the file unwritable even for root."""
    db, path = migrated_db(tmp_path)
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        refused = Consumer("--db", db, "--engine-id", ENGINE, writer)
        assert refused.finish() == 2
        assert "not writable" in "".join(refused.lines)
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def test_a_writer_process_killed_while_it_starts_is_started_again(tmp_path):
    """An OOM kill of the writer process during the daemon's start must not stop the daemon (the
    systemd unit does not restart on exit 2)."""
    db, _ = migrated_db(tmp_path)
    consumer = Consumer("--db", db, "--engine-id", ENGINE, "--endpoint", "tcp://127.0.0.1:9", "--exit-when-idle", "1")
    deadline = time.monotonic() + 30
    while not (children := _children(consumer.proc.pid)):
        assert time.monotonic() < deadline and consumer.proc.poll() is None, "no writer process appeared"
        time.sleep(0.002)
    os.kill(children[0], signal.SIGKILL)  # it needs ~0.5 s to import before it could answer
    retry = consumer.wait_event("ledger.open_retry")
    assert "exited" in retry["error"] and retry["attempt"] == 1
    consumer.wait_event("daemon.started")
    assert consumer.finish() == 0


def test_unmigrated_ledger_is_refused_unless_migrate(tmp_path):
    db = str(tmp_path / "fresh.db")
    refused = Consumer("--db", db, "--engine-id", ENGINE)
    assert refused.finish() == 2
    assert "semkv-ledger migrate" in "".join(refused.lines)
    migrated = Consumer("--db", db, "--engine-id", ENGINE, "--migrate", "--exit-when-idle", "0.2",
                        "--endpoint", "tcp://127.0.0.1:9")
    assert migrated.finish() == 0
    migrated.wait_event("ledger.migrated")


def test_sigterm_commits_what_was_received_and_exits_0(tmp_path):
    db, path = migrated_db(tmp_path)
    make = PayloadMaker()
    with FaultPublisher() as pub:
        consumer = Consumer(*source_args(db, pub, "--metrics-port", "0", "--batch-max-delay-ms", "600000",
                                         "--batch-max-events", "100000"))
        port = consumer.wait_event("daemon.started")["metrics_port"]
        pub.wait_for_subscriber()
        for seq in range(50):
            pub.publish(seq, make(seq))
        wait_for(lambda: metric(port, "semkv_consumer_messages_received_total") >= 50, 20, "50 received")
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).read())
        assert health["status"] == "ok" and health["sources"][f"{ENGINE}@{pub.endpoint}"]["alive"]
        assert metric(port, "semkv_consumer_transactions_total") == 0  # all of it still waits in the writer
        consumer.proc.send_signal(signal.SIGTERM)
        assert consumer.finish() == 0
    counts = ledger_counts(path)
    assert counts.batches == 50 and counts.engine_events == 50 * EVENTS_PER_BATCH
    assert consumer.wait_event("daemon.stopped")["clean_exit"] is True


class Streamer(threading.Thread):
    """Publishes a batch every ``interval_s`` until stopped (a fast engine that never waits)."""

    def __init__(self, pub: FaultPublisher, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.pub, self.interval_s = pub, interval_s
        self.make = PayloadMaker()
        self.published = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.pub.publish(self.published, self.make(self.published))
            self.published += 1
            self.halt.wait(self.interval_s)


@pytest.mark.slow
def test_sigkill_mid_batch_20_times_then_restart_loses_and_duplicates_nothing(tmp_path):
    db, path = migrated_db(tmp_path)
    rng = random.Random(20)
    with FaultPublisher(buffer_steps=200_000) as pub:
        streamer = Streamer(pub, interval_s=0.01)
        streamer.start()
        args = source_args(db, pub, "--batch-max-events", "64", "--log-level", "warning")
        try:
            for _ in range(20):
                before = max(batches_in(path), 0)
                consumer = Consumer(*args)
                wait_for(lambda: batches_in(path) > before or consumer.proc.poll() is not None, 60, "a commit")
                assert consumer.proc.poll() is None, "".join(consumer.lines)[-2000:]
                time.sleep(rng.uniform(0, 0.03))  # somewhere inside the next transactions
                consumer.proc.kill()
                assert consumer.finish() == -signal.SIGKILL
        finally:
            streamer.halt.set()
            streamer.join()
        total = streamer.published
        final = Consumer(*args)
        wait_for(lambda: batches_in(path) == total or final.proc.poll() is not None, 90, f"{total} batches")
        final.proc.send_signal(signal.SIGTERM)
        assert final.finish() == 0
    counts = ledger_counts(path)
    assert counts.batches == total
    assert counts.engine_events == total * EVENTS_PER_BATCH
    assert counts.duplicate_keys == 0
    conn = sqlite3.connect(path)
    per_key = conn.execute("SELECT count(*), count(DISTINCT source_id || '/' || source_epoch || '/' || zmq_seq || "
                           "'/' || batch_index) FROM log WHERE kind IN ('block_stored', 'block_removed')").fetchone()
    conn.close()
    assert per_key == (total * EVENTS_PER_BATCH, total * EVENTS_PER_BATCH)
    assert counts.gaps() == {} and counts.bumps() == {}  # every kill was healed by replay
    assert replay(db).equal
