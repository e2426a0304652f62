"""Fixtures for the connector tests: ``fleet``, a :class:`~tools.harness.fleet.Fleet` of two
reference-harness engines ("A", "B") sharing one SQLite ledger and one donor store, their KV events
reaching the ledger through the real publisher → consumer daemon → ledger path.

The fleet lives in :mod:`tools.harness.fleet` (``tools/bench_discovery.py`` runs on it too).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tools.harness.fleet import Fleet


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path, ("A", "B")).start()
    try:
        yield f
    finally:
        f.stop()
