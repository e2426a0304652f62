"""The connector's client of the ledger: synchronous, bounded reads and the few writes it makes.

Runs inside TensorRT-LLM's scheduler and worker, so every call is synchronous and uses indexed
point queries only (:mod:`ledger.reads`); writes (donor registration, save/evict, leases) are
decisions appended as ordinary log facts in one transaction each (:mod:`ledger.writes`), on this
thread's kept connection (:mod:`ledger.connections`).

Speed (DESIGN §7: the whole lookup, hit or miss, p99 ≤ 250 µs at 2K tokens, ≤ 2 ms at 32K): every
statement is compiled once per dialect and run on a kept DBAPI connection, ~10–30 µs per query on
SQLite (tools/results/connector-*.md). On SQLite a read of several statements runs in one deferred
transaction (one snapshot); on PostgreSQL reads run in autocommit, where READ COMMITTED already
gives every statement its own snapshot.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

from ledger import events as ev
from ledger import reads, writes
from ledger.connections import Connections
from ledger.donor_view import DonorView
from ledger.live_index import LiveIndex
from ledger.placement_reads import PlacementSnapshot, read_placement
from ledger.reads import DonorInfo, DonorSpan, EngineInfo
from ledger.types import BlockHash, FreshnessPolicy, StaleReason, split_hash
from ledger.writes import Lease


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
        self.db = db
        self._connections = Connections(db, check=check, statement_timeout_s=statement_timeout_s)

    @property
    def interruptible(self) -> bool:
        """True when :meth:`deadline` can interrupt this ledger's reads (SQLite)."""
        return self._connections.backend.interruptible

    def close(self) -> None:
        self._connections.close()

    # -- reads -------------------------------------------------------------------------------

    def engine(self, engine_id: str) -> EngineInfo | None:
        """The engine's current generation, status and why that generation started, or None if
        the ledger never saw it."""
        return self._connections.read(lambda sql: reads.engine_info(sql, engine_id))

    def placement(self, block_hashes: Sequence[BlockHash] | Callable[[str | None], Sequence[BlockHash] | None],
                  namespace: str | None, content_keys: Sequence[bytes], *,
                  now: float | None = None) -> PlacementSnapshot:
        """Per engine, the request's exact live overlap and longest fresh donor span, from one
        snapshot (:mod:`ledger.placement_reads`; placement advice, never a promise).

        ``block_hashes``: the request's block hashes for every engine, or ``scheme -> hashes``
        (None: unknown in that scheme), asked once per scheme the fleet's engines use
        (:class:`~ledger.types.BlockKeyScheme` values; None for an engine whose scheme is unknown)."""
        now = time.time() if now is None else now
        if callable(block_hashes):
            per_scheme: dict[str | None, list[tuple[int, bytes]] | None] = {}

            def hashes_for(scheme: str | None) -> list[tuple[int, bytes]] | None:
                if scheme not in per_scheme:
                    given = block_hashes(scheme)  # type: ignore[operator]
                    per_scheme[scheme] = None if given is None else [split_hash(h) for h in given]
                return per_scheme[scheme]
        else:
            fixed = [split_hash(h) for h in block_hashes]

            def hashes_for(scheme: str | None) -> list[tuple[int, bytes]] | None:
                return fixed
        return self._connections.read(lambda sql: read_placement(sql, hashes_for, namespace, content_keys, now),
                                      snapshot=True)

    def last_seq(self) -> int:
        """The log's last seq (0 when empty); also a reachability check."""
        return self._connections.read(reads.last_seq)

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
        return self._connections.read(
            lambda sql: reads.find_donor_span(sql, namespace, content_keys, blocks, now, min_blocks), snapshot=True)

    def refresh_view(self, view: DonorView) -> int:
        """Catch ``view`` up with what changed in the ledger since its cursor (one read
        transaction on SQLite): engines' generations, donors whose ``updated_seq`` moved (a new
        saved donor's content keys, block hashes and block liveness are read here) and the log's
        block rows. Returns the log seq the view now reflects. Cost when nothing changed: one
        statement (the log's max seq). A view far behind (after an outage) catches up at most
        :data:`ledger.reads.VIEW_CATCH_UP_MAX_SEQS` log rows per call, and counts as caught up only at the
        end, so no single statement outgrows a statement timeout."""
        with view.catching_up:
            return self._connections.read(lambda sql: reads.refresh_view(sql, view), snapshot=True)

    def refresh_live_index(self, index: LiveIndex) -> int:
        """Load ``index`` (:class:`~ledger.live_index.LiveIndex`: every live block, in one read
        transaction on SQLite) or catch it up with the log rows that change it since its cursor,
        at most :data:`ledger.reads.VIEW_CATCH_UP_MAX_SEQS` log seqs per call. Returns the log seq
        it now reflects. Cost when nothing changed: one statement (the log's max seq)."""
        with index.catching_up:
            return self._connections.read(lambda sql: reads.refresh_live_index(sql, index), snapshot=True)

    @contextlib.contextmanager
    def deadline(self, seconds: float) -> Iterator[None]:
        """Interrupt this thread's SQLite statements once ``seconds`` have passed: they raise
        :class:`~ledger.errors.DeadlineExceeded`. Lets the scheduler read on the engine's own
        thread under a hard deadline (SQLite checks every 64 virtual-machine steps). A no-op on
        PostgreSQL, whose caller keeps its deadline thread (:attr:`interruptible`)."""
        with self._connections.deadline(seconds):
            yield

    @contextlib.contextmanager
    def lock_wait(self, seconds: float) -> Iterator[None]:
        """Wait at most ``seconds`` for the ledger's write lock in this thread's writes: SQLite's
        database lock (instead of ``busy_timeout``, 30 s), PostgreSQL's lock on the log that every
        writer takes (``lock_timeout``; no limit otherwise). A write that cannot get it raises
        :class:`~ledger.errors.PersistenceError`, for which :func:`ledger.errors.lock_timed_out` is True. For
        writes on a thread that must not stall (the engine's). On SQLite a wait longer than 1 ms is
        tried about every millisecond until ``seconds`` (``SQLiteBackend.lock_poll_ms``: SQLite's own
        handler tries every 100 ms, which a writer committing back to back can starve)."""
        with self._connections.lock_wait(seconds):
            yield

    def donor_freshness(self, donor_id: str, *, namespace: str, num_blocks: int | None = None,
                        policy: FreshnessPolicy = FreshnessPolicy.ENGINE, lease_id: str | None = None,
                        now: float | None = None, memo: FreshnessMemo | None = None) -> StaleReason | None:
        """Revalidate a donor (the worker calls this before each copy). None means fresh.

        Policy ``store`` (or ``num_blocks=0``) skips block liveness: one statement.

        ``memo``: the caller's (one load's, on one thread) record of its last fresh answer. When
        nothing can have changed that answer — no transaction committed since, by any connection
        (this one included), ``now`` before the donor's or the lease's expiry, the same question
        with no more blocks — it is answered from the memo: one statement (SQLite ``PRAGMA
        data_version``, ~3 µs; :meth:`~ledger.connections.Connections.change_token`) instead of the
        freshness read (~0.3 ms over 250 blocks), and ``memo.unchanged`` is set. Otherwise the
        ledger is read and the memo updated (cleared when stale). A backend without a change
        counter (PostgreSQL) reads every time.
        """
        now = time.time() if now is None else now
        token = self._connections.change_token() if memo is not None else None  # BEFORE the read it vouches for
        question = (donor_id, namespace, policy, lease_id)
        if memo is not None:
            memo.unchanged = memo.holds(token, question, num_blocks, now)
            if memo.unchanged:
                return None
            memo.forget()  # until this read answers (a read that raises leaves nothing to trust)
        blocks = policy == FreshnessPolicy.ENGINE and (num_blocks is None or num_blocks > 0)
        stale, fresh_until = self._connections.read(
            lambda sql: reads.donor_freshness_until(sql, donor_id, namespace, num_blocks, policy, lease_id, now),
            snapshot=blocks)
        if memo is not None and stale is None and token is not None:
            memo.remember(token, question, num_blocks if blocks else 0, fresh_until)
        return stale

    def donors_for_key(self, namespace: str, content_key: bytes, limit: int = 4) -> list[DonorInfo]:
        """Donors of ``namespace`` that hold ``content_key``, newest first, FRESH OR NOT (miss
        diagnosis: why is the donor of this text not usable?). Never a reason to load."""
        return self._connections.read(lambda sql: reads.donors_for_key(sql, namespace, content_key, limit))

    def held_leases(self, *, now: float | None = None, donor_id: str | None = None) -> int:
        """Leases held and not expired (all, or of one donor)."""
        now = time.time() if now is None else now
        return self._connections.read(lambda sql: reads.held_leases(sql, now, donor_id))

    # -- writes ------------------------------------------------------------------------------

    def register_donor(self, donor: ev.DonorRegistered) -> None:
        """Append ``donor_registered``. Raises EventRejected if the donor id exists."""
        self._connections.write(writes.register_donor(donor).run)

    def record_engine_start(self, engine_id: str) -> bool:
        """The engine's connector started: a new process, so whatever the ledger learnt of the
        previous one is no longer proof of anything. Bumps the generation (reason
        ``engine_started``) of a known engine, quarantining its live blocks and donors — even when
        the engine's own ``created`` event or ZMQ seq reset never reaches the ledger (DESIGN §3
        "generation"). Returns False (nothing written) for an engine the ledger never saw."""
        return self._connections.write(writes.record_engine_start(engine_id).run)

    def mark_donor_saved(self, donor_id: str, *, store_ref: str, checksum: str, size_bytes: int) -> None:
        """Append ``donor_saved`` (its KV bytes are published in the donor store)."""
        fact = ev.DonorSaved(donor_id=donor_id, store_ref=store_ref, checksum=checksum, size_bytes=size_bytes)
        self._connections.write(writes.donor_fact(donor_id, fact).run)

    def evict_donor(self, donor_id: str, reason: str) -> None:
        """Append ``donor_evicted`` whatever holds the donor (a corrupt entry must go)."""
        self._connections.write(writes.donor_fact(donor_id, ev.DonorEvicted(donor_id=donor_id, reason=reason)).run)

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
        return self._connections.write(writes.evict_donor_if_unleased(donor_id, reason, now).run)

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
        return self._connections.write(writes.take_lease(
            donor_id, request_id=request_id, holder=holder, namespace=namespace, num_blocks=num_blocks,
            wanted=wanted, ttl_s=ttl_s, policy=policy, now=now, lease_id=lease_id).run)

    def release_lease(self, lease_id: str, reason: str) -> bool:
        """Append ``lease_released``; False (nothing written) if unknown or already released."""
        return self._connections.write(writes.release_lease(lease_id, reason).run)


class FreshnessMemo:
    """One load's last fresh answer of :meth:`LedgerClient.donor_freshness` and what it rests on:
    it answers again while the ledger's change token (:meth:`~ledger.connections.Connections.change_token`,
    of the thread that read it) is unchanged and the clock is before ``fresh_until`` (epoch
    seconds: the donor's or the lease's expiry). Used on one thread at a time."""

    __slots__ = ("fresh_until", "num_blocks", "question", "token", "unchanged")

    def __init__(self) -> None:
        self.token: tuple[int, int, int] | None = None
        """None: nothing remembered (never asked, stale, or a backend without a change counter)."""
        self.question: tuple[str, str, FreshnessPolicy, str | None] | None = None
        """``(donor_id, namespace, policy, lease_id)`` asked."""
        self.num_blocks: int | None = 0
        """Leading donor blocks whose liveness was read: None every block, 0 none."""
        self.fresh_until = 0.0
        self.unchanged = False
        """Whether the last :meth:`LedgerClient.donor_freshness` with this memo was answered from it."""

    def holds(self, token: tuple[int, int, int] | None, question: tuple, num_blocks: int | None, now: float) -> bool:
        return (token is not None and token == self.token and question == self.question and now < self.fresh_until
                and _covers(self.num_blocks, num_blocks, question[2]))

    def remember(self, token: tuple[int, int, int], question: tuple, num_blocks: int | None,
                 fresh_until: float) -> None:
        self.token, self.question, self.num_blocks, self.fresh_until = token, question, num_blocks, fresh_until

    def forget(self) -> None:
        self.token = None


def _covers(checked: int | None, asked: int | None, policy: FreshnessPolicy) -> bool:
    """Did a read of ``checked`` blocks' liveness answer a question about ``asked`` blocks?"""
    if policy != FreshnessPolicy.ENGINE or asked == 0:
        return True
    if checked is None:
        return True
    return asked is not None and asked <= checked
