"""Scratch databases on the PostgreSQL server at 127.0.0.1:5432 (trust auth, as the machines and CI
start it): the tests' ``postgres_db`` fixture (``tests/conftest.py``) and the benchmarks create one
per run and drop it afterwards. ``SEMKV_TEST_PG_ADMIN`` names another server's admin URL."""

from __future__ import annotations

import os
import uuid

PG_ADMIN_URL = os.environ.get("SEMKV_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")


def create_pg_database() -> str:
    """Create a scratch database on the local server and return its URL."""
    import psycopg

    name = f"semkv_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"


def drop_pg_database(url: str) -> None:
    import psycopg

    name = url.rsplit("/", 1)[1]
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
