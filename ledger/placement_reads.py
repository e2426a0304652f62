"""What placement advice reads of the ledger: per engine, the exact live overlap and the longest
fresh donor span of one request, from one snapshot.

Run through :meth:`ledger.client.LedgerClient.placement` (one read transaction on SQLite; on
PostgreSQL each statement sees the latest commit). Donor freshness is
:func:`ledger.freshness.fresh_donor_clause`, the rule the connector's lookup uses. Statements are
compiled once (:class:`~ledger.prepared.Prepared`) with a fixed number of ``IN`` parameters, so a long
request is read :data:`CHUNK` keys per statement, in order, stopping at the first chunk that
ends the run.

Each engine's block-key scheme (:class:`~ledger.types.BlockKeyScheme`) is the newest
``engine_described`` fact of the log (the consumer's ``block_key_scheme`` setting), else inferred
from the wire dialect its events came in: TensorRT-LLM LLM-API events (``stored``; no
``BlockStored``) are ``trtllm_v1`` (TensorRT-LLM 1.2 hashes with ``v1_block_key`` unless told
otherwise). Maps and arrays tagged ``BlockStored`` come from vLLM, Dynamo and TensorRT-LLM's native
publisher alike, so they tell nothing: such an engine's scheme must be configured. The caller gives,
per scheme, the request's hashes (or None: it cannot compute that scheme), and an engine whose
hashes are not given is reported with ``live_blocks`` None (unknown), never as 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from sqlalchemy import bindparam, func, select

from ledger import events as ev
from ledger.apply import EVENTS_OF_TYPE
from ledger.db import Sql
from ledger.prepared import Prepared
from ledger.freshness import fresh_donor_clause
from ledger.schema import BlockRow, CounterRow, DonorBlockRow, DonorRow, EngineRow, LogRow, StreamRow
from ledger.types import BlockKeyScheme, BlockState, EngineStatus

__all__ = ["CHUNK", "EngineOverlap", "HashesFor", "PlacementSnapshot", "block_key_schemes", "read_placement"]

CHUNK = 64
"""Keys (block hashes or content keys) one statement asks about."""

_E, _S, _B = EngineRow.__table__, StreamRow.__table__, BlockRow.__table__
_D, _DB, _LOG, _C = DonorRow.__table__, DonorBlockRow.__table__, LogRow.__table__, CounterRow.__table__
HashesFor = Callable[[str | None], Sequence[tuple[int, bytes]] | None]
"""scheme (a :class:`BlockKeyScheme` value, None: unknown) -> the request's block hashes as stored
(:func:`ledger.types.split_hash`) the way that scheme computes them, or None: not known."""


@dataclasses.dataclass(frozen=True, slots=True)
class EngineOverlap:
    """One engine's overlap with a request, in whole blocks, read at ``generation``.

    ``live_blocks``: leading request blocks live in the engine's current generation (the most over
    its streams); None when the request's hashes in the engine's ``block_key_scheme`` are not
    known (unknown scheme, or one that cannot be computed without the caller's hashes);
    ``donor_blocks``: leading content keys held by its freshest-longest donor ``donor_id``. Both
    are 0 (and ``donor_id`` None) when the engine is not ``active``.
    """

    engine_id: str
    generation: int
    status: str
    live_blocks: int | None
    donor_id: str | None
    donor_blocks: int
    block_key_scheme: str | None = None

    @property
    def fresh(self) -> bool:
        """The engine is ``active``: its blocks are trusted (not resynchronising)."""
        return self.status == EngineStatus.ACTIVE


@dataclasses.dataclass(frozen=True, slots=True)
class PlacementSnapshot:
    """Every engine the ledger knows, by ``engine_id``, and the log seq the read includes."""

    seq: int
    engines: tuple[EngineOverlap, ...]


_MAX_SEQ = Prepared(select(func.max(_LOG.c.seq)))
_ENGINE_ROWS = Prepared(select(_E.c.engine_id, _E.c.generation, _E.c.status).order_by(_E.c.engine_id))
_STREAMS = Prepared(select(_S.c.engine_id, _S.c.attention_dp_rank, _S.c.window_size))
_DESCRIBED = Prepared(select(_LOG.c.engine_id, _LOG.c.body).where(_LOG.c.kind == ev.kind_of(
    ev.EngineDescribed(engine_id="", block_key_scheme=""))).order_by(_LOG.c.seq))
"""Every ``engine_described`` fact, oldest first (ix_log_kind_seq; one per consumer start per engine)."""
_DIALECTS = Prepared(select(_C.c.engine_id, _C.c.name).where(
    (_C.c.name == EVENTS_OF_TYPE + "stored") | (_C.c.name == EVENTS_OF_TYPE + "BlockStored"), _C.c.value > 0))
_LIVE_OF = Prepared(
    select(_B.c.block_hash, _B.c.block_hash_ext)
    .where(_B.c.engine_id == bindparam("engine_id"), _B.c.attention_dp_rank == bindparam("attention_dp_rank"),
           _B.c.window_size == bindparam("window_size"), _B.c.state == str(BlockState.LIVE),
           _B.c.generation == bindparam("generation"),
           _B.c.block_hash.in_([bindparam(f"k{i}") for i in range(CHUNK)])))
"""Which of up to :data:`CHUNK` block hashes are live in the stream (``_ext`` told apart in Python)."""
_FRESH_HOLDERS_OF = Prepared(
    select(_D.c.engine_id, _D.c.donor_id, _DB.c.content_key)
    .select_from(_DB.join(_D, _D.c.donor_id == _DB.c.donor_id).join(_E, _E.c.engine_id == _D.c.engine_id))
    .where(_DB.c.content_key.in_([bindparam(f"k{i}") for i in range(CHUNK)]),
           fresh_donor_clause(_D, _E, namespace=bindparam("namespace"), now=bindparam("now")))
    .order_by(_D.c.registered_seq.desc()))
"""Fresh donors (block liveness aside) holding any of up to :data:`CHUNK` content keys, newest first."""


def block_key_schemes(sql: Sql) -> dict[str, str]:
    """``{engine_id: scheme}`` for every engine whose scheme is logged or inferred (module docstring)."""
    dialects: dict[str, set[str]] = {}
    for engine_id, name in sql.all(_DIALECTS, {}):
        dialects.setdefault(engine_id, set()).add(name[len(EVENTS_OF_TYPE):])
    schemes = {engine_id: str(BlockKeyScheme.TRTLLM_V1) for engine_id, names in dialects.items()
               if names == {"stored"}}
    for engine_id, body in sql.all(_DESCRIBED, {}):
        schemes[engine_id] = ev.BODY_DECODER.decode(bytes(body)).block_key_scheme  # the newest wins
    return schemes


def read_placement(sql: Sql, block_hashes: HashesFor, namespace: str | None,
                   content_keys: Sequence[bytes], now: float) -> PlacementSnapshot:
    """See the module docstring. ``block_hashes(scheme)`` gives the request's engine block hashes
    as stored in that scheme (:data:`HashesFor`), ``content_keys`` its chained content keys
    (empty, or ``namespace`` None: no donor spans)."""
    seq = sql.one(_MAX_SEQ, {})[0] or 0
    engines = sql.all(_ENGINE_ROWS, {})
    schemes = block_key_schemes(sql)
    streams: dict[str, list[tuple[int, int]]] = {}
    for engine_id, dp_rank, window in sql.all(_STREAMS, {}):
        streams.setdefault(engine_id, []).append((dp_rank, window))
    donors = _donor_spans(sql, namespace, content_keys, now) if namespace and content_keys else {}
    out = []
    for engine_id, generation, status in engines:
        scheme = schemes.get(engine_id)
        if status != EngineStatus.ACTIVE:
            out.append(EngineOverlap(engine_id, generation, status, 0, None, 0, scheme))
            continue
        hashes = block_hashes(scheme)
        live = None if hashes is None else max((_live_run(sql, (engine_id, dp, window, generation), hashes)
                                                for dp, window in streams.get(engine_id, ())), default=0)
        donor_id, donor_blocks = donors.get(engine_id, (None, 0))
        out.append(EngineOverlap(engine_id, generation, status, live, donor_id, donor_blocks, scheme))
    return PlacementSnapshot(int(seq), tuple(out))


def _chunk_params(keys: Sequence[object]) -> dict[str, object]:
    """``k0…k{CHUNK-1}`` for up to :data:`CHUNK` keys, the last repeated to fill the list."""
    return {f"k{i}": keys[min(i, len(keys) - 1)] for i in range(CHUNK)}


def _live_run(sql: Sql, stream: tuple[str, int, int, int], hashes: Sequence[tuple[int, bytes]]) -> int:
    """Leading ``hashes`` live in ``(engine_id, attention_dp_rank, window_size)`` in ``generation``."""
    engine_id, dp_rank, window, generation = stream
    where = {"engine_id": engine_id, "attention_dp_rank": dp_rank, "window_size": window, "generation": generation}
    count = 0
    for start in range(0, len(hashes), CHUNK):
        part = hashes[start : start + CHUNK]
        rows = sql.all(_LIVE_OF, {**where, **_chunk_params([h for h, _ in part])})
        live = {(h, bytes(ext)) for h, ext in rows}
        for key in part:
            if key not in live:
                return count
            count += 1
    return count


def _donor_spans(sql: Sql, namespace: str, keys: Sequence[bytes], now: float) -> dict[str, tuple[str, int]]:
    """``{engine_id: (donor_id, blocks)}``: per engine, the fresh donor holding the most leading keys
    (the newest among equals). Chained keys: holding key i means holding keys 0..i, so a chunk in
    which no donor holds a key ends the search."""
    position = {key: i for i, key in enumerate(keys)}
    best: dict[str, tuple[str, int]] = {}
    for start in range(0, len(keys), CHUNK):
        rows = sql.all(_FRESH_HOLDERS_OF, {"namespace": namespace, "now": now,
                                           **_chunk_params(keys[start : start + CHUNK])})
        if not rows:
            break
        for engine_id, donor_id, key in rows:
            blocks = position[bytes(key)] + 1
            if blocks > best.get(engine_id, ("", 0))[1]:
                best[engine_id] = (donor_id, blocks)
    return best
