"""Providers that misbehave inside their own process (``provider_isolation = "process"``), for
tests/discovery/test_provider_processes.py; the child imports them by ``package.module:Class``."""

from __future__ import annotations

import os
import time

from connector.discovery.types import Query


class _Quiet:
    generation, needs_text = 1, False

    def __init__(self, settings, *, db=None) -> None:  # noqa: ANN001 - the provider constructor contract
        self.settings = settings

    def index(self, donor) -> None: ...  # noqa: ANN001
    def forget(self, donor_id: str) -> None: ...
    def prepare(self, query: Query) -> None: ...
    def flush(self, force: bool = True) -> None: ...
    def close(self) -> None: ...


class Hung(_Quiet):
    """Never answers: stuck in C (``time.sleep``), so only killing its process ends it."""

    name = "hung"

    def candidates(self, query: Query, limit: int) -> list:
        time.sleep(3600)
        return []


class Dying(_Quiet):
    """Its process exits in the middle of a lookup (a crash, an OOM kill)."""

    name = "dying"

    def candidates(self, query: Query, limit: int) -> list:
        os._exit(3)


class FailsToStart(_Quiet):
    name = "fails"

    def __init__(self, settings, *, db=None) -> None:  # noqa: ANN001
        raise ValueError("no index here")

    def candidates(self, query: Query, limit: int) -> list:
        return []
