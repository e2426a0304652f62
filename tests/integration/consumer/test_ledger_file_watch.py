"""The SQLite ledger file is watched (issue #18, defect 4): deleted, replaced (renamed over), made
read-only (``chattr +i``: the one thing that stops root, who bypasses mode bits) or its directory
made read-only while ``consume`` runs, the daemon stops with a permanent error and a non-zero exit
BEFORE it acknowledges another transaction, instead of committing into a file nobody will read
again (exit 0, ``clean_exit: true``) or retrying "disk I/O error" forever.

Real daemons (in-process for the exact counts, a ``semkv-ledger consume`` process for the exit
code and the log line), real ZMQ on 127.0.0.1, real SQLite files. A lock (SQLITE_BUSY) is still
retried: tests/integration/consumer/test_daemon_faults.py::test_database_briefly_locked_is_retried.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ledger.errors import PersistenceError, is_transient
from tests.integration.consumer.daemon_support import (
    DaemonRun,
    FaultPublisher,
    PayloadMaker,
    ledger_counts,
    migrated_db,
    settings_for,
    subscribed,
    wait_until,
)
from tests.integration.consumer.test_daemon_process import Consumer, source_args, wait_for

ENGINE = "trt-0"
FIRST = 5  # batches committed before the fault


def _chattr(flag: str, *paths: Path) -> bool:
    return subprocess.run(["chattr", flag, *map(str, paths)], capture_output=True).returncode == 0


@pytest.fixture
def immutable() -> Iterator[Callable[[Path], None]]:
    """``immutable(path)``: ``chattr +i`` (undone after the test); skips where the file system has
    no immutable attribute (tmpfs, overlayfs without it) or we lack CAP_LINUX_IMMUTABLE."""
    done: list[Path] = []

    def make(path: Path) -> None:
        if not _chattr("+i", path):
            pytest.skip(f"chattr +i is not supported on {path}'s file system (or not allowed here)")
        done.append(path)

    yield make
    for path in done:
        _chattr("-i", path)


def fault_of(name: str, path: Path, tmp_path: Path, immutable: Callable[[Path], None]) -> Callable[[], None]:
    """The fault ``name`` on the ledger at ``path`` (run while the daemon writes it)."""
    if name == "deleted":
        return lambda: os.unlink(path)
    if name == "replaced":
        _, other = migrated_db(tmp_path, "other.db")  # another valid ledger, renamed over this one
        return lambda: os.replace(other, path)
    if name == "wal_deleted":
        return lambda: os.unlink(f"{path}-wal")
    if name == "read_only":
        return lambda: immutable(path)
    if name == "directory_read_only":
        return lambda: immutable(path.parent)
    raise AssertionError(name)


MESSAGES = {"deleted": ".db was deleted while the consumer wrote it",
            "replaced": ".db was replaced while the consumer wrote it",
            "wal_deleted": ".db-wal was deleted while the consumer wrote it",
            "read_only": "is no longer writable by this user",
            "directory_read_only": "is no longer writable by this user"}
"""The distinctive part of each error (docs/troubleshooting.md quotes them)."""


def test_the_troubleshooting_page_quotes_these_messages():
    page = (Path(__file__).resolve().parents[3] / "docs" / "troubleshooting.md").read_text()
    for message in [*MESSAGES.values(), "stopping: nothing more is acknowledged"]:
        assert message in page, message


@pytest.mark.parametrize("writer_process", [True, False], ids=["process", "thread"])
@pytest.mark.parametrize("fault", list(MESSAGES))
async def test_a_ledger_file_lost_mid_run_stops_the_daemon_before_it_acknowledges_more(
        tmp_path, immutable, fault, writer_process):
    ledger_dir = tmp_path / "ledger"
    ledger_dir.mkdir()
    db, path = migrated_db(ledger_dir)
    inject = fault_of(fault, path, ledger_dir, immutable)
    make = PayloadMaker()
    with FaultPublisher() as pub:
        source = {"engine_id": ENGINE, "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint}
        async with DaemonRun(settings_for(db, source, writer_process=writer_process, db_retry_max_s=0.2)) as run:
            await subscribed(pub, run)
            for seq in range(FIRST):
                pub.publish(seq, make(seq))
            await wait_until(lambda: run.daemon.stats.batches == FIRST, what=f"{FIRST} batches")
            inject()
            for seq in range(FIRST, FIRST + 5):
                pub.publish(seq, make(seq))
            task = run._task
            assert task is not None
            with pytest.raises(PersistenceError) as caught:
                await asyncio.wait_for(asyncio.shield(task), 30)  # not a retry loop: it ends
    assert MESSAGES[fault] in str(caught.value) and not is_transient(caught.value)
    if fault == "directory_read_only":
        assert f"({ledger_dir} is read-only)" in str(caught.value)
    stats = run.daemon.stats
    assert stats.batches == FIRST and not stats.clean_exit  # nothing acknowledged after the fault
    assert run.metric("semkv_consumer_batches_committed_total") == FIRST
    assert run.metric("semkv_consumer_db_retries_total") == 0
    if fault == "replaced":  # the ledger now at the path was never written, nor read with our WAL
        assert ledger_counts(path).batches == 0
        assert sqlite3.connect(path).execute("PRAGMA integrity_check").fetchone() == ("ok",)


@pytest.mark.parametrize("fault", ["deleted", "read_only"])
def test_consume_exits_1_with_one_clear_log_line(tmp_path, immutable, fault):
    db, path = migrated_db(tmp_path)
    inject = fault_of(fault, path, tmp_path, immutable)
    make = PayloadMaker()
    with FaultPublisher() as pub:
        consumer = Consumer(*source_args(db, pub))
        try:
            consumer.wait_event("daemon.started")
            pub.wait_for_subscriber()
            pub.publish(0, make(0))
            wait_for(lambda: ledger_counts(path).batches == 1, 20, "the first batch committed")
            inject()
            for seq in range(1, 4):
                pub.publish(seq, make(seq))
            code = consumer.finish(timeout_s=30)  # not a retry loop: it exits
        finally:
            if consumer.proc.poll() is None:
                consumer.proc.kill()
                consumer.proc.wait()
    assert code == 1
    failed = consumer.wait_event("ledger.append_failed")
    assert MESSAGES[fault] in failed["error"] and str(path) in failed["error"]
    assert consumer.wait_event("daemon.database_error")
    assert not [e for e in consumer.events() if e.get("event") == "ledger.append_retry"]
    assert not [e for e in consumer.events() if e.get("event") == "daemon.stopped"]  # no clean exit
