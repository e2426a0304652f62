"""The connector's side of the ledger: synchronous, bounded reads and the few writes it makes.

Runs inside TensorRT-LLM's scheduler (``get_num_new_matched_tokens`` holds the block manager's
lock, reference/TRTLLM_CONNECTOR.md) and worker, so every call is synchronous, uses indexed
point queries only, and never scans a table. Writes (donor registration, save/evict, leases)
go through :func:`ledger.recorder.transact` and are ordinary log facts.

Freshness is :mod:`ledger.freshness` (the one rule, in Python and as SQL); this module adds block
liveness for policy ``engine``. :meth:`LedgerClient.donor_freshness` returns ``None`` when fresh,
else a :class:`~ledger.types.StaleReason`.

Speed (DESIGN §7: the whole lookup, hit or miss, p99 ≤ 250 µs at 2K tokens, ≤ 2 ms at 32K).
Building and executing SQLAlchemy expressions per call cost 0.5–1.3 ms per query on the 2-core
reference machine, which is why the connector once carried its own copy of these reads as plain
SQL. Now every statement below is written once in Core, compiled once per dialect
(:class:`~ledger.db.Prepared`) and run on this thread's own DBAPI connection, kept open:
~10–30 µs per query on SQLite (tools/results/connector-*.md). On SQLite a read of several
statements runs in one deferred transaction (one snapshot, as before); on PostgreSQL reads run in
autocommit, where READ COMMITTED already gave every statement its own snapshot. Writes open their
transaction on the same connection (``BEGIN IMMEDIATE`` on SQLite).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from sqlalchemy import bindparam, exists, func, select
from sqlalchemy.exc import SQLAlchemyError

from ledger import events as ev
from ledger import db as ledger_db
from ledger.db import Prepared, Sql
from ledger.decide import Decider
from ledger.donor_view import DonorView
from ledger.errors import DeadlineExceeded, EventRejected, PersistenceError, persistence_error
from ledger.freshness import DonorFacts, fresh_donor_clause, longest_prefix, stale_reason
from ledger.liveness import LIVENESS_KINDS
from ledger.migrate import check_schema
from ledger.placement_reads import PlacementSnapshot, read_placement
from ledger.recorder import transact
from ledger.schema import BlockRow, DonorBlockRow, DonorRow, EngineRow, LeaseRow, LogRow
from ledger.types import (
    BlockHash,
    BlockState,
    DonorState,
    FreshnessPolicy,
    GenerationReason,
    LeaseState,
    StaleReason,
    split_hash,
)

T = TypeVar("T")
_DONORS, _DBLOCKS, _ENGINES = DonorRow.__table__, DonorBlockRow.__table__, EngineRow.__table__
_BLOCKS, _LEASES, _LOG = BlockRow.__table__, LeaseRow.__table__, LogRow.__table__


@dataclasses.dataclass(frozen=True, slots=True)
class EngineInfo:
    engine_id: str
    generation: int
    status: str
    generation_reason: GenerationReason | None = None
    """Why the current generation started; None when it is the generation the engine was
    registered with. Read from the log row that set it (``engines.generation_seq``)."""


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
class DonorInfo:
    """A donor as the projection holds it, fresh or not (miss diagnosis, audits)."""

    donor_id: str
    engine_id: str
    generation: int
    state: DonorState
    num_blocks: int
    expires_at: float | None
    store_ref: str | None
    checksum: str | None
    registered_seq: int


@dataclasses.dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    donor_id: str
    expires_at: float
    num_blocks: int = 0
    """Leading donor blocks the lease was granted for (checked live under policy ``engine``)."""


# ------------------------------------------------------------------------------------------------
# statements: the one place where the connector's SQL is written (compiled once per dialect)
# ------------------------------------------------------------------------------------------------

_SPAN_COLUMNS = (_DONORS.c.donor_id, _DONORS.c.engine_id, _DONORS.c.generation, _DONORS.c.tokens_per_block,
                 _DONORS.c.store_ref, _DONORS.c.checksum, _DONORS.c.provider_generation,
                 _DONORS.c.attention_dp_rank, _DONORS.c.window_size)
_HOLDING = Prepared(
    select(*_SPAN_COLUMNS)
    .select_from(_DBLOCKS.join(_DONORS, _DONORS.c.donor_id == _DBLOCKS.c.donor_id)
                 .join(_ENGINES, _ENGINES.c.engine_id == _DONORS.c.engine_id))
    .where(_DBLOCKS.c.content_key == bindparam("content_key"),
           fresh_donor_clause(_DONORS, _ENGINES, namespace=bindparam("namespace"), now=bindparam("now")))
    .order_by(_DONORS.c.registered_seq.desc()).limit(bindparam("limit")))
"""Donors holding a content key that are fresh but for block liveness (:func:`ledger.freshness.fresh_donor_clause`),
newest first. Chained keys: a donor holding key i holds every key before it."""

_FIRST_DEAD = Prepared(
    select(func.min(_DBLOCKS.c.position)).where(
        _DBLOCKS.c.donor_id == bindparam("donor_id"), _DBLOCKS.c.position < bindparam("num_blocks"),
        ~exists().where(_BLOCKS.c.engine_id == bindparam("engine_id"),
                        _BLOCKS.c.attention_dp_rank == bindparam("attention_dp_rank"),
                        _BLOCKS.c.window_size == bindparam("window_size"),
                        _BLOCKS.c.block_hash == _DBLOCKS.c.block_hash,
                        _BLOCKS.c.block_hash_ext == _DBLOCKS.c.block_hash_ext,
                        _BLOCKS.c.state == str(BlockState.LIVE), _BLOCKS.c.generation == bindparam("generation"))))
"""Position of the donor's first block (below ``num_blocks``) that is not live in ``generation``."""

_CHECK = Prepared(
    select(_DONORS.c.namespace, _DONORS.c.state, _DONORS.c.expires_at, _DONORS.c.generation, _ENGINES.c.generation,
           _ENGINES.c.status, _DONORS.c.engine_id, _DONORS.c.attention_dp_rank, _DONORS.c.window_size, _DONORS.c.num_blocks,
           _LEASES.c.state, _LEASES.c.expires_at, _LEASES.c.donor_id)
    .select_from(_DONORS.outerjoin(_ENGINES, _ENGINES.c.engine_id == _DONORS.c.engine_id)
                 .outerjoin(_LEASES, _LEASES.c.lease_id == bindparam("lease_id")))
    .where(_DONORS.c.donor_id == bindparam("donor_id")))
"""Everything freshness needs but block liveness, in one statement (donor ⟕ engine ⟕ lease)."""

_MAX_SEQ = Prepared(select(func.max(_LOG.c.seq)))
_BLOCK_ROWS = Prepared(
    select(_LOG.c.seq, _LOG.c.kind, _LOG.c.engine_id, _LOG.c.attention_dp_rank, _LOG.c.window_size, _LOG.c.body)
    .where(_LOG.c.kind.in_([bindparam(f"kind{i}") for i in range(len(LIVENESS_KINDS))]),
           _LOG.c.seq > bindparam("after"), _LOG.c.seq <= bindparam("upto"), _LOG.c.applied.is_(True))
    .order_by(_LOG.c.seq))
"""Applied block rows in a seq range (one range of ``ix_log_kind_seq`` per kind)."""

_BLOCK_ROW_PARAMS = {f"kind{i}": kind for i, kind in enumerate(LIVENESS_KINDS)}

_ENGINE_GENERATIONS = Prepared(select(_ENGINES.c.engine_id, _ENGINES.c.generation, _ENGINES.c.status))
_DONORS_CHANGED = Prepared(
    select(_DONORS.c.donor_id, _DONORS.c.namespace, _DONORS.c.engine_id, _DONORS.c.attention_dp_rank,
           _DONORS.c.window_size, _DONORS.c.generation, _DONORS.c.tokens_per_block, _DONORS.c.provider_generation,
           _DONORS.c.expires_at, _DONORS.c.state, _DONORS.c.store_ref, _DONORS.c.checksum, _DONORS.c.registered_seq)
    .where(_DONORS.c.updated_seq > bindparam("after"), _DONORS.c.updated_seq <= bindparam("upto"))
    .order_by(_DONORS.c.updated_seq))
"""Donor rows changed in a seq range (``ix_donors_updated_seq``), in the layout DonorView.changed takes."""
_DONOR_BLOCKS_LIVE = Prepared(
    select(_DBLOCKS.c.content_key, _DBLOCKS.c.block_hash, _DBLOCKS.c.block_hash_ext,
           exists().where(_BLOCKS.c.engine_id == bindparam("engine_id"),
                          _BLOCKS.c.attention_dp_rank == bindparam("attention_dp_rank"),
                          _BLOCKS.c.window_size == bindparam("window_size"),
                          _BLOCKS.c.block_hash == _DBLOCKS.c.block_hash,
                          _BLOCKS.c.block_hash_ext == _DBLOCKS.c.block_hash_ext,
                          _BLOCKS.c.state == str(BlockState.LIVE),
                          _BLOCKS.c.generation == bindparam("generation")).label("live"))
    .where(_DBLOCKS.c.donor_id == bindparam("donor_id")).order_by(_DBLOCKS.c.position))
"""A donor's blocks in position order: content key, engine hash, live in the donor's generation."""

_ENGINE_INFO = Prepared(
    select(_ENGINES.c.generation, _ENGINES.c.status, _LOG.c.kind, _LOG.c.body)
    .select_from(_ENGINES.outerjoin(_LOG, _LOG.c.seq == _ENGINES.c.generation_seq))
    .where(_ENGINES.c.engine_id == bindparam("engine_id")))

_DONORS_FOR_KEY = Prepared(
    select(_DONORS.c.donor_id, _DONORS.c.engine_id, _DONORS.c.generation, _DONORS.c.state, _DONORS.c.num_blocks,
           _DONORS.c.expires_at, _DONORS.c.store_ref, _DONORS.c.checksum, _DONORS.c.registered_seq)
    .select_from(_DBLOCKS.join(_DONORS, _DONORS.c.donor_id == _DBLOCKS.c.donor_id))
    .where(_DBLOCKS.c.content_key == bindparam("content_key"), _DONORS.c.namespace == bindparam("namespace"))
    .order_by(_DONORS.c.registered_seq.desc()).limit(bindparam("limit")))

_HELD = (_LEASES.c.state == str(LeaseState.HELD), _LEASES.c.expires_at > bindparam("now"))
_HELD_LEASES = Prepared(select(func.count()).select_from(_LEASES).where(*_HELD))
_HELD_LEASES_OF = Prepared(select(func.count()).select_from(_LEASES).where(
    *_HELD, _LEASES.c.donor_id == bindparam("donor_id")))

VIEW_CATCH_UP_MAX_SEQS = 100_000
"""Log rows one :meth:`LedgerClient.refresh_view` call reads at most (a view's first load reads
no log rows, only donors)."""


class LedgerClient:
    """Synchronous ledger access for the connector (scheduler and worker). Thread-safe: each
    thread uses its own DBAPI connection, opened on first use and kept until :meth:`close`.

    Args:
        db: ledger URL or SQLite path (see :mod:`ledger.db`).
        check: refuse a database not at the schema head (``SchemaOutOfDate``).
        statement_timeout_s: PostgreSQL: statements (lock waits included) are cancelled after this
            long, and so is connecting (see :func:`ledger.db.sync_engine`); None: no limit.

    Raises (constructor): SchemaOutOfDate (``check``), LedgerError for an unsupported URL or a
    missing SQLite file, PersistenceError when the database cannot be opened. Every method raises
    PersistenceError when the database fails (or a statement timed out).
    """

    def __init__(self, db: str, *, check: bool = True, statement_timeout_s: float | None = None) -> None:
        from ledger.db import sync_engine

        self.db = db
        self._engine = sync_engine(db, statement_timeout_s=statement_timeout_s)
        self._local = threading.local()
        self._open: list[Any] = []
        self._open_lock = threading.Lock()
        if check:
            try:
                with self._engine.connect() as conn:
                    check_schema(conn, db)
            except SQLAlchemyError as exc:  # unreachable, refused, not a database
                self._engine.dispose()
                raise persistence_error(exc) from exc

    @property
    def interruptible(self) -> bool:
        """True when :meth:`deadline` can interrupt this ledger's reads (SQLite)."""
        return self._engine.dialect.name == "sqlite"

    def close(self) -> None:
        with self._open_lock:
            connections, self._open = self._open, []
        for raw in connections:
            try:
                raw.close()
            except Exception:  # noqa: BLE001 - closing a broken connection at shutdown
                pass
        self._engine.dispose()

    # -- reads -------------------------------------------------------------------------------

    def engine(self, engine_id: str) -> EngineInfo | None:
        """The engine's current generation, status and why that generation started, or None if
        the ledger never saw it."""
        row = self._read(lambda sql: sql.one(_ENGINE_INFO, {"engine_id": engine_id}))
        if row is None:
            return None
        generation, status, kind, body = row
        reason = None
        if kind == "generation_bumped":
            bumped = ev.BODY_DECODER.decode(bytes(body))
            reason = GenerationReason(bumped.reason)
        return EngineInfo(engine_id, generation, status, reason)

    def placement(self, block_hashes: Sequence[BlockHash], namespace: str | None, content_keys: Sequence[bytes], *,
                  now: float | None = None) -> PlacementSnapshot:
        """Per engine, the request's exact live overlap and longest fresh donor span, from one
        snapshot (:mod:`ledger.placement_reads`; placement advice, never a promise)."""
        now = time.time() if now is None else now
        hashes = [split_hash(h) for h in block_hashes]
        return self._read(lambda sql: read_placement(sql, hashes, namespace, content_keys, now), snapshot=True)

    def last_seq(self) -> int:
        """The log's last seq (0 when empty); also a reachability check."""
        return int(self._read(lambda sql: sql.one(_MAX_SEQ, {})[0]) or 0)

    def find_donor_span(self, namespace: str, content_keys: Sequence[bytes], *,
                        policy: FreshnessPolicy = FreshnessPolicy.ENGINE, now: float | None = None,
                        min_blocks: int = 1, check_blocks: bool = True) -> DonorSpan | None:
        """Longest fresh donor span covering ``content_keys[0:n]`` (chained keys, so a donor that
        holds key i holds every key before it). Binary search over positions: O(log n) indexed
        point queries, then (policy ``engine``) the liveness of the chosen donors' blocks.

        Args:
            content_keys: the request's chained content keys, one per whole block.
            min_blocks: spans shorter than this are not worth returning (blocks).
            check_blocks: False skips the block liveness check (policy ``engine``): the span is
                then only as fresh as its donor's state, and the caller must check the blocks
                itself — :meth:`take_lease` does, in its write transaction (the scheduler's path:
                checking them twice cost ~2 µs per block).
        """
        now = time.time() if now is None else now
        blocks = check_blocks and policy == FreshnessPolicy.ENGINE
        return self._read(lambda sql: _find_span(sql, namespace, content_keys, blocks, now, min_blocks),
                          snapshot=True)

    def refresh_view(self, view: DonorView) -> int:
        """Catch ``view`` up with what changed in the ledger since its cursor (one read
        transaction on SQLite): engines' generations, donors whose ``updated_seq`` moved (a new
        saved donor's content keys, block hashes and block liveness are read here) and the log's
        block rows. Returns the log seq the view now reflects. Cost when nothing changed: one
        statement (the log's max seq). A view far behind (after an outage) catches up at most
        :data:`VIEW_CATCH_UP_MAX_SEQS` log rows per call, and counts as caught up only at the
        end, so no single statement outgrows a statement timeout."""
        def run(sql: Sql) -> int:
            latest = sql.one(_MAX_SEQ, {})[0] or 0
            if latest == view.cursor:
                view.caught_up()
                return latest
            after = view.cursor
            upto = latest if after < 0 else min(latest, after + VIEW_CATCH_UP_MAX_SEQS)
            blocks = sql.all(_BLOCK_ROWS, {"after": after, "upto": upto, **_BLOCK_ROW_PARAMS}) if after >= 0 else []
            view.changed(upto, sql.all(_ENGINE_GENERATIONS, {}),
                         sql.all(_DONORS_CHANGED, {"after": after, "upto": upto}), blocks,
                         lambda row: _view_donor(sql, row), complete=upto == latest)
            return upto

        with view.catching_up:
            return self._read(run, snapshot=True)

    @contextlib.contextmanager
    def deadline(self, seconds: float) -> Iterator[None]:
        """Interrupt this thread's SQLite statements once ``seconds`` have passed: they raise
        :class:`~ledger.errors.DeadlineExceeded`. Lets the scheduler read on the engine's own
        thread under a hard deadline (SQLite checks every 64 virtual-machine steps). A no-op on
        PostgreSQL, whose caller keeps its deadline thread."""
        sql = self._sql()
        if not sql.is_sqlite:
            yield
            return
        limit = time.perf_counter() + seconds
        clock = time.perf_counter
        local = self._local

        def past_deadline() -> bool:
            if clock() > limit:
                local.interrupted = True
                return True
            return False

        local.interrupted = False
        sql.connection.set_progress_handler(past_deadline, 64)
        try:
            yield
        finally:
            sql.connection.set_progress_handler(None, 0)
            local.interrupted = False

    @contextlib.contextmanager
    def lock_wait(self, seconds: float) -> Iterator[None]:
        """Wait at most ``seconds`` for the ledger's write lock in this thread's writes: SQLite's
        database lock (instead of ``busy_timeout``, 30 s), PostgreSQL's lock on the log that every
        writer takes (``lock_timeout``; no limit otherwise). A write that cannot get it raises
        :class:`~ledger.errors.PersistenceError`, for which :func:`lock_timed_out` is True. For
        writes on a thread that must not stall (the engine's)."""
        sql = self._sql()
        ms = max(1, round(seconds * 1000))
        if sql.is_sqlite:
            wait, restore = f"PRAGMA busy_timeout={ms}", f"PRAGMA busy_timeout={ledger_db.SQLITE_BUSY_TIMEOUT_MS}"
        else:  # session level (autocommit connection): SET LOCAL would end with the first COMMIT
            wait, restore = f"SET lock_timeout = {ms}", "RESET lock_timeout"
        try:
            sql.driver(wait)
        except sql.errors as exc:
            self._drop()
            raise persistence_error(sql.wrap(exc)) from exc
        try:
            yield
        finally:
            if getattr(self._local, "sql", None) is sql:  # not replaced by a reconnect meanwhile
                try:
                    sql.driver(restore)
                except sql.errors:  # a broken connection: the next use reconnects with the defaults
                    self._drop()

    def donor_freshness(self, donor_id: str, *, namespace: str, num_blocks: int | None = None,
                        policy: FreshnessPolicy = FreshnessPolicy.ENGINE, lease_id: str | None = None,
                        now: float | None = None) -> StaleReason | None:
        """Revalidate a donor (the worker calls this before each copy). None means fresh.

        Policy ``store`` (or ``num_blocks=0``) skips block liveness: one statement.
        """
        now = time.time() if now is None else now

        def run(sql: Sql) -> StaleReason | None:
            donor = _check(sql, donor_id, namespace, lease_id, now)
            if isinstance(donor, StaleReason):
                return donor
            needed = donor.num_blocks if num_blocks is None else min(num_blocks, donor.num_blocks)
            if policy == FreshnessPolicy.ENGINE and needed > 0 and _live_prefix(sql, donor_id, donor, needed) < needed:
                return StaleReason.BLOCKS_NOT_LIVE
            return None

        blocks = policy == FreshnessPolicy.ENGINE and (num_blocks is None or num_blocks > 0)
        return self._read(run, snapshot=blocks)

    def donors_for_key(self, namespace: str, content_key: bytes, limit: int = 4) -> list[DonorInfo]:
        """Donors of ``namespace`` that hold ``content_key``, newest first, FRESH OR NOT (miss
        diagnosis: why is the donor of this text not usable?). Never a reason to load."""
        rows = self._read(lambda sql: sql.all(_DONORS_FOR_KEY, {"content_key": content_key, "namespace": namespace,
                                                                "limit": limit}))
        return [DonorInfo(r[0], r[1], r[2], DonorState(r[3]), r[4], r[5], r[6], r[7], r[8]) for r in rows]

    def held_leases(self, *, now: float | None = None, donor_id: str | None = None) -> int:
        """Leases held and not expired (all, or of one donor)."""
        now = time.time() if now is None else now
        if donor_id is None:
            return self._read(lambda sql: sql.one(_HELD_LEASES, {"now": now})[0])
        return self._read(lambda sql: sql.one(_HELD_LEASES_OF, {"now": now, "donor_id": donor_id})[0])

    # -- writes ------------------------------------------------------------------------------

    def register_donor(self, donor: ev.DonorRegistered) -> None:
        """Append ``donor_registered``. Raises EventRejected if the donor id exists."""
        def run(decider: Decider) -> None:
            if donor.donor_id in decider.proj.donors:
                raise EventRejected("donor_exists", donor.donor_id)
            decider.ensure_engine(donor.engine_id)
            decider.emit(donor, engine_id=donor.engine_id)

        self._write(lambda sql: run, engine_ids=[donor.engine_id], donor_ids=[donor.donor_id])

    def record_engine_start(self, engine_id: str) -> bool:
        """The engine's connector started: a new process, so whatever the ledger learnt of the
        previous one is no longer proof of anything. Bumps the generation (reason
        ``engine_started``) of a known engine, quarantining its live blocks and donors — even when
        the engine's own ``created`` event or ZMQ seq reset never reaches the ledger (DESIGN §3
        "generation"). Returns False (nothing written) for an engine the ledger never saw."""
        def run(decider: Decider) -> bool:
            if engine_id not in decider.proj.engines:
                return False
            decider.bump(engine_id, GenerationReason.ENGINE_STARTED)
            return True

        return self._write(lambda sql: run, engine_ids=[engine_id])

    def mark_donor_saved(self, donor_id: str, *, store_ref: str, checksum: str, size_bytes: int) -> None:
        """Append ``donor_saved`` (its KV bytes are published in the donor store)."""
        self._donor_fact(donor_id, ev.DonorSaved(donor_id=donor_id, store_ref=store_ref, checksum=checksum,
                                                size_bytes=size_bytes))

    def evict_donor(self, donor_id: str, reason: str) -> None:
        """Append ``donor_evicted`` whatever holds the donor (a corrupt entry must go)."""
        self._donor_fact(donor_id, ev.DonorEvicted(donor_id=donor_id, reason=reason))

    def evict_donor_if_unleased(self, donor_id: str, reason: str, *, now: float | None = None) -> bool:
        """Append ``donor_evicted`` unless a lease holds the donor, in ONE write transaction (no
        lease can be taken between the check and the eviction).

        Returns:
            True if the donor is evicted now (or already was: nothing is written then), False if
            a lease holds it (nothing written).

        Raises:
            EventRejected: unknown donor.
        """
        now = time.time() if now is None else now

        def run(sql: Sql) -> Callable[[Decider], bool]:
            def decide(decider: Decider) -> bool:
                donor = decider.proj.donors.get(donor_id)
                if donor is None:
                    raise EventRejected("unknown_donor", donor_id)
                if sql.one(_HELD_LEASES_OF, {"now": now, "donor_id": donor_id})[0]:
                    return False
                if donor["state"] != DonorState.EVICTED:
                    decider.emit(ev.DonorEvicted(donor_id=donor_id, reason=reason), engine_id=donor["engine_id"])
                return True

            return decide

        return self._write(run, donor_ids=[donor_id])

    def take_lease(self, donor_id: str, *, request_id: str, holder: str, namespace: str, num_blocks: int,
                   ttl_s: float, policy: FreshnessPolicy = FreshnessPolicy.ENGINE, now: float | None = None,
                   up_to_blocks: int | None = None, lease_id: str | None = None) -> Lease | StaleReason:
        """Pin a donor for a load: revalidate and append ``lease_taken`` in ONE write transaction,
        so no generation bump can slip between the check and the pin.

        Args:
            num_blocks: leading donor blocks the load needs (at least this many must be live).
            up_to_blocks: lease the donor's longest live prefix up to this many blocks instead of
                exactly ``num_blocks``: a donor whose tail blocks were evicted since the lookup
                still serves its live head (``Lease.num_blocks`` says how many).
            lease_id: the id to record (a caller that hands the id out before the write commits,
                as the scheduler does); a fresh one by default.

        Returns:
            the lease, or why the donor is no longer fresh (nothing is written then).

        Cost: one transaction of seven statements (freshness in one, block liveness in one,
        then the log row, the lease row and its counter), ~0.1 ms + ~1 µs per block on SQLite.
        """
        now = time.time() if now is None else now
        wanted = num_blocks if up_to_blocks is None else max(num_blocks, up_to_blocks)

        def run(sql: Sql) -> Callable[[Decider], Lease | StaleReason]:
            def decide(decider: Decider) -> Lease | StaleReason:
                donor = _check(sql, donor_id, namespace, None, now)
                if isinstance(donor, StaleReason):
                    return donor
                usable = min(wanted, donor.num_blocks)
                if policy == FreshnessPolicy.ENGINE and usable > 0:
                    usable = _live_prefix(sql, donor_id, donor, usable)
                    if usable < min(num_blocks, donor.num_blocks):
                        return StaleReason.BLOCKS_NOT_LIVE
                lease = Lease(lease_id=lease_id or uuid.uuid4().hex, donor_id=donor_id, expires_at=now + ttl_s,
                              num_blocks=usable)
                decider.emit(ev.LeaseTaken(lease_id=lease.lease_id, donor_id=donor_id, request_id=request_id,
                                           holder=holder, expires_at=lease.expires_at))
                return lease

            return decide

        return self._write(run)

    def release_lease(self, lease_id: str, reason: str) -> bool:
        """Append ``lease_released``; False (nothing written) if unknown or already released."""
        def run(decider: Decider) -> bool:
            row = decider.proj.leases.get(lease_id)
            if row is None or row["state"] != LeaseState.HELD:
                return False
            decider.emit(ev.LeaseReleased(lease_id=lease_id, reason=reason))
            return True

        return self._write(lambda sql: run, lease_ids=[lease_id])

    # -- plumbing ----------------------------------------------------------------------------

    def _donor_fact(self, donor_id: str, fact: ev.DonorSaved | ev.DonorEvicted) -> None:
        def run(decider: Decider) -> None:
            donor = decider.proj.donors.get(donor_id)
            if donor is None:
                raise EventRejected("unknown_donor", donor_id)
            decider.emit(fact, engine_id=donor["engine_id"])

        self._write(lambda sql: run, donor_ids=[donor_id])

    def _sql(self) -> Sql:
        sql = getattr(self._local, "sql", None)
        if sql is None:
            try:
                raw = self._engine.raw_connection()
            except SQLAlchemyError as exc:
                raise PersistenceError(str(getattr(exc, "orig", exc))) from exc
            sql = Sql(raw.dbapi_connection, self._engine.dialect)
            if not sql.is_sqlite:
                raw.dbapi_connection.autocommit = True  # reads see the latest commit; writes BEGIN
            self._local.sql, self._local.raw = sql, raw
            with self._open_lock:
                self._open.append(raw)
        return sql

    def _drop(self) -> None:
        """Forget this thread's connection after a driver error (the next call opens a new one)."""
        raw, self._local.sql, self._local.raw = getattr(self._local, "raw", None), None, None
        if raw is None:
            return
        with self._open_lock:
            if raw in self._open:
                self._open.remove(raw)
        try:
            raw.invalidate()
        except Exception:  # noqa: BLE001 - the connection is already broken
            pass

    def _read(self, fn: Callable[[Sql], T], *, snapshot: bool = False) -> T:
        """Run ``fn`` on this thread's connection; ``snapshot``: one SQLite read transaction."""
        sql = self._sql()
        snapshot = snapshot and sql.is_sqlite
        try:
            if snapshot:
                sql.driver("BEGIN")
            value = fn(sql)
            if snapshot:
                sql.driver("COMMIT")
            return value
        except sql.errors as exc:
            wrapped = sql.wrap(exc)
            if wrapped.connection_invalidated:
                self._drop()
            elif snapshot:
                self._rollback(sql)
            if getattr(self._local, "interrupted", False):
                raise DeadlineExceeded(f"ledger read interrupted at its deadline: {exc}") from wrapped
            raise persistence_error(wrapped) from wrapped
        except BaseException:
            if snapshot:
                self._rollback(sql)
            raise

    def _write(self, fn: Callable[[Sql], Callable[[Decider], T]], **ids: Any) -> T:
        """One write transaction: ``fn(sql)`` returns the decision run by :func:`transact`."""
        sql = self._sql()
        try:
            sql.driver("BEGIN IMMEDIATE" if sql.is_sqlite else "BEGIN")
        except sql.errors as exc:
            wrapped = sql.wrap(exc)
            if wrapped.connection_invalidated:
                self._drop()
            raise persistence_error(wrapped) from wrapped
        try:
            value = transact(sql, fn(sql), **ids)
            sql.driver("COMMIT")
            return value
        except sql.errors as exc:
            self._rollback(sql)
            wrapped = sql.wrap(exc)
            raise persistence_error(wrapped) from wrapped
        except BaseException:
            self._rollback(sql)
            raise

    def _rollback(self, sql: Sql) -> None:
        try:
            sql.driver("ROLLBACK")
        except sql.errors:
            self._drop()


# ------------------------------------------------------------------------------------------------
# query helpers (one connection, no writes)
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Checked:
    engine_id: str
    attention_dp_rank: int
    window_size: int
    generation: int
    num_blocks: int


def _check(sql: Sql, donor_id: str, namespace: str, lease_id: str | None, now: float) -> _Checked | StaleReason:
    """Freshness without block liveness (:func:`ledger.freshness.stale_reason`), and the lease."""
    row = sql.one(_CHECK, {"donor_id": donor_id, "lease_id": lease_id})
    if row is None:
        return StaleReason.UNKNOWN_DONOR
    (ns, state, expires_at, generation, engine_generation, engine_status, engine_id, dp_rank, window, num_blocks,
     l_state, l_expires, l_donor) = row
    reason = stale_reason(DonorFacts(ns, state, expires_at, generation, engine_generation, engine_status),
                          namespace=namespace, now=now)
    if reason is not None:
        return reason
    if lease_id is not None and (l_state != LeaseState.HELD or l_expires is None or l_expires <= now
                                 or l_donor != donor_id):
        return StaleReason.LEASE_NOT_HELD
    return _Checked(engine_id, dp_rank, window, generation, num_blocks)


def _view_donor(sql: Sql, row: Any) -> tuple[list[bytes], list[tuple[int, bytes]], list[bool]]:
    """A ``_DONORS_CHANGED`` row's content keys, block hashes and which blocks are live (DonorView)."""
    blocks = sql.all(_DONOR_BLOCKS_LIVE, {"donor_id": row[0], "engine_id": row[2], "attention_dp_rank": row[3],
                                          "window_size": row[4], "generation": row[5]})
    return [bytes(b[0]) for b in blocks], [(b[1], bytes(b[2])) for b in blocks], [bool(b[3]) for b in blocks]


def _live_prefix(sql: Sql, donor_id: str, donor: Any, num_blocks: int) -> int:
    """How many leading blocks of the donor are live in its generation (at most ``num_blocks``).

    One statement; SQLite probes the blocks primary key once per donor block (~1–2 µs each)."""
    first_dead = sql.one(_FIRST_DEAD, {
        "donor_id": donor_id, "num_blocks": num_blocks, "engine_id": donor.engine_id,
        "attention_dp_rank": donor.attention_dp_rank, "window_size": donor.window_size,
        "generation": donor.generation})[0]
    return num_blocks if first_dead is None else first_dead


def _holding(sql: Sql, namespace: str, key: bytes, now: float, limit: int) -> list:
    return sql.all(_HOLDING, {"content_key": key, "namespace": namespace, "now": now, "limit": limit})


def _longest_held(sql: Sql, namespace: str, keys: Sequence[bytes], now: float, min_blocks: int) -> tuple[int, list]:
    """``(n, rows)``: the most leading keys any state-fresh donor holds (0 if fewer than
    ``min_blocks``) and the newest such donor (a one-row ``_HOLDING`` result)."""
    n, rows = longest_prefix(len(keys), lambda k: _holding(sql, namespace, keys[k - 1], now, 1), min_blocks=min_blocks)
    return n, rows or []


def _span(row: Any, num_blocks: int) -> DonorSpan:
    return DonorSpan(row[0], row[1], row[2], num_blocks, row[3], row[4], row[5], row[6])


def _find_span(sql: Sql, namespace: str, keys: Sequence[bytes], check_blocks: bool, now: float,
               min_blocks: int) -> DonorSpan | None:
    lo, found = _longest_held(sql, namespace, keys, now, min_blocks)
    if not lo:
        return None
    # ``found`` is the newest donor holding keys[lo - 1]; with block checks, up to 4 candidates
    candidates = _holding(sql, namespace, keys[lo - 1], now, 4) if check_blocks else found
    best: DonorSpan | None = None
    for donor in candidates:
        usable = lo
        if check_blocks:
            where = _Checked(donor[1], donor[7], donor[8], donor[2], lo)
            usable = _live_prefix(sql, donor[0], where, lo)
        if usable >= min_blocks and (best is None or usable > best.num_blocks):
            best = _span(donor, usable)
        if best is not None and best.num_blocks == lo:
            break
    return best
