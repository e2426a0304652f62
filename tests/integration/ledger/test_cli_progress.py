"""Long operator work shows progress on a terminal and nowhere else (issue 23): ``replay`` while it
rebuilds, ``inspect block`` while it searches the log and ``migrate`` for each step a revision
reports (0003's projection rebuild) draw a bar on
stderr when stderr is a terminal; off a terminal, and with ``--json``, stderr stays empty.

Real CLI processes with stderr on a pseudo-terminal (:mod:`pty`) or a pipe, real SQLite ledgers;
the migration's steps are also recorded in process by a listener given to ``upgrade``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pty
import shutil
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ledger.migrate import migration_progress, upgrade
from tools.harness.builders import batch, created, downgrade, removed, stored

CLI = Path(sys.executable).with_name("semkv-ledger")
CALL_TIMEOUT_S = 120
BATCHES = 700
BAR = "━"  # rich's bar glyph
REBUILD_STEP = "rebuilding projections from the log"


def fill(db: str) -> None:
    from ledger.writer import LedgerWriter

    upgrade(db)

    async def feed() -> None:
        writer = await LedgerWriter.open(db)
        try:
            await writer.append([batch(0, created(), stored(*range(1, 100), event_id=1))])
            await writer.append([batch(seq, stored(1000 + seq, event_id=2 * seq),
                                       removed(1000 + seq, event_id=2 * seq + 1)) for seq in range(1, BATCHES)])
        finally:
            await writer.close()

    asyncio.run(feed())


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("built") / "ledger.db"
    fill(str(path))
    return path


@pytest.fixture(scope="module")
def log_rows(built: Path) -> int:
    with contextlib.closing(sqlite3.connect(built)) as conn:
        return conn.execute("SELECT count(*) FROM log").fetchone()[0]


@pytest.fixture
def ledger(built: Path, tmp_path: Path) -> str:
    shutil.copy2(built, tmp_path / "ledger.db")
    return str(tmp_path / "ledger.db")


@pytest.fixture
def ledger_at_0002(ledger: str) -> str:
    """The ledger as revision 0002 left it, so that ``migrate`` runs 0003's rebuild."""
    downgrade(ledger, "0002")
    return ledger


def _env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
            "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"}


def run_with_terminal_stderr(*args: str) -> tuple[int, str, str]:
    """Run the CLI with stderr on a pseudo-terminal, stdout on a pipe: (exit code, stdout, what the
    terminal received)."""
    master, slave = pty.openpty()
    received: list[bytes] = []

    def drain() -> None:
        with contextlib.suppress(OSError):  # EIO once the process closed its end
            while chunk := os.read(master, 65536):
                received.append(chunk)

    try:
        proc = subprocess.Popen([str(CLI), *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave,
                                env=_env(), text=True)
        os.close(slave)
        reader = threading.Thread(target=drain)
        reader.start()
        stdout, _ = proc.communicate(timeout=CALL_TIMEOUT_S)
        reader.join(timeout=CALL_TIMEOUT_S)
    finally:
        os.close(master)
    return proc.returncode, stdout, b"".join(received).decode()


def run_piped(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=CALL_TIMEOUT_S, env=_env(),
                          stdin=subprocess.DEVNULL)


def test_replay_draws_a_bar_on_a_terminal(ledger: str, log_rows: int) -> None:
    code, stdout, terminal = run_with_terminal_stderr("replay", "--db", ledger)
    assert code == 0, terminal
    assert "replaying log" in terminal and BAR in terminal
    assert f"{log_rows}/{log_rows}" in terminal  # the bar reached the end of the log
    assert f"replay of {log_rows:,} log rows" in stdout  # the report itself still goes to stdout


def test_replay_is_quiet_off_a_terminal_and_with_json(ledger: str) -> None:
    piped = run_piped("replay", "--db", ledger)
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    code, stdout, terminal = run_with_terminal_stderr("replay", "--db", ledger, "--json")
    assert code == 0 and terminal.strip() == "", terminal
    assert json.loads(stdout)["equal"] is True  # stdout holds the JSON and nothing else


def test_inspect_block_draws_its_search_on_a_terminal_only(ledger: str, log_rows: int) -> None:
    code, stdout, terminal = run_with_terminal_stderr("inspect", "block", "1001", "--db", ledger)
    assert code == 0, terminal
    assert "searching the log after the index" in terminal and BAR in terminal and f"{log_rows}/{log_rows}" in terminal
    assert "block_stored" in stdout and "block_removed" in stdout
    piped = run_piped("inspect", "block", "1001", "--db", ledger)
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    code, stdout, terminal = run_with_terminal_stderr("inspect", "block", "1001", "--db", ledger, "--json")
    assert code == 0 and terminal.strip() == "", terminal
    assert [row["kind"] for row in json.loads(stdout)["rows"]] == ["block_stored", "block_removed"]


def test_migrate_draws_0003s_rebuild_on_a_terminal(ledger_at_0002: str, log_rows: int) -> None:
    code, stdout, terminal = run_with_terminal_stderr("migrate", "--db", ledger_at_0002)
    assert code == 0, terminal
    assert REBUILD_STEP in terminal and BAR in terminal and f"{log_rows}/{log_rows}" in terminal
    assert stdout.strip() == f"ledger {ledger_at_0002}: upgraded 0002 → 0007"
    assert run_piped("replay", "--db", ledger_at_0002, "--json").returncode == 0  # and the rebuild was right


def test_migrate_is_quiet_off_a_terminal(ledger_at_0002: str) -> None:
    result = run_piped("migrate", "--db", ledger_at_0002)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.strip() == f"ledger {ledger_at_0002}: upgraded 0002 → 0007"


class RecordingListener:
    """A :data:`ledger.migrate.MigrationListener` keeping every step and its last position."""

    def __init__(self) -> None:
        self.steps: list[list] = []  # [description, total at start, last (done, total)]

    @contextlib.contextmanager
    def __call__(self, description: str, total: int | None) -> Iterator:
        step = [description, total, None]
        self.steps.append(step)

        def progress(done: int, total: int | None = None) -> None:
            step[2] = (done, total)

        yield progress


def test_0003_reports_its_steps_to_whoever_listens(ledger_at_0002: str, log_rows: int) -> None:
    listener = RecordingListener()
    assert upgrade(ledger_at_0002, progress=listener) == ("0002", "0007")
    assert [step[0] for step in listener.steps] == ["emptying the projections", REBUILD_STEP,
                                                    "writing the rebuilt projections",
                                                    "counting the log's engine events by type",  # 0004
                                                    "creating the block index (filled behind the log: semkv-ledger index)"]
    assert listener.steps[1][2] == (log_rows, log_rows)


def test_migration_progress_is_a_no_op_when_nobody_listens() -> None:
    with migration_progress("a step nobody shows", 10) as progress:
        progress(5)
        progress(10, 10)
