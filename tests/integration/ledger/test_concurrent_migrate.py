"""Several ``migrate`` commands on one new ledger at once (hosts of a fleet deployed together, each
running the documented migrate first): one upgrades, the others wait for it and find the head.

Before, on PostgreSQL, every one created ``alembic_version`` in its own transaction and all but
one failed (exit 2: ``duplicate key value violates unique constraint "pg_type_typname_nsp_index"``,
newcomer finding, 2026-12-05). SQLite's writer transactions (``BEGIN IMMEDIATE``) already waited.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ledger.migrate import HEAD_REVISION
from ledger.replay import replay
from tests.conftest import require_pg
from tools.harness.postgres import create_pg_database, drop_pg_database

CLI = Path(sys.executable).with_name("semkv-ledger")
RUNS = 4


def migrate_at_once(url: str) -> list[tuple[int, str, str]]:
    runs = [subprocess.Popen([str(CLI), "migrate", "--db", url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(RUNS)]
    outputs = [run.communicate(timeout=120) for run in runs]
    return [(run.returncode, out, err) for run, (out, err) in zip(runs, outputs, strict=True)]


def check(results: list[tuple[int, str, str]], url: str) -> None:
    assert all(code == 0 for code, _, _ in results), results
    said = sorted(out.strip().rsplit(": ", 1)[-1] for _, out, _ in results)
    assert said == [*["already at " + HEAD_REVISION] * (RUNS - 1), f"upgraded empty database → {HEAD_REVISION}"], said
    assert replay(url).equal


@pytest.mark.postgres
def test_concurrent_migrates_of_a_new_postgresql_ledger_all_succeed() -> None:
    require_pg()
    url = create_pg_database()
    try:
        check(migrate_at_once(url), url)
    finally:
        drop_pg_database(url)


def test_concurrent_migrates_of_a_new_sqlite_ledger_all_succeed(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    check(migrate_at_once(url), url)
