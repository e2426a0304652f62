"""The block index kept behind the log (ledger/block_index.py) on both backends: ``inspect block``
answers what a search of the whole log answers whether the index is empty, partial, complete or
claims more than the log holds; the follower resumes after a kill; two followers at once still
build the index a derivation from the whole log gives."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select, update

from ledger import events as ev
from ledger.block_index import BlockIndexFollower, IndexAhead, index_state
from ledger.db import sync_engine
from ledger.schema import BlockIndexRow, IndexWatermarkRow, LogRow
from ledger.stats import _hashes_of, find_block
from ledger.types import storage_hashes
from tests.conftest import REPO_ROOT, scratch_pg_ledger
from tools.harness.builders import batch, cleared, created, record, removed, stored, updated

WIDE_A = bytes(range(32))
WIDE_B = bytes(range(8)) + bytes(24)  # the same first 8 bytes as WIDE_A: one index column value
BIG = 0xFEDCBA9876543210  # above 2**63: stored negative
HASHES = [1, 2, 3, 5, 8, BIG, WIDE_A, WIDE_B, 0x1111]  # 0x1111 is never logged


def _history() -> list[list[ev.ReceivedBatch]]:
    """Two engines storing, re-storing, updating and removing blocks over 40 transactions; a parent
    hash naming another block (its bytes in a body that does not name it as a block); a hash twice
    in one event; a clear."""
    transactions = [[batch(0, created(), stored(1, 2, 3, event_id=1), engine_id="engine-a")],
                    [batch(0, created(), stored(5, WIDE_A, event_id=1), engine_id="engine-b")]]
    for i in range(1, 20):
        a = [stored(8, BIG, parent=1, event_id=10 * i), removed(8, 8, event_id=10 * i + 1),
             updated(BIG, cache_level=(0, 1), event_id=10 * i + 2)]
        b = [stored(WIDE_B, 2, event_id=10 * i), removed(WIDE_A, event_id=10 * i + 1),
             stored(WIDE_A, event_id=10 * i + 2)]
        transactions.append([batch(i, *a, engine_id="engine-a"), batch(i, *b, engine_id="engine-b")])
    transactions.append([batch(20, cleared(), stored(3, event_id=301), engine_id="engine-a")])
    return transactions


def _ledger(db: str) -> str:
    record(db, *_history())
    return db


@pytest.fixture(scope="module")
def sqlite_ledger(tmp_path_factory) -> str:
    from ledger.migrate import upgrade

    db = f"sqlite:///{tmp_path_factory.mktemp('block-index') / 'ledger.db'}"
    upgrade(db)
    return _ledger(db)


@pytest.fixture(scope="module")
def postgres_ledger() -> Iterator[str]:
    with scratch_pg_ledger() as url:
        yield _ledger(url)


@pytest.fixture(params=["sqlite", "postgres"])
def ledger(request) -> str:
    return request.getfixturevalue(f"{request.param}_ledger")


@pytest.fixture
def small_buckets(monkeypatch) -> int:
    """Buckets of 4 seqs and 2 buckets per read, so that these small ledgers span many buckets and
    reads (the followers of the test run in this process)."""
    from ledger import block_index, stats

    monkeypatch.setattr(block_index, "BUCKET_BITS", 2)
    monkeypatch.setattr(stats, "BUCKET_BITS", 2)
    monkeypatch.setattr(stats, "BLOCK_INDEX_BUCKETS_PER_READ", 2)
    monkeypatch.setattr(stats, "BLOCK_INDEX_PAGE_SEQS", 3)
    return 2


def whole_log_answer(db: str, block_hash, limit: int) -> list[int]:
    """Seqs of the log rows naming ``block_hash``, the newest ``limit``: every block event of the
    log decoded in Python (no index, no byte search)."""
    log = LogRow.__table__
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(log.c.seq, log.c.body).order_by(log.c.seq)).all()
    finally:
        engine.dispose()
    seqs = [seq for seq, body in rows if block_hash in _hashes_of(ev.BODY_DECODER.decode(bytes(body)))]
    return seqs[-limit:]


def whole_log_index(db: str) -> set[tuple[int, int]]:
    """The index rows a derivation from the whole log gives."""
    log = LogRow.__table__
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(log.c.seq, log.c.body)).all()
    finally:
        engine.dispose()
    from ledger import block_index

    bits = block_index.BUCKET_BITS  # as the followers of this process use it
    return {(seq >> bits, h, seq) for seq, body in rows
            for h in storage_hashes(_hashes_of(ev.BODY_DECODER.decode(bytes(body))))}


def index_rows(db: str) -> set[tuple[int, int]]:
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            return {tuple(r) for r in conn.execute(select(BlockIndexRow.__table__))}
    finally:
        engine.dispose()


def set_watermark(db: str, seq: int) -> None:
    marks = IndexWatermarkRow.__table__
    engine = sync_engine(db, writer=True)
    try:
        with engine.begin() as conn:
            conn.execute(update(marks).values(seq=seq))
    finally:
        engine.dispose()


def lookup(db: str, block_hash, limit: int):
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            return find_block(conn, block_hash, limit)
    finally:
        engine.dispose()


def head_of(db: str) -> int:
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            return index_state(conn).head
    finally:
        engine.dispose()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_inspect_answers_what_the_whole_log_answers_with_the_index_empty_partial_or_complete(ledger: str, small_buckets,
                                                                                            data) -> None:
    head = head_of(ledger)
    through = data.draw(st.sampled_from([0, head]) | st.integers(1, head), label="index through")
    block_hash = data.draw(st.sampled_from(HASHES), label="hash")
    limit = data.draw(st.integers(1, 50), label="limit")
    with BlockIndexFollower(ledger, window_seqs=max(1, through)) as follower:
        follower.rebuild()
        if through:
            assert follower.catch_up(max_windows=1).watermark == through  # the real follower, one window
    found = lookup(ledger, block_hash, limit)
    assert [row["seq"] for row in found.rows] == whole_log_answer(ledger, block_hash, limit)
    assert (found.indexed_through, found.searched_seqs, found.index_ahead) == (through, head - through, False)


def test_a_complete_index_is_the_whole_logs_derivation_and_is_read_without_searching_the_log(ledger: str,
                                                                                            small_buckets) -> None:
    with BlockIndexFollower(ledger, window_seqs=7) as follower:
        follower.rebuild()
        done = follower.catch_up()
    head = head_of(ledger)
    assert done.watermark == head and done.windows == -(-head // 7)
    assert index_rows(ledger) == whole_log_index(ledger)
    found = lookup(ledger, WIDE_B, 200)  # shares its index column with WIDE_A: kept only where named
    assert found.searched_seqs == 0 and [r["seq"] for r in found.rows] == whole_log_answer(ledger, WIDE_B, 200)
    assert lookup(ledger, 0x1111, 5).rows == []


def test_an_index_claiming_more_than_the_log_is_not_used_and_the_follower_refuses_it(ledger: str) -> None:
    # the CLI's follower (another process) uses the real bucket size: so does this test
    head = head_of(ledger)
    with BlockIndexFollower(ledger) as follower:
        follower.rebuild()
        follower.catch_up()
        set_watermark(ledger, head + 1000)
        found = lookup(ledger, BIG, 7)
        assert found.index_ahead and found.indexed_through == 0 and found.searched_seqs == head
        assert [r["seq"] for r in found.rows] == whole_log_answer(ledger, BIG, 7)
        with pytest.raises(IndexAhead):
            follower.step()
        with pytest.raises(IndexAhead):
            follower.catch_up()
        refused = _cli("index", "--db", ledger)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "--rebuild" in refused.stderr
        rebuilt = _cli("index", "--db", ledger, "--rebuild", "--json")
        assert rebuilt.returncode == 0, rebuilt.stderr
    assert index_rows(ledger) == whole_log_index(ledger)


def test_two_followers_at_once_build_the_same_index(ledger: str, small_buckets) -> None:
    with BlockIndexFollower(ledger) as follower:
        follower.rebuild()
    followers = [BlockIndexFollower(ledger, window_seqs=3) for _ in range(2)]
    errors: list[BaseException] = []

    def run(follower: BlockIndexFollower) -> None:
        try:
            follower.catch_up()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(f,)) for f in followers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for follower in followers:
        follower.close()
    assert errors == []
    assert index_rows(ledger) == whole_log_index(ledger)
    assert head_of(ledger) == lookup(ledger, 1, 1).indexed_through


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_follower_resumes_after_a_kill(backend: str, request, tmp_path) -> None:
    db = request.getfixturevalue("sqlite_db" if backend == "sqlite" else "postgres_db")
    record(db, *[[batch(i, stored(3 * i + 1, 3 * i + 2), removed(3 * i + 1, 3 * i + 2))] for i in range(400)])
    head = head_of(db)
    proc = subprocess.Popen([sys.executable, "-m", "ledger", "index", "--db", db, "--window-seqs", "1", "--json"],
                            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        engine = sync_engine(db)
        try:
            while proc.poll() is None:
                with engine.connect() as conn:
                    if index_state(conn).watermark > 0:
                        break
                time.sleep(0.005)
        finally:
            engine.dispose()
        os.kill(proc.pid, signal.SIGKILL)  # mid-run: a window's transaction may be in flight
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    engine = sync_engine(db)
    try:
        with engine.connect() as conn:
            killed_at = index_state(conn).watermark
    finally:
        engine.dispose()
    assert 0 < killed_at < head  # really stopped midway
    assert {seq for _, _, seq in index_rows(db)} <= set(range(1, killed_at + 1))  # nothing past its watermark
    with BlockIndexFollower(db) as follower:
        done = follower.catch_up()
    assert done.started_at == killed_at and done.watermark == head
    assert index_rows(db) == whole_log_index(db)


def test_the_daemons_follower_indexes_the_log_and_stops_at_shutdown(sqlite_db: str, free_tcp_port: int) -> None:
    from consumer.daemon import Daemon
    from consumer.settings import ConsumerSettings, SourceSettings

    free_port = free_tcp_port
    record(sqlite_db, *_history())
    head = head_of(sqlite_db)

    async def run() -> None:
        stop = asyncio.Event()
        quiet = SourceSettings(engine_id="engine-q", endpoint=f"tcp://127.0.0.1:{free_port}")  # nobody publishes
        daemon = Daemon(ConsumerSettings(db=sqlite_db, sources=[quiet], block_index_interval_s=0.05),
                        shutdown_trigger=stop.wait)
        task = asyncio.create_task(daemon.run())
        engine = sync_engine(sqlite_db)
        try:
            while True:
                with engine.connect() as conn:
                    if index_state(conn).watermark == head:
                        break
                assert not task.done(), task.result()
                await asyncio.sleep(0.02)
        finally:
            engine.dispose()
            stop.set()
        assert (await task).clean_exit

    asyncio.run(run())
    assert index_rows(sqlite_db) == whole_log_index(sqlite_db)


def test_the_index_is_read_by_its_key_on_sqlite(sqlite_ledger: str) -> None:
    import sqlite3

    with sqlite3.connect(sqlite_ledger.removeprefix("sqlite:///")) as conn:
        plan = " ".join(str(r[3]) for r in conn.execute(
            "EXPLAIN QUERY PLAN SELECT seq FROM block_index WHERE bucket IN (?, ?, ?) AND block_hash = ? AND seq <= ? "
            "ORDER BY seq DESC", (2, 1, 0, 1, 100)))
    assert "SEARCH block_index USING PRIMARY KEY (bucket=? AND block_hash=? AND seq<?)" in plan and "SCAN" not in plan, plan


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ledger", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)


def test_the_follower_yields_to_a_writer_holding_the_sqlite_lock_and_resumes_after(sqlite_db: str) -> None:
    import sqlite3

    from ledger.block_index import CatchUp

    record(sqlite_db, *_history())
    writer = sqlite3.connect(sqlite_db.removeprefix("sqlite:///"), isolation_level=None)
    with BlockIndexFollower(sqlite_db) as follower:
        writer.execute("BEGIN IMMEDIATE")  # another writer's transaction, as the recorder's
        done = CatchUp()
        try:
            assert follower.step(done) is False and done.lock_busy == 1 and done.windows == 0
            assert follower.state().watermark == 0
        finally:
            writer.execute("COMMIT")
            writer.close()
        assert follower.step(done) is True and done.windows == 1  # the window read before, written now
        assert follower.state().watermark == head_of(sqlite_db)
    assert index_rows(sqlite_db) == whole_log_index(sqlite_db)


def test_a_following_follower_waits_while_the_log_grows_unless_too_far_behind(sqlite_db: str) -> None:
    record(sqlite_db, *_history()[:5])
    with BlockIndexFollower(sqlite_db, window_seqs=1_000) as follower:
        assert follower.step_when_quiet(max_lag_seqs=1_000) is False  # first look: the log may be growing
        assert follower.step_when_quiet(max_lag_seqs=1_000) is True  # quiet since: indexed
        indexed = follower.state().watermark
        record(sqlite_db, *_history()[5:10])
        assert follower.step_when_quiet(max_lag_seqs=1_000) is False  # it grew: wait
        assert follower.state().watermark == indexed
        assert follower.step_when_quiet(max_lag_seqs=0) is True  # it grew, but too far behind: index
        assert follower.state().watermark == head_of(sqlite_db)
    assert index_rows(sqlite_db) == whole_log_index(sqlite_db)


def wait_indexed(db: str, proc: subprocess.Popen) -> int:
    """Wait until the index of ``db`` reaches the log's head (``proc``, the indexer, still running);
    returns the head."""
    engine = sync_engine(db)
    try:
        head = head_of(db)
        while True:
            with engine.connect() as conn:
                if index_state(conn).watermark == head:
                    return head
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
    finally:
        engine.dispose()


def test_index_follow_stops_at_a_signal_without_waiting_out_its_interval(sqlite_db: str) -> None:
    """``index --follow --interval-s 600`` stopped by SIGTERM while it waits ends then (a sleep lasted to
    its end: a systemd stop timed out into SIGKILL), with its summary and exit 0."""
    record(sqlite_db, *_history())
    proc = subprocess.Popen([sys.executable, "-m", "ledger", "index", "--db", sqlite_db, "--follow", "--interval-s",
                             "600", "--json"], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    head = wait_indexed(sqlite_db, proc)  # caught up: now it waits its interval
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)  # far less than the 600 s interval
    assert proc.returncode == 0, err
    assert json.loads(out)["watermark"] == head


def test_index_follow_waits_out_a_postgresql_outage(postgres_db: str) -> None:
    """``index --follow`` on a fleet ledger whose server goes away (a relay in front of it stopped,
    then started): it warns once, retries every interval and goes on when the server is back
    (it exited 2 at the first failed look), then stops at SIGTERM with exit 0."""
    from tests.integration.consumer.test_postgres_outage import relayed

    record(postgres_db, *_history())
    with relayed(postgres_db) as (db, relay):
        proc = subprocess.Popen([sys.executable, "-m", "ledger", "index", "--db", db, "--follow", "--interval-s", "0.2",
                                 "--json"], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            head = wait_indexed(postgres_db, proc)
            relay.stop()
            time.sleep(2.0)  # several looks at the log fail meanwhile
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            relay.start()
            time.sleep(2.0)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err
    assert err.count("warning: ") == 1 and "retrying every 0.2 s" in err and "the ledger answers again" in err, err
    assert json.loads(out)["watermark"] == head


@pytest.mark.parametrize("interval", ["inf", "nan", "0", "-1"])
def test_index_refuses_an_interval_that_is_not_a_positive_number(sqlite_db: str, interval: str) -> None:
    done = _cli("index", "--db", sqlite_db, "--follow", "--interval-s", interval)
    assert done.returncode == 2 and "--interval-s" in done.stderr and "Traceback" not in done.stderr
