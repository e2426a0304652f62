"""THE freshness rule of a donor, once: in Python for memory and revalidation, as SQL for reads.

A donor is fresh for a request iff (docs/safety.md rules 6 and 9):

* it is known and its ``namespace`` equals the request's;
* its state is ``live`` (bytes saved and checksummed; not registered-only, evicted or quarantined);
* it has not expired (``expires_at`` unset or later than ``now``, seconds since the epoch);
* its engine is known, its ``generation`` is the engine's current one, and the engine is
  ``active`` (not resynchronising after lost events: until a new baseline nothing it said is trusted);
* policy ``engine``: every block it needs is live in that generation (checked by the caller, which
  knows how many blocks it needs; policy ``store`` relies on the checksummed bytes instead).

:func:`stale_reason` is the rule on one donor's facts (the worker's revalidation, the lease, the
in-memory :class:`~ledger.donor_view.DonorView`); :func:`fresh_donor_clause` is the same rule as a
SQL condition (the lookup's reads and placement), and ``tests/property/test_freshness_rule.py``
holds the two equal on random ledgers on both backends. :func:`longest_prefix` is the one search for
the longest run of chained content keys a fresh donor holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, and_, or_

from ledger.types import DonorState, EngineStatus, StaleReason

__all__ = ["DonorFacts", "fresh_donor_clause", "longest_prefix", "stale_reason"]

T = TypeVar("T")

_STATE_REASON = {str(DonorState.REGISTERED): StaleReason.NOT_SAVED, str(DonorState.EVICTED): StaleReason.EVICTED,
                 str(DonorState.QUARANTINED): StaleReason.QUARANTINED}
_LIVE, _ACTIVE = str(DonorState.LIVE), str(EngineStatus.ACTIVE)  # plain str: the lookup calls this per donor


@dataclasses.dataclass(frozen=True, slots=True)
class DonorFacts:
    """What freshness reads of a donor and its engine (a ``donors`` row joined to ``engines``).

    ``engine_generation`` and ``engine_status`` are None when the ledger does not know the engine.
    """

    namespace: str
    state: str
    expires_at: float | None
    generation: int
    engine_generation: int | None
    engine_status: str | None


def stale_reason(donor: DonorFacts, *, namespace: str, now: float) -> StaleReason | None:
    """Why ``donor`` is not fresh for a request of ``namespace`` at ``now`` (seconds since the
    epoch), or None when it is (block liveness aside: see the module docstring).

    The first failing condition in this order is returned: namespace, state, expiry, engine
    known, generation, engine status.
    """
    if donor.namespace != namespace:
        return StaleReason.NAMESPACE_MISMATCH
    if donor.state != _LIVE:
        return _STATE_REASON.get(donor.state, StaleReason.NOT_SAVED)
    if donor.expires_at is not None and donor.expires_at <= now:
        return StaleReason.EXPIRED
    if donor.engine_generation is None:
        return StaleReason.ENGINE_UNKNOWN
    if donor.engine_generation != donor.generation:
        return StaleReason.GENERATION_MISMATCH
    if donor.engine_status != _ACTIVE:
        return StaleReason.ENGINE_RESYNCING
    return None


def fresh_donor_clause(donors: Any, engines: Any, *, namespace: Any, now: Any) -> ColumnElement[bool]:
    """:func:`stale_reason` ``is None`` as a SQL condition over the ``donors`` and ``engines``
    tables (inner-joined on ``engine_id``: an unknown engine has no row, so its donors are not
    fresh). ``namespace`` and ``now`` are values or bind parameters."""
    return and_(donors.c.namespace == namespace, donors.c.state == _LIVE,
                or_(donors.c.expires_at.is_(None), donors.c.expires_at > now),
                donors.c.generation == engines.c.generation, engines.c.status == _ACTIVE)


def longest_prefix(num_keys: int, holders: Callable[[int], T | None], *, min_blocks: int = 1) -> tuple[int, T | None]:
    """``(n, holders(n))`` for the largest ``n`` in ``[max(min_blocks, 1), num_keys]`` where
    ``holders(n)`` (who holds the first ``n`` chained content keys; falsy: nobody) is truthy, or
    ``(0, None)`` when there is none.

    Chained keys make holding monotone (a donor holding key i holds every key before it), so this
    is a binary search: the whole run is tried first (a whole-prompt hit costs one probe), then
    the shortest worth having, then O(log num_keys) probes.
    """
    first = max(min_blocks, 1)
    if num_keys < first:
        return 0, None
    found = holders(num_keys)
    if found:
        return num_keys, found
    if first == num_keys:
        return 0, None
    found = holders(first)
    if not found:
        return 0, None
    lo, hi = first, num_keys - 1  # invariant: holders(lo) is truthy; holders(hi + 1) is not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        probe = holders(mid)
        if probe:
            lo, found = mid, probe
        else:
            hi = mid - 1
    return lo, found
