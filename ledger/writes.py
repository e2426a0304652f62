"""The connector's writes: each a decision run by :func:`ledger.recorder.transact` in ONE write
transaction, so its checks and the facts it appends see the same ledger (no lease can be taken
between an eviction's check and the eviction; no generation bump can slip between a lease's
revalidation and the pin). The facts are ordinary log entries, applied like the consumer's.

Each function returns a decision: ``decide(decider) -> value``, given a :class:`~ledger.decide.Decider`
over the rows named by its ``ids`` (:class:`Write`). Raises inside a decision
(:class:`~ledger.errors.EventRejected`) roll the transaction back.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ledger import events as ev
from ledger.db import Sql
from ledger.decide import Decider
from ledger.errors import EventRejected
from ledger.reads import check_donor, held_leases, live_prefix
from ledger.recorder import transact
from ledger.types import DonorState, FreshnessPolicy, GenerationReason, LeaseState, StaleReason

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    donor_id: str
    expires_at: float
    num_blocks: int = 0
    """Leading donor blocks the lease was granted for (checked live under policy ``engine``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Write(Generic[T]):
    """A decision and the projection rows it reads (loaded by :func:`ledger.recorder.transact`)."""

    decide: Callable[[Sql], Callable[[Decider], T]]
    """Given the transaction's connection (for reads beyond the loaded rows), the decision."""
    ids: dict[str, Any] = dataclasses.field(default_factory=dict)

    def run(self, sql: Sql) -> T:
        """Run in the caller's write transaction on ``sql``."""
        return transact(sql, self.decide(sql), **self.ids)


def register_donor(donor: ev.DonorRegistered) -> Write[None]:
    """Append ``donor_registered``; EventRejected if the donor id exists."""
    def decide(decider: Decider) -> None:
        if donor.donor_id in decider.proj.donors:
            raise EventRejected("donor_exists", donor.donor_id)
        decider.ensure_engine(donor.engine_id)
        decider.emit(donor, engine_id=donor.engine_id)

    return Write(lambda sql: decide, {"engine_ids": [donor.engine_id], "donor_ids": [donor.donor_id]})


def record_engine_start(engine_id: str) -> Write[bool]:
    """Bump a known engine's generation (reason ``engine_started``); False for an unknown engine."""
    def decide(decider: Decider) -> bool:
        if engine_id not in decider.proj.engines:
            return False
        decider.bump(engine_id, GenerationReason.ENGINE_STARTED)
        return True

    return Write(lambda sql: decide, {"engine_ids": [engine_id]})


def donor_fact(donor_id: str, fact: ev.DonorSaved | ev.DonorEvicted) -> Write[None]:
    """Append ``fact`` about a known donor; EventRejected for an unknown one."""
    def decide(decider: Decider) -> None:
        donor = decider.proj.donors.get(donor_id)
        if donor is None:
            raise EventRejected("unknown_donor", donor_id)
        decider.emit(fact, engine_id=donor.engine_id)

    return Write(lambda sql: decide, {"donor_ids": [donor_id]})


def evict_donor_if_unleased(donor_id: str, reason: str, now: float) -> Write[bool]:
    """Append ``donor_evicted`` unless a lease holds the donor: True if evicted now or already,
    False if a lease holds it; EventRejected for an unknown donor."""
    def run(sql: Sql) -> Callable[[Decider], bool]:
        def decide(decider: Decider) -> bool:
            donor = decider.proj.donors.get(donor_id)
            if donor is None:
                raise EventRejected("unknown_donor", donor_id)
            if held_leases(sql, now, donor_id):
                return False
            if donor.state != DonorState.EVICTED:
                decider.emit(ev.DonorEvicted(donor_id=donor_id, reason=reason), engine_id=donor.engine_id)
            return True

        return decide

    return Write(run, {"donor_ids": [donor_id]})


def take_lease(donor_id: str, *, request_id: str, holder: str, namespace: str, num_blocks: int, wanted: int,
               ttl_s: float, policy: FreshnessPolicy, now: float, lease_id: str | None) -> Write[Lease | StaleReason]:
    """Revalidate the donor and append ``lease_taken`` for its live head of ``num_blocks`` up to
    ``wanted`` blocks (see :meth:`ledger.client.LedgerClient.take_lease`); why it is stale otherwise."""
    def run(sql: Sql) -> Callable[[Decider], Lease | StaleReason]:
        def decide(decider: Decider) -> Lease | StaleReason:
            donor = check_donor(sql, donor_id, namespace, None, now)
            if isinstance(donor, StaleReason):
                return donor
            usable = min(wanted, donor.num_blocks)
            if policy == FreshnessPolicy.ENGINE and usable > 0:
                usable = live_prefix(sql, donor_id, donor, usable)
                if usable < min(num_blocks, donor.num_blocks):
                    return StaleReason.BLOCKS_NOT_LIVE
            lease = Lease(lease_id=lease_id or uuid.uuid4().hex, donor_id=donor_id, expires_at=now + ttl_s,
                          num_blocks=usable)
            decider.emit(ev.LeaseTaken(lease_id=lease.lease_id, donor_id=donor_id, request_id=request_id,
                                       holder=holder, expires_at=lease.expires_at))
            return lease

        return decide

    return Write(run)


def release_lease(lease_id: str, reason: str) -> Write[bool]:
    """Append ``lease_released``; False (nothing written) if unknown or already released."""
    def decide(decider: Decider) -> bool:
        row = decider.proj.leases.get(lease_id)
        if row is None or row.state != LeaseState.HELD:
            return False
        decider.emit(ev.LeaseReleased(lease_id=lease_id, reason=reason))
        return True

    return Write(lambda sql: decide, {"lease_ids": [lease_id]})
