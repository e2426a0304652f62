"""The connector's side of the ledger: synchronous, bounded reads and the few writes it makes.

Runs inside TensorRT-LLM's scheduler (``get_num_new_matched_tokens`` holds the block manager's
lock, reference/TRTLLM_CONNECTOR.md) and worker, so every call is synchronous, uses indexed
point queries only, and never scans a table. Writes (donor registration, save/evict, leases)
go through :func:`ledger.recorder.transact` and are ordinary log facts.

Freshness (DESIGN §5): a donor is fresh iff state ``live`` ∧ generation = its engine's current
generation ∧ (policy ``engine``: every needed block is live in that generation; policy
``store``: the donor store holds checksummed bytes, i.e. state ``live``) ∧ namespace equal ∧ not
expired. :meth:`LedgerClient.donor_freshness` returns ``None`` when fresh, else a
:class:`~ledger.types.StaleReason`.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence

from sqlalchemy import Connection, and_, func, select
from sqlalchemy.exc import SQLAlchemyError

from ledger import events as ev
from ledger.decide import Decider
from ledger.errors import EventRejected, PersistenceError
from ledger.migrate import check_schema
from ledger.recorder import transact
from ledger.schema import BlockRow, DonorBlockRow, DonorRow, EngineRow, LeaseRow
from ledger.types import (
    BlockHash,
    BlockState,
    DonorState,
    FreshnessPolicy,
    LeaseState,
    StaleReason,
    split_hash,
)

_DONORS, _DBLOCKS, _ENGINES = DonorRow.__table__, DonorBlockRow.__table__, EngineRow.__table__
_BLOCKS, _LEASES = BlockRow.__table__, LeaseRow.__table__


@dataclasses.dataclass(frozen=True, slots=True)
class EngineInfo:
    engine_id: str
    generation: int
    status: str


@dataclasses.dataclass(frozen=True, slots=True)
class DonorSpan:
    """The longest fresh donor prefix for a chain of content keys: ``num_blocks`` whole blocks."""

    donor_id: str
    engine_id: str
    generation: int
    num_blocks: int
    tokens_per_block: int
    store_ref: str | None
    checksum: str | None
    provider_generation: int


@dataclasses.dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    donor_id: str
    expires_at: float


class LedgerClient:
    """Synchronous ledger access for the connector (scheduler and worker).

    Args:
        db: ledger URL or SQLite path (see :mod:`ledger.db`).
        check: refuse a database not at the schema head (``SchemaOutOfDate``).
    """

    def __init__(self, db: str, *, check: bool = True) -> None:
        from ledger.db import sync_engine

        self.db = db
        self._reader = sync_engine(db)
        self._writer = sync_engine(db, writer=True, create=False)
        if check:
            with self._reader.connect() as conn:
                check_schema(conn, db)

    def close(self) -> None:
        self._reader.dispose()
        self._writer.dispose()

    # -- reads -------------------------------------------------------------------------------

    def engine(self, engine_id: str) -> EngineInfo | None:
        """The engine's current generation and status, or None if the ledger never saw it."""
        with self._read() as conn:
            row = conn.execute(select(_ENGINES.c.generation, _ENGINES.c.status)
                               .where(_ENGINES.c.engine_id == engine_id)).first()
        return None if row is None else EngineInfo(engine_id, row.generation, row.status)

    def longest_live_run(self, engine_id: str, block_hashes: Sequence[BlockHash], *, attention_dp_rank: int = 0,
                         window_size: int = 0) -> int:
        """Number of leading ``block_hashes`` that are live in the engine's current generation (blocks)."""
        with self._read() as conn:
            return _live_prefix(conn, engine_id, attention_dp_rank, window_size, block_hashes)

    def find_donor_span(self, namespace: str, content_keys: Sequence[bytes], *,
                        policy: FreshnessPolicy = FreshnessPolicy.ENGINE, now: float | None = None,
                        min_blocks: int = 1) -> DonorSpan | None:
        """Longest fresh donor span covering ``content_keys[0:n]`` (chained keys, so a donor that
        holds key i holds every key before it). Binary search over positions: O(log n) indexed
        point queries, then one liveness check of the chosen donor's blocks (policy ``engine``).

        Args:
            content_keys: the request's chained content keys, one per whole block.
            min_blocks: spans shorter than this are not worth returning (blocks).
        """
        now = time.time() if now is None else now
        with self._read() as conn:
            return _find_span(conn, namespace, content_keys, policy, now, min_blocks)

    def donor_freshness(self, donor_id: str, *, namespace: str, num_blocks: int | None = None,
                        policy: FreshnessPolicy = FreshnessPolicy.ENGINE, lease_id: str | None = None,
                        now: float | None = None) -> StaleReason | None:
        """Revalidate a donor (the worker calls this before each copy). None means fresh."""
        now = time.time() if now is None else now
        with self._read() as conn:
            return _freshness(conn, donor_id, namespace, num_blocks, policy, lease_id, now)

    def held_leases(self, *, now: float | None = None, donor_id: str | None = None) -> int:
        """Leases held and not expired (all, or of one donor)."""
        now = time.time() if now is None else now
        query = select(func.count()).select_from(_LEASES).where(_LEASES.c.state == LeaseState.HELD,
                                                                 _LEASES.c.expires_at > now)
        if donor_id is not None:
            query = query.where(_LEASES.c.donor_id == donor_id)
        with self._read() as conn:
            return conn.execute(query).scalar_one()

    # -- writes ------------------------------------------------------------------------------

    def register_donor(self, donor: ev.DonorRegistered) -> None:
        """Append ``donor_registered``. Raises EventRejected if the donor id exists."""
        def run(decider: Decider) -> None:
            if donor.donor_id in decider.proj.donors:
                raise EventRejected("donor_exists", donor.donor_id)
            decider.ensure_engine(donor.engine_id)
            decider.emit(donor, engine_id=donor.engine_id)

        self._write(run, engine_ids=[donor.engine_id], donor_ids=[donor.donor_id])

    def mark_donor_saved(self, donor_id: str, *, store_ref: str, checksum: str, size_bytes: int) -> None:
        """Append ``donor_saved`` (its KV bytes are published in the donor store)."""
        self._donor_fact(donor_id, ev.DonorSaved(donor_id=donor_id, store_ref=store_ref, checksum=checksum,
                                                size_bytes=size_bytes))

    def evict_donor(self, donor_id: str, reason: str) -> None:
        """Append ``donor_evicted``."""
        self._donor_fact(donor_id, ev.DonorEvicted(donor_id=donor_id, reason=reason))

    def take_lease(self, donor_id: str, *, request_id: str, holder: str, namespace: str, num_blocks: int,
                   ttl_s: float, policy: FreshnessPolicy = FreshnessPolicy.ENGINE,
                   now: float | None = None) -> Lease | StaleReason:
        """Pin a donor for a load: revalidate and append ``lease_taken`` in ONE write transaction,
        so no generation bump can slip between the check and the pin.

        Returns:
            the lease, or why the donor is no longer fresh (nothing is written then).
        """
        now = time.time() if now is None else now
        lease = Lease(lease_id=uuid.uuid4().hex, donor_id=donor_id, expires_at=now + ttl_s)

        def run(decider: Decider, conn: Connection) -> Lease | StaleReason:
            reason = _freshness(conn, donor_id, namespace, num_blocks, policy, None, now)
            if reason is not None:
                return reason
            decider.emit(ev.LeaseTaken(lease_id=lease.lease_id, donor_id=donor_id, request_id=request_id,
                                       holder=holder, expires_at=lease.expires_at))
            return lease

        return self._write(run, with_conn=True)

    def release_lease(self, lease_id: str, reason: str) -> bool:
        """Append ``lease_released``; False (nothing written) if unknown or already released."""
        def run(decider: Decider) -> bool:
            row = decider.proj.leases.get(lease_id)
            if row is None or row["state"] != LeaseState.HELD:
                return False
            decider.emit(ev.LeaseReleased(lease_id=lease_id, reason=reason))
            return True

        return self._write(run, lease_ids=[lease_id])

    # -- plumbing ----------------------------------------------------------------------------

    def _read(self):
        return self._reader.connect()

    def _donor_fact(self, donor_id: str, fact: ev.DonorSaved | ev.DonorEvicted) -> None:
        def run(decider: Decider) -> None:
            donor = decider.proj.donors.get(donor_id)
            if donor is None:
                raise EventRejected("unknown_donor", donor_id)
            decider.emit(fact, engine_id=donor["engine_id"])

        self._write(run, donor_ids=[donor_id])

    def _write(self, fn, *, with_conn: bool = False, **ids):
        try:
            with self._writer.begin() as conn:
                body = (lambda d: fn(d, conn)) if with_conn else fn
                return transact(conn, body, **ids)
        except SQLAlchemyError as exc:
            raise PersistenceError(str(getattr(exc, "orig", exc))) from exc


# ------------------------------------------------------------------------------------------------
# query helpers (one connection, no writes)
# ------------------------------------------------------------------------------------------------


def _fresh_donor_filter(namespace: str, now: float):
    return and_(_DONORS.c.namespace == namespace, _DONORS.c.state == DonorState.LIVE,
                _DONORS.c.generation == _ENGINES.c.generation,
                (_DONORS.c.expires_at.is_(None)) | (_DONORS.c.expires_at > now))


def _donors_holding(conn: Connection, namespace: str, content_key: bytes, now: float, limit: int = 4) -> list:
    query = (select(_DONORS.c.donor_id, _DONORS.c.engine_id, _DONORS.c.generation, _DONORS.c.tokens_per_block,
                    _DONORS.c.store_ref, _DONORS.c.checksum, _DONORS.c.provider_generation,
                    _DONORS.c.attention_dp_rank, _DONORS.c.window_size)
             .select_from(_DBLOCKS.join(_DONORS, _DONORS.c.donor_id == _DBLOCKS.c.donor_id)
                          .join(_ENGINES, _ENGINES.c.engine_id == _DONORS.c.engine_id))
             .where(_DBLOCKS.c.content_key == content_key, _fresh_donor_filter(namespace, now))
             .order_by(_DONORS.c.registered_seq.desc()).limit(limit))
    return conn.execute(query).all()


def _find_span(conn: Connection, namespace: str, keys: Sequence[bytes], policy: FreshnessPolicy, now: float,
               min_blocks: int) -> DonorSpan | None:
    lo, hi = 0, len(keys)  # invariant: a fresh donor holds keys[:lo]; none holds keys[:hi+1]
    if hi == 0 or not _donors_holding(conn, namespace, keys[0], now, 1):
        return None
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _donors_holding(conn, namespace, keys[mid - 1], now, 1):
            lo = mid
        else:
            hi = mid - 1
    best: DonorSpan | None = None
    for donor in _donors_holding(conn, namespace, keys[lo - 1], now):
        usable = lo
        if policy == FreshnessPolicy.ENGINE:
            usable = min(lo, _donor_live_prefix(conn, donor.donor_id, donor.engine_id, donor.attention_dp_rank,
                                                donor.window_size, donor.generation, lo))
        if usable >= min_blocks and (best is None or usable > best.num_blocks):
            best = DonorSpan(donor.donor_id, donor.engine_id, donor.generation, usable, donor.tokens_per_block,
                             donor.store_ref, donor.checksum, donor.provider_generation)
        if best is not None and best.num_blocks == lo:
            break
    return best


def _donor_live_prefix(conn: Connection, donor_id: str, engine_id: str, dp_rank: int, window: int,
                       generation: int, num_blocks: int) -> int:
    """How many leading blocks of the donor are live in ``generation`` (at most ``num_blocks``)."""
    live = and_(_BLOCKS.c.engine_id == engine_id, _BLOCKS.c.attention_dp_rank == dp_rank,
                _BLOCKS.c.window_size == window, _BLOCKS.c.block_hash == _DBLOCKS.c.block_hash,
                _BLOCKS.c.block_hash_ext == _DBLOCKS.c.block_hash_ext, _BLOCKS.c.state == BlockState.LIVE,
                _BLOCKS.c.generation == generation)
    first_dead = conn.execute(
        select(func.min(_DBLOCKS.c.position)).where(
            _DBLOCKS.c.donor_id == donor_id, _DBLOCKS.c.position < num_blocks,
            ~select(_BLOCKS.c.block_hash).where(live).exists())).scalar()
    return num_blocks if first_dead is None else first_dead


def _live_prefix(conn: Connection, engine_id: str, dp_rank: int, window: int, hashes: Sequence[BlockHash]) -> int:
    if not hashes:
        return 0
    generation = conn.execute(select(_ENGINES.c.generation).where(_ENGINES.c.engine_id == engine_id)).scalar()
    if generation is None:
        return 0
    split = [split_hash(h) for h in hashes]
    rows = conn.execute(select(_BLOCKS.c.block_hash, _BLOCKS.c.block_hash_ext).where(
        _BLOCKS.c.engine_id == engine_id, _BLOCKS.c.attention_dp_rank == dp_rank, _BLOCKS.c.window_size == window,
        _BLOCKS.c.block_hash.in_({h for h, _ in split}), _BLOCKS.c.state == BlockState.LIVE,
        _BLOCKS.c.generation == generation)).all()
    live = {(r.block_hash, r.block_hash_ext) for r in rows}
    count = 0
    for key in split:
        if key not in live:
            break
        count += 1
    return count


def _freshness(conn: Connection, donor_id: str, namespace: str, num_blocks: int | None, policy: FreshnessPolicy,
               lease_id: str | None, now: float) -> StaleReason | None:
    donor = conn.execute(select(_DONORS).where(_DONORS.c.donor_id == donor_id)).first()
    if donor is None:
        return StaleReason.UNKNOWN_DONOR
    if donor.namespace != namespace:
        return StaleReason.NAMESPACE_MISMATCH
    state_reason = {DonorState.REGISTERED: StaleReason.NOT_SAVED, DonorState.EVICTED: StaleReason.EVICTED,
                    DonorState.QUARANTINED: StaleReason.QUARANTINED}.get(DonorState(donor.state))
    if state_reason is not None:
        return state_reason
    if donor.expires_at is not None and donor.expires_at <= now:
        return StaleReason.EXPIRED
    generation = conn.execute(select(_ENGINES.c.generation).where(_ENGINES.c.engine_id == donor.engine_id)).scalar()
    if generation is None:
        return StaleReason.ENGINE_UNKNOWN
    if generation != donor.generation:
        return StaleReason.GENERATION_MISMATCH
    needed = donor.num_blocks if num_blocks is None else min(num_blocks, donor.num_blocks)
    if policy == FreshnessPolicy.ENGINE and _donor_live_prefix(
            conn, donor_id, donor.engine_id, donor.attention_dp_rank, donor.window_size, generation, needed) < needed:
        return StaleReason.BLOCKS_NOT_LIVE
    if lease_id is not None:
        lease = conn.execute(select(_LEASES.c.state, _LEASES.c.expires_at, _LEASES.c.donor_id)
                             .where(_LEASES.c.lease_id == lease_id)).first()
        if lease is None or lease.state != LeaseState.HELD or lease.expires_at <= now or lease.donor_id != donor_id:
            return StaleReason.LEASE_NOT_HELD
    return None
