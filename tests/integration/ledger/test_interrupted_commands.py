"""Ctrl-C in the ledger's commands: one ``interrupted:`` line, exit 130, and nothing half-done left
behind (newcomer finding 13: exit 130 without a word, and ``replay --out`` left an empty file).

Each command runs in its own process and gets a real SIGINT from itself at a chosen point: the
hook wraps one of our functions and signals before it returns, so the interrupt lands inside the
command's transaction or file write, where a user's Ctrl-C is most harmful.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ledger.migrate import HEAD_REVISION, upgrade
from tools.harness.builders import batch, record, stored

_INTERRUPTING = textwrap.dedent("""
    import os, signal, sys, importlib
    module, name = sys.argv[1].rsplit(".", 1)
    target = importlib.import_module(module)
    original = getattr(target, name)

    def interrupted(*args, **kwargs):
        result = original(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, delivered before this returns
        for _ in range(1000):
            pass
        return result

    setattr(target, name, interrupted)
    sys.argv = ["semkv-ledger", *sys.argv[2:]]
    from ledger.cli import main
    main()
""")


def interrupt_at(hook: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", _INTERRUPTING, hook, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 130, (done.returncode, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted:"), done.stderr
    return done


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    db = tmp_path / "ledger.db"
    upgrade(str(db))
    record(str(db), [batch(seq, stored(*range(100 * seq, 100 * seq + 4))) for seq in range(20)])
    return db


def test_interrupted_replay_removes_the_out_file_it_created(ledger: Path) -> None:
    out = ledger.parent / "projections.db"
    done = interrupt_at("ledger.replay.write_projection", "replay", "--db", str(ledger), "--out", str(out),
                        cwd=ledger.parent)
    assert "replay did not finish" in done.stderr and "--out" in done.stderr
    assert sorted(p.name for p in ledger.parent.iterdir()) == ["ledger.db"]


def test_interrupted_replay_keeps_an_earlier_out_file(ledger: Path) -> None:
    out = ledger.parent / "projections.db"
    assert subprocess.run([str(Path(sys.executable).with_name("semkv-ledger")), "replay", "--db", str(ledger),
                           "--out", str(out)], capture_output=True).returncode == 0
    interrupt_at("ledger.replay.rebuild", "replay", "--db", str(ledger), "--out", str(out), cwd=ledger.parent)
    with sqlite3.connect(out) as conn:  # an earlier --out is the user's: left as it was
        assert conn.execute("SELECT count(*) FROM blocks").fetchone()[0] > 0


def test_interrupted_migrate_leaves_the_ledger_at_its_revision(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    upgrade(str(db), "0006")
    done = interrupt_at("alembic.command.upgrade", "migrate", "--db", str(db), cwd=tmp_path)
    assert "one transaction" in done.stderr
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone() == ("0006",)
    upgrade(str(db))  # and it migrates afterwards
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone() == (HEAD_REVISION,)


def test_interrupted_snapshot_stores_none(ledger: Path) -> None:
    interrupt_at("ledger.replay.save_snapshot", "snapshot", "--db", str(ledger), cwd=ledger.parent)
    with sqlite3.connect(ledger) as conn:
        assert conn.execute("SELECT count(*) FROM projection_snapshots").fetchone() == (0,)


def test_ctrl_c_while_the_command_line_loads_is_one_line_too(ledger: Path) -> None:
    """Ctrl-C in the first fraction of a second, while modules import and commands register: it was
    a 20-40 line KeyboardInterrupt traceback (newcomer finding 3)."""
    done = interrupt_at("ledger.cli._register_plugins", "stats", "--db", str(ledger), cwd=ledger.parent)
    assert "before the command started" in done.stderr and "Traceback" not in done.stderr
