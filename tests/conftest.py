"""Shared fixtures: the shared/ folder beside the repository, scratch SQLite files and scratch
PostgreSQL databases on the real server at 127.0.0.1:5432 (never mocks, DESIGN §9; created and
dropped by :mod:`tools.harness.postgres`, which the benchmarks share)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools.harness.postgres import PG_ADMIN_URL, create_pg_database, drop_pg_database

REPO_ROOT = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    """``shared/`` beside the repository (CI clones the repo elsewhere with shared/ next to it)."""
    for candidate in (REPO_ROOT.parent / "shared", Path(os.environ.get("SEMKV_SHARED_DIR", "/nonexistent"))):
        if (candidate / "fixtures").is_dir():
            return candidate
    pytest.fail(f"shared/ not found beside {REPO_ROOT}")


@pytest.fixture(scope="session")
def shared() -> Path:
    return shared_dir()


@pytest.fixture
def sqlite_db(tmp_path: Path) -> str:
    """A migrated ledger in a fresh SQLite file."""
    from ledger.migrate import upgrade

    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade(db)
    return db


def _pg_available() -> bool:
    try:
        import psycopg

        with psycopg.connect(PG_ADMIN_URL.replace("postgresql://", "postgresql://", 1), connect_timeout=3):
            return True
    except Exception:  # noqa: BLE001 - any failure means "no server", reported by the fixture
        return False


def require_pg() -> None:
    """Fail in CI, skip elsewhere, when the PostgreSQL server is not reachable."""
    if not _pg_available():
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is required in CI and not reachable at {PG_ADMIN_URL}")
        pytest.skip(f"PostgreSQL not reachable at {PG_ADMIN_URL}")


@contextlib.contextmanager
def scratch_pg_ledger() -> Iterator[str]:
    """A migrated ledger in a scratch PostgreSQL database, dropped on exit (skips or fails the
    test like :func:`require_pg` when the server is unreachable). For fixtures of any scope."""
    from ledger.migrate import upgrade

    require_pg()
    url = create_pg_database()
    try:
        upgrade(url)
        yield url
    finally:
        drop_pg_database(url)


def require_redis() -> None:
    """Fail in CI, skip elsewhere, when no Redis server answers at ``SHARED_REDIS_URL`` or there is
    no ``redis-server`` executable (the donor store tests start their own for a stop mid-load)."""
    from tools.harness.redis_server import SHARED_REDIS_URL, redis_answers, redis_server_binary

    problem = None
    if redis_server_binary() is None:
        problem = "redis-server is not installed"
    elif not redis_answers(SHARED_REDIS_URL):
        problem = f"no Redis server answers at {SHARED_REDIS_URL}"
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(f"Redis is required in CI: {problem} (.ci/run starts one)")
        pytest.skip(problem)


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """A key prefix of this test's own on the shared Redis server, its keys deleted afterwards."""
    from tools.harness.redis_server import SHARED_REDIS_URL, delete_prefix, scratch_prefix

    require_redis()
    prefix = scratch_prefix()
    try:
        yield prefix
    finally:
        delete_prefix(SHARED_REDIS_URL, prefix)


@pytest.fixture
def postgres_db() -> Iterator[str]:
    """A migrated ledger in a scratch PostgreSQL database (dropped afterwards)."""
    with scratch_pg_ledger() as url:
        yield url


# --- real-engine groups (tests/vllm_cpu, tests/dynamo_cpu) -----------------------------------------


def mark_group(items: list[pytest.Item], directory: Path, marker: pytest.MarkDecorator) -> None:
    """Add ``marker`` to the collected tests under ``directory`` (a group's conftest hook)."""
    for item in items:
        if directory in Path(str(item.fspath)).parents:
            item.add_marker(marker)


def engine_group_env(python_var: str, model_var: str, required_var: str, setup_script: str,
                     what: str) -> tuple[str, Path]:
    """(the engine venv's python, the model directory) from the environment variables a group's
    set-up script prints; skips the group when they are missing or stale, or fails it when
    ``required_var`` is ``1`` (CI, where the group must run)."""
    python, model = os.environ.get(python_var), os.environ.get(model_var)
    if not python or not model or not Path(python).exists() or not (Path(model) / "config.json").exists():
        message = (f"{what} not set up: run `python3 {setup_script}` and export the {python_var} / "
                   f"{model_var} it prints")
        if os.environ.get(required_var) == "1":
            pytest.fail(message)
        pytest.skip(message)
    return python, Path(model)
