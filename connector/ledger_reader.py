"""DEPRECATED compatibility shim: the connector's hot-path reads now live in the ledger.

:class:`ledger.queries.LedgerClient` runs precompiled statements on a kept per-thread DBAPI
connection (~10–30 µs per query on SQLite), so the plain-SQL copy of the ledger's freshness reads
that used to live here is gone; the scheduler, worker and miss diagnosis call ``LedgerClient``.
This module runs NO SQL of its own: it only forwards, and exists because ``connector/discovery/``
(``exact.py``, ``service.py``) still imports :class:`LedgerReader`. Delete it once those call

* ``LedgerClient.find_donor_span(namespace, keys, now=now, min_blocks=m, check_blocks=False)``
  instead of ``LedgerReader.find_span(namespace, keys, now, m)``, and
* ``LedgerClient.donor_freshness(donor_id, namespace=ns, num_blocks=0, lease_id=lease, now=now)``
  instead of ``LedgerReader.check(donor_id, ns, lease, now)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ledger.queries import DonorSpan, LedgerClient
from ledger.types import FreshnessPolicy, StaleReason

__all__ = ["LedgerReader"]


class LedgerReader:
    """Forwards to :class:`~ledger.queries.LedgerClient` (see the module docstring)."""

    def __init__(self, db: str) -> None:
        self._client = LedgerClient(db, check=False)

    def find_span(self, namespace: str, keys: Sequence[bytes], now: float, min_blocks: int = 1) -> DonorSpan | None:
        """Longest span ``>= min_blocks`` whose donor's state is fresh (blocks not checked)."""
        return self._client.find_donor_span(namespace, keys, now=now, min_blocks=min_blocks, check_blocks=False)

    def check(self, donor_id: str, namespace: str, lease_id: str | None, now: float) -> StaleReason | None:
        """Freshness without block liveness (namespace, state, expiry, generation, lease). None: fresh."""
        return self._client.donor_freshness(donor_id, namespace=namespace, num_blocks=0,
                                            policy=FreshnessPolicy.STORE, lease_id=lease_id, now=now)

    def close(self) -> None:
        self._client.close()
