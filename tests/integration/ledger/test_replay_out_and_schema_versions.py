"""``replay --out`` never overwrites a ledger; a ledger migrated by a NEWER semkv-ledger is one line
and exit 2 for every command, with advice that works (issue #19, found by a newcomer's try).

Before: ``replay --db L --out L`` rebuilt L's projections in place (a tampered projection was
"repaired" and the evidence gone), ``--out`` another ledger corrupted it; ``migrate`` of a ledger at
an unknown revision was a 103-line Alembic traceback, exit 1, after ``stats`` had advised it.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

CLI = Path(sys.executable).with_name("semkv-ledger")


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    assert cli("migrate", "--db", "ledger.db", cwd=tmp_path).returncode == 0
    return tmp_path / "ledger.db"


def test_replay_out_refuses_the_live_ledger_and_leaves_it_untouched(ledger: Path) -> None:
    with sqlite3.connect(ledger) as conn:  # a tampered projection: what an audit must find
        conn.execute("INSERT INTO engines VALUES ('e', 99, 'active', 0, 0, 0)")
    before = ledger.read_bytes()
    line = one_error_line(cli("replay", "--db", "ledger.db", "--out", "ledger.db", cwd=ledger.parent))
    assert "--out ledger.db" in line and "ledger" in line
    assert ledger.read_bytes() == before
    assert cli("replay", "--db", "ledger.db", cwd=ledger.parent).returncode == 1  # still found


def test_replay_out_refuses_another_ledger_a_directory_and_junk(ledger: Path) -> None:
    cwd = ledger.parent
    assert cli("migrate", "--db", "other.db", cwd=cwd).returncode == 0
    other = (cwd / "other.db").read_bytes()
    assert "--out other.db" in one_error_line(cli("replay", "--db", "ledger.db", "--out", "other.db", cwd=cwd))
    assert (cwd / "other.db").read_bytes() == other
    (cwd / "adir").mkdir()
    (cwd / "junk").write_text("not sqlite")
    for out in ("adir", "junk", "missing-dir/out.db", "/proc/out.db"):  # /proc: a directory where no file can be made
        assert f"--out {out}" in one_error_line(cli("replay", "--db", "ledger.db", "--out", out, cwd=cwd))


def test_replay_out_writes_a_new_file_and_rewrites_its_own(ledger: Path) -> None:
    cwd = ledger.parent
    for _ in range(2):  # the second run overwrites what the first wrote
        done = cli("replay", "--db", "ledger.db", "--out", "rebuilt.db", cwd=cwd)
        assert done.returncode == 0, done.stderr
    with sqlite3.connect(cwd / "rebuilt.db") as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "engines" in tables and "log" not in tables


def test_a_replay_out_file_is_said_to_be_no_ledger_not_sent_to_migrate(ledger: Path) -> None:
    # stats advised `migrate --db rebuilt.db`, which then failed with "table blocks already exists"
    cwd = ledger.parent
    assert cli("replay", "--db", "ledger.db", "--out", "rebuilt.db", cwd=cwd).returncode == 0
    before = (cwd / "rebuilt.db").read_bytes()
    for command in ("stats", "migrate", "inspect"):
        args = (command, "--db", "rebuilt.db") + (("engine", "e") if command == "inspect" else ())
        line = one_error_line(cli(*args, cwd=cwd))
        assert "no log (a `replay --out` file?)" in line and "migrate --db" not in line, line
    assert (cwd / "rebuilt.db").read_bytes() == before


def test_a_ledger_from_a_newer_semkv_ledger_is_one_line_that_does_not_advise_migrate(ledger: Path) -> None:
    with sqlite3.connect(ledger) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0099'")
    cwd = ledger.parent
    for args in (("stats", "--db", "ledger.db"), ("migrate", "--db", "ledger.db"),
                 ("replay", "--db", "ledger.db"),
                 ("consume", "--db", "ledger.db", "--engine-id", "e", "--migrate", "--metrics-port", "0")):
        line = one_error_line(cli(*args, cwd=cwd))
        assert "0099" in line and "newer than this semkv-ledger" in line and "semkv-ledger migrate" not in line and "--migrate" not in line, (args, line)


@pytest.mark.parametrize("damage", ["another_application", "version_table_dropped", "version_blank"])
def test_a_database_with_tables_and_no_ledger_version_is_refused_not_migrated_into(tmp_path: Path,
                                                                                  damage: str) -> None:
    # migrate said "upgraded empty database" and added the ledger's tables beside another application's;
    # a ledger whose version table was lost was advised to `migrate`, which failed "table blocks already exists";
    # a blank version was "is not created, expected …: it is newer than this semkv-ledger knows"
    lost_version = damage != "another_application"
    if lost_version:
        assert cli("migrate", "--db", "app.db", cwd=tmp_path).returncode == 0
        with sqlite3.connect(tmp_path / "app.db") as conn:
            conn.execute("DROP TABLE alembic_version" if damage == "version_table_dropped"
                         else "UPDATE alembic_version SET version_num = ''")
    else:
        with sqlite3.connect(tmp_path / "app.db") as conn:
            conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
            conn.execute("INSERT INTO users VALUES (1, 'ada')")
    def contents() -> list:
        with sqlite3.connect(tmp_path / "app.db") as conn:
            tables = [row[0] for row in conn.execute("SELECT name FROM sqlite_master ORDER BY name")]
            return tables + [conn.execute("SELECT * FROM users").fetchall() if "users" in tables else []]

    before = contents()
    for command in ("migrate", "stats"):
        line = one_error_line(cli(command, "--db", "app.db", cwd=tmp_path))
        assert "holds tables (" in line and "no ledger schema version" in line, line
        assert ("users" in line) != lost_version and "semkv-ledger migrate" not in line, line
    assert contents() == before  # (the file may have been switched to WAL by the open: no table or row moved)
