"""The ledger's reads for the connector: statements and the functions that run them on one connection.

Every function takes a :class:`~ledger.db.Sql` (one connection; on SQLite the caller may hold a
read transaction for one snapshot, :class:`ledger.connections.Connections`) and uses indexed point
queries only: it runs inside TensorRT-LLM's scheduler (``get_num_new_matched_tokens`` holds the
block manager's lock, reference/TRTLLM_CONNECTOR.md) and worker, and never scans a table.

Freshness is :mod:`ledger.freshness` (the one rule, in Python and as SQL); this module adds block
liveness for policy ``engine``. Every statement is written once in Core and compiled once per
dialect (:class:`~ledger.prepared.Prepared`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from sqlalchemy import bindparam, exists, func, select

from ledger import events as ev
from ledger.db import Sql
from ledger.donor_view import DonorView
from ledger.freshness import DonorFacts, fresh_donor_clause, longest_prefix, stale_reason
from ledger.live_index import INDEX_KINDS, LiveIndex
from ledger.liveness import LIVENESS_KINDS
from ledger.placement_reads import block_key_schemes
from ledger.prepared import Prepared
from ledger.schema import BlockRow, DonorBlockRow, DonorRow, EngineRow, LeaseRow, LogRow
from ledger.types import (
    BlockState,
    DonorState,
    FreshnessPolicy,
    GenerationReason,
    LeaseState,
    StaleReason,
)

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
"""Log rows one :func:`refresh_view` call reads at most (a view's first load reads
no log rows, only donors)."""


# ------------------------------------------------------------------------------------------------
# reads (each runs on one connection; the client chooses the transaction)
# ------------------------------------------------------------------------------------------------


def engine_info(sql: Sql, engine_id: str) -> EngineInfo | None:
    """The engine's current generation, status and why that generation started, or None if the
    ledger never saw it."""
    row = sql.one(_ENGINE_INFO, {"engine_id": engine_id})
    if row is None:
        return None
    generation, status, kind, body = row
    reason = None
    if kind == "generation_bumped":
        bumped = ev.BODY_DECODER.decode(bytes(body))
        reason = GenerationReason(bumped.reason)
    return EngineInfo(engine_id, generation, status, reason)


def last_seq(sql: Sql) -> int:
    """The log's last seq (0 when empty)."""
    return int(sql.one(_MAX_SEQ, {})[0] or 0)


def refresh_view(sql: Sql, view: DonorView) -> int:
    """Catch ``view`` up with the ledger (see :meth:`ledger.client.LedgerClient.refresh_view`);
    returns the log seq the view now reflects."""
    latest = sql.one(_MAX_SEQ, {})[0] or 0
    if latest == view.cursor:
        view.caught_up()
        return latest
    after = view.cursor
    upto = latest if after < 0 else min(latest, after + VIEW_CATCH_UP_MAX_SEQS)
    blocks = sql.all(_BLOCK_ROWS, {"after": after, "upto": upto, **_BLOCK_ROW_PARAMS}) if after >= 0 else []
    view.changed(upto, sql.all(_ENGINE_GENERATIONS, {}), sql.all(_DONORS_CHANGED, {"after": after, "upto": upto}),
                 blocks, lambda row: _view_donor(sql, row), complete=upto == latest)
    return upto


_INDEX_ROWS = Prepared(
    select(_LOG.c.seq, _LOG.c.kind, _LOG.c.engine_id, _LOG.c.attention_dp_rank, _LOG.c.window_size, _LOG.c.body)
    .where(_LOG.c.kind.in_([bindparam(f"kind{i}") for i in range(len(INDEX_KINDS))]),
           _LOG.c.seq > bindparam("after"), _LOG.c.seq <= bindparam("upto"), _LOG.c.applied.is_(True))
    .order_by(_LOG.c.seq))
"""The log's rows that change the live index in a seq range (one range of ``ix_log_kind_seq`` per kind)."""
_INDEX_ROW_PARAMS = {f"kind{i}": kind for i, kind in enumerate(INDEX_KINDS)}
_LIVE_BLOCKS = Prepared(
    select(_BLOCKS.c.engine_id, _BLOCKS.c.attention_dp_rank, _BLOCKS.c.window_size, _BLOCKS.c.block_hash,
           _BLOCKS.c.block_hash_ext).where(_BLOCKS.c.state == str(BlockState.LIVE)))


def refresh_live_index(sql: Sql, index: LiveIndex) -> int:
    """Load ``index`` or catch it up with the ledger (see
    :meth:`ledger.client.LedgerClient.refresh_live_index`); returns the log seq it now reflects."""
    latest = sql.one(_MAX_SEQ, {})[0] or 0
    if latest == index.cursor:
        index.caught_up()
        return latest
    if index.cursor < 0:
        index.load(latest, sql.all(_ENGINE_GENERATIONS, {}), sql.all(_LIVE_BLOCKS, {}), block_key_schemes(sql))
        return latest
    upto = min(latest, index.cursor + VIEW_CATCH_UP_MAX_SEQS)
    rows = sql.all(_INDEX_ROWS, {"after": index.cursor, "upto": upto, **_INDEX_ROW_PARAMS})
    index.changed(upto, rows, sql.all(_ENGINE_GENERATIONS, {}), block_key_schemes(sql), complete=upto == latest)
    return upto


def donor_freshness(sql: Sql, donor_id: str, namespace: str, num_blocks: int | None, policy: FreshnessPolicy,
                    lease_id: str | None, now: float) -> StaleReason | None:
    """None when the donor is fresh (see :meth:`ledger.client.LedgerClient.donor_freshness`)."""
    return donor_freshness_until(sql, donor_id, namespace, num_blocks, policy, lease_id, now)[0]


def donor_freshness_until(sql: Sql, donor_id: str, namespace: str, num_blocks: int | None, policy: FreshnessPolicy,
                          lease_id: str | None, now: float) -> tuple[StaleReason | None, float]:
    """``(None, fresh_until)`` when the donor is fresh at ``now``: while the database is unchanged
    it stays fresh until ``fresh_until`` (epoch seconds: the donor's expiry, or the lease's; ``inf``
    when neither expires), the only conditions that time alone changes. ``(reason, now)`` when it
    is stale."""
    donor = check_donor(sql, donor_id, namespace, lease_id, now)
    if isinstance(donor, StaleReason):
        return donor, now
    needed = donor.num_blocks if num_blocks is None else min(num_blocks, donor.num_blocks)
    if policy == FreshnessPolicy.ENGINE and needed > 0 and live_prefix(sql, donor_id, donor, needed) < needed:
        return StaleReason.BLOCKS_NOT_LIVE, now
    return None, donor.fresh_until


def donors_for_key(sql: Sql, namespace: str, content_key: bytes, limit: int) -> list[DonorInfo]:
    """Donors of ``namespace`` holding ``content_key``, newest first, fresh or not."""
    rows = sql.all(_DONORS_FOR_KEY, {"content_key": content_key, "namespace": namespace, "limit": limit})
    return [DonorInfo(r[0], r[1], r[2], DonorState(r[3]), r[4], r[5], r[6], r[7], r[8]) for r in rows]


def held_leases(sql: Sql, now: float, donor_id: str | None = None) -> int:
    """Leases held and not expired (all, or of one donor)."""
    if donor_id is None:
        return sql.one(_HELD_LEASES, {"now": now})[0]
    return sql.one(_HELD_LEASES_OF, {"now": now, "donor_id": donor_id})[0]


@dataclasses.dataclass(frozen=True, slots=True)
class CheckedDonor:
    """A donor fresh but for block liveness (:func:`check_donor`): where its blocks live."""

    engine_id: str
    attention_dp_rank: int
    window_size: int
    generation: int
    num_blocks: int
    fresh_until: float = math.inf
    """Epoch seconds when time alone ends its freshness (its expiry, or the lease's): ``inf`` if never."""


def check_donor(sql: Sql, donor_id: str, namespace: str, lease_id: str | None, now: float) -> CheckedDonor | StaleReason:
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
    fresh_until = min(math.inf if expires_at is None else expires_at, math.inf if lease_id is None else l_expires)
    return CheckedDonor(engine_id, dp_rank, window, generation, num_blocks, fresh_until)


def _view_donor(sql: Sql, row: Any) -> tuple[list[bytes], list[tuple[int, bytes]], list[bool]]:
    """A ``_DONORS_CHANGED`` row's content keys, block hashes and which blocks are live (DonorView)."""
    blocks = sql.all(_DONOR_BLOCKS_LIVE, {"donor_id": row[0], "engine_id": row[2], "attention_dp_rank": row[3],
                                          "window_size": row[4], "generation": row[5]})
    return [bytes(b[0]) for b in blocks], [(b[1], bytes(b[2])) for b in blocks], [bool(b[3]) for b in blocks]


def live_prefix(sql: Sql, donor_id: str, donor: Any, num_blocks: int) -> int:
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


def find_donor_span(sql: Sql, namespace: str, keys: Sequence[bytes], check_blocks: bool, now: float,
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
            where = CheckedDonor(donor[1], donor[7], donor[8], donor[2], lo)
            usable = live_prefix(sql, donor[0], where, lo)
        if usable >= min_blocks and (best is None or usable > best.num_blocks):
            best = _span(donor, usable)
        if best is not None and best.num_blocks == lo:
            break
    return best
