"""The SQLite ledger's files as the writer watches them (ledger/sqlite_writer.py ``LedgerFiles``;
issue #18, defect 4), below the daemon (tests/integration/consumer/test_ledger_file_watch.py runs
it): a writer process restarted after the ledger was deleted or replaced refuses it instead of
creating or adopting another file; the WAL checkpointer never opens another file at the path; a
lock is still a transient error. Real SQLite files, real writer processes."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ledger.checkpoint import WalCheckpointer
from ledger.errors import LedgerUnwritable, PersistenceError, is_transient
from ledger.migrate import upgrade
from ledger.sqlite_writer import FileId, LedgerFiles, SQLiteWriterConnection
from ledger.writer import LedgerWriter
from tools.harness.builders import batch, stored


def _path(db: str) -> Path:
    return Path(db.removeprefix("sqlite:///"))


@pytest.mark.parametrize("fault", ["deleted", "replaced"])
async def test_a_writer_process_restarted_after_the_ledger_was_lost_refuses_it(sqlite_db, tmp_path, fault):
    """The child dies (an OOM kill), then the ledger is deleted or replaced: the new child must not
    create an empty ledger at the path, nor write the file renamed over it."""
    path = _path(sqlite_db)
    writer = await LedgerWriter.open(sqlite_db, process=True)
    try:
        assert (await writer.append([batch(0, stored(1))])).batches == 1
        writer._runner.child.process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        writer._runner.child.process.wait()  # type: ignore[union-attr]
        journal = [Path(f"{path}-wal"), Path(f"{path}-shm")]
        if fault == "deleted":
            path.unlink()
        else:  # the journal of the killed child goes first (with it the file would be corrupt anyway)
            for stale in journal:
                stale.unlink()
            other = f"sqlite:///{tmp_path / 'other.db'}"
            upgrade(other)
            os.replace(_path(other), path)
        with pytest.raises(LedgerUnwritable, match=f"was {fault}") as caught:
            await writer.append([batch(1, stored(2))])
        assert not is_transient(caught.value)
    finally:
        await writer.close()
    if fault == "deleted":
        assert not path.exists()
    else:
        assert not any(p.exists() for p in journal)  # the new child never opened the replacement
        conn = sqlite3.connect(path)
        assert conn.execute("SELECT count(*) FROM log").fetchone() == (0,)
        conn.close()


def test_the_checkpointer_never_opens_another_file_at_the_ledgers_path(sqlite_db, tmp_path):
    path = _path(sqlite_db)
    files = LedgerFiles(path, FileId.of(path))
    path.unlink()  # nothing there now: sqlite3.connect would create an empty file
    checkpointer = WalCheckpointer(str(path), same_file=files.check_same, min_interval_s=0.0)
    try:
        checkpointer.committed()
        time.sleep(0.3)
    finally:
        checkpointer.close()
    assert not path.exists() and checkpointer.checkpoints == 0


def test_the_checkpointer_never_starts_a_second_wal_beside_the_writers(sqlite_db):
    """The writer's WAL deleted: a checkpointer (re)connecting by path would create another one,
    which readers would then pair with the writer's ``-shm``."""
    path = _path(sqlite_db)
    writer = SQLiteWriterConnection(sqlite_db)
    try:
        writer.check_schema()  # pins the ledger and its journal
        wal = Path(f"{path}-wal")
        wal.unlink()
        checkpointer = WalCheckpointer(str(path), same_file=writer.files.check_same, min_interval_s=0.0)
        try:
            checkpointer.committed()
            time.sleep(0.3)
        finally:
            checkpointer.close()
        assert not wal.exists() and checkpointer.checkpoints == 0
        with pytest.raises(LedgerUnwritable, match="-wal was deleted"):
            writer.append([batch(0, stored(1))], None)
    finally:
        writer.close()


def test_a_lock_is_still_transient_and_the_files_check_passes(sqlite_db, lock_holder, monkeypatch):
    import ledger.backends.sqlite

    monkeypatch.setattr(ledger.backends.sqlite, "SQLITE_BUSY_TIMEOUT_MS", 50)
    writer = SQLiteWriterConnection(sqlite_db)
    try:
        writer.check_schema()
        lock_holder.hold()
        with pytest.raises(PersistenceError) as caught:
            writer.append([batch(0, stored(1))], None)
        assert not isinstance(caught.value, LedgerUnwritable) and is_transient(caught.value)
        lock_holder.release()
        assert writer.append([batch(0, stored(1))], None).batches == 1
    finally:
        writer.close()


_WRITE_PAST_A_SIZE_LIMIT = textwrap.dedent("""
    import json, os, resource, signal, sys
    from ledger.errors import LedgerUnwritable, PersistenceError, is_transient
    from ledger.sqlite_writer import SQLiteWriterConnection
    from tools.harness.builders import batch, stored
    db, wal = sys.argv[1], sys.argv[2]
    writer = SQLiteWriterConnection(db)
    writer.check_schema()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # then write(2) fails with EFBIG, as ENOSPC would
    resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(wal) + 200_000, resource.RLIM_INFINITY))
    for seq in range(1000):
        try:
            writer.append([batch(seq, *[stored(seq * 50 + i + 1) for i in range(50)])], None)
        except PersistenceError as exc:
            print(json.dumps({"unwritable": isinstance(exc, LedgerUnwritable), "transient": is_transient(exc),
                              "error": str(exc)}))
            break
""")


def test_an_io_error_with_the_files_in_place_stays_transient(sqlite_db):
    """A write refused by the OS while the ledger's files are in place and writable (here a file
    size limit, EFBIG; a full disk gives ENOSPC, SQLITE_FULL): retried as before, never taken for
    a lost ledger. Its own process: the size limit is per process."""
    path = _path(sqlite_db)
    repo = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", _WRITE_PAST_A_SIZE_LIMIT, sqlite_db, f"{path}-wal"], cwd=repo,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert "disk I/O error" in result["error"] and result["transient"] and not result["unwritable"]
