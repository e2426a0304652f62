"""Fixtures for the connector tests: ``fleet``, a :class:`~tools.harness.fleet.Fleet` of two
reference-harness engines ("A", "B") sharing one SQLite ledger and one donor store, their KV events
reaching the ledger through the real publisher → consumer daemon → ledger path; ``check``, which runs
``semkv-ledger connector-check`` with a ``--llm-args`` file written from a string.

The fleet lives in :mod:`tools.harness.fleet` (``tools/bench_discovery.py`` runs on it too).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from connector.cli import register
from tools.harness.fleet import Fleet


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path, ("A", "B")).start()
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture
def check(tmp_path: Path, sqlite_db: str):  # noqa: ANN201 - ``run(llm_args_text | None, *extra_args)``
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps typer in multi-command mode
    config = tmp_path / "connector.toml"
    config.write_text(f'mode = "exact_equivalent"\nengine_id = "e"\ndb = "{sqlite_db}"\n'
                      f'store_dir = "{tmp_path / "store"}"\n')

    def run(options: str | None, *extra: str):  # noqa: ANN202
        args = ["connector-check", "--config", str(config)]
        if options is not None:
            path = tmp_path / "llm.yaml"
            path.write_text(options)
            args += ["--llm-args", str(path)]
        return CliRunner().invoke(app, [*args, *extra])

    return run
